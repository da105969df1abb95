"""Checksums that scale (issue 21): each rank hashes only the files it writes, while writing them or
right after, also in the --async-save writer thread; at load each rank verifies its share before
any tensor is read, and a damaged file stops every rank naming the file and the rank that found
it; --no-verify-checkpoint-integrity skips the check; sha256 manifests of older saves still verify."""

import hashlib
import json
import os
import re

import pytest
import torch

from megatron_mfsdp.checkpoint import files, integrity
from megatron_mfsdp.testing import run_workers
from megatron_mfsdp.training.configs import checkpoint_settings_from_args
from tests.launch import TINY, pretrain_in_workers

FLAGS = [*TINY, "--eval-iters", "0", "--train-iters", "2", "--use-matrix-fsdp"]


def _job(root: str, world: int, extra: list[str]):
    """A MatrixFSDP job's chunks, optimizer and scheduler, built as pretrain_gpt.py builds them."""
    from megatron_mfsdp.testing.checkpoints import build_job

    return build_job([*FLAGS, "--save", root, "--save-interval", "2", "--load", root, *extra], world)


def _weights(chunks) -> list[torch.Tensor]:
    return [unit.param_segment.clone() for chunk in chunks for unit in chunk.units]


def _save_worker(rank, world, root, extra):
    """Save iteration 2 of weights moved away from the initial ones (+1), so that a load that read
    anything is seen; returns the bytes this rank hashed."""
    from megatron_mfsdp import checkpoint

    args, groups, chunks, optimizer, scheduler = _job(root, world, extra)
    with torch.no_grad():
        for chunk in chunks:
            for unit in chunk.units:
                unit.param_segment.add_(1.0)
    before = integrity.hashed_bytes()
    checkpoint.save_checkpoint(checkpoint_settings_from_args(args), 2, chunks, optimizer, scheduler, (16, 0), groups)
    checkpoint.finalize_async_save(blocking=True)
    return integrity.hashed_bytes() - before


def _load_worker(rank, world, root, extra):
    """Load into a fresh job: (error text or None, bytes hashed, whether any weight changed)."""
    from megatron_mfsdp import checkpoint

    args, groups, chunks, optimizer, scheduler = _job(root, world, extra)
    initial = _weights(chunks)
    before, error = integrity.hashed_bytes(), None
    try:
        checkpoint.load_checkpoint(checkpoint_settings_from_args(args), chunks, optimizer, scheduler, groups)
    except ValueError as err:
        error = str(err)
    changed = any(not torch.equal(a, b) for a, b in zip(initial, _weights(chunks)))
    return {"error": error, "hashed": integrity.hashed_bytes() - before, "changed": changed}


def _manifest(root) -> dict:
    with open(os.path.join(root, "iter_0000002", integrity.MANIFEST)) as f:
        return json.load(f)


def _flip_byte(path) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))


def _largest_file_of(manifest: dict, rank: int) -> str:
    return max((e["bytes"], rel) for rel, e in manifest["files"].items() if e["rank"] == rank)[1]


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_damaged_file_is_caught_by_the_rank_that_reads_it_and_every_rank_stops(tmp_path, fmt):
    root = str(tmp_path / "ckpt")
    extra = ["--ckpt-format", fmt]
    run_workers(4, _save_worker, root, extra)
    damaged = os.path.join(root, "iter_0000002", _largest_file_of(_manifest(root), 2))
    _flip_byte(damaged)
    got = run_workers(4, _load_worker, root, extra)
    for r, result in enumerate(got):
        assert result["error"] is not None, f"rank {r} went on reading"
        assert f"rank 2: checkpoint file {damaged} fails its xxh3_128 checksum" in result["error"], result["error"]
        assert "rank 0:" not in result["error"]  # rank 0 neither read nor checked it
        assert not result["changed"], f"rank {r} read tensors before the check agreed"


@pytest.mark.parametrize("async_save", [False, True])
def test_no_rank_hashes_more_than_its_own_files_and_its_share(tmp_path, async_save):
    """Save at W=4: each rank hashes exactly the bytes it wrote (rank 0 also the small common files),
    in the writer thread with --async-save. Load at W=4: the same files again; at W=2: its own and
    a balanced part of ranks 2 and 3's; every file exactly once over the ranks."""
    root = str(tmp_path / "ckpt")
    saved = run_workers(4, _save_worker, root, ["--async-save"] if async_save else [])
    entries = _manifest(root)["files"]
    total = sum(e["bytes"] for e in entries.values())
    written = integrity.rank_bytes(entries)
    assert saved == [written[r] for r in range(4)], (saved, written)
    assert saved[0] < total / 2  # the old rank 0 hashed all of it
    for world in (4, 2):
        loaded = run_workers(world, _load_worker, root, [])
        assert all(r["error"] is None and r["changed"] for r in loaded), loaded
        got = [r["hashed"] for r in loaded]
        assert sum(got) == total, (world, got, total)
        shares = [sum(entries[rel]["bytes"] for rel in integrity.share(entries, r, world)) for r in range(world)]
        assert got == shares, (world, got, shares)
        assert max(got) <= total / world + max(e["bytes"] for e in entries.values()), (world, got)


