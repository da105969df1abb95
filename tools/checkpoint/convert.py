"""Convert checkpoints between Hugging Face and megatron-mfsdp, with Megatron-LM's command line
(tools/checkpoint/convert.py at core_v0.16.1 and HEAD: --model-type, --loader, --saver, --load-dir,
--save-dir, the core saver's --target-tensor/pipeline/expert-parallel-size, llama_mistral's --checkpoint-type,
--model-size, --tokenizer-model, --bf16/--fp16).

    python tools/checkpoint/convert.py --loader hf --saver mfsdp --load-dir HF --save-dir CKPT
    python tools/checkpoint/convert.py --loader mfsdp --saver hf --load-dir CKPT --save-dir HF
    python tools/checkpoint/convert.py --model-type GPT --loader llama_mistral --checkpoint-type hf \\
        --model-size llama3 --saver core --load-dir HF --save-dir CKPT --tokenizer-model HF

The library is megatron_mfsdp/checkpoint/convert.py (LOADERS and SAVERS map Megatron-LM's names);
this file only parses flags.
"""

import argparse
import sys
import warnings

EPILOG = (
    "mfsdp (Megatron-LM's core, and its old name mcore) is --ckpt-format torch_dist (Megatron-LM's layout: "
    "latest_checkpointed_iteration.txt, iter_NNNNNNN/ by megatron-core dist_checkpointing, the args in the "
    "common state). Its tensors are global, so a checkpoint saved at any TP x PP x DP (by megatron-mfsdp or by "
    "Megatron-LM) is read here, and the saver writes them at 1 x 1 x 1: dist_checkpointing reshards when a run "
    "loads them at another layout. --target-tensor/pipeline/expert-parallel-size set the layout stored in the "
    "args (what --use-checkpoint-args resumes at) and the vocabulary padding of that TP. A converted checkpoint "
    "has no optimizer state: resume from it with --finetune or --no-load-optim. hf (and Megatron-LM's "
    "llama_mistral loader with --checkpoint-type hf) is a LlamaForCausalLM, GPT2LMHeadModel, "
    "Qwen3MoeForCausalLM or DeepseekV3ForCausalLM folder (safetensors + config.json, tokenizer files when the "
    "source has them). "
    "Megatron-LM's legacy (and its old name megatron) checkpoints of non-megatron-core models are refused. "
    "Settings either side cannot express are refused by name."
)
LOADER_NAMES = ("mfsdp", "core", "mcore", "hf", "llama_mistral", "legacy", "megatron")
SAVER_NAMES = ("mfsdp", "core", "mcore", "hf", "legacy", "megatron")


def _add_megatron_args(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's loader and saver flags that mean something here, or are accepted with a note."""
    g = p.add_argument_group("Megatron-LM's loader and saver flags")
    g.add_argument(
        "--checkpoint-type",
        choices=["hf", "meta"],
        default=None,
        help="llama_mistral: hf (a Hugging Face folder, read by the hf loader); meta's original files are refused",
    )
    g.add_argument("--model-size", default=None, help="llama_mistral: noted only; the model is read from config.json")
    g.add_argument(
        "--tokenizer-model",
        default=None,
        help="hf/llama_mistral: the folder whose Hugging Face tokenizer files are carried along (default: --load-dir)",
    )
    g.add_argument("--bf16", action="store_true", help="load the weights in bf16 (and store --bf16)")
    g.add_argument("--fp16", action="store_true", help="load the weights in fp16 (and store --fp16)")
    g.add_argument(
        "--target-expert-parallel-size",
        type=int,
        default=1,
        help="core saver: the stored EP size of an MoE model (its experts are written whole, read at any EP)",
    )
    for flag in ("--megatron-path", "--max-queue-size", "--loader-transformer-impl", "--saver-transformer-impl"):
        g.add_argument(flag, default=None, help="accepted and not needed here (noted in the output)")
    g.add_argument("--no-checking", action="store_true", help="accepted and not needed here (noted in the output)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="convert.py", description="Megatron-style checkpoint converter.", epilog=EPILOG, allow_abbrev=False
    )
    p.add_argument("--model-type", default="GPT", choices=["GPT"], help="only GPT models convert")
    p.add_argument(
        "--loader",
        required=True,
        choices=LOADER_NAMES,
        help="format of --load-dir: mfsdp, core and mcore read torch_dist; hf and llama_mistral a Hugging Face "
        "folder; legacy and megatron are refused",
    )
    p.add_argument(
        "--saver",
        required=True,
        choices=SAVER_NAMES,
        help="format to write to --save-dir: mfsdp, core and mcore write torch_dist; hf a Hugging Face folder; "
        "legacy and megatron are refused",
    )
    p.add_argument("--load-dir", required=True, help="checkpoint folder to read")
    p.add_argument("--save-dir", required=True, help="folder to write (must be empty or absent)")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1, help="torch_dist saver: stored TP size")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1, help="torch_dist saver: stored PP size")
    p.add_argument("--ckpt-step", type=int, default=None, help="torch_dist loader: iteration to read (default: latest)")
    p.add_argument(
        "--true-vocab-size",
        type=int,
        default=None,
        help="torch_dist loader: the tokenizer's vocabulary size, when the stored tokenizer files are gone",
    )
    p.add_argument(
        "--hf-keep-vocab-padding",
        action="store_true",
        help="hf saver: also write Megatron-LM's padding rows (config vocab_size = padded size), so that "
        "transformers' softmax spans what training's did and its loss equals ours exactly",
    )
    p.add_argument(
        "--make-vocab-size-divisible-by", type=int, default=128, help="hf loader: vocabulary padding (Megatron-LM's)"
    )
    _add_megatron_args(p)
    return p


