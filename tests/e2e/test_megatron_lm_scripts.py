"""Megatron-LM's own launch scripts and functional-test configs (tests/megatron_lm_scripts.py): each
parses at its own sizes, and a scaled-down copy trains with --use-matrix-fsdp --optimizer muon added."""

import math

import numpy
import pytest
import torch

from megatron_mfsdp.training.arguments import parse_args
from tests.launch import pretrain_in_workers, train_losses
from tests.megatron_lm_scripts import SCRIPTS, scaled_down

RUNNABLE = [name for name in SCRIPTS if name != "mixtral_8x7b"]


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    """A small indexed dataset and GPT-2 vocab/merges files where the scripts name theirs."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    folder = tmp_path_factory.mktemp("megatron_lm_data")
    prefix = str(folder / "DATA_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for doc in range(8):
        builder.add_document(torch.arange(doc, doc + 50, dtype=torch.int32) % 200, [50])
    builder.finalize(prefix + ".idx")
    (folder / "gpt2-vocab.json").write_text('{"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}')
    (folder / "gpt2-merges.txt").write_text("#version: 0.2\na b\n")
    return {
        "DATA_text_document": prefix,
        "gpt2-vocab.json": str(folder / "gpt2-vocab.json"),
        "vocab.json": str(folder / "gpt2-vocab.json"),
        "gpt2-merges.txt": str(folder / "gpt2-merges.txt"),
        "merges.txt": str(folder / "gpt2-merges.txt"),
        "CKPT": str(folder / "ckpt"),
        "TB": str(folder / "tb"),
        "CACHE": str(folder / "cache"),
    }


def _full_size(flags, files):
    """The script as written (its placeholders pointed at real files), and the world size it asks for."""
    argv = [files.get(token, token) for token in flags]
    size = {f: int(argv[i + 1]) for i, f in enumerate(argv) if f.endswith("-model-parallel-size")}
    return argv, size.get("--tensor-model-parallel-size", 1) * size.get("--pipeline-model-parallel-size", 1)


@pytest.mark.parametrize("name", RUNNABLE)
def test_script_parses_at_its_own_sizes(name, data_files):
    argv, world = _full_size(SCRIPTS[name], data_files)
    args = parse_args(argv, world_size=world)
    assert args.world_size == world and args.data_parallel_size == 1
    if name.startswith("gpt3_175b"):
        # Megatron-LM's meaning: fp16 with dynamic loss scaling, TP 8 x PP 16, ramp-up to 1536.
        assert args.fp16 and args.loss_scale is None and args.global_batch_size == 1536
        assert (args.num_layers, args.hidden_size, args.ffn_hidden_size) == (96, 12288, 4 * 12288)
        assert args.optimizer == "adam" and not args.use_matrix_fsdp


def test_mixtral_is_refused_naming_its_first_moe_flag(data_files, capsys):
    argv, world = _full_size(SCRIPTS["mixtral_8x7b"], data_files)
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv, world_size=world * 8)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--num-experts: mixture of experts is not supported by megatron-mfsdp yet" in err


@pytest.mark.parametrize("name", RUNNABLE)
def test_scaled_down_script_trains_with_matrix_fsdp_and_muon(name, tmp_path):
    flags = scaled_down(SCRIPTS[name], tmp_path) + ["--use-matrix-fsdp", "--optimizer", "muon"]
    result = pretrain_in_workers(2, *flags, tmp_path=tmp_path)
    losses = train_losses(result)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    assert "iteration        3/       3" in result["stdout"]
