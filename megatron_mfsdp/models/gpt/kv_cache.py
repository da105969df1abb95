"""Incremental decoding on megatron-core's own KV cache, with the GPTModel that training builds.

A ``StaticInferenceContext`` passed to ``GPTModel.forward`` holds, per attention layer, key and
value buffers of [max length, batch, query groups of this TP rank, head dim]; each forward writes
the keys and values of the tokens it is given at the context's ``sequence_len_offset`` and attends
over everything stored so far, and only the last position goes through the output layer
(megatron/core/inference/contexts/static_context.py, transformer/attention.py:
``_adjust_key_value_for_inference`` and models/gpt/gpt_model.py at core_v0.16.1). The caller
advances the offset, as megatron-core's inference wrapper does
(model_inference_wrappers/abstract_model_inference_wrapper.py: ``forward_pass_without_pipeline_parallel``).

Past the first forward, megatron-core's attention turns the causal mask off (one new query may see
every stored key), so a later forward must feed one position at a time; :class:`KVCacheDecoder`
refuses more.
"""

from __future__ import annotations

import contextlib

import torch

from ...compat.cpu import cuda_on_cpu
from ...groups import group_size


class KVCacheDecoder:
    """One batch's KV cache on a GPTModel in eval mode (any TP size, PP 1): :meth:`forward` feeds
    the next positions of every row and returns the logits after the last one.

    On a CPU the first forward runs under compat/cpu.py's ``cuda_on_cpu``: megatron-core allocates
    the KV buffers and the RoPE table (cached per length) on ``torch.cuda.current_device()``. Later
    forwards need it only at TP > 1, where the logits all-gather allocates there; at TP = 1 they run
    without its per-call overhead."""

    def __init__(self, model, batch_size: int, max_length: int):
        from megatron.core.inference.contexts import StaticInferenceContext

        if model.training:
            raise ValueError("KV-cache decoding needs model.eval(): megatron-core ignores the cache in training mode")
        self.model = model
        self.context = StaticInferenceContext(batch_size, max_length)
        self.tp_size = group_size(model.pg_collection.tp)
        self.linears = tensor_parallel_linears(model)

    @property
    def length(self) -> int:
        """Positions stored so far (the next forward starts there)."""
        return self.context.sequence_len_offset

    def _device_context(self):
        if self.length == 0 or self.tp_size > 1:
            return cuda_on_cpu()
        return contextlib.nullcontext()

    @torch.inference_mode()  # no autograd bookkeeping at all: ~15% of a small model's decode step
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """[batch, padded vocab] fp32 logits of the token after ``tokens`` ([batch, new positions]),
        which are stored at positions ``length`` onwards."""
        start, count = self.length, tokens.shape[1]
        if start > 0 and count != 1:
            raise ValueError(f"after the first forward, feed one position at a time (got {count})")
        if start + count > self.context.max_sequence_length:
            raise ValueError(f"{start + count} positions exceed the cache's {self.context.max_sequence_length}")
        positions = torch.arange(start, start + count, device=tokens.device).expand_as(tokens)
        with self._device_context(), _plain_linear_forward(self.linears):
            logits = self.model(tokens, positions, None, inference_context=self.context, runtime_gather_output=True)
        self.context.increment_sequence_len_offset(count)
        return logits[:, -1, :].float()


def _matmul_forward(input, weight, bias, sequence_parallel=False, **_):
    """What megatron-core's linear autograd Functions compute in forward without sequence parallelism
    (tensor_parallel/layers.py at core_v0.16.1: LinearWithGradAccumulationAndAsyncCommunication and
    LinearWithFrozenWeight), the same two operations, so the logits are bitwise the same."""
    if sequence_parallel:
        raise ValueError("KV-cache decoding runs without sequence parallelism")
    output = torch.matmul(input, weight.t())
    return output if bias is None else output + bias


def tensor_parallel_linears(model) -> list:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


@contextlib.contextmanager
def _plain_linear_forward(layers: list):
    """Each tensor-parallel linear layer's forward without its torch.autograd.Function: under inference
    mode the Function only runs its forward, but its Python wrapping costs about as much as a decode
    step's matmuls on a small model (measured: benchmarks/results/cpu_costs.md).
    The layers' own communication (gathers, all-reduces) stays where megatron-core puts it, outside.
    A column-parallel layer's input copy (copy_to_tensor_model_parallel_region: the identity forward,
    an all-reduce of the input gradient backward) is skipped as its ``disable_grad_reduce`` does:
    there is no backward here. At TP 1 a row-parallel layer's output all-reduce is the identity too; one
    whose caller adds the bias (``skip_bias_add``, as in the GPT layers) skips it the way megatron-core
    lets an expert layer that communicates itself (``explicit_expert_comm``) do."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    flags = ("_forward_impl", "disable_grad_reduce", "explicit_expert_comm")
    saved = [{k: layer.__dict__[k] for k in flags if k in layer.__dict__} for layer in layers]
    for layer in layers:
        if not layer.sequence_parallel:
            layer._forward_impl = _matmul_forward
        if isinstance(layer, ColumnParallelLinear):
            layer.disable_grad_reduce = True
        elif layer.tp_group.size() == 1 and layer.skip_bias_add:
            layer.explicit_expert_comm = True
    try:
        yield
    finally:
        for layer, before in zip(layers, saved):
            layer.__dict__.pop("_forward_impl", None)
            layer.__dict__.update(before)
