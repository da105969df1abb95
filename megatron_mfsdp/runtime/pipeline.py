"""Driving MatrixFSDP chunks with megatron-core's own forward/backward schedules
(no pipelining, 1F1B, interleaved), on GPUs and, through compat/cpu.py, on CPUs.

The schedules call back into the model through the TransformerConfig:
``no_sync_func`` (accepted; ZeRO-3 reduces per micro-batch), ``grad_scale_func``
(fp16 loss scaling) and ``finalize_model_grads_func``, which here finishes the
owner reduction, sums the tied embedding's gradient between the first and
last pipeline stage and updates the MoE routers' expert bias, as megatron-core's
DDP path does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from ..compat.cpu import cuda_on_cpu
from .comm import all_reduce_flat
from .wrapper import MatrixFSDP


def finalize_model_grads(model_chunks: list[MatrixFSDP], num_tokens: torch.Tensor | None = None, **unused) -> None:
    """Called by the schedule after the last backward of the step. With a per-token loss the
    schedule passes this rank's token count (last stage only): as megatron's finalize_model_grads,
    broadcast it over the pipeline, sum it over DP, and divide the gradients by it."""
    for chunk in model_chunks:
        chunk.finish_grad_sync()
    embedding_group = model_chunks[0].groups.embedding
    if embedding_group is not None:
        for chunk in model_chunks:
            for unit in chunk.units:
                # A unit shared by two stages (the tied embedding) has the same segment bounds
                # on both (one tail parameter, the same DP size): DP rank r sums with DP rank r.
                if unit.unit.shared_across_stages and unit.grad_segment.numel():
                    all_reduce_flat([unit.grad_segment], embedding_group)
    _finish_routers(model_chunks)
    if num_tokens is not None:
        _divide_by_tokens(model_chunks, num_tokens)


def _finish_routers(model_chunks: list[MatrixFSDP]) -> None:
    """What megatron-core's finalize_model_grads does for MoE routers after the gradient reduction:
    the aux-loss-free expert bias stepped from the global batch's token counts (all-reduced over
    TP x DP), then the counts and the global aux loss's tracker reset. Every rank holds the bias (a
    buffer) and updates it alike."""
    config = model_chunks[0].config
    if not config.num_moe_experts:
        return
    from megatron.core.distributed.finalize_model_grads import (
        _update_router_expert_bias,
        reset_model_temporary_tensors,
    )

    if config.moe_router_enable_expert_bias:
        _update_router_expert_bias(model_chunks, config)
    reset_model_temporary_tensors(config, model_chunks)


def _divide_by_tokens(model_chunks: list[MatrixFSDP], num_tokens: torch.Tensor) -> None:
    import torch.distributed as dist

    groups = model_chunks[0].groups
    if groups.pp_size > 1:
        dist.broadcast(num_tokens, src=dist.get_process_group_ranks(groups.pp)[-1], group=groups.pp)
    dist.all_reduce(num_tokens, group=groups.dp)
    if num_tokens.item() > 0:
        for chunk in model_chunks:
            chunk.scale_gradients(1.0 / num_tokens.item())


def configure_schedule(model_chunks: list[MatrixFSDP], optimizer=None) -> None:
    """Point the chunks' TransformerConfig at MatrixFSDP's hooks."""
    config = model_chunks[0].config
    no_sync = [chunk.no_sync for chunk in model_chunks]
    config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
    config.finalize_model_grads_func = finalize_model_grads
    if optimizer is not None and config.fp16:
        config.grad_scale_func = optimizer.scale_loss


def forward_backward(
    forward_step_func: Callable,
    data_iterator: Iterator,
    model_chunks: list[MatrixFSDP],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
) -> list:
    """megatron-core's ``get_forward_backward_func()`` for the current parallel layout;
    returns the loss dicts of the last pipeline stage (empty elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    with cuda_on_cpu():
        return get_forward_backward_func()(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=model_chunks if len(model_chunks) > 1 else model_chunks[0],
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )
