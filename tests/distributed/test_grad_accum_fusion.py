"""Gradient-accumulation fusion (``--gradient-accumulation-fusion``, on by default wherever Apex or
Transformer Engine is installed): megatron-core's own fused path runs here, its CUDA kernel
replaced by a CPU stand-in in the test harness only (megatron_mfsdp/testing/fused_kernels.py), and
MatrixFSDP gives every parameter the ``main_grad`` the layers accumulate into
(runtime/main_grad.py). The fused run is bitwise the unfused one at DP 2 and 4 with 1 and 4
micro-batches, at TP 2 and at PP 2; the stand-in is called; a micro-batch whose weight gradient
never reaches main_grad is caught; a weight whose gradient arrives through main_grad alone (no
dummy ``p.grad``) still reaches its owner; forward holds no gradient memory."""

import pytest
import torch

from megatron_mfsdp.testing import init_megatron, lm_loss, micro_batch, run_workers, tiny_gpt
from tests.launch import TINY, train_losses


def _fused_worker(rank, world_size, num_micro, fused, skip=(), no_dummy=None):
    """One iteration's reduced gradient segments; ``no_dummy`` names a weight whose layer gets no
    ``grad_added_to_main_grad``, so megatron-core hands autograd None for it, not a dummy."""
    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig
    from megatron_mfsdp.compat.cpu import cuda_on_cpu
    from megatron_mfsdp.testing.fused_kernels import FusedWgradStandIn

    init_megatron()
    with FusedWgradStandIn(set(skip)) as kernels:
        config, model = tiny_gpt(gradient_accumulation_fusion=fused)
        ddp = MatrixFSDP(config, MatrixFSDPConfig(), model)
        if no_dummy:
            del dict(model.named_parameters())[no_dummy].grad_added_to_main_grad
        held_in_forward = []
        with cuda_on_cpu():  # megatron-core makes the dummy gradient on torch.cuda.current_device()
            for k in range(num_micro):
                loss = lm_loss(ddp, micro_batch(1, k, rank), num_micro)
                held_in_forward.append(sum(s.main_grads.live for s in ddp.units if s.main_grads))
                loss.backward()
        ddp.finish_grad_sync()
    return {
        "grads": [s.grad_segment.clone() for s in ddp.units],
        "calls": kernels.calls,
        "held_in_forward": held_in_forward,
        "held_after": sum(s.main_grads.live for s in ddp.units if s.main_grads),
        "fused_units": sum(s.main_grads is not None for s in ddp.units),
    }


@pytest.mark.parametrize("world,num_micro", [(2, 1), (2, 4), (4, 1), (4, 4)])
def test_fused_gradient_accumulation_is_bitwise_the_unfused_run(world, num_micro):
    fused = run_workers(world, _fused_worker, num_micro, True)
    unfused = run_workers(world, _fused_worker, num_micro, False)
    for f, u in zip(fused, unfused):
        assert all(torch.equal(a, b) for a, b in zip(f["grads"], u["grads"]))
        # 2 layers x (qkv, proj, fc1, fc2) + the tied output layer, per micro-batch
        assert f["calls"] == 9 * num_micro and u["calls"] == 0, (f["calls"], u["calls"])
        assert f["fused_units"] > 0 and u["fused_units"] == 0
        # between a unit's reductions its main_grad holds no memory: forward keeps none
        assert f["held_in_forward"] == [0] * num_micro and f["held_after"] == 0


def test_a_weight_gradient_that_never_reaches_main_grad_is_caught():
    """Negative control: the stand-in leaves out one micro-batch's accumulation of one weight."""
    unfused = run_workers(2, _fused_worker, 4, False)
    dropped = run_workers(2, _fused_worker, 4, True, (9 + 3,))  # micro-batch 1's fourth fused weight
    assert any(not all(torch.equal(a, b) for a, b in zip(d["grads"], u["grads"])) for d, u in zip(dropped, unfused))


def test_a_gradient_that_arrives_through_main_grad_alone_still_reaches_its_owner():
    """Without ``grad_added_to_main_grad`` megatron-core returns None for the weight (Transformer Engine
    does the same): its hook never fires, so its unit is reduced by finish_grad_sync, from main_grad,
    accumulated over the micro-batches. One micro-batch: bitwise; four: the same sum in another order."""
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    for num_micro in (1, 4):
        fused = run_workers(2, _fused_worker, num_micro, True, (), name)
        unfused = run_workers(2, _fused_worker, num_micro, False)
        for f, u in zip(fused, unfused):
            for a, b in zip(f["grads"], u["grads"]):
                assert torch.equal(a, b) if num_micro == 1 else torch.allclose(a, b, rtol=1e-5, atol=1e-7)
            assert f["held_after"] == 0


def _pretrain_fused_worker(rank, world_size, argv):
    import contextlib
    import io

    from megatron_mfsdp.testing.fused_kernels import FusedWgradStandIn
    from megatron_mfsdp.training.arguments import parse_args
    from megatron_mfsdp.training.loop import pretrain

    with FusedWgradStandIn() as kernels, contextlib.redirect_stdout(io.StringIO()):
        args = parse_args(list(argv), world_size=world_size)
        history = pretrain(args)
    return {"history": history, "calls": kernels.calls, "fusion": args.gradient_accumulation_fusion}


@pytest.mark.parametrize(
    "layout", [["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]], ids=["tp2", "pp2"]
)
def test_pretrain_with_fusion_at_tp2_and_pp2_equals_the_unfused_run(layout, tmp_path):
    """pretrain_gpt.py's code path with Megatron-LM's default (fusion on where the kernel exists) against
    --no-gradient-accumulation-fusion: the same losses, bit for bit, at TP2 x DP2 and PP2 x DP2."""
    flags = [*TINY, "--use-matrix-fsdp", "--eval-iters", "0", "--train-iters", "3", *layout]
    fused = run_workers(4, _pretrain_fused_worker, flags + ["--output-dir", str(tmp_path / "f")])
    unfused = run_workers(4, _pretrain_fused_worker, flags + ["--no-gradient-accumulation-fusion"])
    assert all(r["fusion"] for r in fused) and not any(r["fusion"] for r in unfused)
    assert all(r["calls"] > 0 for r in fused) and all(r["calls"] == 0 for r in unfused)
    losses = [train_losses(r) for r in fused], [train_losses(r) for r in unfused]
    assert losses[0] == losses[1] and len(losses[0][-1]) == 3, losses
