"""Checkpoints below the training loop: megatron-core dist_checkpointing of MatrixFSDP's weights and
optimizer state by megatron-core's keys, saved at DP=2 and loaded at DP=1, 2 and 4 (other owner
ranges), bitwise; the whole model in one process (read_model_checkpoint / write_model_checkpoint); the
owner-range boxes; the folder rules (manifest, tracker)."""

import math

import pytest
import torch

from megatron_mfsdp.testing import (
    assemble_optimizer_state,
    dist_checkpoint,
    init_megatron,
    lm_loss,
    micro_batch,
    optimizer_config,
    run_workers,
    tiny_gpt,
)


def _worker(rank, world_size, path, steps):
    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig, get_megatron_optimizer

    init_megatron()
    config, model = tiny_gpt(by_global_name=True)
    ddp = MatrixFSDP(config, MatrixFSDPConfig(), model)
    opt = get_megatron_optimizer(optimizer_config(), [ddp])
    for step in range(1, steps + 1):
        opt.zero_grad()
        lm_loss(ddp, micro_batch(step, 0, rank), 1).backward()
        ddp.finish_grad_sync()
        opt.step()
    dist_checkpoint(ddp, opt, path, save=bool(steps))
    return {
        "opt": opt.state_dict(),
        "step": opt.step_count,
        "weights": ddp.full_state_dict(),
        "shapes": {s.name: s.shape for u in ddp.plan.units for s in u.slots},
    }


def test_weights_and_optimizer_state_saved_at_dp2_load_at_dp1_dp2_dp4(tmp_path):
    saved = run_workers(2, _worker, str(tmp_path / "ckpt"), 2)
    shapes = saved[0]["shapes"]
    expected = assemble_optimizer_state([r["opt"] for r in saved], shapes)
    for world_size in (2, 1, 4):
        loaded = run_workers(world_size, _worker, str(tmp_path / "ckpt"), 0)
        assert all(r["step"] == 2 for r in loaded)
        for name, tensor in saved[0]["weights"].items():
            assert torch.equal(loaded[0]["weights"][name], tensor), f"DP={world_size}: {name}"
        got = assemble_optimizer_state([r["opt"] for r in loaded], shapes)
        assert set(got) == set(expected)
        for name, state in expected.items():
            for key, tensor in state.items():
                assert not torch.isnan(tensor).any()
                assert torch.equal(got[name][key], tensor), f"DP={world_size}: {name}.{key}"


def test_flat_boxes_cover_every_range_exactly_once():
    from megatron_mfsdp.checkpoint.boxes import flat_boxes

    for shape in [(7,), (4, 5), (3, 4, 5)]:
        n = math.prod(shape)
        numbers = torch.arange(n).view(shape)
        for lo in range(n):
            for hi in range(lo + 1, n + 1):
                boxes = flat_boxes(lo, hi, shape)
                assert len(boxes) <= 3 * len(shape)
                covered = torch.cat(
                    [numbers[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1) for off, size, _ in boxes]
                )
                assert torch.equal(covered, torch.arange(lo, hi)), (shape, lo, hi, boxes)
                assert [at for _, _, at in boxes] == [
                    int(b[0]) for b in torch.split(covered, [math.prod(s) for _, s, _ in boxes])
                ]


def _whole_model_worker(rank, world_size, load, save):
    from megatron_mfsdp.checkpoint import files, read_model_checkpoint, write_model_checkpoint

    args, tensors = read_model_checkpoint(load)
    write_model_checkpoint(save, args, tensors)
    files.verify_manifest(files.iteration_dir(save, 0))  # written with checksums
    again_args, again = read_model_checkpoint(save)
    return {"args": args, "tensors": tensors, "again": again, "again_args": again_args}


def test_read_and_write_the_whole_model_in_one_process(tmp_path):
    """A TP=2 x DP=2 SwiGLU training checkpoint read as the unsplit model (fc1 whole: both halves of
    both TP shards), written back and read again: bitwise."""
    from tests.launch import TINY, pretrain_in_workers

    save = tmp_path / "ckpt"
    flags = [*TINY, "--eval-iters", "0", "--train-iters", "2", "--use-matrix-fsdp", "--swiglu"]
    pretrain_in_workers(
        2,
        *flags,
        "--tensor-model-parallel-size",
        "2",
        "--muon-tp-mode",
        "duplicated",
        "--save",
        str(save),
        "--save-interval",
        "2",
        tmp_path=tmp_path,
    )
    got = run_workers(1, _whole_model_worker, str(save), str(tmp_path / "global"))[0]
    assert got["args"]["hidden_size"] == 64 and got["args"]["swiglu"] and got["again_args"] == got["args"]
    names = set(got["tensors"])
    assert "decoder.layers.1.mlp.linear_fc1.weight" in names and "embedding.word_embeddings.weight" in names
    assert tuple(got["tensors"]["decoder.layers.1.mlp.linear_fc1.weight"].shape) == (
        2 * got["args"]["ffn_hidden_size"],
        64,
    )
    for name, tensor in got["tensors"].items():
        assert torch.equal(got["again"][name], tensor), name


def test_manifest_and_tracker_rules(tmp_path):
    from megatron_mfsdp.checkpoint import files

    folder = tmp_path / "iter_0000003.tmp"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"abc" * 100)
    files.write_manifest(str(folder), {"iteration": 3})
    files.publish(str(folder), str(tmp_path / "iter_0000003"))
    assert files.verify_manifest(str(tmp_path / "iter_0000003"))["iteration"] == 3
    (tmp_path / "iter_0000003" / "extra.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="files not written by the save"):
        files.verify_manifest(str(tmp_path / "iter_0000003"))
    assert files.write_tracker(str(tmp_path), 5) and files.read_tracker(str(tmp_path)) == 5
    assert not files.write_tracker(str(tmp_path), 3) and files.read_tracker(str(tmp_path)) == 5
    (tmp_path / "iter_0000007.tmp").mkdir()
    assert files.remove_leftovers(str(tmp_path)) == [str(tmp_path / "iter_0000007.tmp")]
