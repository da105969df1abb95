"""How a megatron-core GPTModel chunk (one pipeline or virtual stage) splits into units:
the embedding, one per transformer layer, and the final norm with the output layer.

A word embedding tied to the output layer is a unit of its own, on whichever stage
holds a copy, so that its segments line up between the first and last pipeline stage
(their gradients are summed there). On a single stage the output layer becomes an
extra site of that unit."""

from __future__ import annotations

import torch

from ..adapter import ModelUnit

TIED_EMBEDDING = "tied_embedding"


def _tied_unit(model, by_id, pre: bool, post: bool):
    if not (getattr(model, "share_embeddings_and_output_weights", False) and (pre or post)):
        return None, None
    tied = model.shared_embedding_or_output_weight()
    params = [(by_id[id(tied)], tied)]
    output_layer = getattr(model, "output_layer", None)
    if pre:
        sites = [output_layer] if post and output_layer is not None else []
        unit = ModelUnit(TIED_EMBEDDING, params, [model.embedding], sites, shared_across_stages=True)
    else:
        unit = ModelUnit(TIED_EMBEDDING, params, [output_layer], shared_across_stages=True)
    return tied, unit


def _module_groups(model) -> list[tuple[str, list[torch.nn.Module]]]:
    groups = []
    if getattr(model, "embedding", None) is not None:
        groups.append(("embedding", [model.embedding]))
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        raise ValueError(f"{type(model).__name__} has no .decoder: not a megatron-core GPTModel chunk")
    for i, layer in enumerate(decoder.layers):
        groups.append((f"layer{getattr(layer, 'layer_number', i + 1)}", [layer]))
    final = [
        m for m in (getattr(decoder, "final_layernorm", None), getattr(model, "output_layer", None)) if m is not None
    ]
    if final:
        groups.append(("final", final))
    return groups


def gpt_model_units(model: torch.nn.Module) -> list[ModelUnit]:
    """The units of one GPTModel chunk, in forward order."""
    named = dict(model.named_parameters())  # de-duplicates shared parameters: first name wins
    by_id = {id(p): n for n, p in named.items()}
    pre, post = getattr(model, "pre_process", True), getattr(model, "post_process", True)
    tied_param, tied_unit = _tied_unit(model, by_id, pre, post)
    seen = {id(tied_param)} if tied_param is not None else set()
    units = []
    for name, modules in _module_groups(model):
        params = []
        for module in modules:
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append((by_id[id(p)], p))
        units.append(ModelUnit(name, params, modules))
    missing = [n for n, p in named.items() if id(p) not in seen]
    if missing:
        raise ValueError(f"parameters outside every unit: {missing}")
    units = [u for u in units if u.params]
    if tied_unit is not None:
        units.insert(0 if pre else len(units), tied_unit)
    return units
