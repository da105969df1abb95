"""What QK-clip costs per iteration: the max-logit computation in our CPU attention and the clip on the
owners (training/qk_clip.py), against the iteration without them, side by side in one run.

For each model (the quick-start model: 4 layers, hidden 128, 4 heads, sequence 128, micro-batch 4; and a
4-layer hidden-512 model with 8 heads) on W gloo ranks through MatrixFSDP + Muon, every timed iteration
runs the three variants in turn on the same model and batch:

  off     no max logits, no clip (the iteration as without the flags)
  log     --log-max-attention-logit: each head's max logit recorded, all-reduced, logged
  clip    --qk-clip with a threshold just under the step's logits (0.99 of the largest the log variant
          measured): also each owner rescales its linear_qkv rows, by about 1% (a threshold far under the
          logits would shrink the weights toward fp32 denormals, whose arithmetic is slow on a CPU)

It prints the median iteration ms of each (the slowest rank's), the hook's own ms (the all-reduces and the
clip, inside the optimizer step) and the ratios to ``off``.

    .venv/bin/python benchmarks/bench_qk_clip.py            # both models, W = 2
    .venv/bin/python benchmarks/bench_qk_clip.py --quick    # the quick-start model, few iterations
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_mfsdp.testing import run_workers  # noqa: E402

MODELS = {
    "quickstart": dict(num_layers=4, hidden_size=128, num_attention_heads=4, seq=128, mbs=4),
    "hidden512": dict(num_layers=4, hidden_size=512, num_attention_heads=8, seq=128, mbs=4),
}
VARIANTS = ("off", "log", "clip")


def _worker(rank, world, shape: dict, iters: int, warmup: int):
    import torch.distributed as dist

    from megatron_mfsdp import (
        MatrixFSDP,
        MatrixFSDPConfig,
        ProcessGroups,
        configure_schedule,
        forward_backward,
        get_megatron_optimizer,
    )
    from megatron_mfsdp.models.gpt import qk_clip as qk
    from megatron_mfsdp.testing import forward_step, init_megatron, optimizer_config, tiny_gpt
    from megatron_mfsdp.training.qk_clip import QKClip

    init_megatron()
    vocab, seq, mbs = 1024, shape["seq"], shape["mbs"]
    hidden = shape["hidden_size"]
    config, model = tiny_gpt(
        vocab_size=vocab,
        seq_length=seq,
        num_layers=shape["num_layers"],
        hidden_size=hidden,
        ffn_hidden_size=4 * hidden,
        num_attention_heads=shape["num_attention_heads"],
        num_query_groups=shape["num_attention_heads"],
        log_max_attention_logit=True,
    )
    groups = ProcessGroups.from_parallel_state()
    ddp = MatrixFSDP(config, MatrixFSDPConfig(), model, groups)
    opt = get_megatron_optimizer(optimizer_config(lr=1e-3, min_lr=1e-3), [ddp])
    configure_schedule([ddp], opt)
    hooks = {
        "off": None,
        "log": QKClip(types.SimpleNamespace(qk_clip=False, qk_clip_alpha=0.5, qk_clip_threshold=100.0), [ddp], groups),
        "clip": QKClip(types.SimpleNamespace(qk_clip=True, qk_clip_alpha=0.5, qk_clip_threshold=1e-6), [ddp], groups),
    }
    attentions = [a.core_attention for a in qk.self_attentions(model)]
    hook_s = {v: [] for v in VARIANTS}

    def timed(hook):
        def call(optimizer):
            t0 = time.perf_counter()
            hook(optimizer)
            hook_s[name].append(time.perf_counter() - t0)

        return call

    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, vocab, (mbs, seq), generator=g)
    times = {v: [] for v in VARIANTS}
    for it in range(warmup + iters):
        for name in VARIANTS:
            for a in attentions:
                a.track_max_logits = name != "off"
            opt.after_rules = timed(hooks[name]) if hooks[name] is not None else None
            if name == "clip" and hooks["log"].last is not None:  # just under the logits: every step clips, by ~1%
                hooks["clip"].threshold = 0.99 * hooks["log"].last
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            forward_backward(forward_step, iter([tokens]), [ddp], 1, seq, mbs)
            assert opt.step()[0]
            dt = time.perf_counter() - t0
            if it >= warmup:
                times[name].append(dt)
    local = torch.tensor([times[v] for v in VARIANTS], dtype=torch.float64)
    everyone = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(everyone, local)
    slowest = torch.stack(everyone).amax(dim=0)
    hooks_ms = {v: 1e3 * statistics.median(hook_s[v][warmup:]) if hook_s[v] else 0.0 for v in VARIANTS}
    return {"ms": {v: 1e3 * statistics.median(slowest[i].tolist()) for i, v in enumerate(VARIANTS)}, "hook": hooks_ms}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="the quick-start model, 3 iterations after 1")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.iters, args.warmup = ["quickstart"], 3, 1
    cpus = len(os.sched_getaffinity(0))
    print(f"bench_qk_clip: W={args.world_size} gloo ranks on {cpus} cpus; torch {torch.__version__}")
    for name in args.models:
        r = run_workers(
            args.world_size,
            _worker,
            MODELS[name],
            args.iters,
            args.warmup,
            threads=max(1, cpus // args.world_size),
            fresh=True,
        )[0]
        ms, hook = r["ms"], r["hook"]
        print(
            f"{name}: iteration ms (median, slowest rank) off {ms['off']:.1f}, log {ms['log']:.1f} "
            f"(x{ms['log'] / ms['off']:.3f}), clip {ms['clip']:.1f} (x{ms['clip'] / ms['off']:.3f}); "
            f"the hook inside the step: log {hook['log']:.2f} ms, clip {hook['clip']:.2f} ms"
        )
        print(
            f"RESULT model={name} off_ms={ms['off']:.2f} log_ms={ms['log']:.2f} clip_ms={ms['clip']:.2f} "
            f"log_over_off={ms['log'] / ms['off']:.3f} clip_over_off={ms['clip'] / ms['off']:.3f} "
            f"log_hook_ms={hook['log']:.3f} clip_hook_ms={hook['clip']:.3f}"
        )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
