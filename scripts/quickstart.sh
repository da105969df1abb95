#!/usr/bin/env bash
# Install (scripts/setup_env.sh) and run the embedded default pretraining on CPU: 2 gloo ranks,
# a tiny GPT, MatrixFSDP + Muon, on a corpus and SentencePiece tokenizer built from this
# machine's Python sources (no --data-path: pretrain_gpt.py builds them once, into
# ~/.cache/megatron_mfsdp/default_data or --data-cache-path). Every choice is spelled out;
# the rest are Megatron-LM's defaults.
#
# The run folder (--output-dir, default runs/default) gets the loss curve and, in checkpoints/,
# the final checkpoint (torch_dist). The run ends with a greedy sample of it (tools/generate.py)
# and the commands that use it (generate, train more, export to Hugging Face), paths filled in.
# As Megatron-LM's --save DIR --load DIR on one folder: a second run continues from that
# checkpoint (a first line says which); --no-load (this script's option, not a pretrain_gpt.py
# flag) moves it aside (to checkpoints.before-DATE, nothing is deleted) and trains from scratch;
# a fresh --output-dir trains from scratch and keeps the old run.
#
# Extra arguments go to pretrain_gpt.py (a later flag wins: --train-iters 10).
# QUICKSTART_SETUP=0 skips scripts/setup_env.sh (a .venv already set up); QUICKSTART_SAMPLE=0 skips
# the closing sample (the commands are still printed).
set -euo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
[ "${QUICKSTART_SETUP:-1}" = 0 ] || bash scripts/setup_env.sh
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}

# What the extra arguments say about the run folder (pretrain_gpt.py reads them again: a later flag wins).
out=runs/default save="" load="" iters=300 no_load=0 trained=0 args=() again=() prev=""
for arg in "$@"; do
    case "$prev" in
        --output-dir) out=$arg ;;
        --save) save=$arg ;;
        --load) load=$arg ;;
        --train-iters) iters=$arg ;;
    esac
    case "$arg" in
        --output-dir=*) out=${arg#*=} ;;
        --save=*) save=${arg#*=} ;;
        --load=*) load=${arg#*=} ;;
        --train-iters=*) iters=${arg#*=} ;;
    esac
    if [ "$arg" = --no-load ]; then
        no_load=1
    else
        args+=("$arg")
        # the arguments a "train more" command repeats: all but --train-iters N and the scheduler override
        case "$arg:$prev" in
            --train-iters:* | --train-iters=*:* | *:--train-iters | --override-opt[_-]param-scheduler:*) ;;
            *) again+=("$arg") ;;
        esac
    fi
    prev=$arg
done
save=${save:-$out/checkpoints}
tracker=$save/latest_checkpointed_iteration.txt
if [ "$no_load" = 1 ] && [ -n "$load" ]; then
    echo "quickstart.sh: error: --no-load and --load $load: give one" >&2
    exit 2
fi
run_flags=(--output-dir "$out" --ckpt-format torch_dist --save "$save" --save-interval 300)
if [ "$no_load" = 1 ]; then
    if [ -f "$tracker" ]; then
        aside="$save.before-$(date +%Y%m%d-%H%M%S)"
        echo "> quickstart: --no-load: training from scratch; the checkpoint in $save (iteration $(cat "$tracker")) is moved to $aside"
        mv "$save" "$aside"
    else
        echo "> quickstart: --no-load: training from scratch, saving the final checkpoint in $save"
    fi
elif [ -n "$load" ]; then
    echo "> quickstart: --load $load: continuing from its checkpoint if it has one, saving in $save"
elif [ -f "$tracker" ]; then
    done_iters=$(cat "$tracker")
    left=""
    if [ "$done_iters" -ge "$iters" ] 2>/dev/null; then
        left=" of --train-iters $iters: nothing left to train (add --train-iters $((done_iters + iters)) --override-opt_param-scheduler for more)"
        trained=1  # pretrain_gpt.py would load it and stop: the sample and the commands follow at once
    fi
    echo "> quickstart: continuing from the checkpoint in $save at iteration $done_iters$left; --no-load starts from scratch"
    run_flags+=(--load "$save")
else
    echo "> quickstart: training from scratch (no checkpoint in $save yet); a second run continues from the one saved there (--no-load: from scratch)"
    run_flags+=(--load "$save")
fi
[ "$trained" = 1 ] || .venv/bin/torchrun --nproc-per-node 2 pretrain_gpt.py \
    --use-matrix-fsdp --optimizer muon \
    --muon-momentum 0.95 --muon-use-nesterov --muon-extra-scale-factor 0.2 --muon-coefficient-type simple \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 \
    --seq-length 128 --max-position-embeddings 128 --hidden-dropout 0 --attention-dropout 0 \
    --micro-batch-size 4 --global-batch-size 8 \
    --train-iters 300 --lr 3e-3 --lr-decay-style cosine --lr-warmup-fraction 0.07 --adam-beta2 0.95 \
    --log-interval 10 --eval-interval 50 --eval-iters 10 \
    "${run_flags[@]}" ${args[@]+"${args[@]}"}

# What the run leaves: a sample of the checkpoint and the commands that use it, as they run.
if [ ! -f "$tracker" ]; then
    echo "> quickstart: no checkpoint in $save (none saved by this run)"
    exit 0
fi
iteration=$(cat "$tracker")
prompt="def __init__(self"
max_new=32
q() { printf ' %q' "$@"; }
echo
if [ "${QUICKSTART_SAMPLE:-1}" = 0 ]; then
    echo "> quickstart: the model is in $save (iteration $iteration, torch_dist)"
else
    sample=$(.venv/bin/python tools/generate.py --load "$save" --prompt "$prompt" --max-new-tokens "$max_new" --greedy)
    echo "> quickstart: the model is in $save (iteration $iteration, torch_dist); greedy from '$prompt' (tools/generate.py):"
    printf '%s%s\n\n' "$prompt" "$(sed -n '/^generated text: /,$p' <<<"$sample" | sed '1s/^generated text: //')"
fi
echo "> what next (each command runs as printed):"
[ "$caller" = "$PWD" ] || echo "    cd$(q "$PWD")"
echo "    # more text: any --prompt, several at once; without --greedy it samples (--temperature, --top-k, --top-p)"
echo "    .venv/bin/python tools/generate.py --load$(q "$save") --prompt '$prompt' --max-new-tokens $max_new --greedy"
echo "    # train $iters more iterations: this script continues from the checkpoint, its schedule stretched to the new end"
echo "    bash scripts/quickstart.sh${again[@]+$(q "${again[@]}")} --train-iters $((iteration + iters)) --override-opt_param-scheduler"
echo "    # export to Hugging Face (config.json + model.safetensors; transformers' from_pretrained reads it)"
echo "    .venv/bin/python tools/checkpoint/convert.py --loader mfsdp --saver hf --load-dir$(q "$save") --save-dir$(q "$out/hf-iter$iteration")"
