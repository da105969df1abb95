#!/usr/bin/env bash
# The embedded default on CPU (2 gloo ranks): same as `bash scripts/quickstart.sh`,
# spelled out with the flags it uses by default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export PYTHONWARNINGS=ignore
.venv/bin/torchrun --nproc-per-node 2 pretrain_gpt.py \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --micro-batch-size 4 --train-iters 300 --eval-interval 50 --output-dir runs/default "$@"
