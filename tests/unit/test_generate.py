"""models/gpt/generate.py and tools/generate.py.

- Sampling rules on hand-made logits (no model): top-k, top-p as Megatron-LM's text generation
  controller cuts (the first token always stays; a token goes once the probability before it
  passes p), temperature, greedy, reproducible seeds.
- Decoding on megatron-core's KV cache (kv_cache.py) on tiny random models of two architectures:
  its logits equal a full forward's within LOGITS_TOL; greedy tokens equal the full re-run
  (``generate_rerun``, the decoding before the cache) for several prompts and lengths; prompts of
  different lengths batched together decode as each does alone, greedy, with a stop id, and sampled.
- Tensor parallelism: two gloo ranks load their TP shard of a checkpoint and decode as one process.

``pytest -s`` shows the measured logit differences.
"""

import contextlib
import importlib.util
import io
import math
import os

import pytest
import torch

from megatron_mfsdp.checkpoint.model_files import check_tensor_parallel, load_model_shard
from megatron_mfsdp.compat.cpu import cuda_on_cpu
from megatron_mfsdp.models.gpt.generate import choose, filter_logits, generate, generate_rerun
from megatron_mfsdp.models.gpt.kv_cache import KVCacheDecoder

PROBS = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
LOGITS = PROBS.log()


def kept(logits) -> list[int]:
    return [i for i, v in enumerate(logits[0].tolist()) if v != -math.inf]


def test_top_k_keeps_the_k_largest():
    assert kept(filter_logits(LOGITS, top_k=2)) == [1, 3]
    assert kept(filter_logits(LOGITS, top_k=10)) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "top_p,expected", [(0.4, [1]), (0.45, [1]), (0.7, [1, 3]), (0.85, [1, 2, 3]), (0.99, [0, 1, 2, 3])]
)
def test_top_p_keeps_tokens_until_their_mass_passes_p(top_p, expected):
    # sorted: 0.5, 0.3, 0.15, 0.05; mass before each: 0, 0.5, 0.8, 0.95
    assert kept(filter_logits(LOGITS, top_p=top_p)) == expected


def test_greedy_and_top_k_1_are_the_argmax():
    g = torch.Generator().manual_seed(0)
    assert choose(LOGITS, True, 1.0, 0, 0.0, g).tolist() == [1]
    assert all(choose(LOGITS, False, 1.0, 1, 0.0, g).tolist() == [1] for _ in range(20))


def test_sampling_follows_the_distribution_and_the_seed():
    def draws(seed, temperature=1.0):
        g = torch.Generator().manual_seed(seed)
        return torch.stack([choose(LOGITS, False, temperature, 0, 0.0, g) for _ in range(2000)]).flatten()

    counts = torch.bincount(draws(1), minlength=4).float() / 2000
    assert torch.allclose(counts, PROBS[0], atol=0.04), counts
    assert torch.equal(draws(5), draws(5)) and not torch.equal(draws(5), draws(6))
    cold = torch.bincount(draws(1, temperature=0.1), minlength=4).float() / 2000
    assert cold[1] > 0.99  # (0.5/0.3)^10 = 165: a low temperature sharpens to the argmax


def test_temperature_must_be_positive():
    with pytest.raises(ValueError, match="--temperature"):
        choose(LOGITS, False, 0.0, 0, 0.0, torch.Generator())


# ----------------------------------------------------------------------------------------
# Decoding on megatron-core's KV cache (models/gpt/kv_cache.py) against the full re-run
# ----------------------------------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 100  # token rows; the embedding has 128 (Megatron-LM's padding)
# pretrain_gpt.py's default architecture (learned positions, LayerNorm, GELU, biases, tied output)
GPT_ARGS = dict(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    max_position_embeddings=64,
    seq_length=64,
    vocab_size=VOCAB,
    padded_vocab_size=128,
    tokenizer_type="NullTokenizer",
)
# and a Llama-like one: GQA (2 heads per group), RoPE, RMSNorm, SwiGLU, no biases, untied output
LLAMA_ARGS = dict(
    GPT_ARGS,
    ffn_hidden_size=96,
    group_query_attention=True,
    num_query_groups=2,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)
ARCHS = {"gpt": GPT_ARGS, "llama": LLAMA_ARGS}
# max |logit difference| in fp32, KV cache vs full forward and TP2 vs TP1: the logits reach ~6.5 here;
# measured up to 8.2e-6 (cache) and 5.4e-6 (TP2), from GEMMs of other shapes and TP's split sums
LOGITS_TOL = 3e-5


def prompt_ids(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def random_model(args: dict, seed: int = 3):
    """The whole model of ``args`` with weights drawn at std 0.2 (norm weights around 1): logits far
    enough apart that greedy choices are not ties decided by rounding."""
    from megatron_mfsdp.checkpoint.model_files import whole_model

    model = whole_model(args)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=g) * 0.2
            param.copy_(noise + 1 if "norm" in name and name.endswith("weight") else noise)
    return model.eval()


