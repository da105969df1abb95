#!/usr/bin/env bash
# Install (scripts/setup_env.sh) and run the test suite on CPU with gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q "$@"
