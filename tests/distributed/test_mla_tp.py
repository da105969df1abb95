"""Multi-latent attention at TP 2 against one process: the gradient of every MLA down projection after one
backward (megatron-core's local spec with compat/mla.py's repair of the shared rotary key's gradient), with and
without sequence parallelism, and a negative control with the repair removed."""

import pytest
import torch

from megatron_mfsdp.testing import init_megatron, lm_loss, micro_batch, run_workers, tiny_gpt

ROTARY_ROWS = slice(16, 20)  # MLA_TINY: kv_lora_rank 16, qk_pos_emb_head_dim 4: linear_kv_down_proj's last 4 rows


def _down_proj_grads(rank, world_size, sp: bool, repair: bool = True):
    """One forward and backward of the tiny MLA GPT at TP = world size; the down projections' gradients."""
    from megatron_mfsdp.compat.cpu import cuda_on_cpu

    init_megatron(tp=world_size)
    _, model = tiny_gpt(
        by_global_name=True,
        multi_latent_attention=True,
        tensor_model_parallel_size=world_size,
        sequence_parallel=sp,
        rope_type="rope",
    )
    if not repair:
        for layer in model.decoder.layers:
            layer.self_attention.linear_kv_down_proj._forward_hooks.clear()
    with cuda_on_cpu():
        lm_loss(model, micro_batch(1, 0, 0), 1).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if "down_proj" in n}


@pytest.fixture(scope="module")
def reference():
    return run_workers(1, _down_proj_grads, False)[0]


def _errors(results, reference):
    """Per parameter: (max error of all rows, max error of linear_kv_down_proj's rotary rows or 0)."""
    out = {}
    for name, ref in reference.items():
        full = torch.cat([r[name] for r in results], 0)  # column-parallel: TP ranks hold consecutive rows
        rows = ROTARY_ROWS if "kv_down" in name else slice(0, 0)
        rot = (full[rows] - ref[rows]).abs().max().item() / ref[rows].abs().max().item() if "kv_down" in name else 0
        out[name] = ((full - ref).abs().max().item() / ref.abs().max().item(), rot)
    return out


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_mla_tp2_gradients_equal_one_process(sp, reference):
    """Every down projection's gradient within 1e-5 (relative to its largest element) of one process."""
    errors = _errors(run_workers(2, _down_proj_grads, sp), reference)
    print(f"\nMLA TP 2 (sequence parallel {sp}) gradients against one process, relative: {errors}")
    assert all(whole <= 1e-5 and rot <= 1e-5 for whole, rot in errors.values()), errors


def test_without_the_repair_the_rotary_key_rows_lose_half_their_gradient(reference):
    """Negative control: megatron-core 0.16.1's own path keeps each rank's heads' share of the rotary key."""
    errors = _errors(run_workers(2, _down_proj_grads, False, False), reference)
    print(f"\nMLA TP 2 without the repair: {errors}")
    assert max(rot for _, rot in errors.values()) > 0.1, errors
