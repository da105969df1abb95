"""Lion's math (megatron_mfsdp/optim/lion.py) against pytorch_optimizer.Lion (bitwise: the same ops in
the same order), a float64 hand-written formula of Emerging-Optimizers' update (v0.3.0
scalar_optimizers/lion.py), its foreach path against the per-piece one (bitwise), and its flags."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron_mfsdp.optim import lion
from megatron_mfsdp.optim.rule import OwnedPiece, StepContext

LR, WD, BETAS = 3e-3, 0.1, (0.95, 0.98)
SHAPES = [(37,), (8, 12), (5,)]


def _data(seed: int, steps: int = 5):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(steps)]
    return params, grads


def _ours(params, grads, betas=BETAS, lr=LR, wd=WD):
    params = [p.clone() for p in params]
    exp_avgs = [torch.zeros_like(p) for p in params]
    for step_grads in grads:
        for p, g, m in zip(params, step_grads, exp_avgs):
            lion.lion_step_(p, g, m, lr=lr, weight_decay=wd, beta1=betas[0], beta2=betas[1])
    return params, exp_avgs


@pytest.mark.parametrize("foreach", [False, True])
def test_lion_equals_pytorch_optimizer_lion_bitwise(foreach):
    """pytorch_optimizer.Lion(weight_decouple=True) decays by p * (1 - wd * lr), interpolates with lerp,
    takes the sign, then moves the momentum with beta2: our op order, so every step is bitwise equal."""
    from pytorch_optimizer import Lion

    params, grads = _data(1)
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    opt = Lion(ref, lr=LR, betas=BETAS, weight_decay=WD, weight_decouple=True, foreach=foreach)
    for step_grads in grads:
        for p, g in zip(ref, step_grads):
            p.grad = g.clone()
        opt.step()
    ours, exp_avgs = _ours(params, grads)
    for r, o, m in zip(ref, ours, exp_avgs):
        assert torch.equal(r.detach(), o)
        assert torch.equal(opt.state[r]["exp_avg"], m)


def _float64_formula(params, grads, lr=LR, wd=WD, betas=BETAS):
    """Emerging-Optimizers' Lion as its docstring writes it: p -= lr * wd * p (decoupled, first);
    u = sign(b1 m + (1 - b1) g); m = b2 m + (1 - b2) g; p -= lr u; in float64."""
    b1, b2 = betas
    params = [p.double() for p in params]
    exp_avgs = [torch.zeros_like(p) for p in params]
    for step_grads in grads:
        for i, g in enumerate(step_grads):
            g = g.double()
            params[i] = params[i] - lr * wd * params[i]
            update = torch.sign(b1 * exp_avgs[i] + (1 - b1) * g)
            exp_avgs[i] = b2 * exp_avgs[i] + (1 - b2) * g
            params[i] = params[i] - lr * update
    return params, exp_avgs


def test_lion_equals_the_float64_formula_within_rounding():
    """Against the float64 formula: the momentum within rtol 1e-6 + atol 1e-7 (fp32 lerp rounding), the
    parameters within 1e-6 absolute (measured 3.6e-7: a few fp32 roundings of |p| < 3 over 5 steps; a sign
    that flipped would move a parameter by 2 lr = 6e-3, so no update's sign differs)."""
    params, grads = _data(2)
    ours, exp_avgs = _ours(params, grads)
    ref, ref_avgs = _float64_formula(params, grads)
    for o, r, m, rm in zip(ours, ref, exp_avgs, ref_avgs):
        torch.testing.assert_close(m.double(), rm, rtol=1e-6, atol=1e-7)
        assert (o.double() - r).abs().max() < 1e-6
    # Negative control: the betas swapped (beta2 interpolates, beta1 decays) is another optimizer.
    swapped, _ = _ours(params, grads, betas=BETAS[::-1])
    assert any((s.double() - r).abs().max() > 1e-4 for s, r in zip(swapped, ref))


def test_foreach_step_equals_the_per_piece_step_bitwise():
    """lion.step (foreach kernels over all pieces) against lion.step_per_piece (one lion_step_ each)."""
    params, grads = _data(3)
    runs = []
    for fn in (lion.step, lion.step_per_piece):
        masters = [p.clone().reshape(-1) for p in params]
        pieces = [
            OwnedPiece(f"p{i}", f"p{i}", "lion", m.numel(), 0, m, torch.empty_like(m), {"exp_avg": torch.zeros_like(m)})
            for i, m in enumerate(masters)
        ]
        for k, step_grads in enumerate(grads, start=1):
            for piece, g in zip(pieces, step_grads):
                piece.grad.copy_(g.reshape(-1))
            fn(pieces, StepContext(None, k, LR, WD, settings=lion.LionSettings(*BETAS)))
        runs.append([(p.master.clone(), p.state["exp_avg"].clone()) for p in pieces])
    for (a, ma), (b, mb) in zip(*runs):
        assert torch.equal(a, b) and torch.equal(ma, mb)
    assert not torch.equal(runs[0][0][0], params[0].reshape(-1))  # it stepped


def test_lion_flags_are_megatron_lm_heads_names_and_defaults():
    """--lion-beta1 0.95 and --lion-beta2 0.98 (Megatron-LM HEAD's arguments.py), made from LionSettings;
    a beta outside [0, 1) is refused naming its flag."""
    from megatron_mfsdp.training.arguments.ours import add_rule_args

    parser = argparse.ArgumentParser()
    add_rule_args(parser)
    assert (parser.parse_args([]).lion_beta1, parser.parse_args([]).lion_beta2) == (0.95, 0.98)
    args = parser.parse_args(["--lion-beta1", "0.9", "--lion-beta2", "0.99"])
    assert (args.lion_beta1, args.lion_beta2) == (0.9, 0.99)
    with pytest.raises(ValueError, match="--lion-beta2"):
        lion.LionSettings(lion_beta2=1.0)


def test_optimizer_lion_without_matrix_fsdp_parses_and_its_distributed_optimizer_is_refused(capsys, tmp_path):
    """Without --use-matrix-fsdp, --optimizer lion runs on the replicated backend (megatron-core 0.16.1's
    optimizer factory knows adam and sgd only); --use-distributed-optimizer there is refused before any work,
    naming the flags, instead of silently keeping all of Lion's state on every rank. Adam keeps Megatron's."""
    from megatron_mfsdp.training.arguments import parse_args
    from tests.launch import TINY

    at = TINY.index("--optimizer")
    flags = [*TINY[:at], *TINY[at + 2 :], "--output-dir", str(tmp_path / "out")]
    assert parse_args([*flags, "--optimizer", "lion"], world_size=2).optimizer == "lion"
    assert parse_args([*flags, "--optimizer", "adam", "--use-distributed-optimizer"], world_size=2)
    with pytest.raises(SystemExit) as exit_:
        parse_args([*flags, "--optimizer", "lion", "--use-distributed-optimizer"], world_size=2)
    assert exit_.value.code == 2
    assert "--optimizer lion with --use-distributed-optimizer" in capsys.readouterr().err
