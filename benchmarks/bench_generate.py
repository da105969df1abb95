"""Greedy decoding speed: the full re-run of every step vs megatron-core's KV cache, side by side.

Issue 23 asks the KV cache to make 256 new tokens >= 5x faster than tools/generate.py's old
decoding, which re-ran the whole sequence for every new token (``generate_rerun``, kept as the
reference). One process, CPU (or the GPU when there is one), fp32, on the default model: the GPT
that scripts/quickstart.sh trains (4 layers, hidden 128, 4 heads, FFN 512, learned positions,
LayerNorm, GELU, tied output; the embedded default data's 4096-token SentencePiece vocabulary)
with megatron-core's initialization (std 0.02), except that its 128 positions are raised to fit
the prompt and the new tokens (the position table is looked up one row per token: no cost).
Random weights suffice: no stop id ends a row (every run takes exactly --new-tokens steps), the
kernels are dense with no data-dependent work, and the KV-cache time on a second set of weights is
printed next to the first to show it.

Per round, interleaved: the re-run and the KV cache on one 16-token prompt (their tokens must be
identical), then 8 prompts of 8 to 22 tokens batched on one KV cache (tokens/s of new tokens) and
the same prompts one at a time. The best of --rounds is printed (robust to other work on a shared
machine), and the median.

    .venv/bin/python benchmarks/bench_generate.py             # 256 new tokens, 3 rounds
    .venv/bin/python benchmarks/bench_generate.py --quick     # smoke run: small model, 16 tokens
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

# scripts/quickstart.sh's model (the default one pretrain_gpt.py is run with)
DEFAULT_MODEL = dict(num_layers=4, hidden_size=128, ffn_hidden_size=512, num_attention_heads=4)
QUICK_MODEL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4)
PROMPT, BATCH_PROMPTS = 16, tuple(range(8, 23, 2))  # 8 prompts of 8, 10, ..., 22 tokens


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: one core, steadier figures)")
    p.add_argument("--quick", action="store_true", help="2 layers, hidden 64, 16 new tokens, 1 round")
    p.add_argument("--num-layers", type=int, default=None, help="another depth than the default model's")
    p.add_argument("--hidden-size", type=int, default=None, help="another width (FFN 4x, 4 heads)")
    return p


def default_args(a, positions: int) -> dict:
    """The stored-args form of the model (what a checkpoint of it carries)."""
    from megatron_mfsdp.data.corpus import DEFAULT_VOCAB_SIZE
    from megatron_mfsdp.data.datasets import padded_vocab_size

    quick = a.quick
    shape = dict(QUICK_MODEL if quick else DEFAULT_MODEL)
    if a.num_layers:
        shape["num_layers"] = a.num_layers
    if a.hidden_size:
        shape.update(hidden_size=a.hidden_size, ffn_hidden_size=4 * a.hidden_size)
    vocab = 512 if quick else DEFAULT_VOCAB_SIZE
    return dict(
        shape,
        max_position_embeddings=positions,
        seq_length=positions,
        vocab_size=vocab,
        padded_vocab_size=padded_vocab_size(vocab, 128, 1),
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def build_model(args: dict, seed: int):
    """The whole GPTModel as tools/generate.py builds it, with megatron-core's init (std 0.02)."""
    from megatron_mfsdp.checkpoint.model_files import whole_model
    from megatron_mfsdp.models.gpt import initialize_by_global_name

    model = whole_model(args)
    initialize_by_global_name(model, model.config, seed)
    if torch.cuda.is_available():
        model.cuda()
    return model.eval()


def timed(fn):
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def one_round(model, other, prompt, batch, new: int, vocab: int) -> dict:
    """Seconds of each way to decode, and whether the re-run's and the cache's tokens agree."""
    from megatron_mfsdp.models.gpt.generate import generate, generate_rerun

    rerun_s, reference = timed(lambda: generate_rerun(model, prompt, new, vocab))
    kv_s, cached = timed(lambda: generate(model, [prompt], new, vocab)[0])
    other_s, _ = timed(lambda: generate(other, [prompt], new, vocab))
    batched_s, together = timed(lambda: generate(model, batch, new, vocab))
    alone_s, alone = timed(lambda: [generate(model, [p], new, vocab)[0] for p in batch])
    return dict(
        rerun_s=rerun_s,
        kv_s=kv_s,
        kv_other_weights_s=other_s,
        batched_s=batched_s,
        one_at_a_time_s=alone_s,
        identical=cached == reference and together == alone,
    )


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.quick:
        a.new_tokens, a.rounds = min(a.new_tokens, 16), 1
    torch.set_num_threads(a.threads)
    from megatron_mfsdp.checkpoint.model_files import ensure_process_group

    ensure_process_group()
    args = default_args(a, max(BATCH_PROMPTS + (PROMPT,)) + a.new_tokens)
    model, other = build_model(args, seed=1), build_model(args, seed=2)
    g = torch.Generator().manual_seed(0)
    vocab = args["vocab_size"]
    prompt = torch.randint(0, vocab, (PROMPT,), generator=g).tolist()
    batch = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in BATCH_PROMPTS]
    shape = ", ".join(f"{k}={v}" for k, v in args.items() if k in DEFAULT_MODEL)
    print(f"model: {shape}, vocab={args['padded_vocab_size']}, fp32, threads={torch.get_num_threads()}")
    rounds = [one_round(model, other, prompt, batch, a.new_tokens, vocab) for _ in range(a.rounds)]
    best = {k: min(r[k] for r in rounds) for k in rounds[0] if k != "identical"}
    med = {k: statistics.median(r[k] for r in rounds) for k in best}
    identical = all(r["identical"] for r in rounds)
    new, n = a.new_tokens, len(batch)

    def line(label, key, tokens):
        return f"  {label:<26}{best[key]:8.3f} s  ({tokens / best[key]:7.1f} tokens/s)   median {med[key]:.3f} s"

    print(f"{new} new tokens after a {PROMPT}-token prompt, greedy, best of {a.rounds} round(s):")
    print(line("full re-run", "rerun_s", new))
    print(line("KV cache", "kv_s", new))
    print(line("KV cache, other weights", "kv_other_weights_s", new))
    speedup = best["rerun_s"] / best["kv_s"]
    print(f"  speed-up {speedup:.2f} x (medians: {med['rerun_s'] / med['kv_s']:.2f} x), tokens identical: {identical}")
    print(f"{n} prompts of {BATCH_PROMPTS[0]}-{BATCH_PROMPTS[-1]} tokens, {new} new tokens each, KV cache:")
    print(line("batched", "batched_s", n * new))
    print(line("one by one", "one_at_a_time_s", n * new))
    print(
        f"RESULT new_tokens={new} rerun_s={best['rerun_s']:.4f} kv_s={best['kv_s']:.4f} speedup={speedup:.3f} "
        f"kv_other_weights_s={best['kv_other_weights_s']:.4f} batch={n} "
        f"batched_tokens_per_s={n * new / best['batched_s']:.1f} "
        f"one_by_one_tokens_per_s={n * new / best['one_at_a_time_s']:.1f} identical={identical}"
    )
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
