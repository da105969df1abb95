"""Data pipeline: embedded default corpus, SentencePiece tokenizer, megatron indexed datasets,
GPT datasets (megatron-core) and DP-invariant micro-batching.

megatron-core itself is imported lazily (inside functions), so importing this package is cheap.
"""

from megatron_mfsdp.data.corpus import (
    build_default_corpus,
    default_cache_dir,
    prepare_default_data,
    train_sentencepiece,
)
from megatron_mfsdp.data.datasets import (
    build_gpt_dataset_config,
    build_tokenizer,
    build_train_valid_test_datasets,
    get_microbatch,
    iter_microbatches,
    microbatch_indices,
    num_microbatches,
    padded_vocab_size,
    train_valid_test_num_samples,
)
from megatron_mfsdp.data.preprocess import PreprocessError, preprocess

__all__ = [
    "build_default_corpus",
    "default_cache_dir",
    "prepare_default_data",
    "train_sentencepiece",
    "build_gpt_dataset_config",
    "build_tokenizer",
    "build_train_valid_test_datasets",
    "get_microbatch",
    "iter_microbatches",
    "microbatch_indices",
    "num_microbatches",
    "padded_vocab_size",
    "train_valid_test_num_samples",
    "PreprocessError",
    "preprocess",
]
