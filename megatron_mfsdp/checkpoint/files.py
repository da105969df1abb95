"""Checkpoint folders that lose nothing: Megatron-LM's names (``latest_checkpointed_iteration.txt``,
``iter_%07d/``), written into a temporary folder, fsynced, checksummed and renamed into place.

A save writes ``SAVE/iter_0000100.tmp/``; each rank hashes the files it writes (integrity.py); once
every rank has written, rank 0 gathers their entries into ``manifest.json`` (size, checksum and
writer of every file), fsyncs, renames the folder to ``iter_0000100`` and then replaces the
tracker, never with an older iteration than the one it holds. A save that is killed leaves only a
``*.tmp`` folder, which no load picks and the next save removes. Loading has each rank verify its
share of the files against the manifest before any file is opened by torch."""

from __future__ import annotations

import os
import shutil

import torch.distributed as dist

from . import integrity
from .integrity import MANIFEST

TRACKER = "latest_checkpointed_iteration.txt"
TMP_SUFFIX = ".tmp"


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


def write_manifest(folder: str, extra: dict | None = None) -> dict:
    """One process hashes every file in ``folder`` (fsynced) into ``manifest.json``, as rank 0's:
    for tools and tests. A job's save gathers what each rank hashed instead (:func:`finish_save`)."""
    paths = [os.path.join(folder, rel) for rel in integrity.folder_files(folder)]
    return integrity.write_manifest_file(folder, integrity.hash_written(folder, paths, 0), extra)


def read_manifest(folder: str, foreign_ok: bool = False) -> dict:
    """The folder's manifest (any version). With ``foreign_ok`` a torch_dist folder without one
    (written by Megatron-LM or another tool) is accepted unverified, with a notice (rank 0)."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        if foreign_ok and os.path.isfile(os.path.join(folder, "metadata.json")):
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(
                    f"> WARNING: {folder} has no {MANIFEST} (not written by megatron-mfsdp): "
                    "its files cannot be verified"
                )
            return {"format": "torch_dist", "hash": integrity.HASH, "files": {}}
        raise ValueError(f"checkpoint {folder}: {MANIFEST} is missing (not a complete megatron-mfsdp save)")
    return integrity.read_manifest_file(path)


def verify_manifest(folder: str, foreign_ok: bool = False) -> dict:
    """One process checks every file against ``manifest.json`` (for tools and tests; a job's ranks
    each check their share: :func:`verify_collective`); raises naming the first file that is
    missing, truncated, altered or unexpected. Returns the manifest."""
    manifest = read_manifest(folder, foreign_ok)
    for rel in sorted(manifest["files"]):
        error = integrity.check_file(folder, rel, manifest["files"][rel], manifest["hash"])
        if error:
            raise ValueError(error)
    if manifest["files"] and (error := integrity.unexpected_files(folder, manifest)):
        raise ValueError(error)
    return manifest


def verify_collective(folder: str, foreign_ok: bool = False, verify: bool = True) -> dict:
    """Every rank checks its share of the files (integrity.share; rank 0 also lists the folder for
    files the save did not write), then one small collective stops every rank, naming each failing
    file and the rank that found it, before any tensor is read. ``verify=False``
    (--no-verify-checkpoint-integrity) only reads the manifest. Collective; returns the manifest."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    manifest, error = None, None
    try:
        if not os.path.isdir(folder):
            raise ValueError(f"checkpoint folder {folder} does not exist")
        manifest = read_manifest(folder, foreign_ok)
        if verify and manifest["files"]:
            error = integrity.check_files(folder, manifest, integrity.share(manifest["files"], rank, world))
            error = error or (integrity.unexpected_files(folder, manifest) if rank == 0 else None)
    except ValueError as err:
        error = str(err)
    integrity.agree(error)
    return manifest


def finish_save(root: str, iteration: int, tmp: str, entries: dict, fmt: str) -> tuple[str, dict | None]:
    """Collective end of a save: each rank's entries (what it wrote and hashed) are gathered on rank
    0, which hashes the files no rank claimed (megatron-core's common.pt, metadata.json and .metadata,
    written by rank 0: plain values and the global index), writes ``manifest.json``, renames the
    folder into place and only then moves the tracker (never backwards). Returns the final folder
    and, on rank 0, the manifest."""
    final = iteration_dir(root, iteration)
    everyone, error, manifest = integrity.gather_entries(entries), None, None
    if everyone is not None:
        try:
            gathered = integrity.merge_entries(everyone)
            unclaimed = [os.path.join(tmp, rel) for rel in integrity.folder_files(tmp) if rel not in gathered]
            gathered.update(integrity.hash_written(tmp, unclaimed, 0))
            manifest = integrity.write_manifest_file(tmp, gathered, {"iteration": iteration, "format": fmt})
            publish(tmp, final)
            write_tracker(root, iteration)
        except (OSError, ValueError) as err:
            error = f"saving {final}: {err}"
    integrity.agree(error)
    return final, manifest


def retire(root: str, previous: int | None, iteration: int, retain: int) -> str | None:
    """--save-retain-interval (rank 0, after the save of ``iteration``): remove the checkpoint the tracker
    named before it unless its iteration is a multiple of ``retain`` (Megatron-LM's save_checkpoint at
    HEAD: only the latest save and every ``retain``-th survive; a symbolic link is left alone). A newer
    ``previous`` is left alone too: the tracker never moves backwards here, so it still names that one.
    Returns the removed folder."""
    if not previous or previous >= iteration or previous % retain == 0:
        return None
    folder = iteration_dir(root, previous)
    if os.path.islink(folder) or not os.path.isdir(folder):
        return None
    shutil.rmtree(folder)
    print(f"  successfully deleted checkpoint from iteration {previous:7d} at {root}", flush=True)
    return folder


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
