"""Checksums that scale with the ranks, not with the checkpoint: each rank hashes the files it writes
and, at load, verifies its own share; no rank reads the whole checkpoint back.

- Save: a rank hashes each file as it writes it (``HashingWriter``: ``--ckpt-format torch``) or right
  after its write returns, in the same thread (megatron-core's writer, dist.py); the entries
  ``{file: {bytes, digest, rank}}`` are gathered to rank 0, which writes ``manifest.json``.
- Load: every rank reads the manifest and verifies ``share(...)``: the files its namesake rank wrote
  (at the same layout, what it reads) and a largest-first part of the rest; one small collective
  (``agree``) stops every rank, naming the files, before any tensor is read.

The hash is xxHash's XXH3-128 (``xxhash`` on PyPI), the fastest candidate on one thread
(benchmarks/results/checkpoint.md, ``benchmarks/bench_checkpoint.py --hash-speed``). It guards
against damage (a flipped bit, a truncated or swapped file), not against an adversary. Manifests
name their algorithm; version 1 (no ``manifest_version``, ``sha256`` per file) still verifies."""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import threading

import torch
import torch.distributed as dist

MANIFEST = "manifest.json"
MANIFEST_VERSION = 2
HASH = "xxh3_128"
_CHUNK = 1 << 22
_SHOWN = 5  # failing files named per rank


def _xxh3_128():
    import xxhash

    return xxhash.xxh3_128()


HASHES = {"xxh3_128": _xxh3_128, "sha256": hashlib.sha256}

_HASHED = [0]
_LOCK = threading.Lock()


def _count(nbytes: int) -> None:
    with _LOCK:
        _HASHED[0] += nbytes


def hashed_bytes() -> int:
    """Bytes this process has hashed so far (writes and verifications): benchmarks and tests."""
    return _HASHED[0]


def new_hash(algorithm: str, where: str = MANIFEST):
    """A hasher of the algorithm a manifest names; an unknown one is refused naming ``where``."""
    if algorithm not in HASHES:
        raise ValueError(f"{where}: unknown checksum algorithm {algorithm!r} (known: {', '.join(sorted(HASHES))})")
    return HASHES[algorithm]()


def entry(nbytes: int, digest: str, rank: int) -> dict:
    """A manifest entry; the writer ``rank`` lets a load give the file to the rank that reads it."""
    return {"bytes": nbytes, "digest": digest, "rank": rank}


class HashingWriter:
    """A file opened for writing that hashes every byte on its way out (all ``torch.save`` needs:
    write and flush), and fsyncs on close; ``entry`` is then its manifest entry."""

    def __init__(self, path: str, rank: int, algorithm: str = HASH):
        self._file = open(path, "wb")  # closed by close() / __exit__
        self._hash, self._rank, self.size = new_hash(algorithm), rank, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = self._file.write(view)
        self._hash.update(view[:written])
        self.size += written
        _count(written)
        return written

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def entry(self) -> dict:
        return entry(self.size, self._hash.hexdigest(), self._rank)


def hash_file(path: str, algorithm: str = HASH) -> tuple[int, str]:
    """(bytes, digest) of a file, read in chunks; counted in ``hashed_bytes``."""
    digest, size = new_hash(algorithm), 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            size += n
            _count(n)
    return size, digest.hexdigest()


def hash_written(folder: str, paths, rank: int) -> dict:
    """Entries of files this rank has just written (fsynced first: the manifest vouches for what is
    on disk), keyed by their path relative to ``folder``."""
    out = {}
    for path in paths:
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        out[os.path.relpath(path, folder)] = entry(*hash_file(path), rank)
    return out


def folder_files(folder: str) -> list[str]:
    """Every file under ``folder`` but the manifest, relative, sorted."""
    out = []
    for base, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(base, name), folder)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def write_manifest_file(folder: str, entries: dict, extra: dict | None = None) -> dict:
    """``manifest.json`` (version 2) of the gathered entries, fsynced with its folder."""
    manifest = {"manifest_version": MANIFEST_VERSION, "hash": HASH, "files": entries, **(extra or {})}
    path = os.path.join(folder, MANIFEST)
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return manifest


def read_manifest_file(path: str) -> dict:
    """A manifest of any version, in version 2's terms: ``hash`` names the algorithm and every entry
    has ``bytes`` and ``digest`` (version 1 kept ``sha256`` per file and had no version field)."""
    with open(path) as f:
        manifest = json.load(f)
    version = manifest.get("manifest_version", 1)
    if version == 1:
        manifest["hash"] = "sha256"
        manifest["files"] = {rel: {"bytes": e["bytes"], "digest": e["sha256"]} for rel, e in manifest["files"].items()}
    elif version != MANIFEST_VERSION:
        raise ValueError(f"{path}: manifest version {version} is newer than this megatron-mfsdp ({MANIFEST_VERSION})")
    new_hash(manifest["hash"], path)
    return manifest


