"""The start-up line of --distributed-timeout-minutes (issue 21, item 3): what it covers and the largest
rank share of the checkpoint this run resumes from, read from its manifest."""

import json
from argparse import Namespace

from megatron_mfsdp.checkpoint import files, integrity
from megatron_mfsdp.training.timeouts import timeout_line


def _args(tmp_path, **overrides):
    values = dict(distributed_timeout_minutes=7, load=str(tmp_path), save=None, ckpt_step=None)
    return Namespace(**{**values, **overrides})


def test_line_names_the_timeout_and_the_largest_rank_share(tmp_path):
    folder = tmp_path / "iter_0000004"
    folder.mkdir()
    entries = {f"__{r}_0.distcp": integrity.entry((r + 1) * 10**9, "", r) for r in range(4)}
    entries["common.pt"] = integrity.entry(10**6, "", 0)
    (folder / integrity.MANIFEST).write_text(json.dumps({"manifest_version": 2, "hash": "xxh3_128", "files": entries}))
    files.write_tracker(str(tmp_path), 4)
    line = timeout_line(_args(tmp_path), world=2)
    assert line.startswith("> distributed timeout 7 min (--distributed-timeout-minutes) bounds each collective wait")
    assert "largest rank share 4.000 GB at the last save, iter_0000004, rank 3;" in line
    assert "5.001 GB to verify on the busiest of 2 ranks" in line  # rank 0: its 1.001 GB and rank 3's 4 GB
    assert "not verified" in timeout_line(_args(tmp_path, verify_checkpoint_integrity=False), world=2)


def test_line_without_a_checkpoint_says_saves_print_it(tmp_path):
    line = timeout_line(_args(tmp_path / "none", save=str(tmp_path / "none")), world=8)
    assert "no checkpoint of ours yet: each save's line prints its largest rank share" in line
