#!/usr/bin/env bash
# Every GPU-only check of verl-oar in one run on one GPU (torch + transformers only; no verl, Ray or vLLM):
# one JSON (--out) and a text summary beside it (.txt). At most 8 minutes on one H200.
#
#   bash scripts/gpu_acceptance.sh --out $OUT/gpu_acceptance_h200.json    # on the lent GPU, from the repo root
#   bash scripts/gpu_acceptance.sh --tiny --out /tmp/acceptance.json      # CPU smoke run at tiny sizes
#
# The checks, their order and budgets: benchmarks/gpu_acceptance.py's docstring. The Python run stops itself at
# --budget-s (default 470 s); this timeout (GPU_ACCEPTANCE_TIMEOUT, default 480 s) is the backstop, and the JSON
# is rewritten after every check, so a run cut short keeps what it measured.
set -euo pipefail
cd "$(dirname "$0")/.."
# the first of $PYTHON, python3, python that has torch (without importing it)
for candidate in "${PYTHON:-}" python3 python; do
    if [ -n "$candidate" ] && command -v "$candidate" >/dev/null \
        && "$candidate" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
        PYTHON="$candidate"; break
    fi
    PYTHON=""
done
if [ -z "$PYTHON" ]; then
    echo "gpu_acceptance.sh: no python with torch (tried \$PYTHON, python3, python); set PYTHON=/path/to/python" >&2
    exit 2
fi
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec timeout --signal=TERM --kill-after=10 "${GPU_ACCEPTANCE_TIMEOUT:-480}" \
    "$PYTHON" benchmarks/gpu_acceptance.py "$@"
