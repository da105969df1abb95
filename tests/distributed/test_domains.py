"""Shard domains and the expert groups they will use (issue 28): ProcessGroups reads megatron-core's
expert groups, and a MatrixFSDP holds one "dense" domain whose plan, comm and scaling are the ones its
units use."""

from megatron_mfsdp.testing import lm_loss, micro_batch, run_workers, tiny_gpt

EXPERT_GROUPS = ("ep", "expt_tp", "expt_dp", "tp_ep_pp")


def _ep2_worker(rank, world_size):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig, ProcessGroups
    from megatron_mfsdp.groups import initialize_model_parallel

    initialize_model_parallel(1, 1, expert_model_parallel_size=2, create_gloo_process_groups=False)
    groups = ProcessGroups.from_parallel_state()
    megatron = {
        "ep": ps.get_expert_model_parallel_group(),
        "expt_tp": ps.get_expert_tensor_parallel_group(),
        "expt_dp": ps.get_expert_data_parallel_group(),
        "tp_ep_pp": ps.get_expert_tensor_model_pipeline_parallel_group(),
    }
    config, model = tiny_gpt()
    ddp = MatrixFSDP(config, MatrixFSDPConfig(), model, groups)
    dense = ddp.domains["dense"]

    def grads():
        ddp.zero_grad_buffer()
        lm_loss(ddp, micro_batch(1, 0, rank), 1).backward()
        ddp.finish_grad_sync()
        return [u.grad_segment.clone() for u in ddp.units]

    scaling, scaled_once = ddp.gradient_scaling_factor, grads()
    dense.gradient_scaling_factor *= 2  # the reductions read the unit's domain: every gradient doubles
    scaled_twice = grads()
    return {
        "ours": {name: dist.get_process_group_ranks(getattr(groups, name)) for name in EXPERT_GROUPS},
        "megatron": {name: dist.get_process_group_ranks(g) for name, g in megatron.items()},
        "dp": dist.get_process_group_ranks(groups.dp),
        "sizes": (groups.ep_size, groups.expt_tp_size, groups.expt_dp_size),
        "megatron_sizes": (
            ps.get_expert_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_data_parallel_world_size(),
        ),
        "ranks": (groups.ep_rank, groups.expt_dp_rank),
        "megatron_ranks": (ps.get_expert_model_parallel_rank(), ps.get_expert_data_parallel_rank()),
        "domains": list(ddp.domains),
        "dense_is_used": (
            ddp.plan is dense.plan
            and ddp.comm is dense.comm
            and dense.units == ddp.units
            and all(u.domain is dense and u.layout is layout for u, layout in zip(ddp.units, dense.plan.units))
        ),
        "dense_groups": (dense.shard is groups.dp_shard, dense.replica is groups.replica, dense.dp_size, ddp.dp_rank),
        "scaling": scaling,
        "doubled": all(torch.equal(b, 2 * a) for a, b in zip(scaled_once, scaled_twice)),
        "nonzero": any(bool(a.any()) for a in scaled_once),
    }


def test_ep2_dp4_expert_groups_are_megatrons_and_the_dense_domain_is_the_one_used():
    """4 ranks, EP 2, TP 1: EP pairs consecutive ranks, expert DP pairs them across (world / (expert
    TP x EP x PP) = 2), the dense DP group holds all four; the wrapper's plan, comm and scaling are
    its dense domain's (doubling the domain's factor doubles every reduced gradient)."""
    for rank, r in enumerate(run_workers(4, _ep2_worker)):
        assert r["ours"] == r["megatron"], r
        assert r["ours"]["ep"] == r["ours"]["tp_ep_pp"] == [[0, 1], [2, 3]][rank // 2]
        assert r["ours"]["expt_dp"] == [rank % 2, rank % 2 + 2]
        assert r["ours"]["expt_tp"] == [rank]
        assert r["dp"] == [0, 1, 2, 3]
        assert r["sizes"] == r["megatron_sizes"] == (2, 1, 2)
        assert r["ranks"] == r["megatron_ranks"] == (rank % 2, rank // 2)
        assert r["domains"] == ["dense"] and r["dense_is_used"]
        assert r["dense_groups"] == (True, True, 4, rank)
        assert r["scaling"] == 0.25
        assert r["nonzero"] and r["doubled"]
