"""tools/checkpoint/convert.py with a DeepseekV3ForCausalLM (multi-latent attention, a dense first layer,
MoE layers with a shared expert, sigmoid routing with the expert bias), end to end, fp32, CPU (tiny random
models built in the test, nothing from the hub):

- HF -> ours (--ckpt-format torch_dist, stored at EP 2) -> HF is bitwise and transformers loads it; our
  GPTModel read back from the checkpoint gives transformers' logits within 1e-5;
- pretrain_gpt.py --use-matrix-fsdp loads the converted checkpoint at EP 2 on 2 ranks (--finetune, the model
  flags given as a user gives them): its validation loss (--lr 0, --moe-router-bias-update-rate 0) is
  transformers' on the same samples, and its EP 2 checkpoint converts back to the original Hugging Face files
  bitwise. The control: the expert bias zeroed on the HF side misses that loss.

``pytest -s`` shows the measured deltas.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_mfsdp.checkpoint.model_files import load_whole_model  # noqa: E402
from tests.e2e.test_convert import CONVERT, NOT_CARRIED  # noqa: E402
from tests.e2e.test_convert_moe import validation_loss  # noqa: E402
from tests.unit.test_hf import our_logits  # noqa: E402
from tests.unit.test_hf_deepseek_v3 import batch, tiny_deepseek_v3  # noqa: E402
from tests.unit.test_hf_moe import saved_tensors, unequal  # noqa: E402

TOL = 1e-5
pytestmark = pytest.mark.usefixtures("one_rank_process_group")


def convert(*flags) -> None:
    assert CONVERT.main(list(flags)) == 0


def test_hf_to_ours_to_hf_is_bitwise_and_our_checkpoint_gives_transformers_logits(tmp_path, capsys):
    hf_model = tiny_deepseek_v3("rope_q_lora_groups")
    files = saved_tensors(hf_model, tmp_path / "hf")
    convert("--loader", "hf", "--saver", "mfsdp", "--load-dir", str(tmp_path / "hf"),
            "--save-dir", str(tmp_path / "ours"), "--target-expert-parallel-size", "2")  # fmt: skip
    assert "(DeepseekV3ForCausalLM, " in capsys.readouterr().out
    convert("--loader", "mfsdp", "--saver", "hf", "--load-dir", str(tmp_path / "ours"),
            "--save-dir", str(tmp_path / "back"))  # fmt: skip
    from safetensors.torch import load_file

    assert not unequal(load_file(tmp_path / "back" / "model.safetensors"), files)
    skip = NOT_CARRIED | {"bos_token_id", "eos_token_id", "num_nextn_predict_layers"}
    theirs, ours = (
        {k: v for k, v in json.loads((tmp_path / d / "config.json").read_text()).items() if k not in skip}
        for d in ("hf", "back")
    )
    assert ours == theirs
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(loaded(batch()).logits, hf_model(batch()).logits)

    from megatron.core import dist_checkpointing

    args = dist_checkpointing.load_common_state_dict(str(tmp_path / "ours" / "iter_0000000"))["args"]
    assert args["multi_latent_attention"] and args["moe_router_enable_expert_bias"]
    assert args["expert_model_parallel_size"] == 2
    stored, model = load_whole_model(str(tmp_path / "ours"))
    model.eval()
    with torch.no_grad():
        delta = (our_logits(model, batch(), 100) - hf_model(batch()).logits).abs().max().item()
    print(f"\n[convert deepseek_v3] our checkpoint vs transformers: max |logits delta| = {delta:.3e}")
    assert delta <= TOL


def test_target_tensor_parallel_size_is_refused_for_mla(tmp_path, capsys):
    tiny_deepseek_v3("rope_q_lora_groups").save_pretrained(tmp_path / "hf")
    flags = ["--loader", "hf", "--saver", "core", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "o")]
    assert CONVERT.main([*flags, "--target-tensor-parallel-size", "2"]) == 2
    assert "multi-latent attention runs at TP 1 only" in capsys.readouterr().err


# tests/launch.py's TINY shape (2 layers, hidden 64, 4 heads, sequence 32): layer 0 dense, layer 1 MoE; the
# vocabulary 256 = TINY's NullTokenizer (200 + eod) padded to 128
PRETRAIN_HF = dict(
    vocab_size=256,
    intermediate_size=128,
    num_hidden_layers=2,
    n_routed_experts=4,
    n_group=1,
    topk_group=1,
    max_position_embeddings=32,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
DEEPSEEK_V3_FLAGS = [
    *("--swiglu", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6"),
    *("--disable-bias-linear", "--qk-layernorm", "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "128"),
    *("--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "8"),
    *("--qk-pos-emb-head-dim", "4", "--v-head-dim", "12", "--rope-type", "rope"),
    *("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "[0,1]"),
    *("--moe-shared-expert-intermediate-size", "32", "--moe-router-score-function", "sigmoid"),
    *("--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor", "2.5"),
    *("--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0"),
]
# megatron-core updates the expert bias after each step from the expert loads, whatever the learning rate:
# frozen here, so that the run's save converts back to the source bitwise
FROZEN_BIAS = ["--moe-router-bias-update-rate", "0"]


@torch.no_grad()
def test_pretrain_at_ep2_loads_the_converted_checkpoint_and_saves_it_back(tmp_path):
    from megatron_mfsdp.training.arguments import parse_args
    from megatron_mfsdp.training.loop import prepare_data
    from tests.launch import TINY, pretrain_in_workers, without_query_groups

    hf_model = tiny_deepseek_v3("rope_q_lora_groups", **PRETRAIN_HF)
    files = saved_tensors(hf_model, tmp_path / "hf")
    convert("--loader", "hf", "--saver", "mfsdp", "--load-dir", str(tmp_path / "hf"),
            "--save-dir", str(tmp_path / "ours"))  # fmt: skip

    run = ["--train-iters", "1", "--lr-warmup-iters", "0", "--lr", "0", "--eval-interval", "100", "--eval-iters", "1"]
    run += ["--ckpt-format", "torch_dist"]
    flags = [*without_query_groups(TINY), *DEEPSEEK_V3_FLAGS, *FROZEN_BIAS, *run, "--use-matrix-fsdp"]
    io = ["--load", str(tmp_path / "ours"), "--finetune", "--save", str(tmp_path / "ep2"), "--save-interval", "1"]
    ranks = pretrain_in_workers(2, *flags, "--expert-model-parallel-size", "2", *io, tmp_path=tmp_path, rank=None)
    logged = ranks[-1]["history"]["valid"][-1][1]

    _, (_, valid, _) = prepare_data(parse_args(flags, world_size=1))
    theirs = validation_loss(hf_model, valid)
    hf_model.model.layers[1].mlp.gate.e_score_correction_bias.zero_()  # the control: the expert bias lost
    control = validation_loss(hf_model, valid)
    print(
        f"\n[convert deepseek_v3] EP 2 run's validation loss {logged:.7f}, transformers' {theirs:.7f} "
        f"(delta {abs(logged - theirs):.1e}); expert bias zeroed: {control:.7f}"
    )
    tolerance = 1e-5 * max(1.0, abs(theirs))
    assert abs(logged - theirs) <= tolerance
    assert abs(control - theirs) > 10 * tolerance

    convert("--loader", "mfsdp", "--saver", "hf", "--load-dir", str(tmp_path / "ep2"),
            "--save-dir", str(tmp_path / "back"), "--hf-keep-vocab-padding")  # fmt: skip
    from safetensors.torch import load_file

    assert not unequal(load_file(tmp_path / "back" / "model.safetensors"), files)
