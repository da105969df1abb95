"""Driving MatrixFSDP chunks with megatron-core's own forward/backward schedules
(no pipelining, 1F1B, interleaved), on GPUs and, through cpu_compat, on CPUs.

The schedules call back into the model through the TransformerConfig:
``no_sync_func`` (accepted; ZeRO-3 reduces per micro-batch), ``grad_scale_func``
(fp16 loss scaling) and ``finalize_model_grads_func``, which here finishes the
owner reduction and sums the tied embedding's gradient between the first and
last pipeline stage, as megatron-core's DDP path does.
"""

from __future__ import annotations

from typing import Callable, Iterator, List, Optional

import torch
import torch.distributed as dist

from .cpu_compat import cuda_on_cpu
from .runtime import MatrixFSDP


def finalize_model_grads(model_chunks: List[MatrixFSDP], num_tokens: Optional[torch.Tensor] = None,
                         **unused) -> None:
    """Called by the schedule after the last backward of the step."""
    from megatron.core import parallel_state

    for chunk in model_chunks:
        chunk.finish_grad_sync()
    if parallel_state.get_pipeline_model_parallel_world_size() > 1 and parallel_state.is_rank_in_embedding_group():
        group = parallel_state.get_embedding_group()
        for chunk in model_chunks:
            for unit in chunk.units:
                # The tied unit's segments have the same bounds on both stages (one tail
                # parameter, the same DP size), so DP rank r sums with DP rank r.
                if unit.unit.name == "tied_embedding" and unit.grad_segment.numel():
                    dist.all_reduce(unit.grad_segment, group=group)


def configure_schedule(model_chunks: List[MatrixFSDP], optimizer=None) -> None:
    """Point the chunks' TransformerConfig at MatrixFSDP's hooks."""
    config = model_chunks[0].config
    no_sync = [chunk.no_sync for chunk in model_chunks]
    config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
    config.finalize_model_grads_func = finalize_model_grads
    if optimizer is not None and config.fp16:
        config.grad_scale_func = optimizer.scale_loss


def forward_backward(forward_step_func: Callable, data_iterator: Iterator, model_chunks: List[MatrixFSDP],
                     num_microbatches: int, seq_length: int, micro_batch_size: int,
                     forward_only: bool = False) -> list:
    """megatron-core's ``get_forward_backward_func()`` for the current parallel layout;
    returns the loss dicts of the last pipeline stage (empty elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    with cuda_on_cpu():
        return get_forward_backward_func()(
            forward_step_func=forward_step_func, data_iterator=data_iterator,
            model=model_chunks if len(model_chunks) > 1 else model_chunks[0],
            num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
            forward_only=forward_only)
