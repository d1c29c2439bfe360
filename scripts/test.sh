#!/usr/bin/env bash
# The test command: installs what it needs (scripts/install.sh), then runs every test that can run
# here. GPU-only tests are marked `gpu` and skip (counted) on CPU-only machines. Arguments go to
# pytest: `bash scripts/test.sh -m "not slow"` is the developer loop (no trainer launches).
# Two pytest-xdist workers (VERL_OAR_TEST_WORKERS to change; 0 runs in one process): each test module is
# one work unit and the trainer launches go first, longest first (tests/conftest.py); on 2 cores a
# launch leaves about a third of the CPU idle (process start-ups and Ray waits), which the other worker uses.
# The 30 slowest tests are listed at the end, so that every run (CI included) shows where the time goes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test,real-model
. .venv/bin/activate
exec python -m pytest -n "${VERL_OAR_TEST_WORKERS:-2}" --durations=30 tests "$@"
