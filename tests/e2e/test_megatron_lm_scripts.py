"""Megatron-LM's own launch scripts and functional-test configs (tests/megatron_lm_scripts.py): each
parses at its own sizes, and a scaled-down copy trains with --use-matrix-fsdp --optimizer muon added
(Mixtral's expert parallelism trains as written, on megatron-core's DDP; MatrixFSDP's expert domain at
EP 2 is tested in tests/e2e/test_moe_pretrain.py and tests/distributed/test_moe_training.py)."""

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


def test_mixtral_parses_at_its_own_sizes_as_megatron_lm_reads_it(data_files, tmp_path):
    """PP 4 x EP 8 on 32 ranks: data parallelism 8 for the dense part, expert data parallelism 1 (8 x 1 x 4
    expert ranks), megatron-core's DDP and distributed optimizer (the script's adam), alltoall dispatcher;
    --moe-grouped-gemm without Transformer Engine is a notice (SequentialMLP runs)."""
    (tmp_path / "TOKENIZER").write_text("")
    files = {**data_files, "TOKENIZER": str(tmp_path / "TOKENIZER"), "DATA": data_files["DATA_text_document"]}
    argv, _ = _full_size(SCRIPTS["mixtral_8x7b"], files)
    args = parse_args(argv, world_size=32)
    assert (args.num_experts, args.moe_router_topk, args.moe_token_dispatcher_type) == (8, 2, "alltoall")
    assert (args.data_parallel_size, args.expert_model_parallel_size, args.expert_data_parallel_size) == (8, 8, 1)
    assert (args.moe_aux_loss_coeff, args.moe_ffn_hidden_size) == (1e-2, 14336)
    assert args.optimizer == "adam" and args.use_distributed_optimizer and not args.use_matrix_fsdp
    if not torch.cuda.is_available():
        assert not args.moe_grouped_gemm
        assert any(n.startswith("--moe-grouped-gemm: needs Transformer Engine on CUDA") for n in args.notices)


def test_mixtral_scaled_down_trains_at_ep2_on_4_ranks(tmp_path):
    """The script's own flags (bf16, alltoall dispatcher, distributed optimizer with overlapped reduction and
    gather) at tiny sizes, 4 experts over EP 2 x expert DP 2; a higher learning rate than the script's so
    that 6 iterations show the loss falling."""
    steps = ["--train-iters", "6", "--lr-decay-iters", "6", "--lr", "3e-3", "--min-lr", "3e-4", "--eval-iters", "0"]
    flags = scaled_down(SCRIPTS["mixtral_8x7b"], tmp_path) + steps
    result = pretrain_in_workers(4, *flags, tmp_path=tmp_path)
    losses = train_losses(result)
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0] - 0.2, losses
    assert "load_balancing_loss: " in result["stdout"]


@pytest.mark.parametrize("name", RUNNABLE)
def test_scaled_down_script_trains_with_matrix_fsdp_and_muon(name, tmp_path):
    flags = scaled_down(SCRIPTS[name], tmp_path) + ["--use-matrix-fsdp", "--optimizer", "muon"]
    result = pretrain_in_workers(2, *flags, tmp_path=tmp_path)
    losses = train_losses(result)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    assert "iteration        3/       3" in result["stdout"]
