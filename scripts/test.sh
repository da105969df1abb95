#!/usr/bin/env bash
# Install (scripts/setup_env.sh), lint (ruff check + format check), then run the test suite
# on CPU with gloo, printing the 20 slowest tests (the suite is kept under 15 minutes on 2 cores).
# Extra arguments go to pytest (e.g. -m unit for the fast part).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -q --durations=20 "$@"
