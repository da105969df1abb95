"""Two defects of megatron-core 0.16.1's multi-latent attention without Transformer Engine, repaired where
the model is built (models/gpt/build.py), each a no-op where its defect is absent.

transformer/multi_latent_attention.py imports ``TELinear`` from megatron/core/extensions/transformer_engine.py
inside a ``try`` and sets ``HAVE_TE = True`` when the import succeeds; without Transformer Engine that module
still imports, with its TE classes replaced by megatron-core's null-import mocks (instances, not types), so
every MultiLatentAttention fails in its constructor at ``isinstance(self.linear_proj, TELinear)`` ("isinstance()
arg 2 must be a type"). That test only asks whether linear_proj is TE's linear (to save its original input for
FP8/FP4), which it cannot be where TELinear is not a class: :func:`repair_have_te` sets the module's
``HAVE_TE`` to False there.

At TP above 1 the local spec's ``linear_kv_down_proj`` is a ColumnParallelLinear, and
``MLASelfAttention.get_query_key_value_tensors`` gathers its output with
``gather_from_tensor_model_parallel_region`` (backward: keep this rank's slice). The latent part's gradient
arrives whole on every rank (``linear_kv_up_proj`` all-reduces its input's gradient), but the shared rotary key
``k_pos_emb`` feeds every rank's own heads directly, so each rank's copy holds its own heads' gradient only,
and the slice kept is short of the other ranks' (TP 2 drifted 2e-3 from one process in 3 steps).
:func:`repair_rotary_key_gradient` hands megatron-core the whole latent from a forward hook instead, which
takes its other branch (the one Transformer Engine's duplicated down projection takes): without sequence
parallelism the rotary columns' gradient is summed over TP (:class:`SumGradOverTP`: megatron-core's
``copy_to_tensor_model_parallel_region`` would not do, as its ``_reduce`` all-reduces ``grad.contiguous()`` and
returns ``grad``, so a non-contiguous gradient, as the rotary columns' slice is, goes unreduced);
with it the latent is split over the sequence and megatron-core's own ``gather_from_sequence_parallel_region``
of ``k_pos_emb`` sums it (backward: reduce-scatter).
"""

from __future__ import annotations

import functools

import torch


def repair_have_te() -> None:
    """``HAVE_TE = False`` in megatron-core's MLA module when its TELinear is not a class (idempotent)."""
    from megatron.core.transformer import multi_latent_attention as mla

    if mla.HAVE_TE and not isinstance(mla.TELinear, type):
        mla.HAVE_TE = False


def repair_rotary_key_gradient(model) -> int:
    """Hook every MLA attention whose rotary key loses gradient (see the module docstring); returns how many."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    hooked = 0
    for module in model.modules():
        if not isinstance(module, MLASelfAttention) or module.tp_group is None or module.tp_group.size() == 1:
            continue
        if type(module.linear_kv_down_proj) is ColumnParallelLinear:
            module.linear_kv_down_proj.register_forward_hook(functools.partial(_whole_latent, module))
            hooked += 1
    return hooked


def _whole_latent(attention, proj, args, output):
    """linear_kv_down_proj's TP-sharded output as the whole latent and rotary key, as a duplicated linear's."""
    from megatron.core.tensor_parallel import mappings

    out, bias = output
    group, config = attention.tp_group, attention.config
    whole = mappings.gather_from_tensor_model_parallel_region(out, group=group)
    if config.sequence_parallel:
        return mappings.scatter_to_sequence_parallel_region(whole, group=group), bias
    latent, rotary = whole.split([config.kv_lora_rank, config.qk_pos_emb_head_dim], dim=-1)
    rotary = SumGradOverTP.apply(rotary, group)
    return torch.cat([latent, rotary], dim=-1), bias


class SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward: the gradient summed over the TP group (contiguous, so the sum lands)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None