def check_file(folder: str, rel: str, expected: dict, algorithm: str) -> str | None:
    """Why ``rel`` is not what the save wrote (missing, another size, another checksum), or None."""
    path = os.path.join(folder, rel)
    if not os.path.isfile(path):
        return f"checkpoint file {path} is missing"
    size = os.path.getsize(path)
    if size != expected["bytes"]:
        return f"checkpoint file {path} has {size} bytes, the save wrote {expected['bytes']} (truncated?)"
    if hash_file(path, algorithm)[1] != expected["digest"]:
        return f"checkpoint file {path} fails its {algorithm} checksum (corrupted)"
    return None


def check_files(folder: str, manifest: dict, rels) -> str | None:
    """The failures among ``rels`` (up to a few named), or None."""
    errors = [e for rel in rels if (e := check_file(folder, rel, manifest["files"][rel], manifest["hash"]))]
    if not errors:
        return None
    more = f"; and {len(errors) - _SHOWN} more" if len(errors) > _SHOWN else ""
    return "; ".join(errors[:_SHOWN]) + more


def unexpected_files(folder: str, manifest: dict) -> str | None:
    """Files the save did not write (a listing: no file is read)."""
    extra = sorted(set(folder_files(folder)) - set(manifest["files"]))
    return f"checkpoint {folder}: files not written by the save: {extra}" if extra else None


def assign(entries: dict, world: int) -> tuple[dict, list[int]]:
    """Which rank of ``world`` verifies each file, and each rank's bytes: a file goes to the rank of
    the number that wrote it (at the same layout, the rank that reads it); the rest (other world
    sizes, version 1 manifests) largest first, each to the rank with the fewest bytes so far.
    Every rank computes it from the same manifest, so each file is verified exactly once."""
    load, owner, rest = [0] * world, {}, []
    for rel, e in sorted(entries.items()):
        writer = e.get("rank")
        if writer is not None and 0 <= writer < world:
            load[writer] += e["bytes"]
            owner[rel] = writer
        else:
            rest.append(rel)
    heap = [(b, r) for r, b in enumerate(load)]
    heapq.heapify(heap)
    for rel in sorted(rest, key=lambda r: (-entries[r]["bytes"], r)):
        total, rank = heapq.heappop(heap)
        heapq.heappush(heap, (total + entries[rel]["bytes"], rank))
        owner[rel], load[rank] = rank, load[rank] + entries[rel]["bytes"]
    return owner, load


def share(entries: dict, rank: int, world: int) -> list[str]:
    """The files ``rank`` verifies before a load (:func:`assign`)."""
    return sorted(rel for rel, r in assign(entries, world)[0].items() if r == rank)


def rank_bytes(entries: dict) -> dict[int, int]:
    """Bytes each rank wrote and hashed at the save (entries without a writer: rank -1)."""
    out: dict[int, int] = {}
    for e in entries.values():
        out[e.get("rank", -1)] = out.get(e.get("rank", -1), 0) + e["bytes"]
    return out


def collective_device(group=None):
    """Where a small tensor for a collective lives: the current CUDA device under NCCL, else the host."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(error: str | None, world_group=None) -> None:
    """Raise the same error on every rank when any rank found one: an all-reduce of one flag, and
    only on failure an all-gather of the texts, each named by the rank that found it."""
    if not dist.is_initialized() or dist.get_world_size(world_group) == 1:
        if error:
            raise ValueError(error)
        return
    flag = torch.tensor([1 if error else 0], dtype=torch.int32, device=collective_device(world_group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=world_group)
    if not flag.item():
        return
    texts = [None] * dist.get_world_size(world_group)
    dist.all_gather_object(texts, error, group=world_group)
    raise ValueError("; ".join(f"rank {r}: {t}" for r, t in enumerate(texts) if t))


def gather_entries(entries: dict) -> list[dict] | None:
    """Every rank's entries, on rank 0 (None elsewhere): one gather of small dicts."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [entries]
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(entries, everyone, dst=0)
    return everyone


def merge_entries(everyone: list[dict]) -> dict:
    """One manifest's files from every rank's entries; a file two ranks claim stops the save."""
    merged: dict = {}
    for rank_entries in everyone:
        for rel, e in rank_entries.items():
            if rel in merged:
                raise ValueError(f"checkpoint file {rel} was written by ranks {merged[rel]['rank']} and {e['rank']}")
            merged[rel] = e
    return merged
