#!/usr/bin/env bash
# GPU check of megatron-mfsdp in under 5 minutes on one GPU (more are used when present), in the NGC
# image (Dockerfile) or any CUDA + NCCL + Transformer Engine environment. Steps, in this order, each
# with its own time limit inside one overall budget, a log in $OUT_DIR and a PASS/FAIL line:
#   env        versions (torch, CUDA, NCCL, TE, megatron-core), the fused-kernel and FP8 TE paths present
#   fused      pretrain_gpt.py --use-matrix-fsdp --optimizer muon --bf16 on 1 GPU, gradient-accumulation
#              fusion on (its default where Apex or TE exists; the step fails if it was turned off)
#   unfused    the same with --no-gradient-accumulation-fusion: losses compared with fused
#   fp8_quant  benchmarks/gpu_fp8_te_check.py: our FP8 quantization bitwise against TE's quantizers
#   fp8_train  the fused run with --fp8-format e4m3 --fp8-param-gather --fp8-recipe tensorwise: FP8
#              weights handed to TE as Float8Tensor (precision/te.py); loss compared with fused
#   bench_e2e  benchmarks/bench_end_to_end.py at W=2 and 4 (gloo ranks on the CPU cores, its design)
#   exactness  tests/distributed/test_dp_exactness.py (bitwise DP vs single process; gloo, CPU)
#   nccl_N     with N > 1 GPUs: the fused run on N GPUs (same global batch), loss compared with fused
# Usage:  bash benchmarks/gpu_check.sh          (PYTHON=... interpreter, OUT_DIR=... logs,
#                                                GPU_CHECK_BUDGET_S=... overall limit, default 290)
#         GPU_CHECK_DRY_RUN=1 bash benchmarks/gpu_check.sh   the same commands on CPU/gloo (no GPU checks)
# Exit status 0 when every step passed, 1 otherwise, 2 when no GPU is visible. Written and dry-run on a
# CPU-only machine; the loss tolerances (2e-2) are not yet calibrated on a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=${GPU_CHECK_DRY_RUN:-0}
PY=${PYTHON:-python}
[ -z "${PYTHON:-}" ] && [ "$DRY" = 1 ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
OUT=${OUT_DIR:-runs/gpu_check}
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-$([ "$DRY" = 1 ] && echo 1200 || echo 290)}
DEADLINE=$((START + BUDGET))
SUMMARY=()
FAILED=0
mkdir -p "$OUT"
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1

# MatrixFSDP overlaps its gathers and reductions on NCCL's streams: CUDA_DEVICE_MAX_CONNECTIONS must
# not be 1 (training/launch.py); pretrain refuses 1, so a cluster-wide export is dropped here.
if [ -n "${CUDA_DEVICE_MAX_CONNECTIONS:-}" ]; then
    echo "gpu_check: unsetting CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS (MatrixFSDP needs > 1)"
    unset CUDA_DEVICE_MAX_CONNECTIONS
fi

record() {  # record NAME VERDICT DETAIL: one summary line; FAIL (and SKIP outside the dry run) fails the check
    [ "$2" = PASS ] || { [ "$2" = SKIP ] && [ "$DRY" = 1 ]; } || FAILED=1
    SUMMARY+=("$(printf '%-10s %-4s %s' "$1" "$2" "$3")")
}

run_step() {  # run_step NAME SECONDS CMD...: log to $OUT/NAME.log; a failure is recorded here, with why
    local name=$1 limit=$2 left t0 rc
    shift 2
    left=$((DEADLINE - $(date +%s)))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 10 ]; then
        echo "no time left in the ${BUDGET}s budget" >"$OUT/$name.log"
        record "$name" FAIL "not run: no time left in the ${BUDGET}s budget"
        return 1
    fi
    t0=$(date +%s)
    echo "--- $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "    rc $rc after $(($(date +%s) - t0))s"
    [ "$rc" -eq 0 ] && return 0
    tail -n 15 "$OUT/$name.log"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        record "$name" FAIL "timed out after ${limit}s (log: $OUT/$name.log)"
    else
        record "$name" FAIL "exit $rc (log: $OUT/$name.log)"
    fi
    return 1
}

