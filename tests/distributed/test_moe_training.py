"""A tiny MoE GPT on megatron-core's own MoE layer (4 experts, top-2, sigmoid scores, load-balancing
aux loss, z-loss and the aux-loss-free expert bias; SequentialMLP experts, local spec) trained through
megatron-core's schedule on MatrixFSDP at DP 2 x EP 1, against the same run in one process: the
experts are ordinary matrices of the dense shard domain, each on one owner."""

import pytest
import torch

from megatron_mfsdp.testing import count_collectives, forward_step, init_megatron, micro_batch, run_workers, tiny_gpt

STEPS = 3
MOE = dict(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=64,
    moe_aux_loss_coeff=1e-2,
    moe_z_loss_coeff=1e-3,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=1e-2,
)


def _moe_matrix_fsdp_worker(
    rank,
    world_size,
    data_ranks: int,
    ep: int = 1,
    tp: int = 1,
    etp=None,
    mode="blockwise",
    bias=True,
    replicas=1,
    layout="owner",
):
    """STEPS steps of one global batch of ``data_ranks`` micro-batches (one per DP rank of the run this
    stands for), this DP rank's share of them; the full weights (TP shards joined over each parameter's
    TP group: expert TP for experts), the routers' expert biases, each step's mean lm loss and
    optimizer-step collectives, and the plan's slots."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_mfsdp import (
        MatrixFSDP,
        MatrixFSDPConfig,
        ProcessGroups,
        configure_schedule,
        forward_backward,
        get_megatron_optimizer,
    )
    from megatron_mfsdp.runtime.wrapper import is_expert
    from megatron_mfsdp.testing import optimizer_config

    init_megatron(tp=tp, ep=ep, etp=etp)
    parallel = dict(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, expert_tensor_parallel_size=etp or tp)
    parallel["add_bias_linear"] = bias  # megatron-core: biases in MoE only at expert TP 1
    config, model = tiny_gpt(by_global_name=True, expert_model_parallel_size=ep, **parallel, **MOE)
    ddp = MatrixFSDP(config, MatrixFSDPConfig(layout=layout), model, ProcessGroups.from_parallel_state(replicas))
    opt = get_megatron_optimizer(optimizer_config(muon_tp_mode=mode), [ddp])
    configure_schedule([ddp], opt)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mine = [r for r in range(data_ranks) if r % dp_size == dp_rank]
    losses, step_calls, biases, norms = [], [], [], []
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        batches = iter([micro_batch(step, 0, r) for r in mine])
        dicts = forward_backward(forward_step, batches, [ddp], len(mine), 16, 2)
        total = torch.tensor([sum(d["lm loss"].item() for d in dicts)], dtype=torch.float64)
        dist.all_reduce(total, group=ps.get_data_parallel_group())
        losses.append(total.item() / data_ranks)
        biases.append({n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")})
        with count_collectives() as calls:
            success, grad_norm, _ = opt.step()
            assert success
        step_calls.append(list(calls))
        norms.append(grad_norm)
    params, full = dict(model.named_parameters()), {}
    for name, tensor in ddp.full_state_dict().items():
        param = params.get(name)
        group = (
            ps.get_expert_tensor_parallel_group()
            if param is not None and is_expert(param)
            else ps.get_tensor_model_parallel_group()
        )
        if param is not None and getattr(param, "tensor_model_parallel", False) and dist.get_world_size(group) > 1:
            parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, tensor.contiguous(), group=group)
            tensor = torch.cat(parts, dim=param.partition_dim)
        full[ddp.global_names.get(name, name)] = tensor  # experts under their global index
    return {
        "full": full,
        "biases": biases,
        "losses": losses,
        "norms": norms,
        "step_calls": step_calls,
        "plan": [(slot.name, slot.rule, slot.storage, slot.owner) for u in ddp.plan.units for slot in u.slots],
        "domains": {name: [u.layout.name for u in d.units] for name, d in ddp.domains.items()},
        "domain_sizes": {name: (d.dp_size, d.replica_size) for name, d in ddp.domains.items()},
        "policies": {name: d.plan.policy for name, d in ddp.domains.items()},
        "stepped": sorted(o.global_name for o in opt.owned_pieces() if o.rule == "muon"),
        "stepped_tp": sorted((o.global_name, o.tp_rank) for o in opt.owned_pieces() if o.rule == "muon"),
        "bytes": {**ddp.local_bytes(), **opt.local_bytes()},
        "predicted": _predicted(ddp),
    }


def _predicted(ddp) -> dict:
    """What the plans say this rank holds (training/memory.py: owner_bytes), over both shard domains."""
    from megatron_mfsdp.training.memory import owner_bytes

    held = {}
    for name, domain in ddp.domains.items():
        for key, value in owner_bytes([ddp], "muon", domain.dp_rank, name).items():
            held[key] = held.get(key, 0) + value
    return held


@pytest.fixture(scope="module")
def dp2():
    return run_workers(2, _moe_matrix_fsdp_worker, 2)


def test_matrix_fsdp_dp2_ep1_moe_bitwise_equals_one_process(dp2):
    """One micro-batch per rank against both in one process: every gradient is a sum of the same two
    halves in rank order, the token counts behind the expert bias are summed over DP (one process counts
    both), the aux losses are scaled per micro-batch alike: weights, biases and losses equal bitwise."""
    one = run_workers(1, _moe_matrix_fsdp_worker, 2)[0]
    assert one["losses"][-1] < one["losses"][0], one["losses"]
    assert dp2[0]["losses"] == dp2[1]["losses"] == one["losses"], (dp2[0]["losses"], one["losses"])
    for name, ref in one["full"].items():
        assert torch.equal(dp2[0]["full"][name], ref), f"{name} differs by {(dp2[0]['full'][name] - ref).abs().max()}"
    # The expert bias moved (it starts at zero), by the same steps on every rank and in one process.
    for step in range(STEPS):
        for name, ref in one["biases"][step].items():
            assert torch.equal(dp2[0]["biases"][step][name], ref) and torch.equal(dp2[1]["biases"][step][name], ref)
    final = one["biases"][-1]
    assert len(final) == 2 and all(b.abs().sum() > 0 for b in final.values()), final
    # The step moves no tensor: one all-reduce of two scalars (the grad norm and zero count).
    for r in dp2:
        assert all(calls == [("all_reduce", 2)] for calls in r["step_calls"]), r["step_calls"]


def test_matrix_fsdp_dp2_ep1_moe_roles_put_each_expert_and_the_router_on_one_owner(dp2):
    """Each expert's linear_fc1/fc2 and the router's weight are matrices (--optimizer muon: Muon) stored whole
    on one owner, the experts spread over both ranks; the router's and the experts' biases are elementwise."""
    from megatron_mfsdp.placement.classes import ELEMENTWISE, MATRIX, SLICE, WHOLE

    plan = dp2[0]["plan"]
    assert plan == dp2[1]["plan"]
    slots = {name: (rule, storage, owner) for name, rule, storage, owner in plan}
    assert len(slots) == len(plan)  # each parameter placed once
    experts = [n for n in slots if ".mlp.experts.local_experts." in n and n.endswith(".weight")]
    routers = [n for n in slots if n.endswith("mlp.router.weight")]
    assert len(experts) == 2 * 4 * 2 and len(routers) == 2  # 2 layers x 4 experts x fc1/fc2; a router a layer
    for name in experts + routers:
        assert slots[name][:2] == (MATRIX, WHOLE) and slots[name][2] in (0, 1), (name, slots[name])
    assert {slots[n][2] for n in experts} == {0, 1}
    biases = [n for n in slots if n.endswith("mlp.router.bias") or ".local_experts." in n and n.endswith(".bias")]
    assert len(biases) == 2 + 2 * 4 * 2
    assert all(slots[n][:2] == (ELEMENTWISE, SLICE) for n in biases), [(n, slots[n]) for n in biases]


@pytest.fixture(scope="module")
def one4():
    """One process running the four micro-batches of a 4-rank run at DP 4."""
    return run_workers(1, _moe_matrix_fsdp_worker, 4)[0]


def test_matrix_fsdp_ep2_dp2_experts_on_expert_dp_owners_match_one_process(one4):
    """4 ranks, EP 2: each rank holds 2 of the 4 experts, planned over its expert-data-parallel pair
    (the expert domain), the rest over all four DP ranks. Against one process running the four
    micro-batches (each expert's gradient there sums its tokens micro-batch by micro-batch, here both EP
    peers' tokens in one product: another summation order, not bitwise): losses within 1e-5, weights
    within 5e-5 (measured 2.1e-5), the gradient norm within 1e-5 relative (measured 2.5e-8), biases;
    every expert matrix stepped by exactly one owner; the step moves no tensor. Muon hides a wrong
    gradient scale (expert gradients scaled by 1 / expert DP instead of 1 / DP: weights 2.7e-5 apart),
    the norm does not (0.23 apart)."""
    ep2 = run_workers(4, _moe_matrix_fsdp_worker, 4, 2)
    one = one4
    assert one["losses"][-1] < one["losses"][0], one["losses"]
    for r in ep2:
        assert list(r["domains"]) == ["dense", "expert"] and len(r["domains"]["expert"]) == 2, r["domains"]
        assert r["policies"]["expert"] == "global+joint"  # planned from each owner's dense load
        assert r["predicted"] == r["bytes"], (r["predicted"], r["bytes"])  # the start-up figure, both domains
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(one["losses"]), atol=1e-5, rtol=0)
        assert all(calls == [("all_reduce", 2)] for calls in r["step_calls"]), r["step_calls"]
    full = {**ep2[1]["full"], **ep2[0]["full"]}  # ranks 0 and 1: EP ranks 0 and 1, experts 0-1 and 2-3
    assert set(full) == set(one["full"])
    worst = 0.0
    for name, ref in one["full"].items():
        got = full[name]
        worst = max(worst, (got - ref).abs().max().item())
    norms = [abs(a / b - 1) for r in ep2 for a, b in zip(r["norms"], one["norms"])]
    print(f"\nEP2 x DP2 against one process: largest weight difference {worst:.2e}, grad norm {max(norms):.2e}")
    assert 0 < worst <= 5e-5 and max(norms) <= 1e-5, (worst, norms)
    for step in range(STEPS):
        for name, ref in one["biases"][step].items():
            torch.testing.assert_close(ep2[0]["biases"][step][name], ref, atol=1e-6, rtol=0)
    stepped = [n for r in ep2 for n in r["stepped"] if ".experts." in n]
    experts = [n for n in one["stepped"] if ".experts." in n]
    assert sorted(stepped) == sorted(experts) and len(experts) == 2 * 4 * 2  # each expert matrix once


def _joined(results) -> dict:
    """The full weights of every rank's experts and dense parameters, by global name."""
    full = {}
    for r in results:
        full.update(r["full"])
    return full


@pytest.mark.parametrize("etp,bias", [(2, False), (1, True)])
def test_matrix_fsdp_tp2_ep2_matches_one_process(etp, bias):
    """4 ranks as TP 2 (sequence-parallel) x EP 2, dense DP 2: at expert TP 2 each expert matrix is split over
    its expert TP pair, owned by the one rank of its expert DP group (expert DP 1), and megatron-core allows
    no expert biases; at expert TP 1 every expert is whole on an owner of its expert DP pair, with biases.
    With --muon-tp-mode duplicated (the whole matrix's Newton-Schulz, over each parameter's own TP group:
    expert TP for experts) against one process running both micro-batches: losses within 1e-6, the
    gradient norm within 1e-6 relative, weights within 2e-4 (measured 8.0e-7 without biases; 9.0e-5 with
    them, a near-zero bias gradient AdamW normalizes, as in test_parallel.py). Without the repair of
    megatron-core's sequence-parallel mark on expert biases (compat/moe.py) the expert TP 1 run is 4.4e-2
    off. Each expert matrix piece is stepped once per expert TP rank, by one owner."""
    got = run_workers(4, _moe_matrix_fsdp_worker, 2, 2, 2, etp, "duplicated", bias)
    one = run_workers(1, _moe_matrix_fsdp_worker, 2, 1, 1, None, "duplicated", bias)[0]
    full = _joined(got)
    assert set(full) == set(one["full"])
    worst = max((full[n] - ref).abs().max().item() for n, ref in one["full"].items())
    norms = max(abs(a / b - 1) for r in got for a, b in zip(r["norms"], one["norms"]))
    print(f"\nTP2 x EP2 (expert TP {etp}, biases {bias}) against one process: weights {worst:.2e}, norm {norms:.2e}")
    assert worst <= 2e-4 and norms <= 1e-6, (worst, norms)
    for r in got:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(one["losses"]), atol=1e-6, rtol=0)
        assert list(r["domains"]) == ["dense", "expert"]
    stepped = sorted(p for r in got for p in r["stepped_tp"] if ".experts." in p[0])
    experts = [n for n in one["stepped"] if ".experts." in n]
    assert stepped == sorted((n, k) for n in experts for k in range(etp))  # once per expert TP shard


