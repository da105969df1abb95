"""Owner collectives at cluster scale without processes: tools/plan.py --traffic drives the real
planner's layouts through every DP rank's own SegmentComm in this one process (torch's fake
process-group backend, shapes only: megatron_mfsdp/runtime/at_scale.py), for the paper's 25.8B GPT
(128 layers, hidden 4096, FFN 16384) at W = 64, 256 and 1024 and Llama-3-70B at TP 8 over DP 8, 32
and 128. Per unit: the calls of a gather and of a reduction, the busiest rank's bytes against
ZeRO-3's bytes per rank, and the largest buffer any rank allocates. The expert domain (issue 28) of a
Qwen3-30B-A3B-like MoE at EP 8 is driven the same way over its expert-DP ranks at expert DP 4, 16
and 64, with two controls: a unit's experts all on one owner, and that owner in the middle of the
rank-ordered chain."""

import contextlib
import importlib.util
import io
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
GPT = "--num-layers 128 --hidden-size 4096 --ffn-hidden-size 16384 --num-attention-heads 32 --seq-length 4096"
GPT += " --max-position-embeddings 4096 --vocab-size 32000 --bf16"
LLAMA = "--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 --group-query-attention"
LLAMA += " --num-query-groups 8 --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope"
LLAMA += " --untie-embeddings-and-output-weights --vocab-size 128256 --tensor-model-parallel-size 8 --bf16"
QWEN_MOE = "--num-layers 48 --hidden-size 2048 --num-attention-heads 32 --group-query-attention --num-query-groups 4"
QWEN_MOE += " --kv-channels 128 --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope"
QWEN_MOE += " --untie-embeddings-and-output-weights --vocab-size 151936 --num-experts 128 --moe-router-topk 8"
QWEN_MOE += " --moe-ffn-hidden-size 768 --ffn-hidden-size 6144 --expert-model-parallel-size 8 --bf16"


def _plan_tool():
    spec = importlib.util.spec_from_file_location("plan_tool", ROOT / "tools" / "plan.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@pytest.mark.parametrize(
    "model,dp,order",
    [(GPT, 64, "ring"), (GPT, 256, "ring"), (GPT, 1024, "ring"), (LLAMA, 8, "ring"), (LLAMA, 32, "ring")]
    + [(LLAMA, 128, "ring"), (GPT, 64, "rank"), (LLAMA, 8, "rank")],
)
def test_busiest_rank_per_call_stays_at_one_unit_at_cluster_scale(model, dp, order):
    tool = _plan_tool()
    argv = model.split() + ["--data-parallel-size", str(dp), "--traffic", "--traffic-units", "5"]
    args = tool.parse(argv + ["--mfsdp-reduce-order", order])
    _, plan = tool.plan_from_args(args)
    table, rows = tool.traffic(args, plan)
    print(table)
    floor = dp / (dp - 1)  # a rank that owns nothing of a unit receives all of it; ZeRO-3's, (W - 1) / W
    for r in rows:
        assert r.as_predicted, r  # every rank's charges equal runtime/traffic.py's prediction
        assert r.gather_calls == r.parts + 1  # a broadcast per owner part, one all-gather of the tail
        assert r.gather_busiest <= floor * 1.0001 * r.zero3_gather, r
        assert r.transient <= 4 * (r.numel + dp), r  # one unit's fp32 gradient, plus the tail's padding
        if order == "ring":
            assert r.reduce_calls == r.parts + 1
            assert r.reduce_busiest <= floor * 1.0001 * r.zero3_reduce, r
        else:  # the chain: a middle owner also receives its part's sum, never W x its segment
            assert r.reduce_busiest <= 2 * floor * 1.0001 * r.zero3_reduce, r
    if dp >= 32:  # the busiest rank within 1.05x of ZeRO-3's from W = 32 on (at W = 8 the floor is 1.143)
        assert max(r.gather_busiest / r.zero3_gather for r in rows) <= 1.05
    if order == "ring":
        assert max(r.reduce_busiest / r.zero3_reduce for r in rows) <= max(1.05, floor * 1.0001)
    assert any(r.parts >= 1 for r in rows) and "RESULT traffic" in table


