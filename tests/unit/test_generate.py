"""Sampling rules of models/gpt/generate.py on hand-made logits (no model): top-k, top-p as
Megatron-LM's text generation controller cuts (the first token always stays; a token goes once
the probability before it passes p), temperature, greedy, reproducible seeds."""

import math

import pytest
import torch

from megatron_mfsdp.models.gpt.generate import choose, filter_logits

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
