"""tools/checkpoint/convert.py and tools/generate.py end to end, on tiny random Hugging Face
models built in the test (nothing from the hub), fp32, CPU:

- HF -> ours (a --ckpt-format torch_dist checkpoint) -> HF is bitwise, tokenizer files included,
  and transformers' from_pretrained loads the result;
- our GPTModel read back from the converted checkpoint gives transformers' logits within 1e-5;
- greedy tools/generate.py tokens equal transformers' generate(do_sample=False);
- negative controls (a naive Q/K/V split, swapped SwiGLU halves) break the logits comparison;
- a checkpoint saved at TP=2 by dist_checkpointing reads back whole at 1 x 1 x 1;
- conversions that cannot be faithful are refused by name.

Weights are drawn with std 0.2 (tests/unit/test_hf.py explains why). ``pytest -s`` shows the deltas.
"""

import importlib.util
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_mfsdp.checkpoint.model_files import (  # noqa: E402
    load_whole_model,
    read_model_checkpoint,
    write_model_checkpoint,
)
from tests.unit.test_hf import (  # noqa: E402
    VARIANTS,
    batch,
    naive_qkv,
    our_logits,
    saved_tensors,
    swapped_gate_up,
    tiny_hf_model,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL, CONTROL_MIN = 1e-5, 1e-3
ARCHS = ["llama_gqa_tied", "llama_gqa_untied", "gpt2_gelu_new"]
NOT_CARRIED = {"_name_or_path", "transformers_version", "dtype", "torch_dtype"}


def tool(relative: str):
    """A tools/ script as a module (its main(argv) runs in this process)."""
    spec = importlib.util.spec_from_file_location(relative.replace("/", "_")[:-3], os.path.join(ROOT, relative))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CONVERT, GENERATE = tool("tools/checkpoint/convert.py"), tool("tools/generate.py")


pytestmark = pytest.mark.usefixtures("one_rank_process_group")


def word_tokenizer(vocab_size: int, folder):
    """A whitespace word-level tokenizer of ``vocab_size`` ids ("<s>" 0, "</s>" 1, "w2".."wN"), saved
    as transformers saves one: the files the converter must carry along."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(folder)
    return tokenizer


@pytest.fixture(scope="module", params=ARCHS)
def converted(request, tmp_path_factory):
    """(name, HF model, HF folder, our checkpoint, HF folder converted back). The Llama variants
    carry a tokenizer; the untied one is stored for TP=2 (its vocabulary padded for TP=2)."""
    name = request.param
    root = tmp_path_factory.mktemp(name)
    hf_model = tiny_hf_model(name)
    hf_model.save_pretrained(root / "hf")
    if name.startswith("llama"):
        word_tokenizer(VARIANTS[name]["vocab_size"], root / "hf")
    tp = "2" if name == "llama_gqa_untied" else "1"
    flags = ["--target-tensor-parallel-size", tp]
    assert (
        CONVERT.main(
            [
                "--loader",
                "hf",
                "--saver",
                "mfsdp",
                "--load-dir",
                str(root / "hf"),
                "--save-dir",
                str(root / "ours"),
                *flags,
            ]
        )
        == 0
    )
    assert (
        CONVERT.main(
            ["--loader", "mfsdp", "--saver", "hf", "--load-dir", str(root / "ours"), "--save-dir", str(root / "back")]
        )
        == 0
    )
    return name, hf_model, root


def test_hf_to_ours_to_hf_is_bitwise(converted):
    name, hf_model, root = converted
    from safetensors.torch import load_file

    back = load_file(root / "back" / "model.safetensors")
    expected = saved_tensors(hf_model)
    assert sorted(back) == sorted(expected)
    assert not [k for k in expected if not torch.equal(back[k], expected[k])]
    theirs = {k: v for k, v in json.loads((root / "hf" / "config.json").read_text()).items() if k not in NOT_CARRIED}
    ours = {k: v for k, v in json.loads((root / "back" / "config.json").read_text()).items() if k not in NOT_CARRIED}
    if name.startswith("gpt2"):  # no tokenizer in the source: its token ids have no carrier and stay unset
        assert ours.pop("bos_token_id") is None and ours.pop("eos_token_id") is None
        theirs = {k: v for k, v in theirs.items() if k not in ("bos_token_id", "eos_token_id")}
    assert ours == theirs
    if name.startswith("llama"):
        assert (root / "back" / "tokenizer.json").read_bytes() == (root / "hf" / "tokenizer.json").read_bytes()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(root / "back", attn_implementation="eager").eval()
    tokens = batch()
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, hf_model(tokens).logits)


def test_our_checkpoint_layout_and_args(converted):
    """Megatron-LM's layout, the model settings and tokenizer in the stored args, no optimizer state."""
    name, hf_model, root = converted
    from megatron.core import dist_checkpointing

    assert (root / "ours" / "latest_checkpointed_iteration.txt").read_text() == "0"
    common = dist_checkpointing.load_common_state_dict(str(root / "ours" / "iter_0000000"))
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 0
    args = common["args"]
    json.dumps(args)  # plain values only
    tp = 2 if name == "llama_gqa_untied" else 1
    assert args["tensor_model_parallel_size"] == tp and args["padded_vocab_size"] == 128 * tp
    assert args["num_layers"] == 2 and args["swiglu"] == name.startswith("llama")
    keys = set(dist_checkpointing.load_tensors_metadata(str(root / "ours" / "iter_0000000")))
    assert "decoder.layers.self_attention.linear_qkv.weight" in keys  # global: layers stacked
    assert not [k for k in keys if "optimizer" in k or "exp_avg" in k]
    if name.startswith("llama"):
        assert args["tokenizer_type"] == "HuggingFaceTokenizer"
        assert os.path.isfile(os.path.join(args["tokenizer_model"], "tokenizer.json"))


@torch.no_grad()
def test_our_logits_from_the_checkpoint_match_transformers(converted):
    name, hf_model, root = converted
    args, model = load_whole_model(str(root / "ours"))
    tokens = batch()
    delta = (our_logits(model.eval(), tokens, args["vocab_size"]) - hf_model(tokens).logits).abs().max().item()
    print(f"\n[convert] {name}: max |logits ours - transformers| = {delta:.3e} (fp32, from the converted checkpoint)")
    assert delta <= TOL


def generated_ids(stdout: str) -> list[list[int]]:
    return [
        [int(t) for t in line.split(":", 1)[1].split()]
        for line in stdout.splitlines()
        if line.startswith("generated ids:")
    ]


@torch.no_grad()
def test_greedy_generate_matches_transformers(converted, capsys):
    name, hf_model, root = converted
    prompts = batch()[:, :6]
    steps = 10
    hf_model.generation_config.eos_token_id = None  # decode every step on both sides
    theirs = hf_model.generate(prompts, max_new_tokens=steps, do_sample=False, pad_token_id=0)[:, 6:]
    flags = [f for p in prompts for f in ("--prompt-ids", " ".join(map(str, p.tolist())))]
    assert (
        GENERATE.main(
            ["--load", str(root / "ours"), *flags, "--max-new-tokens", str(steps), "--greedy", "--ignore-eos"]
        )
        == 0
    )
    ours = generated_ids(capsys.readouterr().out)
    agree = sum(a == b for o, t in zip(ours, theirs.tolist()) for a, b in zip(o, t))
    print(f"\n[convert] {name}: greedy tokens agreeing with transformers' generate: {agree}/{theirs.numel()}")
    assert ours == theirs.tolist()


@torch.no_grad()
def test_text_prompt_uses_the_checkpoints_tokenizer(converted, capsys):
    name, hf_model, root = converted
    if not name.startswith("llama"):
        pytest.skip("only the Llama sources carry a tokenizer")
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "hf")
    text = "w5 w17 w42 w8"
    prompt = torch.tensor([tokenizer(text).input_ids])
    hf_model.generation_config.eos_token_id = None
    theirs = hf_model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, prompt.shape[1] :]
    assert (
        GENERATE.main(
            ["--load", str(root / "ours"), "--prompt", text, "--max-new-tokens", "6", "--greedy", "--ignore-eos"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert generated_ids(out) == [theirs.tolist()]
    assert f"generated text: {tokenizer.decode(theirs)}" in out


# ----------------------------------------------------------------------------------------
# Negative controls: a wrong mapping in the checkpoint breaks the logits comparison
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("control", ["naive_qkv_split", "swapped_gate_up"])
@torch.no_grad()
def test_negative_control_breaks_logits(control, converted):
    name, hf_model, root = converted
    if name != "llama_gqa_untied":
        pytest.skip("the controls run on the GQA Llama with 4 query heads per group")
    args, model = load_whole_model(str(root / "ours"))
    tensors = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    wrong = (naive_qkv if control == "naive_qkv_split" else swapped_gate_up)(tensors, args)
    model.load_state_dict(wrong, strict=False)
    tokens = batch()
    delta = (our_logits(model.eval(), tokens, args["vocab_size"]) - hf_model(tokens).logits).abs().max().item()
    print(f"\n[convert] negative control {control}: max |logits ours - transformers| = {delta:.3e}")
    assert delta > CONTROL_MIN


# ----------------------------------------------------------------------------------------
# A checkpoint saved by another layout reads back whole
# ----------------------------------------------------------------------------------------

LLAMA_ARGS = dict(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    group_query_attention=True,
    num_query_groups=2,
    max_position_embeddings=64,
    seq_length=64,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    vocab_size=100,
    padded_vocab_size=128,
    tokenizer_type="NullTokenizer",
    init_method_std=0.2,
)
SEED = 11


def save_at_layout(rank, world_size, folder, tp, pp):
    """Save LLAMA_ARGS's model, weights seeded by global name, from a TP x PP layout (as training does)."""
    from megatron.core import dist_checkpointing, parallel_state

    from megatron_mfsdp.compat.cpu import cuda_on_cpu
    from megatron_mfsdp.models.gpt import build_gpt_model, initialize_by_global_name
    from megatron_mfsdp.models.gpt.config import transformer_config
    from megatron_mfsdp.models.gpt.hf import MEGATRON_DEFAULTS
    from megatron_mfsdp.testing import init_megatron

    init_megatron(tp, pp)
    args = {**MEGATRON_DEFAULTS, **LLAMA_ARGS, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp}
    config = transformer_config({**args, "use_cpu_initialization": True})
    model = build_gpt_model(
        config,
        vocab_size=128,
        max_sequence_length=64,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        use_transformer_engine=False,
    )
    initialize_by_global_name(model, config, SEED, parallel_state.get_tensor_model_parallel_rank(), tp)
    state = {"model": model.sharded_state_dict(prefix=""), "args": args, "checkpoint_version": 3.0, "iteration": 3}
    os.makedirs(os.path.join(folder, "iter_0000003"), exist_ok=True)
    with cuda_on_cpu():
        dist_checkpointing.save(state, os.path.join(folder, "iter_0000003"))
    if rank == 0:
        with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("3")


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_checkpoint_saved_at_another_layout_reads_whole(tp, pp, tmp_path):
    """Q/K/V per query group and SwiGLU's [gate; up] split over TP, layers over PP: read back at
    1 x 1 x 1 they equal the whole model's weights (seeded by global name), bitwise."""
    from megatron_mfsdp.checkpoint.model_files import model_tensors, whole_model
    from megatron_mfsdp.models.gpt import initialize_by_global_name
    from megatron_mfsdp.testing import run_workers

    run_workers(2, save_at_layout, str(tmp_path), tp, pp)
    args, tensors = read_model_checkpoint(str(tmp_path))
    assert args["tensor_model_parallel_size"] == tp
    expected = whole_model(LLAMA_ARGS)
    initialize_by_global_name(expected, expected.config, SEED)
    expected = model_tensors(expected)
    assert sorted(tensors) == sorted(expected)
    assert not [k for k in expected if not torch.equal(tensors[k], expected[k])]


def test_write_then_read_is_bitwise(tmp_path):
    from megatron_mfsdp.checkpoint.model_files import model_tensors, whole_model

    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(v.shape, generator=g) for k, v in model_tensors(whole_model(LLAMA_ARGS)).items()}
    write_model_checkpoint(str(tmp_path), LLAMA_ARGS, tensors, iteration=5)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "5"
    args, back = read_model_checkpoint(str(tmp_path))
    assert args == LLAMA_ARGS and sorted(back) == sorted(tensors)
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


# ----------------------------------------------------------------------------------------
# Refusals name what cannot be converted
# ----------------------------------------------------------------------------------------


def test_refusals_name_the_setting(tmp_path, capsys):
    from megatron_mfsdp.checkpoint.model_files import model_tensors, whole_model

    gelu = tiny_hf_model("llama_gqa_tied")
    gelu.config.hidden_act = "gelu"
    gelu.save_pretrained(tmp_path / "gelu")
    assert (
        CONVERT.main(
            [
                "--loader",
                "hf",
                "--saver",
                "mfsdp",
                "--load-dir",
                str(tmp_path / "gelu"),
                "--save-dir",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )
    assert "hidden_act='gelu' cannot be converted" in capsys.readouterr().err

    qk = dict(LLAMA_ARGS, qk_layernorm=True)
    write_model_checkpoint(str(tmp_path / "qk"), qk, {k: v.clone() for k, v in model_tensors(whole_model(qk)).items()})
    assert (
        CONVERT.main(
            [
                "--loader",
                "mfsdp",
                "--saver",
                "hf",
                "--load-dir",
                str(tmp_path / "qk"),
                "--save-dir",
                str(tmp_path / "y"),
            ]
        )
        == 2
    )
    assert "qk_layernorm=True cannot be converted" in capsys.readouterr().err

    flags = [
        "--loader",
        "mfsdp",
        "--saver",
        "mfsdp",
        "--load-dir",
        str(tmp_path / "qk"),
        "--save-dir",
        str(tmp_path / "z"),
    ]
    assert CONVERT.main([*flags, "--target-tensor-parallel-size", "3"]) == 2
    assert "--target-tensor-parallel-size 3 does not divide num_attention_heads=4" in capsys.readouterr().err
    assert (
        CONVERT.main(
            [
                "--loader",
                "mfsdp",
                "--saver",
                "hf",
                "--load-dir",
                str(tmp_path / "none"),
                "--save-dir",
                str(tmp_path / "w"),
            ]
        )
        == 2
    )
    assert "latest_checkpointed_iteration.txt: no such file" in capsys.readouterr().err


def generate_on_ranks(rank, world_size, argv):
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        GENERATE.main(list(argv))
    return out.getvalue()


def test_generate_on_two_data_parallel_ranks_prints_what_one_process_does(converted, capsys):
    """torchrun's DP ranks each read the whole model and decode their share of the prompts."""
    from megatron_mfsdp.testing import run_workers

    name, hf_model, root = converted
    if name != "gpt2_gelu_new":
        pytest.skip("one architecture is enough for the rank split")
    flags = ["--load", str(root / "ours"), "--max-new-tokens", "5", "--temperature", "0.9", "--top-k", "20"]
    flags += ["--top-p", "0.9", "--seed", "3", *[f for p in ("1 2 3", "4 5", "6 7 8 9") for f in ("--prompt-ids", p)]]
    assert GENERATE.main(flags) == 0
    alone = capsys.readouterr().out
    outputs = run_workers(2, generate_on_ranks, flags)
    assert len(generated_ids(alone)) == 3 and outputs[0] == alone and outputs[1] == ""


# ----------------------------------------------------------------------------------------
# Ours -> HF after real training with pretrain_gpt.py
# ----------------------------------------------------------------------------------------

VALID_LINE = r"validation loss at iteration 4 on validation set \| lm loss value: ([\d.E+-]+) \|"


@torch.no_grad()
def test_trained_checkpoint_converts_and_transformers_loss_equals_our_validation_loss(tmp_path):
    """Train 4 iterations (a tiny Llama on mock data), save --ckpt-format torch_dist, convert to HF
    and compute transformers' lm loss on the final validation batch (samples 0-7 of the validation
    split, 4 micro-batches of 2, mean of per-micro-batch token means, as steps.evaluate). With
    --hf-keep-vocab-padding it equals the logged loss (the print's precision); the default
    conversion drops the padding rows from the softmax, so its loss is lower (printed)."""
    import re

    from megatron_mfsdp.training.arguments import parse_args
    from megatron_mfsdp.training.loop import prepare_data
    from tests.launch import TINY, pretrain_in_workers

    llama = ["--swiglu", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--disable-bias-linear"]
    run = ["--train-iters", "4", "--eval-interval", "100", "--eval-iters", "1", "--ckpt-format", "torch_dist"]
    flags = [*TINY, *llama, *run, "--use-matrix-fsdp", "--save", str(tmp_path / "ckpt"), "--save-interval", "4"]
    stdout = pretrain_in_workers(1, *flags, tmp_path=tmp_path)["stdout"]
    logged = float(re.search(VALID_LINE, stdout).group(1))
    _, (_, valid, _) = prepare_data(parse_args(flags, world_size=1))
    losses = {}
    for keep in (True, False):
        out = tmp_path / f"hf_{keep}"
        extra = ["--hf-keep-vocab-padding"] if keep else []
        assert (
            CONVERT.main(
                [
                    "--loader",
                    "mfsdp",
                    "--saver",
                    "hf",
                    "--load-dir",
                    str(tmp_path / "ckpt"),
                    "--save-dir",
                    str(out),
                    *extra,
                ]
            )
            == 0
        )
        model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        per_micro = []
        for first in range(0, 8, 2):
            samples = [valid[i] for i in range(first, first + 2)]
            tokens, labels, mask = (
                torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in ("tokens", "labels", "loss_mask")
            )
            logits = model(tokens).logits.float()
            ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
            per_micro.append(((ce * mask.flatten()).sum() / mask.sum()).item())
        losses[keep] = sum(per_micro) / len(per_micro)
    print(
        f"\n[convert] trained: logged validation loss {logged:.6f}, transformers {losses[True]:.6f} (padding kept), "
        f"{losses[False]:.6f} (padding dropped)"
    )
    assert abs(losses[True] - logged) <= 2e-5 * max(1.0, abs(logged))
    assert losses[False] < losses[True]


# ----------------------------------------------------------------------------------------
# Megatron-LM's loader and saver names (tools/checkpoint/ at HEAD and core_v0.16.1)
# ----------------------------------------------------------------------------------------


def test_megatron_loader_and_saver_names_are_our_formats(tmp_path, capsys):
    """Megatron-LM's llama_mistral loader (--checkpoint-type hf) -> core saver -> mcore loader -> hf saver
    is the hf -> mfsdp -> hf round trip, bitwise, and each output line names the format behind the name."""
    from safetensors.torch import load_file

    hf_model = tiny_hf_model("llama_gqa_tied")
    hf_model.save_pretrained(tmp_path / "hf")
    word_tokenizer(VARIANTS["llama_gqa_tied"]["vocab_size"], tmp_path / "tok")
    megatron = ["--model-type", "GPT", "--checkpoint-type", "hf", "--model-size", "llama3", "--max-queue-size", "50"]
    first = ["--loader", "llama_mistral", "--saver", "core", "--load-dir", str(tmp_path / "hf")]
    first += ["--save-dir", str(tmp_path / "core"), "--tokenizer-model", str(tmp_path / "tok")]
    assert CONVERT.main([*megatron, *first]) == 0
    out = capsys.readouterr().out
    assert "note: --model-size llama3: the model is read from config.json" in out
    assert "note: --max-queue-size: not needed here" in out
    assert (
        "converted llama_mistral [a Hugging Face LlamaForCausalLM, GPT2LMHeadModel, Qwen3MoeForCausalLM or "
        "DeepseekV3ForCausalLM folder (" in out
    )
    assert "-> core [--ckpt-format torch_dist (Megatron-LM's layout" in out
    args, _ = read_model_checkpoint(str(tmp_path / "core"))
    assert args["tokenizer_type"] == "HuggingFaceTokenizer"  # the --tokenizer-model folder's files, carried along
    assert os.path.isfile(os.path.join(args["tokenizer_model"], "tokenizer.json"))
    back = ["--loader", "mcore", "--saver", "hf", "--load-dir", str(tmp_path / "core"), "--save-dir"]
    assert CONVERT.main([*back, str(tmp_path / "back")]) == 0
    assert "converted mcore [--ckpt-format torch_dist" in capsys.readouterr().out
    expected, got = saved_tensors(hf_model), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k]) for k in expected)


def test_megatron_bf16_flag_loads_the_weights_in_bf16(tmp_path, capsys):
    hf_model = tiny_hf_model("llama_gqa_tied")
    hf_model.save_pretrained(tmp_path / "hf")
    flags = ["--loader", "hf", "--saver", "core", "--load-dir", str(tmp_path / "hf"), "--save-dir"]
    assert CONVERT.main([*flags, str(tmp_path / "core"), "--bf16"]) == 0
    args, tensors = read_model_checkpoint(str(tmp_path / "core"))
    assert args["bf16"] and not args["fp16"]
    weight = tensors["embedding.word_embeddings.weight"]
    assert weight.dtype == torch.bfloat16
    source = saved_tensors(hf_model)["model.embed_tokens.weight"]
    assert torch.equal(weight[: source.shape[0]], source.to(torch.bfloat16))


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--loader", "legacy", "--saver", "core"], "--loader legacy: Megatron-LM's legacy checkpoints"),
        (["--loader", "megatron", "--saver", "core"], "(megatron is core_v0.16.1's old name of legacy)"),
        (["--loader", "core", "--saver", "legacy"], "--saver legacy: Megatron-LM's legacy checkpoints (per-rank"),
        (
            ["--loader", "llama_mistral", "--checkpoint-type", "meta", "--saver", "core"],
            "--checkpoint-type meta: Meta's original checkpoint files are not read",
        ),
    ],
)
def test_megatron_names_we_cannot_honour_are_refused_with_the_reason(flags, message, tmp_path, capsys):
    assert CONVERT.main([*flags, "--load-dir", str(tmp_path / "in"), "--save-dir", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_target_expert_parallel_size_needs_experts(tmp_path, capsys):
    """--target-expert-parallel-size sets the stored EP of an MoE model (tests/e2e/test_convert_moe.py); a
    dense model has no experts to split."""
    tiny_hf_model("llama_gqa_tied").save_pretrained(tmp_path / "hf")
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
    assert CONVERT.main([*flags, "--target-expert-parallel-size", "2"]) == 2
    assert "--target-expert-parallel-size 2: the model has no experts" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_convert_help_says_what_each_name_reads_and_writes(capsys):
    with pytest.raises(SystemExit):
        CONVERT.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for phrase in (
        "mfsdp, core and mcore read torch_dist",
        "hf and llama_mistral a Hugging Face folder",
        "legacy and megatron are refused",
        "mfsdp, core and mcore write torch_dist",
    ):
        assert phrase in text, phrase
