#!/usr/bin/env bash
# The test command: installs what it needs (scripts/install.sh), then runs every test that can run
# here. GPU-only tests are marked `gpu` and skip (counted) on CPU-only machines. Arguments go to
# pytest: `bash scripts/test.sh -m "not slow"` is the developer loop (no trainer launches).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
. .venv/bin/activate
exec python -m pytest tests "$@"
