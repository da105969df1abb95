#!/usr/bin/env bash
# Install (scripts/setup_env.sh) and run the embedded default pretraining on CPU:
# 2 gloo ranks, a tiny GPT, MatrixFSDP + Muon, on a corpus built from this machine's
# Python sources. Extra arguments go to pretrain_gpt.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
exec .venv/bin/torchrun --nproc-per-node 2 pretrain_gpt.py "$@"
