"""CPU stand-ins for the CUDA kernels megatron-core's gradient-accumulation fusion calls, for the
test harness only, so megatron-core's own fused path (tensor_parallel/layers.py at core_v0.16.1:
``LinearWithGradAccumulationAndAsyncCommunication.backward`` with ``gradient_accumulation_fusion``)
runs around them on a CPU. ``fused_weight_gradient_mlp_cuda`` is Apex's extension: its
``wgrad_gemm_accum_fp32(input, grad_output, main_grad)`` adds ``grad_output^T @ input`` into
``main_grad`` (and ``_fp16`` the same for a half-precision ``main_grad``); the stand-in computes it
with the very product the unfused path computes (``grad_output.t().matmul(total_input)``), so a
fused run is bitwise the unfused one where ``main_grad`` starts at zero. The dummy gradient the
layer then hands autograd is made on ``torch.cuda.current_device()``: run backward under
``compat.cpu.cuda_on_cpu()`` (pretrain's schedules do)."""

from __future__ import annotations

import importlib.machinery
import sys
import types

NAME = "fused_weight_gradient_mlp_cuda"


class FusedWgradStandIn:
    """``with FusedWgradStandIn() as kernels:`` makes the extension importable and megatron-core's layers
    use it; ``kernels.calls`` counts the kernel calls. ``skip`` (a set of call numbers, from 0) leaves
    those calls out: a negative control, a micro-batch's weight gradient that never reaches main_grad."""

    def __init__(self, skip: set[int] = frozenset()):
        self.calls, self.skip = 0, set(skip)

    def _accumulate(self, total_input, grad_output, main_grad) -> None:
        call, self.calls = self.calls, self.calls + 1
        if call not in self.skip:
            main_grad.add_(grad_output.t().matmul(total_input))

    def __enter__(self) -> FusedWgradStandIn:
        from megatron.core.tensor_parallel import layers

        module = types.ModuleType(NAME)
        module.__spec__ = importlib.machinery.ModuleSpec(NAME, None)
        module.wgrad_gemm_accum_fp32 = module.wgrad_gemm_accum_fp16 = self._accumulate
        self._saved = (sys.modules.get(NAME), layers._grad_accum_fusion_available, getattr(layers, NAME, None))
        sys.modules[NAME] = module
        layers._grad_accum_fusion_available = True
        setattr(layers, NAME, module)
        return self

    def __exit__(self, *exc) -> bool:
        from megatron.core.tensor_parallel import layers

        module, available, attribute = self._saved
        if module is None:
            sys.modules.pop(NAME, None)
        else:
            sys.modules[NAME] = module
        layers._grad_accum_fusion_available = available
        if attribute is None:
            delattr(layers, NAME)
        else:
            setattr(layers, NAME, attribute)
        return False
