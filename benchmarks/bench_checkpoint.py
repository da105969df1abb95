"""Checkpoint save and load at W ranks (gloo workers, CPU): seconds and the bytes each rank hashes.

Issue 21: rank 0 alone used to hash every file of every rank at each save and each load (sha256,
reading the checkpoint back) while the others waited in a barrier. This runs one save and one load
of a MatrixFSDP + Adam job (weights, fp32 masters and both moments) through
``megatron_mfsdp.checkpoint.save_checkpoint`` / ``load_checkpoint`` and prints, per rank, the bytes
it hashed at the save and at the load, and the seconds of each (max over ranks: the others wait in
a collective for the slowest).

Bytes hashed come from ``checkpoint.integrity``'s counter; against code without it (an older
checkout on PYTHONPATH) the old sha256 routine is wrapped to count what it reads.

    .venv/bin/python benchmarks/bench_checkpoint.py                    # W=8, ~1 GB checkpoint
    .venv/bin/python benchmarks/bench_checkpoint.py --world 2 --hidden 256   # quick
    .venv/bin/python benchmarks/bench_checkpoint.py --async-save
    .venv/bin/python benchmarks/bench_checkpoint.py --hash-speed       # GB/s of each hash, one thread
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile


def job_flags(a, root: str) -> list[str]:
    shape = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--ffn-hidden-size", str(4 * a.hidden)]
    shape += ["--num-attention-heads", str(max(1, a.hidden // 64)), "--vocab-size", str(a.vocab)]
    run = ["--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1"]
    run += ["--global-batch-size", str(a.world), "--train-iters", "1", "--lr", "1e-4", "--mock-data"]
    run += ["--tokenizer-type", "NullTokenizer", "--distributed-backend", "gloo", "--use-matrix-fsdp"]
    run += ["--optimizer", "adam", "--ckpt-format", a.format, "--save", root, "--save-interval", "1"]
    run += ["--load", root, "--eval-iters", "0"]
    return shape + run + (["--async-save"] if a.async_save else [])


def _counter():
    """() -> bytes this process hashed so far: the integrity counter, or a wrapped sha256 (old code)."""
    try:
        from megatron_mfsdp.checkpoint import integrity

        return integrity.hashed_bytes
    except ImportError:
        from megatron_mfsdp.checkpoint import files

        seen = [0]
        original = files.sha256_file

        def counted(path):
            seen[0] += os.path.getsize(path)
            return original(path)

        files.sha256_file = counted
        return lambda: seen[0]


def _set_up(argv: list[str], world: int):
    from megatron_mfsdp.testing.checkpoints import build_job

    return build_job(argv, world)


def _round(args, job, iteration: int, hashed) -> dict:
    """One save (finished, also when asynchronous) and one load of it; this rank's seconds and bytes."""
    import time

    import torch.distributed as dist

    from megatron_mfsdp import checkpoint
    from megatron_mfsdp.training.configs import checkpoint_settings_from_args

    groups, chunks, optimizer, scheduler = job
    settings = checkpoint_settings_from_args(args)
    out = {}
    dist.barrier()
    before, start = hashed(), time.perf_counter()
    checkpoint.save_checkpoint(settings, iteration, chunks, optimizer, scheduler, (iteration, 0), groups)
    out["save_return_s"] = time.perf_counter() - start
    checkpoint.finalize_async_save(blocking=True)
    out["save_s"], out["save_hashed"] = time.perf_counter() - start, hashed() - before
    dist.barrier()
    before, start = hashed(), time.perf_counter()
    checkpoint.load_checkpoint(settings, chunks, optimizer, scheduler, groups)
    out["load_s"], out["load_hashed"] = time.perf_counter() - start, hashed() - before
    return out


def _worker(rank, world, argv, rounds):
    import contextlib
    import io

    args, *job = _set_up(argv, world)
    hashed = _counter()
    with contextlib.redirect_stdout(io.StringIO()):
        return [_round(args, job, iteration, hashed) for iteration in range(1, rounds + 1)]


def hash_speeds(mib: int = 256) -> None:
    """GB/s of each candidate hash on one thread, over ``mib`` MiB of random bytes in 4 MiB updates
    (how integrity.hash_file feeds it); best of 3. blake3 only if installed."""
    import hashlib
    import time

    import xxhash

    candidates = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256, "blake2b": hashlib.blake2b}
    try:
        import blake3

        candidates["blake3 (1 thread)"] = lambda: blake3.blake3(max_threads=1)
    except ImportError:
        pass
    data = memoryview(os.urandom(mib << 20))
    for name, make in candidates.items():
        best = float("inf")
        for _ in range(3):
            digest, start = make(), time.perf_counter()
            for at in range(0, len(data), 1 << 22):
                digest.update(data[at : at + (1 << 22)])
            digest.hexdigest()
            best = min(best, time.perf_counter() - start)
        print(f"{name:18s} {len(data) / best / 1e9:6.2f} GB/s")


def _folder_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(b, n)) for b, _, names in os.walk(root) for n in names)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--format", default="torch_dist", choices=["torch_dist", "torch"])
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--rounds", type=int, default=3, help="save+load rounds; medians of the max over ranks")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder, removed)")
    p.add_argument("--hash-speed", action="store_true", help="only measure each hash's GB/s on one thread")
    a = p.parse_args()
    if a.hash_speed:
        return hash_speeds()

    from megatron_mfsdp.testing import run_workers

    root = a.dir or tempfile.mkdtemp(prefix="bench_ckpt_")
    try:
        rounds = run_workers(a.world, _worker, job_flags(a, root), a.rounds, fresh=True)
        total = _folder_bytes(os.path.join(root, f"iter_{a.rounds:07d}"))
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    _report(a, rounds, total)


def _report(a, rounds: list[list[dict]], total: int) -> None:
    import statistics

    results = [per_rank[-1] for per_rank in rounds]  # the last round per rank
    print(f"W={a.world}, {a.format}{', --async-save' if a.async_save else ''}: checkpoint {total / 1e6:.1f} MB")
    print("rank | save s | load s | MB hashed at save | MB hashed at load   (last round)")
    for r, got in enumerate(results):
        print(
            f"{r:4d} | {got['save_s']:6.2f} | {got['load_s']:6.2f} | "
            f"{got['save_hashed'] / 1e6:17.1f} | {got['load_hashed'] / 1e6:17.1f}"
        )

    def slowest(key: str) -> list[float]:  # per round, the max over ranks
        return [max(per_rank[i][key] for per_rank in rounds) for i in range(a.rounds)]

    for key in ("save_s", "load_s") + (("save_return_s",) if a.async_save else ()):
        values = slowest(key)
        shown = ", ".join(f"{v:.2f}" for v in values)
        print(f"{key}: max over ranks per round {shown}; median {statistics.median(values):.2f}")
    for key in ("save_hashed", "load_hashed"):
        most = max(g[key] for g in results)
        print(f"{key}: max over ranks {most / 1e6:.1f} MB, rank 0 {results[0][key] / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
