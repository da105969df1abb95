"""GPT train/valid/test datasets on megatron-core, plus DP-invariant micro-batch slicing.

* Tokenizers come from ``tokenizers.py``: Megatron-LM's training tokenizers for each
  ``--tokenizer-type`` (GPT2BPETokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer,
  Llama2Tokenizer, HuggingFaceTokenizer, TikTokenizer, NullTokenizer), with what
  ``GPTDatasetConfig``/``GPTDataset``/``MockGPTDataset`` read: ``vocab_size``, ``eod``, ``pad``
  (raises where Megatron-LM's does, e.g. NullTokenizer; megatron then falls back to -1),
  ``unique_identifiers`` (hashed into the index-cache file names), ``tokenize``/``detokenize``.
* Datasets come from ``BlendedMegatronDatasetBuilder`` with ``GPTDatasetConfig`` and
  ``GPTDataset`` (or ``MockGPTDataset`` when no data prefix is given / ``mock=True``).
  Works with ``torch.distributed`` uninitialized, and when initialized (e.g. gloo): every rank
  builds its datasets (``is_built_on_rank`` is True everywhere by default) and megatron's builder
  lets global rank 0 build the index cache first, then barriers, then the other ranks load it.
* ``get_microbatch`` implements the Megatron pretraining-sampler convention: the global batch of
  iteration ``i`` is samples ``[i*G, (i+1)*G)`` whatever the DP size; rank ``r`` at micro-batch
  ``k`` takes ``[i*G + k*mbs*dp + r*mbs, ... + mbs)``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence

import numpy
import torch

logger = logging.getLogger(__name__)


DataPrefix = str | os.PathLike | Sequence[str | os.PathLike]


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


def build_tokenizer(
    tokenizer_type: str = "SentencePieceTokenizer",
    tokenizer_model: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    **kwargs,
):
    """A tokenizer usable as ``GPTDatasetConfig.tokenizer``, with Megatron-LM's ids for its
    ``--tokenizer-type`` (``tokenizers.build_tokenizer``; ``kwargs`` are its other arguments:
    vocab_file, merge_file, vocab_extra_ids, tokenizer_special_tokens, tiktoken_pattern, ...)."""
    from .tokenizers import build_tokenizer as build

    return build(tokenizer_type, tokenizer_model=tokenizer_model, vocab_size=vocab_size, **kwargs)


def padded_vocab_size(
    vocab_size: int, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1
) -> int:
    """Megatron-LM's embedding-size padding: round up to a multiple of divisor * TP."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


# --------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------


def _blend(data_prefix: DataPrefix | None, weights: Sequence[float] | None = None):
    """megatron-core's (prefixes, weights) blend of a --data-path list (P1 P2 ... or W1 P1 W2 P2 ...,
    read by megatron.core.datasets.utils.get_blend_from_list), with absolute prefixes."""
    from megatron.core.datasets.utils import get_blend_from_list

    if data_prefix is None:
        return None
    if isinstance(data_prefix, (str, os.PathLike)):
        data_prefix = [data_prefix]
    prefixes, listed = get_blend_from_list([os.fspath(p) for p in data_prefix])
    prefixes = [os.path.abspath(p) for p in prefixes]
    for p in prefixes:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(p + ext):
                raise FileNotFoundError(f"data prefix {p}: missing {p + ext}")
    if weights is not None and len(weights) != len(prefixes):
        raise ValueError("weights and data prefixes must be equal in number")
    return prefixes, list(weights) if weights is not None else listed


