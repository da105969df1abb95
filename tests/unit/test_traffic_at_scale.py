"""Owner collectives at cluster scale without processes: tools/plan.py --traffic drives the real
planner's layouts through every DP rank's own SegmentComm in this one process (torch's fake
process-group backend, shapes only: megatron_mfsdp/runtime/at_scale.py), for the paper's 25.8B GPT
(128 layers, hidden 4096, FFN 16384) at W = 64, 256 and 1024 and Llama-3-70B at TP 8 over DP 8, 32
and 128. Per unit: the calls of a gather and of a reduction, the busiest rank's bytes against
ZeRO-3's bytes per rank, and the largest buffer any rank allocates."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
GPT = "--num-layers 128 --hidden-size 4096 --ffn-hidden-size 16384 --num-attention-heads 32 --seq-length 4096"
GPT += " --max-position-embeddings 4096 --vocab-size 32000 --bf16"
LLAMA = "--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 --group-query-attention"
LLAMA += " --num-query-groups 8 --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope"
LLAMA += " --untie-embeddings-and-output-weights --vocab-size 128256 --tensor-model-parallel-size 8 --bf16"


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