pytestmark = pytest.mark.usefixtures("one_rank_process_group")


@pytest.fixture(scope="module", params=list(ARCHS))
def model(request):
    return random_model(ARCHS[request.param])


def cached_logits(model, tokens: torch.Tensor, prefill: int) -> torch.Tensor:
    """[batch, seq - prefill + 1, padded vocab]: the KV-cache logits after positions prefill - 1 ..
    seq - 1, from one prefill of ``prefill`` tokens, then one token per forward (teacher forced)."""
    decoder = KVCacheDecoder(model, tokens.shape[0], tokens.shape[1])
    steps = [decoder.forward(tokens[:, :prefill])]
    steps += [decoder.forward(tokens[:, p : p + 1]) for p in range(prefill, tokens.shape[1])]
    return torch.stack(steps, dim=1)


@torch.no_grad()
def full_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with cuda_on_cpu():
        return model(tokens, positions, None).float()


def test_cached_logits_equal_a_full_forward(model):
    """Prefill, then one position per forward on the cache: the logits of a forward over the whole
    sequence (a cache that attended wrongly, e.g. causally aligned top-left, is off by ~0.2)."""
    tokens = torch.tensor(prompt_ids([24, 24], seed=1))
    for prefill in (1, 9):
        delta = (cached_logits(model, tokens, prefill) - full_logits(model, tokens)[:, prefill - 1 :]).abs().max()
        print(f"\n[kv] prefill {prefill}: max |cached - full| = {delta:.2e}")
        assert delta < LOGITS_TOL


def test_decoding_linear_forward_is_bitwise_megatrons(model, monkeypatch):
    """kv_cache runs each linear layer's forward without megatron-core's autograd Functions (the same
    matmul and bias add; at TP 1 no identity copies or reductions): a full forward's logits are bitwise
    those of megatron-core's own path, and every linear layer went through the plain forward."""
    from megatron_mfsdp.models.gpt import kv_cache

    calls = []
    plain = kv_cache._matmul_forward
    monkeypatch.setattr(kv_cache, "_matmul_forward", lambda *a, **k: calls.append(1) or plain(*a, **k))
    tokens = torch.tensor(prompt_ids([11, 11], seed=3))
    linears = kv_cache.tensor_parallel_linears(model)
    before = [dict(layer.__dict__) for layer in linears]
    with torch.inference_mode(), kv_cache._plain_linear_forward(linears):
        ours = full_logits(model, tokens)
    assert len(calls) == len(linears) > 0
    assert [dict(layer.__dict__) for layer in linears] == before  # every switched attribute restored
    assert torch.equal(ours, full_logits(model, tokens))


@pytest.mark.parametrize("max_new", [1, 6, 30])
def test_greedy_kv_cache_equals_the_full_rerun(model, max_new):
    prompts = prompt_ids([1, 3, 8, 17], seed=max_new)
    reference = [generate_rerun(model, p, max_new, VOCAB) for p in prompts]
    assert [generate(model, [p], max_new, VOCAB)[0] for p in prompts] == reference
    assert all(len(r) == max_new for r in reference)


def test_batched_prompts_of_different_lengths_decode_as_alone(model):
    """Right-padded rows that start generating at different steps, one stopping early at a stop id."""
    prompts = prompt_ids([5, 1, 12, 3, 9], seed=4)
    alone = [generate(model, [p], 20, VOCAB)[0] for p in prompts]
    assert generate(model, prompts, 20, VOCAB) == alone
    stop = alone[2][3]  # row 2 stops after its 4th token (or earlier, if that id came before)
    stopped = [generate_rerun(model, p, 20, VOCAB, stop_ids=(stop,)) for p in prompts]
    assert generate(model, prompts, 20, VOCAB, stop_ids=(stop,)) == stopped
    assert len(stopped[2]) <= 4 and stopped[2][-1] == stop


def test_sampling_in_a_batch_draws_what_each_prompt_draws_alone(model):
    prompts = prompt_ids([4, 7, 2], seed=5)
    settings = dict(greedy=False, temperature=0.9, top_k=20, top_p=0.95)
    alone = [generate(model, [p], 12, VOCAB, seeds=[7 + i], **settings)[0] for i, p in enumerate(prompts)]
    assert generate(model, prompts, 12, VOCAB, seeds=[7, 8, 9], **settings) == alone
    assert [generate_rerun(model, p, 12, VOCAB, seed=7 + i, **settings) for i, p in enumerate(prompts)] == alone
    assert generate(model, prompts, 12, VOCAB, seeds=[1, 2, 3], **settings) != alone


