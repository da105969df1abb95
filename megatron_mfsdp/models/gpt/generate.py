"""Autoregressive decoding with megatron-core's GPTModel: what tools/generate.py runs.

- :func:`generate`: batched prompts on megatron-core's KV cache (kv_cache.py), any TP size.
  Batching follows megatron-core's static-batch loop (text_generation_controllers/
  text_generation_controller.py: ``generate_all_output_tokens_static_batch`` at core_v0.16.1):
  prompts are right-padded, the shortest prompt's length is prefilled at once, and from there each
  step feeds one position of every row, the prompt's own token while a row is still inside its
  prompt (the model's pick is dropped), else the token it generated. Each row sees its own tokens
  at their own positions under the causal mask, so no padding mask is needed and each prompt
  decodes as it would alone.
- :func:`generate_rerun`: one prompt, re-running the whole sequence for every new token (no cache:
  the logits a training forward gives). The reference the KV-cache path is tested against.
- :func:`continuation_logprob`: an lm-evaluation-harness style score of a continuation.

Sampling follows Megatron-LM's text generation (text_generation_controller.py at core_v0.16.1):
temperature divides the logits, top-k keeps the k largest, top-p keeps the most probable tokens
until their probability passes p (the first token always stays). Each prompt draws from its own
generator (its seed), so what it samples does not depend on the other prompts of its batch.
"""

from __future__ import annotations

import torch

from ...compat.cpu import cuda_on_cpu
from .kv_cache import KVCacheDecoder


@torch.no_grad()
def next_token_logits(model, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[batch, vocab] logits of the token after ``tokens`` ([batch, seq]); padded rows cut off."""
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    with cuda_on_cpu():  # megatron-core's RoPE puts its frequencies on torch.cuda.current_device()
        logits = model(tokens, positions, None)
    return logits[:, -1, :vocab_size].float()


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 0.0) -> torch.Tensor:
    """Logits with the tokens outside top-k and top-p set to -inf (0 disables either)."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True, dim=-1)
        probs = ordered.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # the mass before this token already passes p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def choose(logits: torch.Tensor, greedy: bool, temperature: float, top_k: int, top_p: float, generator) -> torch.Tensor:
    """[batch] next tokens: the argmax, or a draw from the filtered, tempered distribution."""
    if greedy:
        return logits.argmax(-1)
    if temperature <= 0:
        raise ValueError(f"--temperature must be > 0, got {temperature}")
    probs = filter_logits(logits / temperature, top_k, top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_rerun(
    model,
    prompt: list[int],
    max_new_tokens: int,
    vocab_size: int,
    *,
    greedy: bool = True,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 0.0,
    seed: int = 1234,
    stop_ids: tuple[int, ...] = (),
) -> list[int]:
    """The new token ids after ``prompt`` (at most ``max_new_tokens``; stops after a ``stop_ids``
    token), each from a forward over the whole sequence so far (a whole, TP = 1 model)."""
    device = next(model.parameters()).device
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    new = []
    for _ in range(max_new_tokens):
        logits = next_token_logits(model, tokens, vocab_size)
        token = choose(logits, greedy, temperature, top_k, top_p, generator)
        new.append(int(token[0]))
        tokens = torch.cat([tokens, token[:, None]], dim=1)
        if new[-1] in stop_ids:
            break
    return new


class _Sampler:
    """The per-row choice of :func:`generate`: one argmax over the batch, or one draw per row
    from that row's own generator (what the row would draw decoding alone)."""

    def __init__(self, seeds, device, greedy, temperature, top_k, top_p):
        self.greedy, self.settings = greedy, (temperature, top_k, top_p)
        self.generators = [] if greedy else [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def __call__(self, logits: torch.Tensor, rows: list[int]) -> dict:
        if self.greedy:
            picks = logits.argmax(-1).tolist()
            return {i: picks[i] for i in rows}
        return {i: int(choose(logits[i : i + 1], False, *self.settings, self.generators[i])[0]) for i in rows}


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    vocab_size: int,
    *,
    greedy: bool = True,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 0.0,
    seeds: list[int] | None = None,
    stop_ids: tuple[int, ...] = (),
) -> list[list[int]]:
    """Per prompt, its new token ids (at most ``max_new_tokens``; a row stops after a ``stop_ids``
    token), all prompts decoded together on one KV cache; ``seeds[i]`` seeds prompt i's sampling
    (default 1234 + i). Collective over the tensor-parallel group when the model is TP-split."""
    if not prompts or not all(prompts):
        raise ValueError("give at least one prompt, each with at least one token")
    lengths = [len(p) for p in prompts]
    if max_new_tokens <= 0:
        return [[] for _ in prompts]
    device = next(model.parameters()).device
    total = max(lengths) + max_new_tokens
    tokens = torch.zeros(len(prompts), total, dtype=torch.long, device=device)
    for i, prompt in enumerate(prompts):
        tokens[i, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    pick = _Sampler(seeds or [1234 + i for i in range(len(prompts))], device, greedy, temperature, top_k, top_p)
    new, done = [[] for _ in prompts], [False] * len(prompts)
    decoder = KVCacheDecoder(model, len(prompts), total)
    logits = decoder.forward(tokens[:, : min(lengths)])[:, :vocab_size]
    for position in range(min(lengths), total):
        generating = [i for i in range(len(prompts)) if not done[i] and position >= lengths[i]]
        for i, token in pick(logits, generating).items():
            tokens[i, position] = token
            new[i].append(token)
            done[i] = len(new[i]) == max_new_tokens or token in stop_ids
        if all(done):
            break
        logits = decoder.forward(tokens[:, position : position + 1])[:, :vocab_size]
    return new


@torch.no_grad()
def continuation_logprob(model, context: list[int], continuation: list[int], vocab_size: int) -> tuple[float, bool]:
    """(sum of log p(continuation token | everything before it), whether each continuation token is
    the argmax): lm-evaluation-harness's ``loglikelihood`` on a causal LM (lm_eval/models/
    huggingface.py: ``_loglikelihood_tokens`` feeds context + continuation but the last token and
    takes a log-softmax over the model's vocabulary: here the ``vocab_size`` token rows, as the
    Hugging Face export keeps by default)."""
    if not context or not continuation:
        raise ValueError("context and continuation need at least one token each")
    device = next(model.parameters()).device
    tokens = torch.tensor([context + continuation[:-1]], dtype=torch.long, device=device)
    positions = torch.arange(tokens.shape[1], device=device)[None]
    with cuda_on_cpu():
        logits = model(tokens, positions, None)
    logprobs = logits[0, -len(continuation) :, :vocab_size].float().log_softmax(-1)
    target = torch.tensor(continuation, device=device)
    total = logprobs.gather(-1, target[:, None]).sum()
    return float(total), bool((logprobs.argmax(-1) == target).all())