compare() {  # compare A B TOL: relative gap of the mean lm loss of the last 5 iterations (loss_history.json)
    "$PY" - "$OUT/$1/loss_history.json" "$OUT/$2/loss_history.json" "$3" <<'EOF'
import json, math, sys
a, b = ([loss for _, loss in json.load(open(p))["train"]] for p in sys.argv[1:3])
tol = float(sys.argv[3])
tail_a, tail_b = sum(a[-5:]) / 5, sum(b[-5:]) / 5
gap = abs(tail_a - tail_b) / abs(tail_b)
ok = all(map(math.isfinite, a + b)) and len(a) == len(b) and gap < tol
print(f"last-5 loss {tail_a:.4f} vs {tail_b:.4f}, relative gap {gap:.2e} (limit {tol:g}); first {a[0]:.4f} vs {b[0]:.4f}")
sys.exit(0 if ok else 1)
EOF
}

learned() {  # learned RUN: the loss went down (mean of the last 5 iterations below the first 5)
    "$PY" -c 'import json, sys; l = [v for _, v in json.load(open(sys.argv[1]))["train"]]
sys.exit(0 if sum(l[-5:]) < sum(l[:5]) else 1)' "$OUT/$1/loss_history.json"
}

if [ "$DRY" = 1 ]; then
    NGPU=1
    echo "gpu_check dry run: CPU and gloo (pretrain_gpt.py falls back from --distributed-backend nccl)"
else
    NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
    if [ "$NGPU" -lt 1 ]; then
        echo "gpu_check.sh: no CUDA device visible to $PY (GPU_CHECK_DRY_RUN=1 runs the CPU dry run)" >&2
        exit 2
    fi
fi

# env ------------------------------------------------------------------------------------------------
if run_step env 60 "$PY" -c '
import importlib.util, os, torch
import megatron.core, megatron_mfsdp
from megatron_mfsdp.precision import te_available
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
if torch.cuda.is_available():
    print("nccl", torch.cuda.nccl.version(), "device", torch.cuda.get_device_name(0))
