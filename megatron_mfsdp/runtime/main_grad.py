"""``main_grad`` as megatron-core's fused layers expect it (``--gradient-accumulation-fusion``).

With the fusion on, megatron-core's linear layers (tensor_parallel/layers.py at core_v0.16.1:
``LinearWithGradAccumulationAndAsyncCommunication``) and Transformer Engine's
(``fuse_wgrad_accumulation``) accumulate the weight gradient straight into ``weight.main_grad``
with a CUDA kernel (``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32``) and hand autograd
a dummy gradient (when the weight has ``grad_added_to_main_grad``) or none. The layer takes
``weight.main_grad`` at forward and writes it at backward, so every parameter of a unit keeps a
``main_grad`` view into one fp32 buffer from construction on; the buffer holds memory only while
its unit is held for backward (its storage is resized to nothing in between, so forward keeps no
gradient memory: ZeRO-3's). What arrives through ``p.grad`` instead (norms, biases, the embedding
lookup, an unfused layer) is added into ``main_grad`` the way megatron-core's DDP does
(distributed_data_parallel.py ``_make_backward_post_hook``): unless the layer already added it
(``grad_added_to_main_grad``), or the dummy is zeros (``zero_out_wgrad``, a tied embedding on one
stage). The unit's reduction then packs from the ``main_grad`` views.
"""

from __future__ import annotations

import math

import torch


class MainGrads:
    """The ``main_grad`` buffer of one unit: each parameter's view, contiguous, in model order."""

    def __init__(self, tensors: list, shapes: dict[str, tuple], device):
        numel = sum(math.prod(shapes[name]) for name, _ in tensors)
        self.buffer = torch.zeros(numel, dtype=torch.float32, device=device)
        self.nbytes = self.buffer.untyped_storage().nbytes()
        self.params = [p for _, p in tensors]
        self.views, offset = {}, 0
        for name, p in tensors:
            n = math.prod(shapes[name])
            self.views[name] = self.buffer[offset : offset + n].view(shapes[name])
            offset += n
            p.main_grad = self.views[name]  # what the fused layers read, from the first forward on
            p.grad_added_to_main_grad = False
        self.live = True
        self.free()

    def materialize(self) -> None:
        """Give the buffer its memory, zeroed, before the unit's backward (once per reduction)."""
        if self.live:
            return
        self.buffer.untyped_storage().resize_(self.nbytes)
        self.buffer.zero_()
        for p in self.params:
            p.grad_added_to_main_grad = False
        self.live = True

    def absorb(self, p: torch.nn.Parameter) -> None:
        """A gradient autograd accumulated into ``p.grad``: into ``main_grad``, unless the fused layer
        already put it there and ``p.grad`` is its dummy (garbage, unless ``zero_out_wgrad``)."""
        if p.grad is not None and (not p.grad_added_to_main_grad or getattr(p, "zero_out_wgrad", False)):
            p.main_grad.add_(p.grad)
        p.grad = None

    def free(self) -> None:
        """Drop the buffer's memory (the views stay, for the next forward to hand to the layers)."""
        if self.live:
            self.buffer.untyped_storage().resize_(0)
            self.live = False
