#!/usr/bin/env bash
# The main job: GRPO vs OAR-G vs OAR-P on the chain_sum testbed through verl's real trainer on CPU
# (a few seeds), the importance estimators against the oracle, and an HTML report in ./oar_demo.
# Flags go to python -m verl_oar.testbed.demo (--help lists them: seeds, steps, task size, methods).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh plot   # the report's figures need matplotlib (the plot extra)
. .venv/bin/activate
exec python -m verl_oar.testbed.demo "$@"
