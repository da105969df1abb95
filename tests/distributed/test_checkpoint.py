"""Checkpoints: megatron-core dist_checkpointing of the optimizer state, saved at
DP=2 and loaded back at DP=2, 1 and 4 (another owner layout), bitwise."""

import torch

from megatron_mfsdp.testing import (
    assemble_optimizer_state,
    init_megatron,
    lm_loss,
    micro_batch,
    optimizer_config,
    run_workers,
    tiny_gpt,
)


def _worker(rank, world_size, path, steps):
    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig, get_megatron_optimizer
    from megatron_mfsdp.checkpoint.dist import load_optimizer_distributed, save_optimizer_distributed

    init_megatron()
    config, model = tiny_gpt(by_global_name=True)
    ddp = MatrixFSDP(config, MatrixFSDPConfig(), model)
    opt = get_megatron_optimizer(optimizer_config(), [ddp])
    for step in range(1, steps + 1):
        opt.zero_grad()
        lm_loss(ddp, micro_batch(step, 0, rank), 1).backward()
        ddp.finish_grad_sync()
        opt.step()
    if steps:
        save_optimizer_distributed(opt, path)
    else:
        load_optimizer_distributed(opt, path)
    return {
        "opt": opt.state_dict(),
        "step": opt.step_count,
        "shapes": {s.name: s.shape for u in ddp.plan.units for s in u.slots},
    }


def test_optimizer_state_saved_at_dp2_loads_at_dp2_dp1_dp4(tmp_path):
    saved = run_workers(2, _worker, str(tmp_path / "ckpt"), 2)
    shapes = saved[0]["shapes"]
    expected = assemble_optimizer_state([r["opt"] for r in saved], shapes)
    for world_size in (2, 1, 4):
        loaded = run_workers(world_size, _worker, str(tmp_path / "ckpt"), 0)
        assert all(r["step"] == 2 for r in loaded)
        got = assemble_optimizer_state([r["opt"] for r in loaded], shapes)
        assert set(got) == set(expected)
        for name, state in expected.items():
            for key, tensor in state.items():
                assert not torch.isnan(tensor).any()
                assert torch.equal(got[name][key], tensor), f"DP={world_size}: {name}.{key}"
