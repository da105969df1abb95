"""The start-up facts a Megatron-LM user reads, each in Megatron-LM's text (core_v0.16.1): the
arguments dump, the parameter count per (TP, PP) rank, the theoretical memory footprints (and
ours for the owner layout), the memory line and its TensorBoard tags, and the owner-plan report
summarised at large W."""

import argparse
import contextlib
import io
import re

import pytest
import torch

from megatron_mfsdp.placement import WHOLE, ParamSpec, UnitSpec
from megatron_mfsdp.placement.layout import FULL_TABLE_MAX_RANKS, histogram_counts, layout_units
from megatron_mfsdp.testing import init_megatron, optimizer_config, run_workers, tiny_gpt
from megatron_mfsdp.training import logging, memory

# Megatron-LM's text, from its source at core_v0.16.1 -------------------------------------------
# megatron/training/arguments.py, _print_args: a title line, '  {arg} {dots} {value}' with
# dots = '.' * (48 - len(arg)), sorted by str.lower, an end line.
ARGS_HEAD = "------------------------ arguments ------------------------"
ARGS_END = "-------------------- end of arguments ---------------------"
ARG_LINE = re.compile(r"^  (\S+) (\.*) (.*)$")
# megatron/training/training.py, get_model.
PARAMETER_COUNT = re.compile(
    r"^ > number of parameters on \(tensor, pipeline\) model parallel rank \((\d+), (\d+)\): (\d+)$"
)
# megatron/training/theoretical_memory_usage.py, report_theoretical_memory.
THEORETICAL = re.compile(
    r"^Theoretical memory footprints: weight and optimizer=(\d+\.\d\d) MB, activation=(\d+\.\d\d) MB, "
    r"total=(\d+\.\d\d) MB\n$"
)
# megatron/training/utils.py, report_memory ('[Rank {}] {}' of name + ' memory (MB)' and four fields).
MEMORY = re.compile(
    r"^\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: (\d+\.\d\d) \| max allocated: "
    r"(\d+\.\d\d) \| reserved: (\d+\.\d\d) \| max reserved: (\d+\.\d\d)(.*)$"
)
# megatron/training/training.py, training_log: the --log-memory-to-tensorboard tags.
MEGATRON_MEMORY_TAGS = {"mem-reserved-bytes", "mem-allocated-bytes", "mem-max-allocated-bytes", "mem-allocated-count"}


def check_args_dump(text: str, args) -> None:
    """Megatron's dump of ``args``: every argument once, dotted to column 48, sorted case-blind."""
    lines = text.splitlines()
    assert lines[0] == ARGS_HEAD and lines[-1] == ARGS_END, (lines[0], lines[-1])
    body = lines[1:-1]
    assert body == sorted(body, key=str.lower), "not in Megatron's order"
    seen = {}
    for line in body:
        m = ARG_LINE.match(line)
        assert m, line
        name, dots, value = m.groups()
        assert len(dots) == max(0, 48 - len(name)), line
        seen[name] = value
    assert seen == {k: str(v) for k, v in vars(args).items()}