def test_matrix_fsdp_tp2_ep2_blockwise_step_moves_no_tensor():
    """The same layout at expert TP 2 with megatron's default --muon-tp-mode blockwise (each TP shard its own
    Newton-Schulz): the step's only collective is the all-reduce of two scalars, on every rank."""
    got = run_workers(4, _moe_matrix_fsdp_worker, 2, 2, 2, 2, "blockwise", False)
    for r in got:
        assert all(calls == [("all_reduce", 2)] for calls in r["step_calls"]), r["step_calls"]
        assert r["losses"][-1] < r["losses"][0]


@pytest.mark.parametrize(
    "replicas,sizes", [(2, {"dense": (2, 2), "expert": (1, 2)}), (4, {"dense": (1, 4), "expert": (1, 2)})]
)
def test_matrix_fsdp_ep2_with_replicas_matches_one_process(replicas, sizes, one4):
    """EP 2 on 4 ranks with --mfsdp-replicate-size 2, and 4 (every dense matrix replicated: the backend of
    --optimizer muon without --use-matrix-fsdp): the expert-DP pair splits into gcd(replicas, 2) = 2 replicas
    of one owner each, so each expert is stepped on both ranks of its pair. Against one process: losses within
    1e-5, weights within 5e-5, the gradient norm within 1e-5 relative (each element counted once: replicas
    past the first are left out); the step moves no tensor."""
    got = run_workers(4, _moe_matrix_fsdp_worker, 4, 2, 1, None, "blockwise", True, replicas)
    full = _joined(got)
    worst = max((full[n] - ref).abs().max().item() for n, ref in one4["full"].items())
    norms = max(abs(a / b - 1) for r in got for a, b in zip(r["norms"], one4["norms"]))
    print(f"\nEP2 with {replicas} replicas against one process: weights {worst:.2e}, grad norm {norms:.2e}")
    assert worst <= 5e-5 and norms <= 1e-5, (worst, norms)
    for r in got:
        assert r["domain_sizes"] == sizes, r["domain_sizes"]
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(one4["losses"]), atol=1e-5, rtol=0)
        assert all(calls == [("all_reduce", 2)] for calls in r["step_calls"]), r["step_calls"]
    experts = sorted(n for n in one4["stepped"] if ".experts." in n)
    assert sorted(n for r in got for n in r["stepped"] if ".experts." in n) == sorted(experts * 2)


