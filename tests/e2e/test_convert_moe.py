"""tools/checkpoint/convert.py with a Qwen3MoeForCausalLM, end to end, fp32, CPU (tiny random models
built in the test, nothing from the hub):

- HF -> ours (--ckpt-format torch_dist, experts under megatron-core's SequentialMLP keys, one per
  linear with an expert axis) -> HF is bitwise and transformers loads it; our GPTModel read back from
  the checkpoint gives transformers' logits within 1e-5;
- pretrain_gpt.py --use-matrix-fsdp loads the converted checkpoint at EP 2 on 2 ranks (--finetune,
  the model flags given as a user gives them, checked against the stored args): its validation loss
  is transformers' on the same samples; it trains with --lr 0 and saves at EP 2, and that checkpoint
  converts back to the original Hugging Face files bitwise.

``pytest -s`` shows the measured deltas.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_mfsdp.checkpoint.model_files import load_whole_model  # noqa: E402
from tests.e2e.test_convert import CONVERT, NOT_CARRIED  # noqa: E402
from tests.unit.test_hf import our_logits  # noqa: E402
from tests.unit.test_hf_moe import batch, saved_tensors, tiny_qwen3_moe, unequal  # noqa: E402

TOL = 1e-5
pytestmark = pytest.mark.usefixtures("one_rank_process_group")


def convert(*flags) -> None:
    assert CONVERT.main(list(flags)) == 0


def test_hf_to_ours_to_hf_is_bitwise_and_our_checkpoint_gives_transformers_logits(tmp_path, capsys):
    hf_model = tiny_qwen3_moe("dense0_norm_topk_untied")
    files = saved_tensors(hf_model, tmp_path / "hf")
    convert("--loader", "hf", "--saver", "mfsdp", "--load-dir", str(tmp_path / "hf"),
            "--save-dir", str(tmp_path / "ours"), "--target-expert-parallel-size", "2")  # fmt: skip
    assert "(Qwen3MoeForCausalLM, " in capsys.readouterr().out
    convert("--loader", "mfsdp", "--saver", "hf", "--load-dir", str(tmp_path / "ours"),
            "--save-dir", str(tmp_path / "back"))  # fmt: skip
    from safetensors.torch import load_file

    assert not unequal(load_file(tmp_path / "back" / "model.safetensors"), files)
    theirs = {
        k: v for k, v in json.loads((tmp_path / "hf" / "config.json").read_text()).items() if k not in NOT_CARRIED
    }
    ours = {
        k: v for k, v in json.loads((tmp_path / "back" / "config.json").read_text()).items() if k not in NOT_CARRIED
    }
    # no tokenizer in the source: its token ids have no carrier and stay unset (as test_convert.py's GPT-2)
    assert ours.pop("bos_token_id") is None and ours.pop("eos_token_id") is None
    assert ours == {k: v for k, v in theirs.items() if k not in ("bos_token_id", "eos_token_id")}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(loaded(batch()).logits, hf_model(batch()).logits)

    from megatron.core import dist_checkpointing

    folder = tmp_path / "ours" / "iter_0000000"
    args = dist_checkpointing.load_common_state_dict(str(folder))["args"]
    assert args["num_experts"] == 8 and args["moe_layer_freq"] == [0, 1, 1] and args["expert_model_parallel_size"] == 2
    # megatron-core's SequentialMLP keys: one per linear and layer, the global expert index its first axis
    metadata = dist_checkpointing.load_tensors_metadata(str(folder))
    fc2 = metadata["decoder.layers.1.mlp.experts.experts.linear_fc2.weight"]
    assert tuple(fc2.global_shape) == (8, 64, 32)
    assert not [k for k in metadata if "local_experts" in k]

    stored, model = load_whole_model(str(tmp_path / "ours"))
    model.eval()
    tokens = batch()
    with torch.no_grad():
        delta = (our_logits(model, tokens, 100) - hf_model(tokens).logits).abs().max().item()
    print(f"\n[convert moe] our checkpoint vs transformers: max |logits delta| = {delta:.3e}")
    assert delta <= TOL


# The Hugging Face model of the pretrain test: tests/launch.py's TINY shape (2 layers, hidden 64, 4 heads in 2
# groups, sequence 32), layer 0 dense and layer 1 MoE; vocabulary 256 = TINY's NullTokenizer (200 + eod) padded
# to 128, so no padding row changes the softmax.
PRETRAIN_HF = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    mlp_only_layers=[0],
    norm_topk_prob=True,
    max_position_embeddings=32,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
# The same model as Megatron-LM flags (what a user gives pretrain_gpt.py; the run refuses a checkpoint whose
# stored shape differs: checkpoint/resume.py check_same_model).
QWEN3_MOE_FLAGS = [
    *("--swiglu", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6"),
    *("--disable-bias-linear", "--qk-layernorm", "--untie-embeddings-and-output-weights", "--kv-channels", "16"),
    *("--ffn-hidden-size", "128", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"),
    *("--moe-layer-freq", "[0,1]", "--moe-aux-loss-coeff", "0.01"),
]


def validation_loss(hf_model, valid) -> float:
    """transformers' lm loss on the run's final validation batch (samples 0-7, 4 micro-batches of 2, 2 a DP
    rank): the mean of per-micro-batch token means, as training/steps.py evaluate reduces it."""
    per_micro = []
    for first in range(0, 8, 2):
        samples = [valid[i] for i in range(first, first + 2)]
        tokens, labels, mask = (
            torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in ("tokens", "labels", "loss_mask")
        )
        logits = hf_model(tokens).logits.flatten(0, 1)
        ce = torch.nn.functional.cross_entropy(logits, labels.flatten(), reduction="none")
        per_micro.append(((ce * mask.flatten()).sum() / mask.sum()).item())
    return sum(per_micro) / len(per_micro)


@torch.no_grad()
def test_pretrain_at_ep2_loads_the_converted_checkpoint_and_saves_it_back(tmp_path):
    """HF -> ours -> pretrain_gpt.py --use-matrix-fsdp on 2 ranks at --expert-model-parallel-size 2 (2 experts
    a rank) with --finetune: the final validation loss (--lr 0, so the weights stay the converted ones) equals
    transformers' on the same validation samples; the run's EP 2 checkpoint -> HF gives the source files back
    bitwise. The control: the same model with EP rank 1's experts in rank 0's places misses that loss."""
    from megatron_mfsdp.training.arguments import parse_args
    from megatron_mfsdp.training.loop import prepare_data
    from tests.launch import TINY, pretrain_in_workers

    hf_model = tiny_qwen3_moe("dense0_norm_topk_untied", **PRETRAIN_HF)
    files = saved_tensors(hf_model, tmp_path / "hf")
    convert("--loader", "hf", "--saver", "mfsdp", "--load-dir", str(tmp_path / "hf"),
            "--save-dir", str(tmp_path / "ours"))  # fmt: skip

    run = ["--train-iters", "1", "--lr-warmup-iters", "0", "--lr", "0", "--eval-interval", "100", "--eval-iters", "1"]
    run += ["--ckpt-format", "torch_dist"]
    flags = [*TINY, *QWEN3_MOE_FLAGS, *run, "--use-matrix-fsdp"]
    io = ["--load", str(tmp_path / "ours"), "--finetune", "--save", str(tmp_path / "ep2"), "--save-interval", "1"]
    ranks = pretrain_in_workers(2, *flags, "--expert-model-parallel-size", "2", *io, tmp_path=tmp_path, rank=None)
    assert "EP=2 (2 experts per rank)" in ranks[0]["stdout"]
    logged = ranks[-1]["history"]["valid"][-1][1]

    _, (_, valid, _) = prepare_data(parse_args(flags, world_size=1))
    theirs = validation_loss(hf_model, valid)
    # the control: EP rank 1's experts (2, 3) in rank 0's places, as a wrong expert placement would load them
    experts = hf_model.model.layers[1].mlp.experts
    for weight in (experts.gate_up_proj, experts.down_proj):
        weight.copy_(weight[[2, 3, 0, 1]].clone())
    control = validation_loss(hf_model, valid)
    print(
        f"\n[convert moe] EP 2 run's validation loss {logged:.7f}, transformers' {theirs:.7f} "
        f"(delta {abs(logged - theirs):.1e}); experts placed on the wrong EP rank: {control:.7f}"
    )
    tolerance = 1e-5 * max(1.0, abs(theirs))
    assert abs(logged - theirs) <= tolerance
    assert abs(control - theirs) > 10 * tolerance  # measured 1.7e-3, 25 x the tolerance (a batch mean dilutes it)

    convert("--loader", "mfsdp", "--saver", "hf", "--load-dir", str(tmp_path / "ep2"),
            "--save-dir", str(tmp_path / "back"), "--hf-keep-vocab-padding")  # fmt: skip
    from safetensors.torch import load_file

    assert not unequal(load_file(tmp_path / "back" / "model.safetensors"), files)


def test_target_expert_parallel_size_must_divide_the_experts(tmp_path, capsys):
    tiny_qwen3_moe("dense0_norm_topk_untied").save_pretrained(tmp_path / "hf")
    flags = [
        "--loader",
        "hf",
        "--saver",
        "core",
        "--load-dir",
        str(tmp_path / "hf"),
        "--save-dir",
        str(tmp_path / "out"),
    ]
    assert CONVERT.main([*flags, "--target-expert-parallel-size", "3"]) == 2
    assert "--target-expert-parallel-size 3 does not divide num_experts=8" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
