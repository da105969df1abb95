"""Integrity checks of megatron-core indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``), run
before training so a truncated or mismatched pair fails at start-up naming the file, instead
of a crash or silent garbage deep into a run.

The ``.idx`` layout (megatron/core/datasets/indexed_dataset.py, _IndexWriter/_IndexReader at
core_v0.16.1): the 9-byte magic ``MMIDIDX\\0\\0``, version (``<Q``, 1), dtype code (``<B``),
sequence count S and document count D (``<Q`` each), then S int32 sequence lengths, S int64
byte offsets, D int64 document indices, and S int8 modes for multimodal data. The ``.bin`` holds
``sum(lengths)`` elements of the dtype. Only the ``.idx`` is read; the ``.bin`` is ``stat``-ed.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy

INDEX_MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8
# megatron-core's DType codes.
DTYPE_CODES = {
    1: numpy.uint8,
    2: numpy.int8,
    3: numpy.int16,
    4: numpy.int32,
    5: numpy.int64,
    6: numpy.float64,
    7: numpy.float32,
    8: numpy.uint16,
}


@dataclass(frozen=True)
class IndexedDatasetInfo:
    prefix: str
    dtype: type
    num_sequences: int
    num_documents: int  # documents, i.e. document indices minus the leading 0
    num_tokens: int
    multimodal: bool


def _read_header(idx_path: str, idx_size: int) -> tuple[type, int, int]:
    if idx_size < HEADER_BYTES:
        raise ValueError(f"{idx_path}: truncated index file ({idx_size} bytes, the header alone is {HEADER_BYTES})")
    with open(idx_path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if head[:9] != INDEX_MAGIC:
        raise ValueError(f"{idx_path}: not a megatron indexed-dataset index (no {INDEX_MAGIC!r} header)")
    (version,) = struct.unpack("<Q", head[9:17])
    if version != 1:
        raise ValueError(f"{idx_path}: unsupported index version {version} (megatron-core writes 1)")
    code = head[17]
    if code not in DTYPE_CODES:
        raise ValueError(f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
    num_sequences, num_documents = struct.unpack("<QQ", head[18:34])
    return DTYPE_CODES[code], num_sequences, num_documents


def _check_arrays(idx_path: str, lengths, pointers, doc_indices, itemsize: int) -> int:
    """The index must describe one contiguous .bin (first offset 0, last offset + last length
    = total) and documents from sequence 0 to the last. Returns the .bin size it implies.
    Constant memory: the lengths are summed in place, the other arrays read at their ends."""
    total = int(lengths.sum(dtype=numpy.int64)) * itemsize
    if lengths.size:
        if int(lengths.min()) < 0:
            raise ValueError(f"{idx_path}: negative sequence length in the index")
        if int(pointers[0]) != 0 or int(pointers[-1]) + int(lengths[-1]) * itemsize != total:
            raise ValueError(f"{idx_path}: sequence offsets do not follow the sequence lengths (corrupt index)")
    if doc_indices.size == 0 or int(doc_indices[0]) != 0 or int(doc_indices[-1]) != lengths.size:
        raise ValueError(f"{idx_path}: document indices must run from 0 to the sequence count {lengths.size}")
    return total


def check_indexed_dataset(prefix: str | os.PathLike) -> IndexedDatasetInfo:
    """Check ``PREFIX.idx`` against itself and against the size of ``PREFIX.bin``; raise a
    ValueError naming the file when the index is truncated or not an index, its dtype code is
    unknown, or the ``.bin`` is shorter or longer than the index says. Reads the index only."""
    prefix = os.fspath(prefix)
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise ValueError(f"{path}: missing (data prefix {prefix} needs both .bin and .idx)")
    idx_size = os.path.getsize(idx_path)
    dtype, num_sequences, num_documents = _read_header(idx_path, idx_size)
    body = HEADER_BYTES + 12 * num_sequences + 8 * num_documents
    if idx_size not in (body, body + num_sequences):
        raise ValueError(
            f"{idx_path}: {idx_size} bytes, but its header ({num_sequences} sequences, {num_documents} "
            f"document indices) needs {body} (or {body + num_sequences} with modes): truncated or corrupt"
        )
    index = numpy.memmap(idx_path, mode="r", dtype=numpy.uint8)
    lengths = numpy.frombuffer(index, numpy.int32, num_sequences, HEADER_BYTES)
    pointers = numpy.frombuffer(index, numpy.int64, num_sequences, HEADER_BYTES + 4 * num_sequences)
    doc_indices = numpy.frombuffer(index, numpy.int64, num_documents, HEADER_BYTES + 12 * num_sequences)
    itemsize = numpy.dtype(dtype).itemsize
    try:
        expected_bin = _check_arrays(idx_path, lengths, pointers, doc_indices, itemsize)
        num_tokens = expected_bin // itemsize
    finally:
        del lengths, pointers, doc_indices, index
    bin_size = os.path.getsize(bin_path)
    if bin_size != expected_bin:
        word = "shorter" if bin_size < expected_bin else "longer"
        raise ValueError(
            f"{bin_path}: {bin_size} bytes, {word} than the {expected_bin} bytes its index {idx_path} describes "
            f"({num_tokens} {numpy.dtype(dtype).name} tokens); the pair is truncated or mismatched"
        )
    multimodal = idx_size == body + num_sequences and num_sequences > 0
    return IndexedDatasetInfo(prefix, dtype, num_sequences, max(num_documents - 1, 0), num_tokens, multimodal)


def check_data_prefixes(prefixes) -> list[IndexedDatasetInfo]:
    """``check_indexed_dataset`` for each prefix of a ``--data-path`` list; numeric entries
    (blend weights, as in ``--data-path 0.3 a 0.7 b``) are skipped."""
    infos = []
    for entry in [prefixes] if isinstance(prefixes, (str, os.PathLike)) else list(prefixes):
        try:
            float(os.fspath(entry))
            continue
        except ValueError:
            pass
        infos.append(check_indexed_dataset(entry))
    return infos
