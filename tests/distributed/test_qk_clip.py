"""QK-clip on owners (training/qk_clip.py): the owner of each linear_qkv (multi-latent attention: of its query
and key/value up projections) rescales its fp32 master inside the step, from the step's max logits all-reduced
over DP. A one-layer tiny GPT without biases (megatron-core
scales weights only) through megatron-core's schedule on MatrixFSDP."""

import types

import pytest
import torch

from megatron_mfsdp.testing import count_collectives, forward_step, init_megatron, micro_batch, run_workers, tiny_gpt

STEPS = 3


def _worker(
    rank,
    world_size,
    data_ranks: int,
    tp: int,
    threshold: float,
    lr: float,
    clip: bool = True,
    qkv_owners="whole",
    mla: bool = False,
    pp: int = 1,
    optimizer: str = "muon",
    layers: int | None = None,
):
    """STEPS steps of ``data_ranks`` micro-batches; each step's largest max logit and collectives, the full
    weights (TP shards joined; a pipeline stage's own layers), and the max logits of the last batch run again
    after the last step. ``layers``: one a pipeline stage unless given."""
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
    from megatron_mfsdp.models.gpt import qk_clip as qk
    from megatron_mfsdp.testing import optimizer_config
    from megatron_mfsdp.training.qk_clip import QKClip

    init_megatron(tp=tp, pp=pp)
    parallel = dict(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, pipeline_model_parallel_size=pp)
    if pp > 1:
        parallel.update(
            pipeline_dtype=torch.float32,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
        )
    config, model = tiny_gpt(
        by_global_name=True,
        num_layers=layers or pp,
        add_bias_linear=False,
        qk_clip=clip,
        log_max_attention_logit=True,
        **parallel,
        **({"multi_latent_attention": True} if mla else {}),
    )
    groups = ProcessGroups.from_parallel_state()
    ddp = MatrixFSDP(config, MatrixFSDPConfig(split_qkv_owners=qkv_owners), model, groups)
    settings = optimizer_config(optimizer=optimizer, lr=lr, min_lr=lr, muon_tp_mode="duplicated")
    opt = get_megatron_optimizer(settings, [ddp])
    configure_schedule([ddp], opt)
    hook = QKClip(types.SimpleNamespace(qk_clip=clip, qk_clip_alpha=0.5, qk_clip_threshold=threshold), [ddp], groups)
    opt.after_rules = hook
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mine = [r for r in range(data_ranks) if r % dp_size == dp_rank]
    maxes, calls = [], []
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        forward_backward(forward_step, iter([micro_batch(step, 0, r) for r in mine]), [ddp], len(mine), 16, 2)
        with count_collectives() as log:
            assert opt.step()[0]
        maxes.append(hook.last)
        calls.append(list(log))
    forward_backward(forward_step, iter([micro_batch(STEPS, 0, r) for r in mine]), [ddp], len(mine), 16, 2, True)
    after = torch.stack([getattr(a.core_attention, qk.MAX_LOGITS) for a in hook.layers])
    if pp > 1:  # every stage's layers, in layer order
        stages = [torch.empty_like(after) for _ in range(pp)]
        dist.all_gather(stages, after, group=ps.get_pipeline_model_parallel_group())
        after = torch.cat(stages)
    dist.all_reduce(after, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
    params, full = dict(model.named_parameters()), {}
    for name, tensor in ddp.full_state_dict().items():
        param = params.get(name)
        if param is not None and getattr(param, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(tensor) for _ in range(tp)]
            dist.all_gather(parts, tensor.contiguous(), group=ps.get_tensor_model_parallel_group())
            tensor = torch.cat(parts, dim=param.partition_dim)
        full[ddp.global_names.get(name, name)] = tensor
    heads = config.num_attention_heads // tp
    blocks = sum(1 for p in opt.owned_pieces() if "linear_qkv" in p.global_name and p.runs[3] > 1)
    return {"maxes": maxes, "calls": calls, "after": after, "full": full, "heads": heads, "blocks": blocks}


def test_a_low_threshold_clips_each_groups_worst_head_to_it():
    """lr 0: the weights change by the clip alone, so the same batch run again has each query group's
    largest logit at the threshold (those past it) and none above it, within fp32 rounding."""
    free = run_workers(1, _worker, 1, 1, 1e9, 0.0)[0]
    threshold = free["maxes"][0] / 2
    got = run_workers(1, _worker, 1, 1, threshold, 0.0)[0]
    assert got["maxes"][0] == pytest.approx(free["maxes"][0], rel=1e-6)  # the first step measured the same
    after = got["after"]
    assert float(after.max()) == pytest.approx(threshold, rel=1e-4), (after, threshold)
    assert float(after.max()) <= threshold * (1 + 1e-4)
    assert float(free["after"].max()) > 1.9 * threshold  # without the clip the logits stay where they were


def test_a_threshold_above_every_logit_is_bitwise_the_run_without_the_clip():
    high = run_workers(1, _worker, 2, 1, 1e9, 1e-2)[0]
    without = run_workers(1, _worker, 2, 1, 1e9, 1e-2, False)[0]
    for name, ref in without["full"].items():
        assert torch.equal(high["full"][name], ref), name


@pytest.fixture(scope="module")
def one_process():
    free = run_workers(1, _worker, 2, 1, 1e9, 1e-2)[0]
    threshold = free["maxes"][0] * 0.7
    return threshold, run_workers(1, _worker, 2, 1, threshold, 1e-2)[0]


@pytest.mark.parametrize("tp,qkv_owners", [(1, "whole"), (2, "whole"), (1, "all")])
def test_dp2_and_tp2_clip_as_one_process_and_the_step_moves_only_scalars(tp, qkv_owners, one_process):
    """DP 2 (each rank one micro-batch; also with Q, K and V on owners of their own, each scaling its block's
    rows) and TP 2 x DP 1 (each TP rank its own heads, no reduction over TP)
    against one process running both micro-batches, with a threshold the logits pass: weights within 1e-5
    (no biases; TP changes the order of the row-parallel sums), each step's largest logit within 1e-5
    relative. The step's collectives: the grad-norm scalars, the layers' max logits (one float per local
    head) over DP, and the largest one over the world (DP 2: bitwise, each gradient the same sum)."""
    threshold, one = one_process
    assert one["maxes"][0] > threshold  # the clip acts
    got = run_workers(2, _worker, 2, tp, threshold, 1e-2, True, qkv_owners)
    assert sum(r["blocks"] for r in got) == (3 if qkv_owners == "all" else 0)  # Q, K, V block owners
    full = {}
    for r in got:
        full.update(r["full"])
    worst = max((full[n] - ref).abs().max().item() for n, ref in one["full"].items())
    print(f"\nQK-clip at {'TP 2' if tp == 2 else 'DP 2'} against one process: weights {worst:.2e}")
    assert worst <= 1e-5, worst  # measured 0 (DP 2) and 2.5e-7 (TP 2)
    for r in got:
        torch.testing.assert_close(torch.tensor(r["maxes"]), torch.tensor(one["maxes"]), rtol=1e-5, atol=0)
        for calls in r["calls"]:  # at TP 2 --muon-tp-mode duplicated also gathers each matrix over TP
            scalars = [c for c in calls if c[0] != "all_gather_single"]
            assert scalars == [("all_reduce", 2), ("all_reduce", r["heads"]), ("all_reduce", 1)], calls


def _fp8_worker(rank, world_size, threshold: float):
    """A bf16 tiny GPT whose matrices are FP8 on their owners (tensorwise), one clip-only step (lr 0): the
    linear_qkv owner's fp32 master before and after, and the working weight (dequantized FP8) after."""
    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig, ProcessGroups, get_megatron_optimizer
    from megatron_mfsdp.precision import Fp8Config
    from megatron_mfsdp.testing import lm_loss, optimizer_config
    from megatron_mfsdp.training.qk_clip import QKClip

    init_megatron()
    bf16 = dict(params_dtype=torch.bfloat16, bf16=True)
    config, model = tiny_gpt(
        hidden_size=128, ffn_hidden_size=256, num_layers=1, add_bias_linear=False, qk_clip=True, **bf16
    )
    groups = ProcessGroups.from_parallel_state()
    ddp = MatrixFSDP(config, MatrixFSDPConfig(fp8=Fp8Config(fp8_recipe="tensorwise")), model, groups)
    opt = get_megatron_optimizer(optimizer_config(lr=0.0, min_lr=0.0, weight_decay=0.0, **bf16), [ddp])
    hook = QKClip(types.SimpleNamespace(qk_clip=True, qk_clip_alpha=0.5, qk_clip_threshold=threshold), [ddp], groups)
    opt.after_rules = hook
    (piece,) = [p for p in opt.owned_pieces() if p.global_name.endswith("linear_qkv.weight")]
    before = piece.master.clone()
    opt.zero_grad()
    lm_loss(ddp, micro_batch(1, 0, 0), 1).backward()
    ddp.finish_grad_sync()
    assert opt.step()[0]
    name = next(n for n in ddp.full_state_dict() if n.endswith("linear_qkv.weight"))
    return {"before": before, "after": piece.master.clone(), "weight": ddp.full_state_dict()[name].float(),
            "max": hook.last}  # fmt: skip


def test_fp8_owners_requantize_the_clipped_master():
    """With FP8 matrices the owner clips its fp32 master and re-quantizes from it: rows of clipped heads
    are scaled exactly in the master, and the FP8 working weight follows them (within E4M3's rounding)."""
    first = run_workers(1, _fp8_worker, 1e9)[0]
    assert torch.equal(first["after"], first["before"])  # nothing clipped at a threshold above every logit
    got = run_workers(1, _fp8_worker, first["max"] / 2)[0]
    ratio = got["after"].norm(dim=1) / got["before"].norm(dim=1)
    assert float(ratio.min()) < 0.8 and float(ratio.max()) == pytest.approx(1.0, abs=1e-6)  # values untouched
    torch.testing.assert_close(got["weight"], got["after"], rtol=0.07, atol=1e-3)  # E4M3: 3 mantissa bits
    assert not torch.allclose(got["weight"], got["before"], rtol=0.07, atol=1e-3)  # it did follow the clip


def test_mla_a_low_threshold_clips_each_head_to_it():
    """Multi-latent attention (megatron-core's MLASelfAttention.clip_qk rule, per head): at lr 0 the same batch
    run again after one clip-only step has each head that passed the threshold at it and none above it; the
    heads below it keep their logits."""
    free = run_workers(1, _worker, 1, 1, 1e9, 0.0, True, "whole", True)[0]
    heads = free["after"][0]
    threshold = float(heads.max() + heads.min()) / 2
    got = run_workers(1, _worker, 1, 1, threshold, 0.0, True, "whole", True)[0]
    after = got["after"][0]
    expected = torch.clamp(heads, max=threshold)
    worst = float(((after - expected).abs() / expected).max())
    print(f"\nMLA QK-clip at lr 0: max logit per head against min(before, threshold): {worst:.2e} relative")
    assert worst <= 1e-5, (after, expected)
    assert bool((heads > threshold).any()) and bool((heads < threshold).any())


def test_mla_dp2_clips_as_one_process():
    """MLA with a threshold the logits pass: DP 2 (each rank one micro-batch) against one process running both,
    weights within 1e-5 and each step's largest logit within 1e-5 relative; the clip changed the weights."""
    free = run_workers(1, _worker, 2, 1, 1e9, 1e-2, True, "whole", True)[0]
    threshold = free["maxes"][0] * 0.7
    one = run_workers(1, _worker, 2, 1, threshold, 1e-2, True, "whole", True)[0]
    assert one["maxes"][0] > threshold
    assert any(not torch.equal(one["full"][n], free["full"][n]) for n in free["full"])  # the clip acted
    got = run_workers(2, _worker, 2, 1, threshold, 1e-2, True, "whole", True)
    worst = max((got[0]["full"][n] - ref).abs().max().item() for n, ref in one["full"].items())
    print(f"\nMLA QK-clip at DP 2 against one process: weights {worst:.2e}")
    assert worst <= 1e-5, worst
    for r in got:
        torch.testing.assert_close(torch.tensor(r["maxes"]), torch.tensor(one["maxes"]), rtol=1e-5, atol=0)


def _threshold_and_reference(data_ranks: int, pp: int, optimizer: str):
    """A threshold at 0.7 x the first step's largest logit, and the one-process clipped run at it
    (``pp`` 2: its two layers)."""
    free = run_workers(1, _worker, data_ranks, 1, 1e9, 1e-2, True, "whole", False, 1, optimizer, pp)[0]
    threshold = free["maxes"][0] * 0.7
    one = run_workers(1, _worker, data_ranks, 1, threshold, 1e-2, True, "whole", False, 1, optimizer, pp)[0]
    assert one["maxes"][0] > threshold and any(not torch.equal(one["full"][n], free["full"][n]) for n in free["full"])
    return threshold, one


def test_pp2_clips_each_stages_layers_as_one_process():
    """Two layers on two pipeline stages (each stage clips its own layer; the logged largest logit is over the
    world) against one process with both layers: weights within 1e-5, each step's largest logit within 1e-5
    relative, the clipped layer's logits after the run equal; the step moves scalars only."""
    threshold, one = _threshold_and_reference(2, 2, "muon")
    got = run_workers(2, _worker, 2, 1, threshold, 1e-2, True, "whole", False, 2)
    full = {**got[0]["full"], **got[1]["full"]}
    assert set(full) == set(one["full"])
    worst = max((full[n] - ref).abs().max().item() for n, ref in one["full"].items())
    print(f"\nQK-clip at PP 2 against one process: weights {worst:.2e}")
    assert worst <= 1e-5, worst
    torch.testing.assert_close(got[0]["after"], one["after"], rtol=1e-5, atol=0)
    for r in got:
        torch.testing.assert_close(torch.tensor(r["maxes"]), torch.tensor(one["maxes"]), rtol=1e-5, atol=0)
        assert all(size <= 4 for calls in r["calls"] for _, size in calls), r["calls"]


@pytest.mark.parametrize("optimizer", ["adam", "soap"])
def test_other_rules_clip_at_dp2_as_one_process(optimizer):
    """The clip is the owner's, whatever rule steps the matrix: AdamW (--optimizer adam) and SOAP at DP 2
    against one process, weights within 1e-5 and each step's largest logit within 1e-5 relative."""
    threshold, one = _threshold_and_reference(2, 1, optimizer)
    got = run_workers(2, _worker, 2, 1, threshold, 1e-2, True, "whole", False, 1, optimizer)
    worst = max((got[0]["full"][n] - ref).abs().max().item() for n, ref in one["full"].items())
    print(f"\nQK-clip with {optimizer} at DP 2 against one process: weights {worst:.2e}")
    assert worst <= 1e-5, worst
    for r in got:
        torch.testing.assert_close(torch.tensor(r["maxes"]), torch.tensor(one["maxes"]), rtol=1e-5, atol=0)