def test_arguments_dump_is_megatrons(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    args = argparse.Namespace(
        lr=3e-3, Zeta="x", num_layers=2, a_very_long_argument_name_that_runs_past_the_dots_column=1, explicit=["--lr"]
    )
    logging.print_args(args)
    out = capsys.readouterr().out
    check_args_dump(out, args)
    assert "  a_very_long_argument_name_that_runs_past_the_dots_column  1\n" in out  # no dots left: two spaces
    assert f"  lr {'.' * 46} 0.003\n" in out  # 48 - len("lr") dots
    # Controls: the insertion order, or one dot too many, is not Megatron's dump.
    unsorted = "\n".join([ARGS_HEAD, *(f"  {k} {'.' * (48 - len(k))} {v}" for k, v in vars(args).items()), ARGS_END])
    with pytest.raises(AssertionError, match="order"):
        check_args_dump(unsorted, args)
    with pytest.raises(AssertionError):
        check_args_dump(out.replace(". 0.003", ".. 0.003"), args)
    monkeypatch.setenv("RANK", "1")
    logging.print_args(args)
    assert capsys.readouterr().out == ""  # rank 0 only


# ---------------------------------------------------------------------------- parameter count
def _count_worker(rank, world_size, tp):
    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig

    init_megatron(tp=tp)
    config, model = tiny_gpt()
    tp_local = sum(p.numel() for p in model.parameters())  # megatron's count, before any sharding
    ddp = MatrixFSDP(config, MatrixFSDPConfig(), model)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        logging.print_parameter_count([ddp], ddp.groups)
    return {
        "tp_local": tp_local,
        "counted": logging.tp_local_parameter_count([ddp]),
        "segments": sum(s.param_segment.numel() for s in ddp.units),  # what this rank holds
        "resident": sum(p.numel() for p in ddp.parameters()),  # released after sharding
        "out": out.getvalue(),
    }


@pytest.mark.parametrize("tp", [1, 2])
def test_parameter_count_is_the_tp_local_model_from_dp_rank_0(tp):
    results = run_workers(2, _count_worker, tp)
    full = run_workers(1, _count_worker, 1)[0]["tp_local"]
    for rank, r in enumerate(results):
        assert r["counted"] == r["tp_local"]
        printed = [PARAMETER_COUNT.match(line) for line in r["out"].splitlines()]
        if tp == 1 and rank == 1:
            assert printed == [], r["out"]  # DP rank 1 of the (0, 0) pair prints nothing
            continue
        assert len(printed) == 1 and printed[0], r["out"]
        assert tuple(int(x) for x in printed[0].groups()) == (rank if tp == 2 else 0, 0, r["tp_local"])
    if tp == 1:
        # Controls: what a DP rank holds (its segment) or what stays in the module is not the count.
        assert all(r["segments"] < r["tp_local"] and r["resident"] == 0 for r in results)
        assert results[0]["segments"] + results[1]["segments"] == full
    else:
        assert results[0]["tp_local"] < full  # TP-local: the sharded matrices count their shard


# ----------------------------------------------------------------------- theoretical memory
def _args(**overrides):
    """Megatron's arguments for a small dense GPT: 2 layers, hidden 64, 4 heads of 16, FFN 256,
    LayerNorm, tied embeddings, padded vocab 640, sequence 64 x micro-batch 2, no parallelism."""
    kw = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        kv_channels=16,
        group_query_attention=False,
        num_query_groups=1,
        ffn_hidden_size=256,
        swiglu=False,
        normalization="LayerNorm",
        padded_vocab_size=640,
        untie_embeddings_and_output_weights=False,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        data_parallel_size=2,
        use_distributed_optimizer=False,
        sequence_parallel=False,
        recompute_granularity=None,
        seq_length=64,
        micro_batch_size=2,
    )
    return argparse.Namespace(**(kw | overrides))


MB = 1024 * 1024


def test_theoretical_memory_by_hand_without_sp():
    """Attention 2*64*64*(1 + 4/4) = 16384, a layer 2*64*(256 + 2) + 16384 = 49408, the block
    2 layers + final LayerNorm 128 = 98944, the embedding 64*640 = 40960: 139904 parameters on
    the one shard at 18 bytes each. Activations: a layer 64*2*64*(10 + 24) = 278528, 2 of them +
    8*64*2 + 64*2*64 = 566272, + (64*2*640 + 64*2*64)*2 = 746496, times 1.05."""
    lines, weights = memory.theoretical_memory(_args(), num_microbatches=2)
    assert memory.weight_and_optimizer_bytes(_args(), []) == 139904 * 18
    assert memory.activation_bytes_without_sp(_args(), 2, []) == pytest.approx(746496 * 1.05, rel=1e-12)
    assert weights == pytest.approx(139904 * 18 / MB)
    assert lines == [
        "Number of parameters in transformer block in billions:  0.00",  # Megatron's ': .2f' (a space)
        "Number of parameters in embedding layers in billions: 0.00",
        "Total number of parameters in billions: 0.00",
        "Number of parameters in most loaded shard in billions: 0.0001",
        "compute_activation_memory_without_sp",
        "Activation memory footprint per transformer layer (precise, without SP): 0.3 MB",
        "Theoretical memory footprints: weight and optimizer=2.40 MB, activation=0.75 MB, total=3.15 MB\n",
    ]
    m = THEORETICAL.match(lines[-1])
    assert m and float(m.group(1)) == round(139904 * 18 / MB, 2)
    # Control: Megatron's distributed optimizer takes 6 + 12/DP bytes a parameter, not 18.
    assert memory.weight_and_optimizer_bytes(_args(use_distributed_optimizer=True), []) == 139904 * 12


