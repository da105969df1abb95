#!/usr/bin/env bash
# Install (scripts/setup_env.sh), lint (ruff check + format check), then run the test suite
# on CPU with gloo. Extra arguments go to pytest (e.g. -m unit for the fast part).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -q "$@"