def test_opting_out_skips_verification_and_without_it_the_same_damage_is_caught(tmp_path):
    root = str(tmp_path / "ckpt")
    run_workers(2, _save_worker, root, [])
    damaged = os.path.join(root, "iter_0000002", _largest_file_of(_manifest(root), 1))
    _flip_byte(damaged)
    control = run_workers(2, _load_worker, root, [])
    assert all(f"checkpoint file {damaged} fails its xxh3_128 checksum" in (r["error"] or "") for r in control)
    assert not any(r["changed"] for r in control)
    opted_out = run_workers(2, _load_worker, root, ["--no-verify-checkpoint-integrity"])
    for r in opted_out:
        assert r["hashed"] == 0 and r["error"] is None and r["changed"], r  # read as is


def _as_sha256_manifest(folder: str) -> None:
    """Rewrite the manifest as megatron-mfsdp wrote it before issue 21 (version 1: sha256 per file)."""
    path = os.path.join(folder, integrity.MANIFEST)
    with open(path) as f:
        new = json.load(f)

    def sha256(rel):
        with open(os.path.join(folder, rel), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    old = {
        "files": {rel: {"sha256": sha256(rel), "bytes": e["bytes"]} for rel, e in new["files"].items()},
        "iteration": new["iteration"],
        "format": new["format"],
    }
    with open(path, "w") as f:
        json.dump(old, f)


def test_an_older_sha256_manifest_still_verifies(tmp_path):
    root = str(tmp_path / "ckpt")
    run_workers(2, _save_worker, root, [])
    folder = os.path.join(root, "iter_0000002")
    _as_sha256_manifest(folder)
    assert files.verify_manifest(folder)["hash"] == "sha256"
    loaded = run_workers(2, _load_worker, root, [])
    assert all(r["error"] is None and r["changed"] for r in loaded), loaded
    with open(os.path.join(folder, integrity.MANIFEST)) as f:
        entries = {rel: {"bytes": e["bytes"]} for rel, e in json.load(f)["files"].items()}
    assert sum(r["hashed"] for r in loaded) == sum(e["bytes"] for e in entries.values())  # each file once
    damaged = os.path.join(folder, _largest_file_of({"files": {k: {**v, "rank": 0} for k, v in entries.items()}}, 0))
    _flip_byte(damaged)
    failed = run_workers(2, _load_worker, root, [])
    assert all(f"checkpoint file {damaged} fails its sha256 checksum" in (r["error"] or "") for r in failed), failed


def test_hash_while_writing_equals_the_file_and_manifests_name_their_algorithm(tmp_path):
    path = tmp_path / "state.pt"
    with integrity.HashingWriter(str(path), rank=3) as f:
        torch.save({"w": torch.randn(300, 70), "step": 4}, f)
    assert f.entry() == integrity.entry(*integrity.hash_file(str(path)), 3)
    assert torch.load(path, weights_only=True)["step"] == 4
    manifest = tmp_path / integrity.MANIFEST
    manifest.write_text(json.dumps({"manifest_version": 2, "hash": "md4", "files": {}}))
    with pytest.raises(ValueError, match=rf"{manifest}: unknown checksum algorithm 'md4'"):
        integrity.read_manifest_file(str(manifest))
    manifest.write_text(json.dumps({"manifest_version": 3, "hash": "xxh3_128", "files": {}}))
    with pytest.raises(ValueError, match="manifest version 3 is newer"):
        integrity.read_manifest_file(str(manifest))


def test_share_gives_every_file_to_one_rank_the_writer_first():
    entries = {f"__{r}_0.distcp": {"bytes": 100 + r, "digest": "", "rank": r} for r in range(8)}
    entries["common.pt"] = {"bytes": 5, "digest": "", "rank": 0}
    entries["old.bin"] = {"bytes": 50, "digest": ""}  # a version 1 entry: no writer
    for world in (8, 3, 16):
        owners = [integrity.share(entries, r, world) for r in range(world)]
        assert sorted(rel for own in owners for rel in own) == sorted(entries), world
        loads = [sum(entries[rel]["bytes"] for rel in own) for own in owners]
        assert max(loads) <= sum(e["bytes"] for e in entries.values()) / world + 107 + 5, (world, loads)
    assert integrity.share(entries, 5, 8) == ["__5_0.distcp"]
    assert "old.bin" in integrity.share(entries, 8, 16)  # the least-loaded rank, not rank 0


def test_timeout_line_is_printed_once_and_states_the_largest_rank_share(tmp_path):
    """pretrain's start-up prints what --distributed-timeout-minutes covers once, on rank 0; each save
    line and the next run's start-up line give the largest rank share, as the manifest has it."""
    save = tmp_path / "ckpt"
    first = pretrain_in_workers(2, *FLAGS, "--save", str(save), "--save-interval", "2", tmp_path=tmp_path, rank=None)
    assert [r["stdout"].count("> distributed timeout 10 min (--distributed-timeout-minutes)") for r in first] == [1, 0]
    assert "no checkpoint of ours yet" in first[0]["stdout"]
    written = integrity.rank_bytes(_manifest(str(save))["files"])
    rank, largest = max(written.items(), key=lambda kv: (kv[1], -kv[0]))
    share = f"largest rank share {largest / 1e9:.3f} GB"
    assert re.search(rf"successfully saved checkpoint .*{share} written and hashed \(rank {rank}\)", first[0]["stdout"])
    again = pretrain_in_workers(
        2, *FLAGS, "--load", str(save), "--distributed-timeout-minutes", "3", tmp_path=tmp_path, rank=0
    )
    assert "> distributed timeout 3 min" in again["stdout"]
    assert f"{share} at the last save, iter_0000002, rank {rank};" in again["stdout"]
