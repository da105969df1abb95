"""Matrix rules' state (factors, eigenbases, second moments, a plug-in's n x n Gram) through
pretrain_gpt.py's checkpoints: saved at TP2 x PP2 x DP2 in the exact TP mode, resumed at 1x1x1,
at DP4 and at TP2 x DP2, iterations 4-6 give the uninterrupted run's losses (issue 22)."""

import pytest

from megatron_mfsdp.optim import registry
from tests import toy_rule
from tests.launch import TINY, pretrain_in_workers, train_losses

FLAGS = [*TINY, "--num-layers", "4", "--eval-iters", "0", "--train-iters", "6", "--use-matrix-fsdp"]
TP2, PP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
RESUME_AT = {"1x1x1": (1, []), "dp4": (4, []), "tp2 x dp2": (4, TP2)}
# Layouts sum gradients in other orders; tests/e2e/test_checkpoint_resume.py bounds Muon's at 1e-5 too.
TOLERANCE = 1e-5
RULES = {
    # optimizer: (its exact TP mode, extra flags)
    "soap": (["--soap-tp-mode", "duplicated"], ["--soap-precondition-frequency", "2"]),
    # Shampoo's default epsilon 1e-12 leaves the rank-deficient factors' near-zero eigenvalues in the
    # inverse 4th roots, which turn another layout's summation-order noise into 5e-4 of loss at the
    # refresh of step 6; at 1e-8 the roots are well conditioned and the layouts agree to 2e-6.
    "shampoo": (
        ["--shampoo-tp-mode", "duplicated"],
        ["--shampoo-precondition-frequency", "2", "--shampoo-epsilon", "1e-8"],
    ),
    "adaptive_muon": (["--muon-tp-mode", "duplicated"], ["--adaptive-muon-moment2-method", "normuon"]),
    "toy": (["--toy-tp-mode", "duplicated"], []),
}


@pytest.mark.parametrize("optimizer", list(RULES))
def test_rule_state_saved_at_tp2_pp2_dp2_resumes_at_other_layouts(optimizer, tmp_path):
    if optimizer != "toy" and optimizer not in registry.optimizer_choices():
        pytest.fail(f"--optimizer {optimizer} is not registered")
    setup = toy_rule.register if optimizer == "toy" else None
    tp_mode, extra = RULES[optimizer]
    flags = [*FLAGS, "--optimizer", optimizer, *tp_mode, *extra]
    save = tmp_path / "ckpt"
    full = pretrain_in_workers(
        8, *flags, *TP2, *PP2, "--save", str(save), "--save-interval", "3", tmp_path=tmp_path, setup=setup
    )
    reference = train_losses(full)
    assert len(reference) == 6 and reference[-1] < reference[0], reference
    (save / "latest_checkpointed_iteration.txt").write_text("3")  # resume from the middle of the run
    for name, (nproc, layout) in RESUME_AT.items():
        resumed = pretrain_in_workers(nproc, *flags, *layout, "--load", str(save), tmp_path=tmp_path, setup=setup)
        got = train_losses(resumed)
        deltas = [abs(a - b) for a, b in zip(got, reference[3:])]
        print(f"\n{optimizer} resumed at {name}: max |lm loss delta| over iterations 4-6 = {max(deltas):.2e}")
        assert len(got) == 3 and max(deltas) <= TOLERANCE, (name, got, reference[3:])


def test_a_checkpoint_without_the_rule_state_is_refused_naming_it(tmp_path):
    """Negative control: Muon's checkpoint read by the toy rule lacks the toy's state: the load
    fails naming a missing key rather than starting the factors from zero."""
    save = tmp_path / "ckpt"
    pretrain_in_workers(
        2, *FLAGS, "--save", str(save), "--save-interval", "3", "--exit-interval", "3", tmp_path=tmp_path
    )
    with pytest.raises(Exception, match=r"optimizer\.state\.(gram|count)\."):
        pretrain_in_workers(
            2, *FLAGS, "--optimizer", "toy", "--load", str(save), tmp_path=tmp_path, setup=toy_rule.register
        )
