"""Generate text from a megatron-mfsdp checkpoint (--ckpt-format torch_dist, saved at any layout).

    python tools/generate.py --load CKPT --prompt "def main(" --max-new-tokens 32 --greedy
    python tools/generate.py --load CKPT --prompt-ids "1 2 3" --temperature 0.8 --top-p 0.9 --seed 7
    torchrun --nproc-per-node 2 tools/generate.py --load CKPT --prompt "a" --prompt "b" --greedy
    torchrun --nproc-per-node 2 tools/generate.py --load CKPT --tensor-model-parallel-size 2 --prompt "a"

Decoding runs on megatron-core's KV cache (models/gpt/kv_cache.py), up to --batch-size prompts of
any lengths together. Each process holds its --tensor-model-parallel-size shard of the model
(dist_checkpointing reshards whatever layout saved it); the world size is TP x DP and the prompts
are shared out round robin over the data-parallel ranks. Rank 0 prints, per prompt,
``generated ids: ...`` and the decoded text. Text prompts use the tokenizer the checkpoint's
stored --tokenizer-* flags describe (override them with the same flags).
"""

import argparse
import sys
import warnings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="generate.py", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True, help="checkpoint folder (latest_checkpointed_iteration.txt, iter_*)")
    p.add_argument("--ckpt-step", type=int, default=None, help="iteration to load (default: the latest)")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=[], help='prompt token ids, e.g. "1 2 3" (repeatable)')
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument(
        "--tensor-model-parallel-size", type=int, default=1, help="TP size to hold the model at (divides the world)"
    )
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together on one KV cache")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (ignores the sampling flags)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling mass (0: off)")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the tokenizer's end-of-document id")
    for flag in ("--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file"):
        p.add_argument(flag, default=None, help="override the checkpoint's stored value")
    return p


def _tokenizer(args, stored: dict):
    from megatron_mfsdp.checkpoint.convert import tokenizer_from_args

    overrides = {k: getattr(args, k) for k in ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")}
    try:
        return tokenizer_from_args({**stored, **{k: v for k, v in overrides.items() if v is not None}}), None
    except Exception as err:  # any tokenizer failure: text prompts need it, id prompts do not
        return None, err


def _prompts(args, tokenizer, error) -> list:
    prompts = []
    for text in args.prompt:
        if tokenizer is None:
            sys.exit(f"generate.py: error: --prompt needs the checkpoint's tokenizer: {error}")
        prompts.append(list(tokenizer.tokenize(text)))
    for ids in args.prompt_ids:
        try:
            prompts.append([int(t) for t in ids.replace(",", " ").split()])
        except ValueError:
            sys.exit(f"generate.py: error: --prompt-ids {ids!r} is not a list of integers")
    if not prompts or not all(prompts):
        sys.exit("generate.py: error: give at least one non-empty --prompt or --prompt-ids")
    return prompts


def _vocab_size(stored: dict) -> int:
    """The logits cut at the tokens (Megatron-LM's padding rows are not tokens)."""
    from megatron_mfsdp.checkpoint.convert import true_vocab_size
    from megatron_mfsdp.models.gpt.hf import ConversionError

    try:
        return true_vocab_size(stored)
    except ConversionError as err:
        print(
            f"generate.py: warning: sampling over all {stored['padded_vocab_size']} padded rows ({err})",
            file=sys.stderr,
        )
        return int(stored["padded_vocab_size"])


def _stop_ids(args, tokenizer) -> tuple:
    if args.ignore_eos or tokenizer is None:
        return ()
    try:
        return () if tokenizer.eod is None else (int(tokenizer.eod),)
    except NotImplementedError:
        return ()


def _decode(args, model, prompts, vocab, stop_ids) -> dict:
    """{prompt index: new ids} of this data-parallel rank's prompts (round robin), in batches; empty
    on TP ranks other than 0 (they decode the same prompts)."""
    from megatron.core import parallel_state as ps

    from megatron_mfsdp.models.gpt.generate import generate

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mine = [i for i in range(len(prompts)) if i % dp_size == dp_rank]
    results = {}
    for start in range(0, len(mine), args.batch_size):
        batch = mine[start : start + args.batch_size]
        new = generate(
            model,
            [prompts[i] for i in batch],
            args.max_new_tokens,
            vocab,
            greedy=args.greedy,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seeds=[args.seed + i for i in batch],
            stop_ids=stop_ids,
        )
        results.update(zip(batch, new))
    return results if ps.get_tensor_model_parallel_rank() == 0 else {}


def _print_results(prompts, results, tokenizer) -> None:
    for i, prompt in enumerate(prompts):
        print(f"prompt ids: {' '.join(map(str, prompt))}")
        print(f"generated ids: {' '.join(map(str, results[i]))}")
        if tokenizer is not None:
            print(f"generated text: {tokenizer.detokenize(results[i])}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.batch_size < 1:
        sys.exit(f"generate.py: error: --batch-size must be >= 1, got {args.batch_size}")
    # megatron-core's fallback warnings: one line at the end (-W or PYTHONWARNINGS: Python's own output)
    with warnings.catch_warnings(record=not sys.warnoptions) as caught:
        try:
            return run(args)
        finally:
            from megatron_mfsdp.compat.fallbacks import report

            report(caught, "generate.py")


def _eager_fusions() -> None:
    """On a CPU, megatron-core's fused bias-activation and friends run eagerly, as pretrain_gpt.py's
    --disable-jit-fuser runs them: compiling them (inductor, at their first call) costs more than a
    short decode gains back, same tokens (benchmarks/results/startup.md)."""
    from megatron.core import jit

    jit.disable_jit_fuser()  # megatron_mfsdp's deferred compile (compat/jit.py) then calls them as they are


def run(args) -> int:
    """Load, decode and print (rank 0), as the module docstring says."""
    import torch
    import torch.distributed as dist

    from megatron_mfsdp.checkpoint.model_files import ensure_process_group, load_model_shard

    owns_process_group = ensure_process_group()
    try:
        stored, model = load_model_shard(args.load, args.ckpt_step, args.tensor_model_parallel_size)
    except ValueError as err:
        sys.exit(f"generate.py: error: {err}")
    if torch.cuda.is_available():
        model.cuda()
    else:
        _eager_fusions()
    model.eval()
    tokenizer, error = _tokenizer(args, stored)
    prompts, vocab = _prompts(args, tokenizer, error), _vocab_size(stored)
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    if longest > stored["max_position_embeddings"]:
        sys.exit(f"generate.py: error: prompt + --max-new-tokens = {longest} > {stored['max_position_embeddings']}")
    mine = _decode(args, model, prompts, vocab, _stop_ids(args, tokenizer))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        _print_results(prompts, {i: ids for part in gathered for i, ids in part.items()}, tokenizer)
    dist.barrier()
    if owns_process_group:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
