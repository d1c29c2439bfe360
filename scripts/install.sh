#!/usr/bin/env bash
# Create .venv and install verl-oar into it, CPU-only: torch first (the CPU build), then verl
# without extras (every verl extra pins a CUDA torch of several GB), then this package.
# Idempotent: a second run only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch, verl, verl_oar, math_verify, matplotlib, pytest, hypothesis" >/dev/null 2>&1; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
  python -m pip install -q -e ".[test]"
fi
python - <<'PY'
import importlib.metadata as md, torch
print(f"[install] torch {torch.__version__}, verl {md.version('verl')}, verl-oar {md.version('verl-oar')}")
PY