def _expert_traffic(expert_dp: int, order: str = "ring", owner=None):
    """The expert domain's --traffic rows of QWEN_MOE at TP 1, EP 8 (DP = 8 x expert DP), 3 units (the
    first two MoE layers and the last: every MoE layer's experts are alike). ``owner`` (a rank): every
    expert matrix on it instead of the real planner's owners (the adversarial plan)."""
    from megatron_mfsdp.placement import WHOLE
    from megatron_mfsdp.placement.layout import layout_units

    tool = _plan_tool()
    argv = QWEN_MOE.split() + ["--data-parallel-size", str(8 * expert_dp), "--traffic", "--traffic-units", "3"]
    args = tool.parse(argv + ["--mfsdp-reduce-order", order])
    specs, plan = tool.plan_from_args(args, "expert")
    assert plan.world_size == expert_dp
    if owner is not None:
        owners = {p.name: owner for u in specs for p in u.params if p.storage == WHOLE}
        plan, size = layout_units(specs, expert_dp, owners, "one owner"), plan.element_size
        plan.element_size = size
    table, rows = tool.traffic(args, plan, "expert")
    print(table)
    assert table.splitlines()[-1].startswith(f"RESULT traffic domain=expert dp={expert_dp} order={order} units=3 ")
    gather = max(r.gather_busiest / r.zero3_gather for r in rows)
    reduce = max(r.reduce_busiest / r.zero3_reduce for r in rows)
    return rows, gather, reduce


@pytest.mark.parametrize("expert_dp", [4, 16, 64])
def test_expert_domain_busiest_rank_per_call_within_5_percent_of_zero3_at_expert_dp_4_to_64(expert_dp):
    """Issue 28's bytes claim: the real planner's expert plan (128 experts at EP 8: 16 local experts,
    32 matrices per MoE layer, no tail) through every expert-DP rank's SegmentComm; per call the busiest
    rank moves at most 1.05x ZeRO-3's bytes per rank, or the W/(W-1) floor of a rank that owns none of
    the unit (1.016 at 64: at most 32 of the 64 ranks own a part of a unit's 32 matrices). The plan is
    the joint one (each owner's dense load balanced against), whose unequal parts cost 1.044 at 16."""
    rows, gather, reduce = _expert_traffic(expert_dp)
    floor = expert_dp / (expert_dp - 1)
    for r in rows:
        assert r.as_predicted, r  # every rank's charges equal runtime/traffic.py's prediction
        assert r.parts <= min(expert_dp, 32) and r.gather_calls == r.reduce_calls == r.parts  # no tail
        assert r.transient <= 4 * r.numel, r  # one unit's fp32 gradient
    assert gather <= max(1.05, floor * 1.0001) and reduce <= max(1.05, floor * 1.0001), (gather, reduce)
    assert gather <= 1.05 and reduce <= 1.05  # measured 1.000, 1.044 (owners uneven by their dense loads), 1.016