def train_valid_test_num_samples(
    train_iters: int, global_batch_size: int, eval_interval: int, eval_iters: int
) -> list[int]:
    """Megatron-LM's sample counts: [train, valid, test]."""
    eval_runs = (train_iters // eval_interval + 1) if eval_interval > 0 else 1
    return [
        train_iters * global_batch_size,
        eval_runs * eval_iters * global_batch_size,
        eval_iters * global_batch_size,
    ]


def build_gpt_dataset_config(
    tokenizer,
    seq_length: int,
    data_prefix: DataPrefix | None = None,
    split: str = "969,30,1",
    seed: int = 1234,
    data_cache_path: str | os.PathLike | None = None,
    weights: Sequence[float] | None = None,
    per_split_prefixes: Sequence[DataPrefix | None] | None = None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = True,
    mmap_bin_files: bool = True,
    num_dataset_builder_threads: int = 1,
):
    """A ``GPTDatasetConfig``; mock mode (``config.mock``) when ``data_prefix`` and
    ``per_split_prefixes`` (--train/valid/test-data-path, Megatron-LM's blend_per_split) are None.
    ``data_prefix`` is a --data-path list: prefixes, or weights and prefixes alternating.

    Splits that would receive zero tokens from a data prefix (e.g. the "1" of "969,30,1" over a
    corpus of a few hundred documents) are dropped from ``split_matrix`` (that split's dataset is
    None): megatron-core 0.16's ``GPTDataset`` would otherwise loop forever in
    ``_get_num_epochs`` when asked for samples from an empty split.
    """
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    blend = _blend(data_prefix, weights)
    per_split = [_blend(p) for p in per_split_prefixes] if per_split_prefixes else None
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=per_split,
        split=split if blend is not None else None,
        path_to_cache=os.fspath(data_cache_path) if data_cache_path is not None else None,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
        mmap_bin_files=mmap_bin_files,
        num_dataset_builder_threads=num_dataset_builder_threads,
    )
    prefixes = blend[0] if blend is not None else None
    if prefixes is not None:
        _drop_empty_splits(config, prefixes)
    return config


def _split_token_counts(prefix: str, split_matrix) -> list[int | None]:
    """Tokens per split of one indexed dataset, with the builder's own rounding."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    # Copy the lengths while the IndexedDataset is alive: its __del__ closes the .idx mmap, and
    # a numpy view into it outliving the object segfaults on access.
    low_level = IndexedDataset(prefix, multimodal=False, mmap=True)
    lengths = numpy.array(low_level.sequence_lengths, dtype=numpy.int64, copy=True)
    del low_level
    n = lengths.shape[0]
    counts: list[int | None] = []
    for bookends in split_matrix:
        if bookends is None:
            counts.append(None)
            continue
        beg = int(round(bookends[0] * float(n)))
        end = int(round(bookends[1] * float(n)))
        counts.append(int(numpy.sum(lengths[beg:end], dtype=numpy.int64)))
    return counts


def _drop_empty_splits(config, prefixes: list[str]) -> None:
    from megatron.core.datasets.utils import Split

    per_prefix = [_split_token_counts(p, config.split_matrix) for p in prefixes]
    for split in Split:
        i = split.value
        if config.split_matrix[i] is None:
            continue
        counts = [c[i] for c in per_prefix]
        if all(c == 0 for c in counts):
            logger.warning(
                "split %r gives the %s split no documents; that split is disabled",
                config.split,
                split.name,
            )
            config.split_matrix[i] = None
        elif any(c == 0 for c in counts):
            empty = [p for p, c in zip(prefixes, counts) if c == 0]
            raise ValueError(
                f"split {config.split!r}: the {split.name} split of {empty} has no documents "
                "while other data prefixes do; use a coarser split or more data"
            )


def _default_is_built_on_rank() -> bool:
    return True


def build_train_valid_test_datasets(
    train_valid_test_num_samples: Sequence[int | None],
    seq_length: int,
    tokenizer=None,
    data_prefix: DataPrefix | None = None,
    split: str = "969,30,1",
    seed: int = 1234,
    mock: bool = False,
    data_cache_path: str | os.PathLike | None = None,
    tokenizer_type: str = "SentencePieceTokenizer",
    tokenizer_model: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    is_built_on_rank: Callable[[], bool] | None = None,
    config=None,
    **config_kwargs,
):
    """Build (train, valid, test) datasets with megatron-core's ``BlendedMegatronDatasetBuilder``.

    Args:
        train_valid_test_num_samples: samples per split (None = one epoch of that split).
        seq_length: tokens per sample (``tokens``/``labels`` both have this length).
        tokenizer: a tokenizer from ``build_tokenizer``; built from ``tokenizer_type``/
            ``tokenizer_model``/``vocab_size`` when None.
        data_prefix: one prefix or a list (a blend) of ``.bin``/``.idx`` prefixes; None or
            ``mock=True`` gives ``MockGPTDataset`` (synthetic documents, split forced to 1,1,1).
        split: e.g. ``"969,30,1"``.
        data_cache_path: where index caches go (megatron default: ``<prefix dir>/cache``).
        is_built_on_rank: megatron's hook; default True on every rank (each DP rank reads its
            own micro-batches). Must be True on global rank 0, which builds the cache first.
        config: a prebuilt ``GPTDatasetConfig`` (then the other config arguments are ignored).
        **config_kwargs: forwarded to ``build_gpt_dataset_config`` (reset_position_ids,
            eod_mask_loss, create_attention_mask, weights, ...).

    Returns:
        A list ``[train, valid, test]`` of datasets (an entry is None for a disabled split).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    if config is None:
        if tokenizer is None:
            tokenizer = build_tokenizer(tokenizer_type, tokenizer_model, vocab_size)
        config = build_gpt_dataset_config(
            tokenizer,
            seq_length,
            data_prefix=None if mock else data_prefix,
            split=split,
            seed=seed,
            data_cache_path=data_cache_path,
            **config_kwargs,
        )
    cls = MockGPTDataset if config.mock else GPTDataset
    sizes = list(train_valid_test_num_samples)
    if len(sizes) != 3:
        raise ValueError("train_valid_test_num_samples must have 3 entries")
    builder = BlendedMegatronDatasetBuilder(cls, sizes, is_built_on_rank or _default_is_built_on_rank, config)
    return builder.build()


