"""Checkpoint folders that lose nothing: Megatron-LM's names (``latest_checkpointed_iteration.txt``,
``iter_%07d/``), written into a temporary folder, fsynced, checksummed and renamed into place.

A save writes ``SAVE/iter_0000100.tmp/``; once every rank has written its files, rank 0 writes
``manifest.json`` (sha256 and size of every file), fsyncs, renames the folder to ``iter_0000100``
and then replaces the tracker, never with an older iteration than the one it holds. A save that
is killed leaves only a ``*.tmp`` folder, which no load picks and the next save removes.
Loading verifies the manifest before any file is opened by torch."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
TMP_SUFFIX = ".tmp"
_CHUNK = 1 << 22


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def temporary_dir(root: str, iteration: int) -> str:
    return iteration_dir(root, iteration) + TMP_SUFFIX


RELEASE = "release"


def load_target(root: str, step: int | None = None) -> tuple[str, int] | None:
    """(folder, iteration) that --load ROOT reads: ``step`` (--ckpt-step) or the tracker's; a
    tracker that says ``release`` means ROOT/release/ at iteration 0 (Megatron-LM's
    get_checkpoint_name, megatron/training/checkpointing.py at core_v0.16.1). None: no tracker."""
    if step is not None:
        return iteration_dir(root, step), step
    text = _tracker_text(root)
    if text == RELEASE:
        return os.path.join(root, RELEASE), 0
    iteration = None if text is None else _tracker_iteration(root, text)
    return None if iteration is None else (iteration_dir(root, iteration), iteration)


def read_tracker(root: str) -> int | None:
    """The iteration the tracker names, or None without a tracker ('release' is Megatron's 0)."""
    text = _tracker_text(root)
    return None if text is None else _tracker_iteration(root, text)


def _tracker_text(root: str) -> str | None:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip()


def _tracker_iteration(root: str, text: str) -> int:
    if text == RELEASE:
        return 0
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{os.path.join(root, TRACKER)}: expected an iteration number, found {text!r}") from None


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tracker(root: str, iteration: int) -> bool:
    """Point the tracker at ``iteration`` unless it already names a newer one; returns whether it moved."""
    current = read_tracker(root)
    if current is not None and current > iteration:
        return False
    tmp = os.path.join(root, TRACKER + TMP_SUFFIX)
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))
    _fsync_dir(root)
    return True


def remove_leftovers(root: str) -> list[str]:
    """Delete temporary folders and files of saves that never finished (a killed job)."""
    removed = []
    if not os.path.isdir(root):
        return removed
    for name in sorted(os.listdir(root)):
        if name.endswith(TMP_SUFFIX) or ".tmp." in name:
            path = os.path.join(root, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            removed.append(path)
    return removed


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: str) -> list[str]:
    out = []
    for base, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(base, name), folder)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def write_manifest(folder: str, extra: dict | None = None) -> dict:
    """sha256 and size of every file in ``folder`` (fsynced), as ``manifest.json``."""
    entries = {}
    for rel in _files(folder):
        path = os.path.join(folder, rel)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        entries[rel] = {"sha256": sha256_file(path), "bytes": os.path.getsize(path)}
    manifest = {"files": entries, **(extra or {})}
    path = os.path.join(folder, MANIFEST)
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(folder)
    return manifest


def verify_manifest(folder: str, foreign_ok: bool = False) -> dict:
    """Check every file against ``manifest.json``; raise naming the first file that is missing,
    truncated, altered or unexpected. Returns the manifest. With ``foreign_ok`` a torch_dist folder
    without one (written by Megatron-LM or another tool) is accepted unverified, with a notice."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        if foreign_ok and os.path.isfile(os.path.join(folder, "metadata.json")):
            print(
                f"> WARNING: {folder} has no {MANIFEST} (not written by megatron-mfsdp): its files cannot be verified"
            )
            return {"format": "torch_dist", "files": {}}
        raise ValueError(f"checkpoint {folder}: {MANIFEST} is missing (not a complete megatron-mfsdp save)")
    with open(path) as f:
        manifest = json.load(f)
    for rel, entry in sorted(manifest["files"].items()):
        file = os.path.join(folder, rel)
        if not os.path.isfile(file):
            raise ValueError(f"checkpoint file {file} is missing")
        size = os.path.getsize(file)
        if size != entry["bytes"]:
            raise ValueError(f"checkpoint file {file} has {size} bytes, the save wrote {entry['bytes']} (truncated?)")
        if sha256_file(file) != entry["sha256"]:
            raise ValueError(f"checkpoint file {file} fails its sha256 checksum (corrupted)")
    unexpected = sorted(set(_files(folder)) - set(manifest["files"]))
    if unexpected:
        raise ValueError(f"checkpoint {folder}: files not written by the save: {unexpected}")
    return manifest


def publish(tmp: str, final: str) -> None:
    """Rename a finished temporary folder into place (replacing an older save of the same iteration)."""
    if os.path.exists(final):
        old = final + ".old" + TMP_SUFFIX
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(os.path.dirname(final) or ".")
