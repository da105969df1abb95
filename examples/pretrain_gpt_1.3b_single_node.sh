#!/usr/bin/env bash
# GPT of ~1.3B parameters (24 layers, hidden 2048, 16 heads) on one node of 8 GPUs,
# MatrixFSDP + Muon in bf16. Set DATA_PATH (a megatron .bin/.idx prefix) and TOKENIZER_MODEL
# (a SentencePiece model); tools/preprocess_data.py makes both from jsonl.
set -euo pipefail
: "${DATA_PATH:?set DATA_PATH to an indexed dataset prefix}"
: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to a SentencePiece .model}"
GPUS=${GPUS:-8}
CKPT=${CKPT:-checkpoints/gpt-1.3b}

torchrun --nproc-per-node "$GPUS" pretrain_gpt.py \
    --use-matrix-fsdp --optimizer muon --muon-ns-dtype bf16 \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
    --seq-length 2048 --max-position-embeddings 2048 \
    --position-embedding-type rope --normalization RMSNorm --swiglu \
    --micro-batch-size 4 --global-batch-size 256 \
    --train-iters 50000 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 2000 \
    --weight-decay 0.1 --clip-grad 1.0 --bf16 \
    --data-path "$DATA_PATH" --split 969,30,1 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL" \
    --log-interval 10 --eval-interval 1000 --eval-iters 10 \
    --save "$CKPT" --load "$CKPT" --save-interval 1000 \
    --distributed-backend nccl --output-dir "$CKPT/logs" "$@"
