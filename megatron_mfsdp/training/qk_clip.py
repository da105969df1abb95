"""MuonClip's per-step part (--qk-clip, --log-max-attention-logit): the step's max attention logits,
one MAX all-reduce over data parallelism, and on MatrixFSDP the clip on the owners' fp32 masters.

Megatron-LM (megatron/core/optimizer/qk_clip.py at core_v0.16.1) all-reduces each layer's max logits
over DP x CP and rescales ``linear_qkv.weight`` (multi-latent attention: its query projection and
``linear_kv_up_proj.weight``; and their ``main_param``) after optimizer.step(). Here the owner of each
such weight (or of its Q and K blocks) holds the fp32 master whole, so it rescales its own rows inside
the step, before the weights are re-derived from the masters (FP8
owners re-quantize then); the only collectives are the per-layer max logits over DP and one scalar
over the world for the log. The max logits are reset every step (Megatron-LM resets them only when
it clips). Each TP rank clips its own heads; each pipeline stage its own layers."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..models.gpt import qk_clip as qk


class QKClip:
    """The step's max logits and their clip, for a job's model chunks."""

    def __init__(self, args, chunks, groups):
        self.clip, self.alpha, self.threshold = args.qk_clip, args.qk_clip_alpha, args.qk_clip_threshold
        self.dp = groups.dp
        # where the collectives run: the model's device (NCCL takes CUDA tensors only; gloo either)
        self.device = next((p.device for c in chunks for p in getattr(c, "module", c).parameters()), None)
        self.layers = []  # self-attention modules, in layer order
        self.names = {}  # id(weight) -> global name, for every parameter of the chunks
        for chunk in chunks:
            module = getattr(chunk, "module", chunk)
            names = getattr(chunk, "global_names", {})
            self.names.update({id(p): names.get(name, name) for name, p in module.named_parameters()})
            self.layers += qk.self_attentions(module)
        self.last: float | None = None  # the step's largest max logit, over the whole model

    def __call__(self, optimizer=None) -> None:
        """After the rules' step (MatrixFSDPOptimizer.after_rules): gather the max logits, keep the
        largest for the log and, with --qk-clip and an ``optimizer`` that owns masters, clip. Collective."""
        logits = self._reduced()
        top = logits.max().item() if logits.numel() else float("-inf")
        largest = torch.tensor([top], dtype=torch.float64, device=self.device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        self.last = largest.item()
        if self.clip and optimizer is not None:
            optimizer.scale_rows(self.row_scales(logits))
        for attention in self.layers:
            setattr(attention.core_attention, qk.MAX_LOGITS, None)

    def _reduced(self) -> torch.Tensor:
        """[layers, local heads] of this step's max logits, the largest over DP (-inf where a layer ran no
        training forward), on the CPU (the row multipliers are built there)."""
        rows = []
        for attention in self.layers:
            current = getattr(attention.core_attention, qk.MAX_LOGITS, None)
            heads = attention.num_attention_heads_per_partition
            none = torch.full((heads,), float("-inf"), device=self.device)
            rows.append(none if current is None else current.detach().float().to(self.device))
        if not rows:
            return torch.empty(0, 0)
        stacked = torch.stack(rows)
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX, group=self.dp)
        return stacked.cpu()

    def row_scales(self, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per layer whose max logit passed the threshold: the row multipliers of the weights its clip scales
        (linear_qkv; MLA's query projection and linear_kv_up_proj), by global name."""
        scales = {}
        for attention, layer in zip(self.layers, logits):
            for weight, rows in qk.clipped_weights(attention, layer, self.threshold, self.alpha):
                scales[self.names[id(weight)]] = rows
        return scales
