"""Global (1 x 1 x 1) parameter names of a GPTModel chunk, across PP, VP, TP and EP.

Pipeline stages and virtual stages number their ``decoder.layers`` from 0; the global
index comes from megatron's ``layer_number``. A tied output layer on the last stage is
the embedding's weight. TP shards keep their name (the TP split is in the tensor). Each
expert-parallel rank numbers its local experts from 0 (``mlp.experts.local_experts.{i}`` of
SequentialMLP, ``mlp.experts.linear_fc1.weight{i}`` of TEGroupedMLP); the global expert is the
MoE layer's ``local_expert_indices[i]``."""

from __future__ import annotations

import re

import torch

_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.")
_GROUPED_EXPERT = re.compile(r"^(mlp\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")


def _global_expert(rest: str, indices) -> str:
    """``rest`` (a name inside one transformer layer) with its local expert index made global."""
    if indices is None:
        return rest
    local = _LOCAL_EXPERT.match(rest)
    if local is not None:
        return f"mlp.experts.local_experts.{indices[int(local.group(1))]}." + rest[local.end() :]
    grouped = _GROUPED_EXPERT.match(rest)
    if grouped is not None:
        return f"{grouped.group(1)}{indices[int(grouped.group(2))]}"
    return rest


def global_parameter_names(model: torch.nn.Module) -> dict[str, str]:
    """Local parameter name -> the name it has in the unsplit model."""
    prefixes = {}
    decoder = getattr(model, "decoder", None)
    if decoder is not None:
        for i, layer in enumerate(decoder.layers):
            experts = getattr(getattr(layer, "mlp", None), "local_expert_indices", None)
            prefixes[f"decoder.layers.{i}."] = (f"decoder.layers.{layer.layer_number - 1}.", experts)
    names = {}
    for name, _ in model.named_parameters():
        global_name = name
        for local, (glob, experts) in prefixes.items():
            if name.startswith(local):
                global_name = glob + _global_expert(name[len(local) :], experts)
                break
        if name == "output_layer.weight" and getattr(model, "share_embeddings_and_output_weights", False):
            global_name = "embedding.word_embeddings.weight"
        names[name] = global_name
    return names