def test_matrix_fsdp_ep2_even_layout_matches_one_process(one4):
    """--mfsdp-layout even at EP 2 on 4 ranks: every tensor in even slices, the dense ones over DP 4, the
    experts over their expert-DP pair; each step gathers every matrix's Muon direction over its own domain's
    group (the experts' over expert DP) and runs the whole matrix's Newton-Schulz on each rank of it. Against
    one process: losses within 1e-5, weights within 5e-5, grad norm within 1e-5 relative; the step's gathers
    are one per matrix of each domain."""
    got = run_workers(4, _moe_matrix_fsdp_worker, 4, 2, 1, None, "blockwise", True, 1, "even")
    full = _joined(got)
    worst = max((full[n] - ref).abs().max().item() for n, ref in one4["full"].items())
    norms = max(abs(a / b - 1) for r in got for a, b in zip(r["norms"], one4["norms"]))
    print(f"\nEP2, even layout, against one process: weights {worst:.2e}, grad norm {norms:.2e}")
    assert worst <= 5e-5 and norms <= 1e-5, (worst, norms)
    dense = sum(1 for name, rule, _, _ in got[0]["plan"] if rule == "matrix")
    for r in got:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(one4["losses"]), atol=1e-5, rtol=0)
        gathers = [name for name, _ in r["step_calls"][0] if name != "all_reduce"]
        assert len(gathers) == dense + 2 * 2 * 2, (len(gathers), dense)  # + 2 layers x 2 local experts x fc1/fc2
