"""Global (1 x 1 x 1) parameter names of a GPTModel chunk, across PP, VP and TP.

Pipeline stages and virtual stages number their ``decoder.layers`` from 0; the global
index comes from megatron's ``layer_number``. A tied output layer on the last stage is
the embedding's weight. TP shards keep their name (the TP split is in the tensor)."""

from __future__ import annotations

import torch


def global_parameter_names(model: torch.nn.Module) -> dict[str, str]:
    """Local parameter name -> the name it has in the unsplit model."""
    prefixes = {}
    decoder = getattr(model, "decoder", None)
    if decoder is not None:
        for i, layer in enumerate(decoder.layers):
            prefixes[f"decoder.layers.{i}."] = f"decoder.layers.{layer.layer_number - 1}."
    names = {}
    for name, _ in model.named_parameters():
        global_name = name
        for local, glob in prefixes.items():
            if name.startswith(local):
                global_name = glob + name[len(local) :]
                break
        if name == "output_layer.weight" and getattr(model, "share_embeddings_and_output_weights", False):
            global_name = "embedding.word_embeddings.weight"
        names[name] = global_name
    return names
