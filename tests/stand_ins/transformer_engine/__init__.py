"""A CPU stand-in for Transformer Engine, for tests only (tests/unit/test_te_max_logit.py puts this folder first
on a subprocess's path). It has just enough of TE's surface for megatron-core's extensions/transformer_engine.py
to import, and a DotProductAttention that computes causal softmax attention in torch and, as TE 2.9's
``return_max_logit`` does, returns each head's largest pre-softmax logit with it, so that megatron-core's own
TEDotProductAttention code (its running max, ``current_max_attn_logits``) runs around it on a CPU."""

__version__ = "2.9.0"

from . import pytorch  # noqa: E402,F401


def __getattr__(name):  # te.common.recipe.DelayedScaling and the like: placeholder classes
    return getattr(pytorch, name)
