"""The lm-evaluation-harness route (README, "Evaluating with lm-evaluation-harness"): export a
checkpoint to Hugging Face with tools/checkpoint/convert.py, then lm-eval's ``hf`` model scores
the folder. lm-eval itself is not needed (no network at test time): its causal-LM scoring is
re-stated here on the exported folder (``hf_loglikelihood``), and what transformers computes must
equal our own model's ``continuation_logprob`` on the checkpoint.

A tiny random checkpoint of pretrain_gpt.py's default architecture (GPT-2 style: learned
positions, LayerNorm, GELU, biases, tied output; fp32) with a Hugging Face word-level tokenizer,
saved as training saves (torch_dist, the tokenizer named by the stored --tokenizer-* flags).
"""

import importlib.util
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_mfsdp.checkpoint.model_files import (  # noqa: E402
    load_model_shard,
    model_tensors,
    whole_model,
    write_model_checkpoint,
)
from megatron_mfsdp.models.gpt.generate import continuation_logprob  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 100  # tokenizer ids; the embedding has 128 rows (Megatron-LM's padding), the export keeps 100
# |sum of continuation log-probs, transformers - ours| in fp32 (measured ~1e-6 on 1 to 6 tokens)
TOL = 1e-4
REQUESTS = [  # (context, continuation) as a task hands them to lm-eval: the continuation starts with a space
    ("w5 w17 w3", " w42"),
    ("w9", " w11 w12 w13 w14 w15 w16"),
    ("w60 w61 w62 w63 w64 w65 w66 w67 w68 w69", " w2 w99"),
]
ARGS = dict(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=256,
    num_attention_heads=4,
    max_position_embeddings=64,
    seq_length=64,
    vocab_size=VOCAB,
    padded_vocab_size=128,
    tokenizer_type="HuggingFaceTokenizer",
)


def tool(relative: str):
    spec = importlib.util.spec_from_file_location(relative.replace("/", "_")[:-3], os.path.join(ROOT, relative))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pytestmark = pytest.mark.usefixtures("one_rank_process_group")


def save_word_tokenizer(folder) -> None:
    """A whitespace word-level tokenizer ("<s>" 0, "</s>" 1, "w2".."w99"), saved as transformers does."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(our checkpoint folder, the Hugging Face folder convert.py exported from it)."""
    root = tmp_path_factory.mktemp("lm_eval")
    save_word_tokenizer(root / "tokenizer")
    args = dict(ARGS, tokenizer_model=str(root / "tokenizer"))
    model = whole_model(args)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=g) * 0.2
            param.copy_(noise + 1 if "layer_norm_weight" in name or name.endswith("norm.weight") else noise)
    write_model_checkpoint(str(root / "ckpt"), args, model_tensors(model))
    argv = ["--loader", "mfsdp", "--saver", "hf", "--load-dir", str(root / "ckpt"), "--save-dir", str(root / "hf")]
    assert tool("tools/checkpoint/convert.py").main(argv) == 0
    return root / "ckpt", root / "hf"


@torch.no_grad()
def hf_loglikelihood(model, tokenizer, context: str, continuation: str):
    """lm-eval's HFLM.loglikelihood of one request on a causal LM (lm_eval/models/huggingface.py:
    ``_encode_pair`` encodes context + continuation whole and splits it at the context's length,
    without special tokens; ``_loglikelihood_tokens`` feeds all but the last token, log-softmaxes over
    the model's vocabulary and sums the continuation's entries). Returns (sum, is_greedy, ids)."""
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    continuation_ids = whole[len(context_ids) :]
    inputs = torch.tensor([(context_ids + continuation_ids)[:-1]])
    logprobs = model(inputs).logits[0, -len(continuation_ids) :].float().log_softmax(-1)
    target = torch.tensor(continuation_ids)
    greedy = bool((logprobs.argmax(-1) == target).all())
    return float(logprobs.gather(-1, target[:, None]).sum()), greedy, (context_ids, continuation_ids)


def test_exported_folder_scores_as_our_model(exported):
    """AutoModelForCausalLM + AutoTokenizer load the export; each request's log-likelihood and
    is-greedy flag equal ours on the checkpoint within TOL. Over the 128 padded rows instead of the
    tokenizer's 100 (what the export drops), ours moves by far more than TOL: the cut is what matches."""
    ckpt, folder = exported
    assert (folder / "tokenizer.json").is_file() and (folder / "model.safetensors").is_file()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert hf_model.config.vocab_size == VOCAB and type(hf_model).__name__ == "GPT2LMHeadModel"
    args, ours = load_model_shard(str(ckpt))
    ours.eval()
    for context, continuation in REQUESTS:
        theirs, greedy, (context_ids, continuation_ids) = hf_loglikelihood(hf_model, tokenizer, context, continuation)
        assert len(continuation_ids) == len(continuation.split())
        mine, my_greedy = continuation_logprob(ours, context_ids, continuation_ids, args["vocab_size"])
        padded, _ = continuation_logprob(ours, context_ids, continuation_ids, args["padded_vocab_size"])
        print(f"\n[lm-eval] {continuation!r}: transformers {theirs:.6f}, ours {mine:.6f}, diff {theirs - mine:.1e}")
        assert abs(theirs - mine) < TOL and greedy == my_greedy
        assert abs(padded - mine) > 100 * TOL
