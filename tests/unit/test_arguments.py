"""pretrain_gpt.py's flags: bad input fails before any work, naming the flag."""

import pytest

from tests.launch import TINY


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--global-batch-size", "6"], "--global-batch-size 6 is not divisible"),
        (["--fp16", "--bf16"], "--fp16 and --bf16"),
        (["--num-attention-heads", "3"], "--hidden-size 64 is not divisible by --num-attention-heads 3"),
        (["--optimizer", "sgd"], "--optimizer"),
        (["--lr-warmup-iters", "9"], "--lr-warmup-iters 9 must be smaller"),
        (
            ["--tensor-model-parallel-size", "2", "--num-query-groups", "1"],
            "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2",
        ),
        (["--tensor-model-parallel-size", "4"], "world size 2 is not divisible by --tensor-model-parallel-size"),
        (["--mfsdp-replicate-size", "3"], "--mfsdp-replicate-size 3 does not divide the data-parallel size 2"),
        (
            ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
            "--num-layers-per-virtual-pipeline-stage 2 needs",
        ),
        (["--muon-tp-mode", "sharded"], "--muon-tp-mode"),
        (["--muon-scale-mode", "frobenius"], "--muon-scale-mode"),
        (["--data-path", "/nonexistent/corpus"], "--data-path /nonexistent/corpus"),
        (
            ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "/nonexistent.model"],
            "--tokenizer-model",
        ),
    ],
)
def test_bad_flags_fail_before_any_work_naming_the_flag(flags, message, capsys):
    from megatron_mfsdp.training.arguments import parse_args

    uses_files = "--data-path" in flags
    base = [a for a in TINY if a != "--mock-data"] if uses_files else TINY
    with pytest.raises(SystemExit):
        parse_args(base + flags, world_size=2)
    assert message in capsys.readouterr().err