def pretrain_defaults() -> dict:
    """pretrain_gpt.py's defaults: a converted checkpoint stores a whole vars(args), as training does."""
    from megatron_mfsdp.training.arguments import build_parser as training_parser

    return vars(training_parser().parse_known_args([])[0])


def _check(args, convert_lib) -> tuple[str, str, list[str]]:
    """(loader's format, saver's format, notes) of the names given; ConversionError for a refusal."""
    from megatron_mfsdp.models.gpt.hf import ConversionError

    loader, saver = convert_lib.resolve("loader", args.loader)[1], convert_lib.resolve("saver", args.saver)[1]
    if args.checkpoint_type == "meta":
        raise ConversionError(
            "--checkpoint-type meta: Meta's original checkpoint files are not read; give the "
            "Hugging Face folder (--checkpoint-type hf)"
        )
    if args.bf16 and args.fp16:
        raise ConversionError("--bf16 and --fp16 exclude each other")
    notes = [f"--model-size {args.model_size}: the model is read from config.json"] if args.model_size else []
    for flag in ("megatron_path", "max_queue_size", "loader_transformer_impl", "saver_transformer_impl"):
        if getattr(args, flag) is not None:
            notes.append(f"--{flag.replace('_', '-')}: not needed here (one process reads and writes)")
    if args.no_checking:
        notes.append("--no-checking: not needed here (every tensor name is checked either way)")
    return loader, saver, notes


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # megatron-core's fallback warnings: one line at the end (-W or PYTHONWARNINGS: Python's own output)
    with warnings.catch_warnings(record=not sys.warnoptions) as caught:
        try:
            return run(args)
        finally:
            from megatron_mfsdp.compat.fallbacks import report

            report(caught, "convert.py")


def run(args) -> int:
    """Check the names, convert, print the one-line result (or the error, returning 2)."""
    import torch

    from megatron_mfsdp.checkpoint import convert as convert_lib
    from megatron_mfsdp.checkpoint.model_files import CheckpointError
    from megatron_mfsdp.models.gpt.hf import ConversionError

    try:
        loader_format, saver_format, notes = _check(args, convert_lib)
        for note in notes:
            print(f"convert.py: note: {note}")
        loaded = convert_lib.convert(
            args.loader,
            args.saver,
            args.load_dir,
            args.save_dir,
            base_args=pretrain_defaults(),
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            step=args.ckpt_step,
            true_vocab_size=args.true_vocab_size,
            target_tp=args.target_tensor_parallel_size,
            target_pp=args.target_pipeline_parallel_size,
            target_ep=args.target_expert_parallel_size,
            keep_vocab_padding=args.hf_keep_vocab_padding,
            dtype=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None,
            tokenizer_dir=args.tokenizer_model,
        )
    except (ConversionError, CheckpointError, FileNotFoundError) as err:
        print(f"convert.py: error: {err}", file=sys.stderr)
        return 2
    from megatron_mfsdp.models.gpt import hf

    kind = hf.ARCHITECTURES[hf.architecture(loaded.args)]
    tensors = len(loaded.tensors)
    print(
        f"converted {args.loader} [{loader_format}] {args.load_dir} -> {args.saver} [{saver_format}] "
        f"{args.save_dir} ({kind}, {tensors} tensors)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
