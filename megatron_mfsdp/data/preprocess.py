"""Tokenize raw documents into megatron-core indexed datasets (``.bin``/``.idx``).

The output is what ``megatron.core.datasets.indexed_dataset.IndexedDataset`` reads: one
sequence per document, optionally followed by the tokenizer's EOD id, written through
megatron-core's own ``IndexedDatasetBuilder``. Output prefixes follow Megatron-LM's
``tools/preprocess_data.py``: ``{output_prefix}_{json_key}_document``.

Inputs are a ``.jsonl`` file (one JSON object per line, text under ``json_keys``), any
other text file (one document), or a folder of UTF-8 text files (every non-hidden
regular file below it, sorted by relative path, each one document).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_TOKENIZER_TYPES = ("SentencePieceTokenizer", "NullTokenizer")


class PreprocessError(ValueError):
    """A user-facing input error; the message names the offending flag and/or file."""


def check_input_path(path, flag: str = "--input") -> Path:
    """A readable file, or a readable folder holding at least one file."""
    p = Path(path)
    if not p.exists():
        raise PreprocessError(f"{flag}: input path does not exist: {p}")
    if not os.access(p, os.R_OK):
        raise PreprocessError(f"{flag}: input is not readable: {p}")
    if p.is_dir():
        if not any(True for _ in _text_files(p)):
            raise PreprocessError(f"{flag}: input folder contains no (non-hidden) files: {p}")
    elif not p.is_file():
        raise PreprocessError(f"{flag}: input is neither a regular file nor a folder: {p}")
    return p


def check_tokenizer_model(path, flag: str = "--tokenizer-model") -> Path:
    """A readable SentencePiece model."""
    if path is None:
        raise PreprocessError(f"{flag} is required for the SentencePieceTokenizer")
    p = Path(path)
    if not p.is_file() or not os.access(p, os.R_OK):
        raise PreprocessError(f"{flag}: tokenizer model file is missing or unreadable: {p}")
    import sentencepiece

    try:
        sentencepiece.SentencePieceProcessor().Load(str(p))
    except (OSError, RuntimeError) as err:
        raise PreprocessError(f"{flag}: {p} is not a valid SentencePiece model ({err})") from err
    return p


def check_output_prefix(prefix, flag: str = "--output-prefix") -> Path:
    """The prefix's folder exists (or can be created) and is writable."""
    p = Path(prefix)
    if str(prefix).endswith(os.sep) or p.is_dir():
        raise PreprocessError(f"{flag}: expected a file prefix, got a folder: {p}")
    parent = p.parent if str(p.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PreprocessError(f"{flag}: cannot create output folder {parent}: {err}") from err
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PreprocessError(f"{flag}: output folder is not writable: {parent}")
    return p


def _text_files(folder: Path) -> list[Path]:
    """Non-hidden regular files below ``folder``, sorted by relative path."""
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        files += [Path(root, n) for n in names if not n.startswith(".") and Path(root, n).is_file()]
    return sorted(files, key=lambda fp: fp.relative_to(folder).as_posix())


def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() in (".jsonl", ".json", ".ndjson")


def _read_text(fp: Path) -> str:
    try:
        return fp.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise PreprocessError(f"{fp}: not UTF-8 text ({err})") from err


def _json_document(p: Path, lineno: int, line: str, keys: Sequence[str]) -> dict[str, str]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise PreprocessError(f"{p}:{lineno}: invalid JSON ({err})") from err
    if not isinstance(obj, dict):
        raise PreprocessError(f"{p}:{lineno}: expected a JSON object per line")
    for k in keys:
        if k not in obj:
            raise PreprocessError(f"{p}:{lineno}: missing key {k!r} (given by --json-keys)")
        if not isinstance(obj[k], str):
            raise PreprocessError(f"{p}:{lineno}: value of key {k!r} is not a string")
    return {k: obj[k] for k in keys}


def iter_documents(input_path, json_keys: Sequence[str] = ("text",)) -> Iterator[dict[str, str]]:
    """``{key: text}`` per document; errors name the file (and line of a .jsonl)."""
    p, keys = Path(input_path), list(json_keys)
    if p.is_dir() or not _is_jsonl(p):
        for fp in _text_files(p) if p.is_dir() else [p]:
            text = _read_text(fp)
            yield {k: text for k in keys}
        return
    with open(p, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise PreprocessError(f"{p}:{lineno}: not UTF-8 text ({err})") from err
            if line.strip():
                yield _json_document(p, lineno, line, keys)


_WORKER: dict[str, object] = {}


def _init_worker(
    tokenizer_type: str, tokenizer_model: str | None, vocab_size: int | None, keys: list[str], append_eod: bool
) -> None:
    from .datasets import build_tokenizer

    _WORKER.update(
        tokenizer=build_tokenizer(tokenizer_type, tokenizer_model, vocab_size), keys=keys, append_eod=append_eod
    )


def _encode(doc: dict[str, str]) -> tuple[dict[str, list[int]], int]:
    tok = _WORKER["tokenizer"]
    out = {k: list(tok.tokenize(doc[k])) + ([tok.eod] if _WORKER["append_eod"] else []) for k in _WORKER["keys"]}
    return out, sum(len(v.encode("utf-8")) for v in doc.values())


@dataclass
class PreprocessResult:
    output_prefixes: dict[str, str]
    num_documents: int
    num_tokens: dict[str, int]
    seconds: float
    dtype: str


def _tokenize_into(builders, documents, pool, bar) -> tuple[int, dict[str, int]]:
    """Encode every document (in ``pool`` when given) and add it to each key's builder."""
    encoded = pool.imap(_encode, documents, chunksize=16) if pool else map(_encode, documents)
    num_docs, num_tokens = 0, {k: 0 for k in builders}
    for out, nbytes in encoded:
        for k, builder in builders.items():
            if out[k]:  # an empty document without EOD: nothing to store
                builder.add_document(out[k], [len(out[k])])
                num_tokens[k] += len(out[k])
        num_docs += 1
        bar.update(nbytes)
    return num_docs, num_tokens


def _check_inputs(input_path, output_prefix, tokenizer_type, tokenizer_model, vocab_size, json_keys, workers):
    """Everything that can be wrong, before any work: each error names its flag or file."""
    if tokenizer_type not in SUPPORTED_TOKENIZER_TYPES:
        raise PreprocessError(
            f"--tokenizer-type: unsupported {tokenizer_type!r}; choose one of {', '.join(SUPPORTED_TOKENIZER_TYPES)}"
        )
    in_path = check_input_path(input_path)
    if tokenizer_type == "SentencePieceTokenizer":
        tokenizer_model = str(check_tokenizer_model(tokenizer_model))
    elif vocab_size is None:
        raise PreprocessError("--vocab-size is required for the NullTokenizer")
    out_prefix = check_output_prefix(output_prefix)
    if not json_keys:
        raise PreprocessError("--json-keys: at least one key is required")
    if workers < 1:
        raise PreprocessError(f"--workers must be >= 1, got {workers}")
    if next(iter_documents(in_path, json_keys), None) is None:  # bad JSON or missing keys fail here
        raise PreprocessError(f"--input: no documents found in {in_path}")
    return in_path, out_prefix, tokenizer_model


def preprocess(
    input_path,
    output_prefix,
    tokenizer_model=None,
    tokenizer_type: str = "SentencePieceTokenizer",
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = True,
    workers: int = 1,
    vocab_size: int | None = None,
    progress: bool = True,
) -> PreprocessResult:
    """Tokenize every document of ``input_path`` into ``{output_prefix}_{key}_document.bin/.idx``.

    Files are written under temporary names and moved into place (``.bin`` first, ``.idx``
    last), so a reader never sees a half-written dataset; a failure removes them."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path
    from tqdm import tqdm

    t0 = time.time()
    keys = list(json_keys)
    in_path, out_prefix, tokenizer_model = _check_inputs(
        input_path, output_prefix, tokenizer_type, tokenizer_model, vocab_size, keys, workers
    )
    _init_worker(tokenizer_type, tokenizer_model, vocab_size, keys, append_eod)
    dtype = DType.optimal_dtype(_WORKER["tokenizer"].vocab_size)  # Megatron-LM's rule: uint16 below 65500
    prefixes = {k: f"{out_prefix}_{k}_document" for k in keys}
    tmp = {k: f"{prefixes[k]}.tmp{os.getpid()}" for k in keys}
    builders = {k: IndexedDatasetBuilder(get_bin_path(tmp[k]), dtype=dtype) for k in keys}
    pool = None
    bar = tqdm(desc=f"tokenize {in_path.name}", unit="B", unit_scale=True, disable=not progress)
    try:
        if workers > 1:
            init = (tokenizer_type, tokenizer_model, vocab_size, keys, append_eod)
            pool = multiprocessing.get_context("fork").Pool(workers, initializer=_init_worker, initargs=init)
        num_docs, num_tokens = _tokenize_into(builders, iter_documents(in_path, keys), pool, bar)
        for k in keys:
            builders[k].finalize(get_idx_path(tmp[k]))
            os.replace(get_bin_path(tmp[k]), get_bin_path(prefixes[k]))
            os.replace(get_idx_path(tmp[k]), get_idx_path(prefixes[k]))
    except BaseException:
        for k in keys:
            builders[k].data_file.close()
            for path in (get_bin_path(tmp[k]), get_idx_path(tmp[k])):
                Path(path).unlink(missing_ok=True)
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    return PreprocessResult(prefixes, num_docs, num_tokens, time.time() - t0, dtype.__name__)