def test_theoretical_memory_by_hand_with_sp_and_pipeline():
    """GQA (2 groups of 4 heads), SwiGLU, RMSNorm, untied, FFN 128, 4 layers, TP 2 x PP 2, the
    distributed optimizer over DP 4, 1 micro-batch. Attention 2*64*64*(1 + 2/4) = 12288, a layer
    2*64*(128*1.5 + 1) + 12288 = 36992, the block 4 layers + 64 = 148032, the embedding 64*256 =
    16384 (twice, untied): the first stage (148032/2 + 16384)/2 = 45200 parameters at 6 + 12/4 = 9
    bytes. Activations (SP): a layer 32*2*64*(18 + 4*2) = 106496, 4 of them + 8*32*2*2 + 32*2*64*2
    = 435200, half of it in flight (1 micro-batch of 2 stages), over TP 2: 108800 bytes."""
    args = _args(
        num_layers=4,
        group_query_attention=True,
        num_query_groups=2,
        ffn_hidden_size=128,
        swiglu=True,
        normalization="RMSNorm",
        padded_vocab_size=256,
        untie_embeddings_and_output_weights=True,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        data_parallel_size=4,
        use_distributed_optimizer=True,
        sequence_parallel=True,
        recompute_granularity="selective",
        seq_length=32,
    )
    assert memory.parameter_counts(args) == {
        "block": 148032,
        "embeddings": 32768,
        "total": 180800,
        "most_loaded": 45200,
        "other": 37008,
    }
    assert memory.weight_and_optimizer_bytes(args, []) == 45200 * 9
    assert memory.activation_bytes_with_sp(args, 1, []) == 108800
    lines, _ = memory.theoretical_memory(args, num_microbatches=1)
    assert lines[4:] == [
        "Number of parameters in other shards in billions: 0.0000",
        "compute_activation_memory with SP",
        "Activation memory footprint per transformer layer: 0.1 MB",
        "Number of in-flight microbatches: 1",
        "Theoretical memory footprints: weight and optimizer=0.39 MB, activation=0.10 MB, total=0.49 MB\n",
    ]
    # The interleaved schedule: penalty 1 + (2 - 1)/(2 * 2) = 1.25, ceil(1.25 * 2) = 3 in flight.
    lines, _ = memory.theoretical_memory(
        argparse.Namespace(**(vars(args) | {"virtual_pipeline_model_parallel_size": 2})), 8
    )
    assert "Memory penalty from interleaved schedule: 1.25" in lines
    assert "Number of in-flight microbatches: 3" in lines
    assert memory.activation_bytes_with_sp(
        argparse.Namespace(**(vars(args) | {"virtual_pipeline_model_parallel_size": 2})), 8, []
    ) == pytest.approx(435200 * 1.25 / 2)


def test_theoretical_memory_and_flops_of_an_moe_model_by_hand():
    """Megatron's formulas with --num-experts 4 --moe-ffn-hidden-size 32 --moe-layer-freq ([0]+[1]*1): the
    dense layer 49408 as above; the MoE layer holds all 4 experts (Megatron does not divide them by EP) and no
    router, 2*64*(32*4 + 2) + 16384 = 33024; the block 49408 + 33024 + 128 = 82560. FLOPs: the MoE layer's MLP
    is its top-2 experts', 64*2*(32*2) multiply-adds a token against the dense layer's 64*2*256."""
    moe = dict(num_experts=4, moe_ffn_hidden_size=32, moe_layer_freq=[0, 1], moe_router_topk=2)
    args = _args(**moe, moe_shared_expert_intermediate_size=None)
    assert memory.parameter_counts(args)["block"] == 82560
    shared = memory.parameter_counts(_args(**moe, moe_shared_expert_intermediate_size=16))["block"]
    assert shared == 82560 + 2 * 64 * 16
    flops = logging.flops_per_iteration(args, 1, 640)
    assert flops == logging.flops_per_iteration(_args(), 1, 640) - 64 * 6 * 64 * 2 * (256 - 2 * 32)
    # Control: every layer MoE (--moe-layer-freq 1) counts the experts' MLP twice.
    every = _args(**(moe | {"moe_layer_freq": 1}), moe_shared_expert_intermediate_size=None)
    assert logging.flops_per_iteration(every, 1, 640) == flops - 64 * 6 * 64 * 2 * (256 - 2 * 32)


