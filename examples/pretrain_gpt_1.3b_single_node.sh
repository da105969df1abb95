#!/usr/bin/env bash
# GPT of ~1.3B parameters (24 layers, hidden 2048, 16 heads) on one node of 8 GPUs, MatrixFSDP + Muon in
# bf16, in the image of ../Dockerfile (or any CUDA + NCCL + Transformer Engine environment). Set DATA_PATH
# (a megatron .bin/.idx prefix) and TOKENIZER_MODEL (a SentencePiece model); tools/preprocess_data.py makes
# both from jsonl. Extra pretrain_gpt.py flags go after the script's name. The model and training flags are
# those of pretrain_gpt_1.3b_multi_node.slurm (there: 4 nodes, global batch 512).
set -euo pipefail
: "${DATA_PATH:?set DATA_PATH to an indexed dataset prefix}"
: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to a SentencePiece .model}"
GPUS=${GPUS:-8}
CKPT=${CKPT:-checkpoints/gpt-1.3b}
EXIT_DURATION_MINS=${EXIT_DURATION_MINS:-}  # e.g. a few minutes under a scheduler's time limit

# MatrixFSDP overlaps its owner gathers and gradient reductions with compute on NCCL's streams, so
# CUDA_DEVICE_MAX_CONNECTIONS must not be 1 (pretrain refuses 1: megatron_mfsdp/training/launch.py);
# unset keeps CUDA's default of 8.
unset CUDA_DEVICE_MAX_CONNECTIONS

ARGS=(
    --use-matrix-fsdp --optimizer muon --muon-ns-dtype bf16
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16
    --seq-length 2048 --max-position-embeddings 2048
    --position-embedding-type rope --normalization RMSNorm --swiglu
    --micro-batch-size 4 --global-batch-size 256
    --train-iters 50000 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 2000
    --weight-decay 0.1 --clip-grad 1.0 --bf16
    --data-path "$DATA_PATH" --split 969,30,1
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL"
    --log-interval 10 --log-throughput --eval-interval 1000 --eval-iters 10
    --save "$CKPT" --load "$CKPT" --save-interval 1000 --exit-signal-handler
    --distributed-backend nccl --output-dir "$CKPT/logs"
)
[ -n "$EXIT_DURATION_MINS" ] && ARGS+=(--exit-duration-in-mins "$EXIT_DURATION_MINS")

# --exit-signal-handler: on SIGTERM (a scheduler's warning; docker stop -t 300) every rank finishes its
# iteration, saves and exits. torchrun forwards SIGTERM to the ranks and kills them after its shutdown
# timeout: TORCH_ELASTIC_SHUTDOWN_TIMEOUT where its torch reads it (newer releases), else 30 s.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}
exec torchrun --nproc-per-node "$GPUS" pretrain_gpt.py "${ARGS[@]}" "$@"
