"""Convert checkpoints between Hugging Face and megatron-mfsdp, with Megatron-LM's command line
(tools/checkpoint/convert.py at core_v0.16.1: --loader, --saver, --load-dir, --save-dir and the
core saver's --target-tensor/pipeline-parallel-size).

    python tools/checkpoint/convert.py --loader hf --saver mfsdp --load-dir HF --save-dir CKPT
    python tools/checkpoint/convert.py --loader mfsdp --saver hf --load-dir CKPT --save-dir HF

The library is megatron_mfsdp/checkpoint/convert.py; this file only parses flags.
"""

import argparse
import sys

EPILOG = (
    "mfsdp is --ckpt-format torch_dist (Megatron-LM's layout: latest_checkpointed_iteration.txt, "
    "iter_NNNNNNN/ by megatron-core dist_checkpointing, the args in the common state). Its tensors are "
    "global, so a checkpoint saved at any TP x PP x DP is read here, and the saver writes them at 1 x 1 x 1: "
    "dist_checkpointing reshards when a run loads them at another layout. --target-tensor/pipeline-parallel-size "
    "set the layout stored in the args (what --use-checkpoint-args resumes at) and the vocabulary padding of "
    "that TP. A converted checkpoint has no optimizer state: resume from it with --finetune or --no-load-optim. "
    "hf is a LlamaForCausalLM or GPT2LMHeadModel folder (safetensors + config.json, tokenizer files when the "
    "source has them). Settings either side cannot express are refused by name."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="convert.py", description="Megatron-style checkpoint converter.", epilog=EPILOG, allow_abbrev=False
    )
    p.add_argument("--model-type", default="GPT", choices=["GPT"], help="only GPT models convert")
    p.add_argument("--loader", required=True, choices=["mfsdp", "hf"], help="format of --load-dir")
    p.add_argument("--saver", required=True, choices=["mfsdp", "hf"], help="format to write to --save-dir")
    p.add_argument("--load-dir", required=True, help="checkpoint folder to read")
    p.add_argument("--save-dir", required=True, help="folder to write (must be empty or absent)")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1, help="mfsdp saver: stored TP size")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1, help="mfsdp saver: stored PP size")
    p.add_argument("--ckpt-step", type=int, default=None, help="mfsdp loader: iteration to read (default: latest)")
    p.add_argument(
        "--true-vocab-size",
        type=int,
        default=None,
        help="mfsdp loader: the tokenizer's vocabulary size, when the stored tokenizer files are gone",
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
    return p


def pretrain_defaults() -> dict:
    """pretrain_gpt.py's defaults: a converted checkpoint stores a whole vars(args), as training does."""
    from megatron_mfsdp.training.arguments import build_parser as training_parser

    return vars(training_parser().parse_known_args([])[0])


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_mfsdp.checkpoint.convert import convert
    from megatron_mfsdp.checkpoint.model_files import CheckpointError
    from megatron_mfsdp.models.gpt.hf import ConversionError

    try:
        loaded = convert(
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
            keep_vocab_padding=args.hf_keep_vocab_padding,
        )
    except (ConversionError, CheckpointError, FileNotFoundError) as err:
        print(f"convert.py: error: {err}", file=sys.stderr)
        return 2
    kind = "LlamaForCausalLM" if loaded.args.get("swiglu") else "GPT2LMHeadModel"
    tensors = len(loaded.tensors)
    print(f"converted {args.loader} {args.load_dir} -> {args.saver} {args.save_dir} ({kind}, {tensors} tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
