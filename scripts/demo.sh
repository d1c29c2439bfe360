#!/usr/bin/env bash
# The main job: a short OAR-G training of a tiny model through verl's real trainer in CPU mode.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
exec python -m verl_oar.cpu.launch --adv-estimator oar_g "$@"