def test_refusals_name_what_is_wrong(model):
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[1, 2], []], 4, VOCAB)
    decoder = KVCacheDecoder(model, 1, 8)
    decoder.forward(torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="one position at a time"):
        decoder.forward(torch.tensor([[3, 4]]))
    model.train()
    try:
        with pytest.raises(ValueError, match=r"model\.eval\(\)"):
            KVCacheDecoder(model, 1, 8)
    finally:
        model.eval()
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 3 does not divide the world size"):
        check_tensor_parallel(LLAMA_ARGS, 3, 2)
    with pytest.raises(ValueError, match=r"--tensor-model-parallel-size 4 does not divide num_query_groups \(2\)"):
        check_tensor_parallel(LLAMA_ARGS, 4, 4)


# ----------------------------------------------------------------------------------------
# Tensor parallelism: each rank loads its shard of a checkpoint, under gloo
# ----------------------------------------------------------------------------------------

TP_PROMPTS = ((3, 1, 4), (15, 9), (2, 6, 5, 3, 5, 8, 9), (7,))
SHARDED = ("embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_proj.weight")


def generate_tool():
    spec = importlib.util.spec_from_file_location("tools_generate", os.path.join(ROOT, "tools", "generate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tool_output(argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert generate_tool().main(list(argv)) == 0
    return out.getvalue()


def tool_argv(root, tp: int) -> list[str]:
    flags = ["--load", str(root), "--max-new-tokens", "10", "--greedy", "--ignore-eos", "--batch-size", "3"]
    return (
        flags
        + ["--tensor-model-parallel-size", str(tp)]
        + [a for p in TP_PROMPTS for a in ("--prompt-ids", " ".join(map(str, p)))]
    )


def shard_worker(rank, world_size, root, tokens):
    """At TP = 2 (this rank's shard only), then TP = 1 x DP = 2: the shard tensors, the greedy
    tokens, the KV-cache logits and what tools/generate.py prints."""
    results = {}
    for tp in (2, 1):
        _, model = load_model_shard(str(root), tp=tp)
        model.eval()
        state = model.state_dict()
        results[tp] = dict(
            shard={name: state[name].clone() for name in SHARDED},
            numel=sum(p.numel() for p in model.parameters()),
            greedy=generate(model, [list(p) for p in TP_PROMPTS], 10, VOCAB),
            logits=cached_logits(model, tokens, 5),
            printed=tool_output(tool_argv(root, tp)),
        )
    return results


def test_tensor_parallel_ranks_load_their_shard_and_decode_as_one_process(tmp_path):
    """A Llama-like checkpoint written whole; two gloo ranks load it at TP = 2 (each holds half of
    every split tensor) and at TP = 1 x DP = 2: greedy tokens and tools/generate.py's output equal
    one process's, logits within LOGITS_TOL."""
    from megatron_mfsdp.checkpoint.model_files import model_tensors, write_model_checkpoint
    from megatron_mfsdp.testing import run_workers

    whole = random_model(LLAMA_ARGS)
    write_model_checkpoint(str(tmp_path / "ckpt"), LLAMA_ARGS, model_tensors(whole))
    _, loaded = load_model_shard(str(tmp_path / "ckpt"))
    loaded.eval()
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), whole.parameters()))
    tokens = torch.tensor(prompt_ids([20, 20], seed=6))
    expected = dict(
        greedy=generate(loaded, [list(p) for p in TP_PROMPTS], 10, VOCAB),
        logits=cached_logits(loaded, tokens, 5),
        printed=tool_output(tool_argv(tmp_path / "ckpt", 1)),
    )
    assert expected["greedy"] == [generate_rerun(whole, list(p), 10, VOCAB) for p in TP_PROMPTS]
    ranks = run_workers(2, shard_worker, tmp_path / "ckpt", tokens)
    state = whole.state_dict()
    for rank, result in enumerate(ranks):
        tp2 = result[2]
        assert torch.equal(tp2["shard"][SHARDED[0]], state[SHARDED[0]].chunk(2, dim=0)[rank])
        assert torch.equal(tp2["shard"][SHARDED[1]], state[SHARDED[1]].chunk(2, dim=1)[rank])
        assert tp2["numel"] < 0.55 * sum(p.numel() for p in whole.parameters())
        for tp in (2, 1):
            delta = (result[tp]["logits"] - expected["logits"]).abs().max()
            print(f"\n[kv] rank {rank} TP={tp}: max |logits - one process| = {delta:.2e}")
            assert delta < LOGITS_TOL and result[tp]["greedy"] == expected["greedy"]
    assert ranks[0][2]["printed"] == ranks[0][1]["printed"] == expected["printed"]
    assert ranks[1][2]["printed"] == ranks[1][1]["printed"] == ""
