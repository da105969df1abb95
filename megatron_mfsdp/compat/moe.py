"""Three defects of megatron-core 0.16.1's MoE layer that bite on any device, repaired where the model is
built (models/gpt/build.py), each a no-op where the defect is absent.

- Without Transformer Engine (every CPU, and a GPU without it) the router's forward raises
  ``NameError: te_general_gemm``: transformer/moe/moe_utils.py imports the name inside its TE ``try``
  but tests ``te_general_gemm is not None`` unguarded in its gating linear.
  :func:`define_te_general_gemm` defines it as None, which selects the torch path that test guards.
- On the local spec with biases, an expert whose tensor-parallel group has one rank and no expert
  parallelism fails its first forward: its ``linear_fc2`` (RowParallelLinear) returns its input from
  the identity all-reduce autograd Function, and the expert MLP then adds the weighted bias to it in
  place ("Output 0 of _ReduceFromModelParallelRegion is a view and is being modified inplace",
  transformer/mlp.py). :func:`skip_single_rank_expert_reduce` marks those linears
  ``explicit_expert_comm``, the flag megatron-core sets for every expert linear with more than one
  rank to talk to: it skips exactly that all-reduce (over one rank, the identity) and changes nothing
  else at one rank.
- With sequence parallelism an expert's ``linear_fc2`` bias is marked ``sequence_parallel`` (RowParallelLinear
  marks every bias so), and megatron-core's finalize_model_grads (and our wrapper, which honours the mark) sums
  such gradients over the dense TP group. An expert's bias already holds all of its tokens (the dispatcher
  brings them), and at expert TP 1 the dense TP peers hold *other* experts: the sum adds another expert's
  bias gradient to each (tests/distributed/test_moe_training.py, TP 2 x EP 2 at expert TP 1: 4.4e-2 off
  after 3 steps). :func:`unmark_expert_sequence_parallel` clears the mark on expert parameters. Megatron-LM
  HEAD (tensor_parallel/layers.py, distributed/finalize_model_grads.py) still marks and sums them; megatron-core
  refuses MoE biases at expert TP above 1, so only expert TP 1 with TP above 1 meets it.
"""

from __future__ import annotations

import torch


def define_te_general_gemm() -> None:
    """The router's missing name, defined as None (idempotent; nothing changes where TE defined it)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def skip_single_rank_expert_reduce(model: torch.nn.Module) -> int:
    """Mark the expert linears that would all-reduce over a single rank ``explicit_expert_comm``; returns
    how many were marked."""
    marked = 0
    for module in model.modules():
        if getattr(module, "is_expert", False) and getattr(module, "explicit_expert_comm", True) is False:
            module.explicit_expert_comm = True
            marked += 1
    return marked


def unmark_expert_sequence_parallel(model: torch.nn.Module) -> int:
    """Clear ``sequence_parallel`` on expert parameters (their gradients are never partial over the dense
    TP group); returns how many were cleared."""
    cleared = 0
    for module in model.modules():
        if not getattr(module, "is_expert", False):
            continue
        for param in module.parameters(recurse=False):
            if getattr(param, "sequence_parallel", False):
                param.sequence_parallel = False
                cleared += 1
    return cleared
