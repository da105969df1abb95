"""Multi-latent attention's parameters (megatron-core's MLASelfAttention, transformer/multi_latent_attention.py
at core_v0.16.1), from Megatron-LM dests: their TP-local shapes in registration order (tools/plan.py's analytic
model, the FP8 tile checks) and the rows of each head in the projections QK-clip scales (qk_clip.py).

Per head, queries and keys have qk_head_dim "no position" dims and qk_pos_emb_head_dim rotary dims; values
v_head_dim. linear_q_proj (or linear_q_down_proj -> q_layernorm -> linear_q_up_proj) gives every head's query,
[no-pe; pe] per head; linear_kv_down_proj gives the key/value latent (kv_lora_rank) and the one rotary key that
all heads share (qk_pos_emb_head_dim), linear_kv_up_proj each head's [key no-pe; value] from the normed latent.
The down projections are column parallel, their outputs gathered over TP; the up projections split heads over TP.
"""

from __future__ import annotations

from collections.abc import Mapping


def attention_shapes(dests: Mapping, tp: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name under ``self_attention.``, TP-local shape) of an MLASelfAttention's parameters in registration
    order: linear_proj (row parallel, its bias whole), the query projection(s), the key/value projections,
    then q_layernorm and kv_layernorm (with --qk-layernorm; a LayerNorm has a bias). The projections have
    no bias (megatron-core builds them with bias=False)."""
    h, heads = dests["hidden_size"], dests["num_attention_heads"]
    q_head = dests["qk_head_dim"] + dests["qk_pos_emb_head_dim"]
    q_rank, kv_rank = dests["q_lora_rank"], dests["kv_lora_rank"]
    out = [("linear_proj.weight", (h, heads * dests["v_head_dim"] // tp))]
    out += [("linear_proj.bias", (h,))] if dests["add_bias_linear"] else []
    if q_rank is None:
        out.append(("linear_q_proj.weight", (heads * q_head // tp, h)))
    else:
        out += [
            ("linear_q_down_proj.weight", (q_rank // tp, h)),
            ("linear_q_up_proj.weight", (heads * q_head // tp, q_rank)),
        ]
    out.append(("linear_kv_down_proj.weight", ((kv_rank + dests["qk_pos_emb_head_dim"]) // tp, h)))
    out.append(("linear_kv_up_proj.weight", (heads * (dests["qk_head_dim"] + dests["v_head_dim"]) // tp, kv_rank)))
    if dests.get("qk_layernorm", False):
        layernorm = dests.get("normalization", "LayerNorm") == "LayerNorm"
        for norm, size in (("q_layernorm", q_rank), ("kv_layernorm", kv_rank)):
            if size is not None:
                out += [(f"{norm}.weight", (size,))] + ([(f"{norm}.bias", (size,))] if layernorm else [])
    return out
