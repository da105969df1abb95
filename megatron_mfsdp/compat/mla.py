"""A defect of megatron-core 0.16.1's multi-latent attention without Transformer Engine, repaired where the
model is built (models/gpt/build.py), a no-op where the defect is absent.

transformer/multi_latent_attention.py imports ``TELinear`` from megatron/core/extensions/transformer_engine.py
inside a ``try`` and sets ``HAVE_TE = True`` when the import succeeds; without Transformer Engine that module
still imports, with its TE classes replaced by megatron-core's null-import mocks (instances, not types), so
every MultiLatentAttention fails in its constructor at ``isinstance(self.linear_proj, TELinear)`` ("isinstance()
arg 2 must be a type"). That test only asks whether linear_proj is TE's linear (to save its original input for
FP8/FP4), which it cannot be where TELinear is not a class: :func:`repair_have_te` sets the module's
``HAVE_TE`` to False there.
"""

from __future__ import annotations


def repair_have_te() -> None:
    """``HAVE_TE = False`` in megatron-core's MLA module when its TELinear is not a class (idempotent)."""
    from megatron.core.transformer import multi_latent_attention as mla

    if mla.HAVE_TE and not isinstance(mla.TELinear, type):
        mla.HAVE_TE = False