def _owner_worker(rank, world_size, bf16, optimizer):
    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig, get_megatron_optimizer

    init_megatron()
    precision = dict(params_dtype=torch.bfloat16, bf16=True) if bf16 else {}
    config, model = tiny_gpt(**precision)
    ddp = MatrixFSDP(config, MatrixFSDPConfig(), model)
    opt = get_megatron_optimizer(optimizer_config(optimizer=optimizer, **precision), [ddp])
    predicted = [memory.owner_bytes([ddp], optimizer, r) for r in range(world_size)]
    return {"predicted": predicted, "measured": {**ddp.local_bytes(), **opt.local_bytes()}}


@pytest.mark.parametrize("bf16,optimizer", [(False, "muon"), (True, "muon"), (True, "adam")])
def test_owner_figure_predicts_what_each_rank_holds(bf16, optimizer):
    """The plan's prediction, for every DP rank, is what that rank's wrapper and optimizer hold."""
    results = run_workers(2, _owner_worker, bf16, optimizer)
    for rank, r in enumerate(results):
        assert r["predicted"][rank] == r["measured"], (rank, r)
        assert r["predicted"] == results[0]["predicted"]  # every rank plans every rank alike
    held = results[0]["predicted"][0]
    assert (held["masters"] > 0) == bf16  # fp32 masters beside bf16 parameters only
    assert held["grads"] == (2 if bf16 else 1) * held["params"]  # fp32 gradient segments
    if optimizer == "adam":  # two fp32 moments for every element
        assert held["optimizer_state"] == 2 * held["grads"]
    else:  # Muon's one momentum on the matrices, Adam's two on the rest
        assert held["grads"] < held["optimizer_state"] < 2 * held["grads"]


def test_owner_line_names_the_busiest_rank_and_the_measured_spread():
    small = dict(params=MB, grads=MB, masters=0, optimizer_state=2 * MB)
    big = dict(params=2 * MB, grads=2 * MB, masters=0, optimizer_state=4 * MB)
    everyone = [(small, 1, 4, 0, 4 * MB), (big, 3, 4, 1, 6 * MB)]
    line = memory.owner_line(everyone, megatron_mb=16.0)
    assert line.startswith("Theoretical memory footprints, MatrixFSDP owner layout: weight and optimizer=8.00 MB")
    assert "(DP rank 3 of 4, pipeline stage 1: params=2.00 MB, fp32 grads=2.00 MB" in line
    assert "x0.500 of Megatron's figure" in line
    assert line.endswith("measured per rank: max 6.00 MB (rank 1), min 4.00 MB")
    assert memory.expert_line(everyone) is None  # no expert domain
    experts = [(*everyone[0], (3 * MB, 2 * MB)), (*everyone[1], (2 * MB, 2 * MB))]
    assert memory.expert_line(experts) == (
        "Theoretical memory footprints, experts: the busiest rank holds 3.00 MB of expert weights, gradients, "
        "masters and optimizer state; ZeRO-3's even split over expert DP 2.00 MB (x1.500)"
    )
    assert memory.owner_line(experts, megatron_mb=16.0) == line


# ---------------------------------------------------------------------------- memory line
def test_memory_line_on_cpu_is_megatrons_shape_with_rss(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    text = logging.memory_line("(after 2 iterations)")
    m = MEMORY.match(f"[Rank 0] {text}")
    assert m, text
    allocated, max_allocated, reserved, max_reserved = (float(x) for x in m.groups()[2:6])
    assert 0 < allocated <= max_allocated and (reserved, max_reserved) == (allocated, max_allocated)
    assert m.group(7) == logging.CPU_MEMORY_NOTE and "RSS" in m.group(7)
    assert set(logging.memory_stats()) == MEGATRON_MEMORY_TAGS - {"mem-allocated-count"}  # no allocator count


def test_memory_line_on_gpu_is_megatrons_exactly(monkeypatch):
    """The CUDA branch with the allocator's figures faked: Megatron's text, nothing after it."""
    figures = {"memory_allocated": 1.5, "max_memory_allocated": 2.25, "memory_reserved": 4, "max_memory_reserved": 8}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, mb in figures.items():
        monkeypatch.setattr(torch.cuda, name, lambda mb=mb: int(mb * MB))
    stats = {"reserved_bytes.all.current": 1, "allocated_bytes.all.current": 2}
    stats |= {"allocated_bytes.all.peak": 3, "allocation.all.current": 4}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: stats)
    text = logging.memory_line("(after 1 iterations)")
    assert text == (
        "(after 1 iterations) memory (MB) | allocated: 1.50 | max allocated: 2.25 | reserved: 4.00 | max reserved: 8.00"
    )
    assert MEMORY.match(f"[Rank 3] {text}").group(7) == ""
    assert logging.memory_stats() == {
        "mem-reserved-bytes": 1,
        "mem-allocated-bytes": 2,
        "mem-max-allocated-bytes": 3,
        "mem-allocated-count": 4,
    }


