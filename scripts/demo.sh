#!/usr/bin/env bash
# The main job: GRPO, OAR-G and OAR-P (--methods all adds CSCR and OPPO) on the pick_max testbed through verl's real trainer
# on CPU, from the committed start, one seed; the credit each assigned, the importance estimators
# against the oracle, and an HTML report in ./oar_demo (about 10 minutes on 2 cores).
# Flags go to python -m verl_oar.testbed.demo (--help lists them: seeds, steps, methods, validation).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh plot   # the report's figures need matplotlib (the plot extra)
. .venv/bin/activate
exec python -m verl_oar.testbed.demo "$@"
