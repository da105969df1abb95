"""Megatron-LM's MoE flags: its defaults and derived values, megatron-core's meaning in the TransformerConfig,
bad input named before any work, what this machine cannot run noticed, what megatron-mfsdp lacks refused."""

import pytest

from tests.launch import TINY
from tests.launch import parse as _parse
from tests.launch import parse_error as _error

MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "64"]


def test_moe_defaults_and_derived_values_are_megatron_lms():
    args = _parse(
        TINY
        + ["--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--disable-bias-linear"]
    )
    assert args.moe_ffn_hidden_size == args.ffn_hidden_size == 256  # validate_args: the dense FFN size
    assert args.expert_tensor_parallel_size == 2 and args.expert_model_parallel_size == 1  # ETP defaults to TP
    assert (args.moe_router_topk, args.moe_router_score_function, args.moe_token_dispatcher_type) == (
        2,
        "softmax",
        "allgather",
    )
    assert args.moe_router_load_balancing_type == "aux_loss" and args.moe_aux_loss_coeff == 0.0
    assert args.expert_data_parallel_size == 1  # world 2 / (EP 1 x expert TP 2 x PP 1)
    # One-element lists become scalars, as Megatron-LM's validate_args makes them.
    args = _parse(TINY + MOE + ["--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.1"])
    assert (args.moe_router_load_balancing_type, args.moe_aux_loss_coeff) == ("seq_aux_loss", 0.1)
    two = _parse(
        TINY
        + MOE
        + ["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"]
        + ["--moe-aux-loss-coeff", "0.1", "0.2"]
    )
    assert two.moe_router_load_balancing_type == ["aux_loss", "seq_aux_loss"]


def test_moe_flags_reach_megatron_cores_transformer_config():
    from megatron_mfsdp.training.configs import transformer_config_from_args

    args = _parse(
        TINY
        + MOE
        + ["--moe-router-topk", "3", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
        + ["--moe-router-bias-update-rate", "0.01", "--moe-z-loss-coeff", "1e-3", "--moe-aux-loss-coeff", "0.02"]
        + ["--moe-shared-expert-intermediate-size", "32", "--moe-layer-freq", "([0]+[1]*1)"]
        + ["--moe-expert-capacity-factor", "1.5", "--moe-token-drop-policy", "position", "--moe-router-dtype", "fp32"]
        + ["--moe-router-num-groups", "2", "--moe-router-group-topk", "1", "--moe-input-jitter-eps", "0.01"]
        + ["--expert-model-parallel-size", "2", "--optimizer", "adam", "--moe-token-dispatcher-type", "alltoall"]
    )
    config = transformer_config_from_args(args)
    assert (config.num_moe_experts, config.moe_ffn_hidden_size, config.moe_router_topk) == (4, 64, 3)
    assert (config.moe_router_score_function, config.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert (config.moe_router_bias_update_rate, config.moe_z_loss_coeff, config.moe_aux_loss_coeff) == (
        0.01,
        1e-3,
        0.02,
    )
    assert (config.moe_shared_expert_intermediate_size, config.moe_layer_freq) == (32, [0, 1])
    assert (config.moe_expert_capacity_factor, config.moe_token_drop_policy, config.moe_router_dtype) == (
        1.5,
        "position",
        "fp32",
    )
    assert (config.moe_router_num_groups, config.moe_router_group_topk, config.moe_input_jitter_eps) == (2, 1, 0.01)
    assert (config.expert_model_parallel_size, config.moe_token_dispatcher_type) == (2, "alltoall")
    dense = transformer_config_from_args(_parse(TINY))
    assert dense.num_moe_experts is None and dense.moe_ffn_hidden_size is None


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--expert-model-parallel-size", "3"], "--num-experts 4 is not divisible by --expert-model-parallel-size 3"),
        (
            ["--expert-model-parallel-size", "4", "--optimizer", "adam"],
            "world size 2 is not divisible by --expert-model-parallel-size 4 x --expert-tensor-parallel-size 1 x "
            "--pipeline-model-parallel-size 1",
        ),
        (
            ["--expert-tensor-parallel-size", "4", "--optimizer", "adam", "--disable-bias-linear"],
            "world size 2 is not divisible by --expert-model-parallel-size 1 x --expert-tensor-parallel-size 4",
        ),
        (["--moe-router-topk", "5"], "--moe-router-topk 5 is larger than --num-experts 4"),
        (
            ["--tensor-model-parallel-size", "2", "--disable-bias-linear"],
            "--num-experts with --tensor-model-parallel-size 2 needs --sequence-parallel",
        ),
        (["--moe-layer-freq", "([0]+[1]*3)"], "--moe-layer-freq gives 4 layers, --num-layers 2: one entry per layer"),
        (["--moe-layer-freq", "[2]*2"], "argument --moe-layer-freq: expected a positive integer or a list expression"),
        (["--moe-layer-freq", "__import__('os')"], "argument --moe-layer-freq: expected a positive integer"),
        (
            ["--moe-token-dispatcher-type", "flex"],
            "--moe-token-dispatcher-type flex: the flex dispatcher runs DeepEP or HybridEP CUDA kernels, which "
            "megatron-mfsdp does not support",
        ),
        (
            ["--moe-use-legacy-grouped-gemm"],
            "--moe-use-legacy-grouped-gemm: megatron-core's legacy GroupedMLP is not supported: its weight1 "
            "concatenates the local experts in one 2D tensor, so a matrix optimizer cannot treat each expert",
        ),
        (
            ["--expert-tensor-parallel-size", "2", "--use-matrix-fsdp", "--disable-bias-linear"],
            "--expert-tensor-parallel-size 2 (not --tensor-model-parallel-size 1) at --expert-model-parallel-size 1 "
            "with --use-matrix-fsdp: experts get a shard domain of their own",
        ),
        (
            ["--moe-router-enable-expert-bias"],
            "--num-experts 4: megatron-core refuses the MoE settings: Expert bias for aux-loss-free routing only "
            "supports sigmoid score function",
        ),
    ],
)
def test_bad_moe_input_exits_2_naming_the_flags_before_any_work(flags, message, capsys):
    assert message in _error(TINY + MOE + flags, capsys)