# -------------------------------------------------------------------- the owner-plan report
def _plan(world_size: int):
    """Rank r owns one matrix of (r + 1) x 8 elements costing r + 1: loads 1..W."""
    specs = [ParamSpec(f"m{r}", (r + 1, 8), "muon", WHOLE, r + 1) for r in range(world_size)]
    return layout_units([UnitSpec("u", specs)], world_size, {f"m{r}": r for r in range(world_size)}, "test")


def _row(line: str) -> tuple[int, int, int, int]:
    rank, nbytes, flops, matrices = line.split()
    return int(rank), int(nbytes.replace(",", "")), int(flops.replace(",", "")), int(matrices)


def test_plan_report_at_w64_shows_4_plus_4_ranks_and_histograms():
    report = _plan(64).report().splitlines()
    assert report[0] == "MatrixFSDP plan: 1 units over 64 DP ranks, policy test"
    assert report[-1] == "max/mean: bytes 1.969, NS flops 1.969"  # 64 / 32.5, unchanged
    header = report.index(f"{'rank':>6} {'owned bytes':>14} {'NS flops/step':>16} {'matrices':>9}")
    top, gap, bottom = report[header + 1 : header + 5], report[header + 5], report[header + 6 : header + 10]
    assert [_row(line) for line in top] == [(r, (r + 1) * 32, 2 * (r + 1), 1) for r in (63, 62, 61, 60)]
    assert [_row(line) for line in bottom] == [(r, (r + 1) * 32, 2 * (r + 1), 1) for r in (3, 2, 1, 0)]
    assert gap.split() == ["...", "(56", "ranks", "between)"]
    histograms = [line for line in report if line.startswith("histogram of ")]
    assert len(histograms) == 2 and len(report) == header + 10 + 2 + 1
    for line in histograms:
        m = re.match(
            r"histogram of (.+) / mean over 64 ranks, 10 equal bins from ([\d.]+) to ([\d.]+): ([\d ]+)$", line
        )
        assert m, line
        counts = [int(c) for c in m.group(4).split()]
        assert sum(counts) == 64
        # By hand: loads 1..64 over a mean of 32.5, bins 6.3 loads wide from load 1.
        assert counts == [7, 6, 6, 7, 6, 6, 7, 6, 6, 7]
        assert (m.group(2), m.group(3)) == (f"{1 / 32.5:.3f}", f"{64 / 32.5:.3f}")


def test_plan_report_keeps_the_full_table_up_to_the_threshold():
    for world_size in (8, FULL_TABLE_MAX_RANKS):
        report = _plan(world_size).report().splitlines()
        rows = [_row(line) for line in report[2:-1]]
        assert rows == [(r, (r + 1) * 32, 2 * (r + 1), 1) for r in range(world_size)]
        assert not any(line.startswith("histogram") for line in report)
    assert any(line.startswith("histogram") for line in _plan(FULL_TABLE_MAX_RANKS + 1).report().splitlines())


def test_histogram_counts_edges():
    assert histogram_counts([5, 5, 5]) == (1.0, 1.0, [3] + [0] * 9)  # equal loads: one bin
    assert histogram_counts([0, 0]) == (1.0, 1.0, [2] + [0] * 9)  # nothing to balance: 1.0, as balance()
    lo, hi, counts = histogram_counts([1, 3], bins=2)
    assert (lo, hi, counts) == (0.5, 1.5, [1, 1])  # the highest value in the last bin