def test_run_prints_the_expert_domain_traffic_after_the_dense_one():
    """tools/plan.py --traffic at EP 8: the dense table with its RESULT line as before, then the expert
    domain's over expert DP 4 (DP 32 / EP 8), tagged domain=expert."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert _plan_tool().run(QWEN_MOE.split() + "--data-parallel-size 32 --traffic --traffic-units 2".split()) == 0
    results = [line for line in out.getvalue().splitlines() if line.startswith("RESULT traffic")]
    assert [line.split()[2] for line in results] == ["dp=32", "domain=expert"], results
    assert results[1].split()[3] == "dp=4" and "traffic at expert DP 4 " in out.getvalue()
    assert all("max_gather_over_zero3=1.0" in line and "as_predicted=True" in line for line in results)


@pytest.mark.parametrize("expert_dp", [4, 16, 64])
def test_expert_controls_one_owner_and_the_chain_through_it_exceed_the_bound(expert_dp):
    """Negative controls, so the bound above is no formality. Every expert matrix on one owner, in ring
    order: a rank that owns nothing receives the whole unit, W/(W-1) of ZeRO-3 (1.333 and 1.067 at 4 and
    16, above 1.05, where the real plan is at 1.000 and 1.044; at 64 the real plan is at that floor too). The same
    plan in rank order with that owner in the middle of the chain (runtime/chain.py: it receives its
    part's partial sum and then the rest) doubles its reduction, 2W/(W-1) of ZeRO-3, above the bound."""
    floor = expert_dp / (expert_dp - 1)
    bound = max(1.05, floor * 1.0001)
    _, gather, reduce = _expert_traffic(expert_dp, owner=expert_dp // 2)
    assert gather == reduce == pytest.approx(floor, rel=1e-9)
    if expert_dp < 21:
        assert gather > 1.05  # the strict 1.05x fails; the real plan passes it (test above)
    _, gather, reduce = _expert_traffic(expert_dp, order="rank", owner=expert_dp // 2)
    assert gather == pytest.approx(floor, rel=1e-9)
    assert reduce == pytest.approx(2 * floor, rel=1e-9) and reduce > bound


@pytest.mark.parametrize("algorithm", ["two_level", "padded"])
def test_forced_algorithms_per_level_at_w64_in_nodes_of_8(algorithm):
    """The paper's GPT (2 layers of it) at W = 64 in simulated nodes of 8, each algorithm forced: two_level's
    busiest rank moves at most ZeRO-3's bytes per rank times its W/(W-1) floor on each level (inside a
    node and across nodes), with 2 calls per level of a unit at most; padded makes one call and a
    layer, whose matrices sit on a few owners, costs W x the largest segment (F of ../SCALE.md)."""
    tool = _plan_tool()
    argv = GPT.replace("--num-layers 128", "--num-layers 2").split() + ["--data-parallel-size", "64", "--traffic"]
    argv += ["--traffic-units", "0", "--traffic-algorithm", algorithm, "--ranks-per-node", "8"]
    args = tool.parse(argv + ["--mfsdp-reduce-order", "ring"])
    _, plan = tool.plan_from_args(args)
    table, rows = tool.traffic(args, plan)
    print(table)
    floor = 64 / 63
    for r in rows:
        assert r.as_predicted is True, r  # the comm's charges equal traffic.py's algorithm_links
        if algorithm == "two_level":
            assert set(r.gather_levels) == set(r.reduce_levels) == {"intra", "inter"}, r
            for level in ("intra", "inter"):
                assert r.gather_levels[level] <= floor * 1.0001 * r.zero3_gather, (level, r)
                assert r.reduce_levels[level] <= floor * 1.0001 * r.zero3_reduce, (level, r)
            assert r.gather_calls <= 2 * (r.parts + 1) and r.reduce_calls <= 2 * (r.parts + 1), r
        else:
            assert r.gather_calls == r.reduce_calls == 1 and set(r.gather_levels) == {"flat"}, r
    layers = [r for r in rows if r.parts]
    assert layers and "RESULT traffic levels" in table
    if algorithm == "padded":
        assert all(r.gather_levels["flat"] > 5 * r.zero3_gather for r in layers)


def test_by_cost_at_w64_in_nodes_of_8_takes_no_padded_layer_and_stays_at_zero3_per_level():
    """--traffic-algorithm auto: the runtime's choice on NCCL (the cost model) for the same plan. No layer is
    padded (its W x largest segment would cost 21x ZeRO-3's bytes); where a bandwidth-optimal algorithm is
    chosen each level's busiest rank stays within 1.05x ZeRO-3's bytes per rank; the choice table prints
    every algorithm's predicted time, and the comm moved what traffic.py predicts for each unit's choice."""
    tool = _plan_tool()
    argv = GPT.replace("--num-layers 128", "--num-layers 2").split() + ["--data-parallel-size", "64", "--traffic"]
    argv += ["--traffic-units", "0", "--traffic-algorithm", "auto", "--ranks-per-node", "8"]
    args = tool.parse(argv + ["--mfsdp-reduce-order", "ring"])
    _, plan = tool.plan_from_args(args)
    table, rows = tool.traffic(args, plan)
    print(table)
    assert "owner collectives (auto; W 64, 8 ranks per node, nccl" in table and "(times: parts / two_level" in table
    choices = plan.collectives.choices()
    for r in rows:
        assert r.as_predicted is True, r
        for op, levels, zero3 in (
            ("gather", r.gather_levels, r.zero3_gather),
            ("reduce", r.reduce_levels, r.zero3_reduce),
        ):
            if "padded" not in choices[r.index]:
                assert all(moved <= 1.05 * zero3 for moved in levels.values()), (op, r)
    assert all("padded" not in choices[r.index] for r in rows if r.parts)