def test_tp_pp_dp_mapping_is_megatron_lms_order_with_the_expert_axis(capsys):
    """Megatron-LM's --use-tp-pp-dp-mapping is the order tp-cp-ep-pp-dp (megatron/training/initialize.py), which
    megatron-core's rank generator needs for the expert groups (an order without 'ep' fails at EP > 1)."""
    args = _parse(TINY + MOE + ["--expert-model-parallel-size", "2", "--optimizer", "adam", "--use-tp-pp-dp-mapping"])
    assert args.parallel_order == "tp-cp-ep-pp-dp"
    assert _parse(TINY).parallel_order == "tp-cp-ep-dp-pp"
    pp2 = ["--pipeline-model-parallel-size", "2", "--use-tp-pp-dp-mapping"]
    err = _error(TINY + MOE + ["--expert-model-parallel-size", "2", "--optimizer", "adam"] + pp2, capsys, world_size=4)
    assert "--use-tp-pp-dp-mapping with --pipeline-model-parallel-size 2: the expert data-parallel size 1" in err


def test_expert_parallelism_needs_experts(capsys):
    err = _error(TINY + ["--expert-model-parallel-size", "2", "--optimizer", "adam"], capsys)
    assert "--expert-model-parallel-size 2 needs --num-experts" in err


def test_cuda_only_moe_kernels_are_noticed_with_what_runs_instead():
    import torch

    if torch.cuda.is_available():
        pytest.skip("the notices are for machines without Transformer Engine on CUDA")
    flags = ["--moe-grouped-gemm", "--moe-permute-fusion", "--moe-router-fusion", "--moe-token-dispatcher-type"]
    args = _parse(TINY + MOE + flags + ["alltoall", "--moe-shared-expert-intermediate-size", "32"])
    assert not (args.moe_grouped_gemm or args.moe_permute_fusion or args.moe_router_fusion)
    notices = [n for n in args.notices if n.startswith("--moe-")]
    assert [n.split(":")[0] for n in notices] == ["--moe-grouped-gemm", "--moe-permute-fusion", "--moe-router-fusion"]
    assert "SequentialMLP runs the local experts one GEMM each" in notices[0]
    overlap = _parse(TINY + MOE + ["--moe-token-dispatcher-type", "alltoall", "--moe-shared-expert-overlap"])
    assert not overlap.moe_shared_expert_overlap
    assert any(n.startswith("--moe-shared-expert-overlap: ") and "unoverlapped" in n for n in overlap.notices)


def test_gelu_experts_run_the_bias_gelu_unfused_with_a_notice():
    """megatron-core's expert MLP fuses only SwiGLU with the routing weights: GELU would fail at the first
    forward, so its fusion is off (and the run says so); SwiGLU keeps its fusion, a dense model its GELU one."""
    gelu = _parse(TINY + MOE)
    assert not gelu.bias_gelu_fusion and any(n.startswith("--num-experts with GELU") for n in gelu.notices)
    assert _parse(TINY + MOE + ["--swiglu"]).bias_swiglu_fusion
    assert _parse(TINY).bias_gelu_fusion


def test_the_expert_layout_line():
    from megatron_mfsdp.training.arguments.moe import expert_layout_line

    args = _parse(TINY + MOE + ["--expert-model-parallel-size", "2", "--optimizer", "adam"], world_size=4)
    line = expert_layout_line(args)
    assert line.startswith("> experts: 4 per MoE layer, top-2 (softmax), EP=2 (2 experts per rank) x expert TP=1")
    assert "expert DP=2, allgather dispatcher, FFN 64 per expert" in line
    assert expert_layout_line(_parse(TINY)) is None


def test_a_checkpoint_of_another_expert_count_is_named_before_any_tensor():
    """checkpoint/resume.py checks the MoE shape arguments Megatron-LM's load_args_from_checkpoint copies
    (core_v0.16.1 megatron/training/checkpointing.py): another --num-experts or expert FFN size stops the
    load naming the flag; the same ones pass."""
    from megatron_mfsdp.checkpoint.resume import check_same_model

    saved = {"num_layers": 2, "num_experts": 4, "moe_ffn_hidden_size": 64}
    check_same_model(dict(saved), saved, "ckpt/common.pt")
    for key, value, flag in (("num_experts", 8, "--num-experts"), ("moe_ffn_hidden_size", 32, "--moe-ffn-hidden-size")):
        with pytest.raises(ValueError, match=f"saved for another model: {flag}: checkpoint"):
            check_same_model({**saved, key: value}, saved, "ckpt/common.pt")


def test_expert_tp_above_1_with_biases_names_both_ways_out(capsys):
    """megatron-core asserts "Bias in Moe is only supported when ETP==1"; the parser names the flags first,
    and says when the expert TP came from the TP default."""
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2"]
    err = _error(TINY + MOE + tp2, capsys, world_size=4)
    assert "--expert-tensor-parallel-size 2 (by default the TP size) with biases: megatron-core has MoE biases" in err
    assert "add --disable-bias-linear or --expert-tensor-parallel-size 1" in err
    assert (
        _parse(TINY + MOE + tp2 + ["--expert-tensor-parallel-size", "1"], world_size=4).expert_tensor_parallel_size == 1
    )
