#!/usr/bin/env bash
# Install (scripts/setup_env.sh) and run the embedded default pretraining on CPU: 2 gloo ranks,
# a tiny GPT, MatrixFSDP + Muon, on a corpus and SentencePiece tokenizer built from this
# machine's Python sources (no --data-path: pretrain_gpt.py builds them once, into
# ~/.cache/megatron_mfsdp/default_data or --data-cache-path). Every choice is spelled out;
# the rest are Megatron-LM's defaults.
# Extra arguments go to pretrain_gpt.py (a later flag wins: --train-iters 10).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
exec .venv/bin/torchrun --nproc-per-node 2 pretrain_gpt.py \
    --use-matrix-fsdp --optimizer muon \
    --muon-momentum 0.95 --muon-use-nesterov --muon-extra-scale-factor 0.2 --muon-coefficient-type simple \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 \
    --seq-length 128 --max-position-embeddings 128 --hidden-dropout 0 --attention-dropout 0 \
    --micro-batch-size 4 --global-batch-size 8 \
    --train-iters 300 --lr 3e-3 --lr-decay-style cosine --lr-warmup-fraction 0.07 --adam-beta2 0.95 \
    --log-interval 10 --eval-interval 50 --eval-iters 10 \
    --output-dir runs/default "$@"