# --------------------------------------------------------------------------------------------
# DP-invariant micro-batches
# --------------------------------------------------------------------------------------------


def num_microbatches(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    per_step = micro_batch_size * dp_size
    if micro_batch_size < 1 or dp_size < 1 or global_batch_size % per_step != 0:
        raise ValueError(
            f"global batch size {global_batch_size} is not divisible by "
            f"micro batch size {micro_batch_size} x data-parallel size {dp_size}"
        )
    return global_batch_size // per_step


def microbatch_indices(
    iteration: int,
    microbatch_index: int,
    dp_rank: int,
    dp_size: int,
    micro_batch_size: int,
    global_batch_size: int,
) -> list[int]:
    """Sample indices of one rank's micro-batch (Megatron pretraining-sampler convention)."""
    m = num_microbatches(global_batch_size, micro_batch_size, dp_size)
    if not 0 <= microbatch_index < m:
        raise IndexError(f"micro-batch index {microbatch_index} out of range [0, {m})")
    if not 0 <= dp_rank < dp_size:
        raise IndexError(f"dp rank {dp_rank} out of range [0, {dp_size})")
    if iteration < 0:
        raise IndexError(f"iteration must be >= 0, got {iteration}")
    start = iteration * global_batch_size + microbatch_index * micro_batch_size * dp_size + dp_rank * micro_batch_size
    return list(range(start, start + micro_batch_size))


def collate_samples(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor | None]:
    """Stack GPTDataset samples into a batch dict; ``attention_mask`` is None when the dataset
    does not create one (``create_attention_mask=False``)."""
    batch: dict[str, torch.Tensor | None] = {}
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        batch[key] = torch.stack([s[key] for s in samples])
    if all("attention_mask" in s and s["attention_mask"] is not None for s in samples):
        batch["attention_mask"] = torch.stack([s["attention_mask"] for s in samples])
    else:
        batch["attention_mask"] = None
    return batch


def get_microbatch(
    dataset,
    iteration: int,
    microbatch_index: int,
    dp_rank: int,
    dp_size: int,
    micro_batch_size: int,
    global_batch_size: int,
    wrap: bool = False,
) -> dict[str, torch.Tensor | None]:
    """Collated micro-batch ``microbatch_index`` of iteration ``iteration`` for ``dp_rank``.

    Returns a dict with ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` of shape
    ``[micro_batch_size, seq]`` (and ``attention_mask`` ``[mbs, 1, seq, seq]`` bool, True =
    masked out, or None), plus ``indices`` (the dataset sample indices used).
    ``wrap=True`` takes indices modulo ``len(dataset)``; otherwise running past the end raises.
    """
    idx = microbatch_indices(iteration, microbatch_index, dp_rank, dp_size, micro_batch_size, global_batch_size)
    n = len(dataset)
    if wrap:
        idx = [i % n for i in idx]
    elif idx[-1] >= n:
        raise IndexError(
            f"iteration {iteration} needs sample {idx[-1]} but the dataset has {n} samples; "
            "build it with more samples (train_iters * global_batch_size) or pass wrap=True"
        )
    batch = collate_samples([dataset[i] for i in idx])
    batch["indices"] = torch.tensor(idx, dtype=torch.long)
    return batch