te = importlib.util.find_spec("transformer_engine")
print("transformer_engine", __import__("transformer_engine").__version__ if te else "missing")
print("megatron-core", megatron.core.__version__, "megatron_mfsdp", megatron_mfsdp.__file__)
print("apex fused_weight_gradient_mlp_cuda", bool(importlib.util.find_spec("fused_weight_gradient_mlp_cuda")))
print("FP8 TE path (precision/te.py te_available)", te_available())
print("CUDA_DEVICE_MAX_CONNECTIONS", os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset"))'; then
    record env PASS "$(grep -E '^(transformer_engine|megatron-core) ' "$OUT/env.log" | cut -d' ' -f1-2 | tr '\n' ' ')"
fi
cat "$OUT/env.log"

# A tiny GPT on the embedded default corpus (built once into ~/.cache/megatron_mfsdp); 4 micro-batches
# per step, so main_grad accumulates across micro-batches in the fused path.
PRETRAIN=(pretrain_gpt.py --use-matrix-fsdp --optimizer muon --bf16 --distributed-backend nccl
    --num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128
    --hidden-dropout 0 --attention-dropout 0 --micro-batch-size 2 --global-batch-size 8 --train-iters 20
    --lr 3e-3 --lr-warmup-iters 2 --log-interval 5 --eval-interval 1000 --eval-iters 0 --seed 1234
    --log-throughput)
OFF_NOTICE="fusions not available.*gradient accumulation"  # validate_device's notice when it turned fusion off

pretrain_step() {  # pretrain_step NAME GPUS EXTRA...: one run; true when it ran, printed the launch line and learned
    local name=$1 gpus=$2
    shift 2
    run_step "$name" 75 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$gpus" "${PRETRAIN[@]}" \
        --output-dir "$OUT/$name" "$@" || return 1
    if ! grep -q '^> CUDA_DEVICE_MAX_CONNECTIONS' "$OUT/$name.log"; then
        record "$name" FAIL "no CUDA_DEVICE_MAX_CONNECTIONS start-up line (training/launch.py not called)"
        return 1
    fi
    if ! learned "$name"; then
        record "$name" FAIL "the loss did not go down over 20 iterations"
        return 1
    fi
}

judge() {  # judge NAME A B TOL: PASS when the losses of runs A and B agree within TOL
    local detail rc
    detail=$(compare "$2" "$3" "$4" 2>&1)
    rc=$?
    detail=${detail##*$'\n'}  # the last line: the comparison, or the error that stopped it
    if [ "$rc" -eq 0 ]; then record "$1" PASS "$detail"; else record "$1" FAIL "$detail"; fi
}

if pretrain_step fused 1; then
    if [ "$DRY" != 1 ] && grep -q "$OFF_NOTICE" "$OUT/fused.log"; then
        record fused FAIL "gradient-accumulation fusion was turned off: no Apex or TE kernels in this environment"
    else
        record fused PASS "$(grep -o 'lm loss: [0-9.E+-]*' "$OUT/fused.log" | tail -n 1); $(grep '^> CUDA_DEVICE' "$OUT/fused.log" | cut -c3-70)"
    fi
fi

# bf16 weight gradients added into fp32 (unfused) vs accumulated in fp32 by the GEMM (fused): the
# same problem rounded differently; a micro-batch's gradient lost moves the loss far more.
pretrain_step unfused 1 --no-gradient-accumulation-fusion && judge unfused unfused fused 2e-2

if [ "$DRY" = 1 ]; then
    record fp8_quant SKIP "dry run: needs CUDA and Transformer Engine"
elif run_step fp8_quant 60 "$PY" benchmarks/gpu_fp8_te_check.py; then
    if grep -q '^skipped' "$OUT/fp8_quant.log"; then
        record fp8_quant FAIL "$(grep '^skipped' "$OUT/fp8_quant.log")"
    else
        record fp8_quant PASS "$(tail -n 1 "$OUT/fp8_quant.log")"
    fi
fi

if pretrain_step fp8_train 1 --fp8-format e4m3 --fp8-param-gather --fp8-recipe tensorwise --log-params-norm; then
    if ! grep -q 'fp8 quantization error' "$OUT/fp8_train.log"; then
        record fp8_train FAIL "no FP8 error line: the weights were not FP8"
    elif [ "$DRY" != 1 ] && ! "$PY" -c 'from megatron_mfsdp.precision import te_available as t; exit(not t())'; then
        record fp8_train FAIL "Transformer Engine not usable here: the FP8 weights were dequantized, not given to TE"
    else
        judge fp8_train fp8_train fused 2e-2  # fp32 masters: FP8 rounds only what the GEMMs see
    fi
fi

# bench_end_to_end.py runs gloo worker processes on the CPU cores (testing/workers.py), its design:
# the GPU is hidden from it so that pretrain's set-up keeps the models on the CPU.
E2E_WORLDS=(2 4)
[ "$DRY" = 1 ] && E2E_WORLDS=(2)
if run_step bench_e2e 90 env CUDA_VISIBLE_DEVICES= "$PY" benchmarks/bench_end_to_end.py \
    --world-sizes "${E2E_WORLDS[@]}" --num-layers 2 --hidden-size 256 --heads 4 --seq-length 128 \
    --vocab-size 1024 --iters 3 --warmup 1 --threads 2; then
    missing=""
    for w in "${E2E_WORLDS[@]}"; do
        grep -q "^RESULT W=$w ours_step_tensor_collectives=0 " "$OUT/bench_e2e.log" || missing="$missing W=$w"
    done
    if [ -z "$missing" ]; then
        record bench_e2e PASS "$(grep '^RESULT' "$OUT/bench_e2e.log" | cut -d' ' -f2,3,6,7 | tr '\n' ' ')"
    else
        record bench_e2e FAIL "no RESULT line with 0 tensor collectives in ours' step for$missing"
    fi
fi

if run_step exactness 90 env CUDA_VISIBLE_DEVICES= "$PY" -m pytest -q -x -p no:cacheprovider \
    tests/distributed/test_dp_exactness.py; then
    record exactness PASS "$(grep -hE '[0-9]+ passed' "$OUT/exactness.log" | tail -n 1)"
fi

if [ "$NGPU" -gt 1 ]; then
    if [ $((8 % NGPU)) -ne 0 ]; then
        record "nccl_$NGPU" FAIL "global batch 8 does not split over $NGPU GPUs: set CUDA_VISIBLE_DEVICES to 2, 4 or 8"
    elif pretrain_step "nccl_$NGPU" "$NGPU" --micro-batch-size 1; then
        # The same 8 samples per step over N data-parallel ranks: NCCL's ring-order bf16 sums differ.
        judge "nccl_$NGPU" "nccl_$NGPU" fused 2e-2
    fi
fi

echo
echo "=== gpu_check summary: $NGPU GPU(s), $(($(date +%s) - START)) s of a ${BUDGET} s budget, logs in $OUT ==="
printf '%s\n' "${SUMMARY[@]}"
if [ "$FAILED" -ne 0 ]; then
    echo "gpu_check: FAIL"
    exit 1
fi
echo "gpu_check: PASS"
