#!/usr/bin/env bash
# The test command: installs what it needs (scripts/install.sh), then runs every test that can run
# here. GPU-only tests are marked `gpu` and skip (counted) on CPU-only machines.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
exec python -m pytest tests "$@"
