"""Autoregressive decoding with a whole (1 x 1 x 1) GPTModel: what tools/generate.py runs.

Each step re-runs the model on the whole sequence (no KV cache: short and exact, the same
logits a training forward gives). Sampling follows Megatron-LM's text generation
(megatron/core/inference/text_generation_controllers/text_generation_controller.py at
core_v0.16.1): temperature divides the logits, top-k keeps the k largest, top-p keeps the most
probable tokens until their probability passes p (the first token always stays).
"""

from __future__ import annotations

import torch

from ...compat.cpu import cuda_on_cpu


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
def generate(
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
    """The new token ids after ``prompt`` (at most ``max_new_tokens``; stops after a ``stop_ids`` token)."""
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
