"""Tokenize raw documents into megatron-core indexed datasets (``.bin``/``.idx``).

The output format is the one read by ``megatron.core.datasets.indexed_dataset.IndexedDataset``:
one sequence per document (no sentence splitting), optionally followed by the tokenizer's EOD id,
written through megatron-core's own ``IndexedDatasetBuilder``. Output prefixes follow the
Megatron-LM ``tools/preprocess_data.py`` convention: ``{output_prefix}_{json_key}_document``.

Inputs are either a ``.jsonl`` file (one JSON object per line, text under ``json_keys``) or a
folder of UTF-8 text files (every non-hidden regular file below it, sorted by relative path, each
file one document under the key ``text``).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, TextIO, Tuple

__all__ = [
    "PreprocessError",
    "ProgressBar",
    "SUPPORTED_TOKENIZER_TYPES",
    "check_input_path",
    "check_tokenizer_model",
    "check_output_prefix",
    "iter_documents",
    "count_input_units",
    "choose_dtype",
    "output_prefix_for_key",
    "preprocess",
]

SUPPORTED_TOKENIZER_TYPES = ("SentencePieceTokenizer", "NullTokenizer")
DOCUMENT_LEVEL = "document"


class PreprocessError(ValueError):
    """A user-facing input error; the message names the offending flag and/or file."""


# --------------------------------------------------------------------------------------------
# Validation (cheap, runs before any tokenization work)
# --------------------------------------------------------------------------------------------


def check_input_path(path: os.PathLike | str, flag: str = "--input") -> Path:
    """Check that ``path`` is a readable .jsonl/text file or a readable folder holding files."""
    p = Path(path)
    if not p.exists():
        raise PreprocessError(f"{flag}: input path does not exist: {p}")
    if p.is_dir():
        if not os.access(p, os.R_OK | os.X_OK):
            raise PreprocessError(f"{flag}: input folder is not readable: {p}")
        if not any(True for _ in _iter_text_files(p)):
            raise PreprocessError(f"{flag}: input folder contains no (non-hidden) files: {p}")
        return p
    if not p.is_file():
        raise PreprocessError(f"{flag}: input is neither a regular file nor a folder: {p}")
    if not os.access(p, os.R_OK):
        raise PreprocessError(f"{flag}: input file is not readable: {p}")
    try:
        with open(p, "rb") as f:
            f.read(1)
    except OSError as err:
        raise PreprocessError(f"{flag}: cannot read input file {p}: {err}") from err
    return p


def check_tokenizer_model(
    path: Optional[os.PathLike | str], flag: str = "--tokenizer-model"
) -> Path:
    """Check that a SentencePiece model exists, is readable and actually loads."""
    if path is None or str(path) == "":
        raise PreprocessError(f"{flag} is required for the SentencePieceTokenizer")
    p = Path(path)
    if not p.exists():
        raise PreprocessError(f"{flag}: tokenizer model file does not exist: {p}")
    if not p.is_file():
        raise PreprocessError(f"{flag}: tokenizer model is not a regular file: {p}")
    if not os.access(p, os.R_OK):
        raise PreprocessError(f"{flag}: tokenizer model file is not readable: {p}")
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.Load(str(p))
    except (OSError, RuntimeError) as err:
        raise PreprocessError(
            f"{flag}: {p} is not a valid SentencePiece model ({err})"
        ) from err
    return p


def check_output_prefix(prefix: os.PathLike | str, flag: str = "--output-prefix") -> Path:
    """Check that the folder of the output prefix exists (or can be created) and is writable."""
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


# --------------------------------------------------------------------------------------------
# Reading documents
# --------------------------------------------------------------------------------------------


def _iter_text_files(folder: Path) -> Iterator[Path]:
    """Non-hidden regular files below ``folder``, sorted by relative path (deterministic)."""
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            if name.startswith("."):
                continue
            fp = Path(root) / name
            if fp.is_file():
                files.append(fp)
    files.sort(key=lambda fp: fp.relative_to(folder).as_posix())
    return iter(files)


def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() in (".jsonl", ".json", ".ndjson")


def iter_documents(
    input_path: os.PathLike | str, json_keys: Sequence[str] = ("text",)
) -> Iterator[Dict[str, str]]:
    """Yield ``{key: text}`` per document.

    * ``.jsonl`` / ``.json`` / ``.ndjson`` file: one JSON object per non-empty line; every key of
      ``json_keys`` must be present and hold a string (errors name the file and line number).
    * any other file: the whole file is one document under every key of ``json_keys``.
    * folder: every non-hidden file below it (sorted) is one document.
    """
    p = Path(input_path)
    keys = list(json_keys)
    if p.is_dir():
        for fp in _iter_text_files(p):
            yield {k: _read_text(fp) for k in keys}
        return
    if not _is_jsonl(p):
        text = _read_text(p)
        yield {k: text for k in keys}
        return
    with open(p, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise PreprocessError(f"{p}:{lineno}: invalid JSON ({err})") from err
            if not isinstance(obj, dict):
                raise PreprocessError(f"{p}:{lineno}: expected a JSON object per line")
            doc = {}
            for k in keys:
                if k not in obj:
                    raise PreprocessError(
                        f"{p}:{lineno}: missing key {k!r} (given by --json-keys)"
                    )
                if not isinstance(obj[k], str):
                    raise PreprocessError(f"{p}:{lineno}: value of key {k!r} is not a string")
                doc[k] = obj[k]
            yield doc


def _read_text(fp: Path) -> str:
    try:
        return fp.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise PreprocessError(f"{fp}: not UTF-8 text ({err})") from err


def count_input_units(input_path: os.PathLike | str) -> Tuple[int, str]:
    """Total work for the progress bar: bytes for a file, number of files for a folder."""
    p = Path(input_path)
    if p.is_dir():
        return sum(1 for _ in _iter_text_files(p)), "files"
    return p.stat().st_size, "bytes"


# --------------------------------------------------------------------------------------------
# Progress bar (plain text on stderr, no tqdm)
# --------------------------------------------------------------------------------------------


class ProgressBar:
    """A small text progress bar. On a terminal it redraws one line with ``\\r``; otherwise it
    prints a line at most every 10 % so that logs stay short."""

    def __init__(
        self,
        total: int,
        desc: str = "",
        unit: str = "",
        stream: Optional[TextIO] = None,
        width: int = 30,
        min_interval_s: float = 0.2,
    ) -> None:
        self.total = max(int(total), 0)
        self.desc = desc
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.min_interval_s = min_interval_s
        self.n = 0
        self.t0 = time.monotonic()
        self._last_draw = 0.0
        self._last_decile = -1
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self._tty:
            if now - self._last_draw >= self.min_interval_s:
                self._draw(end="\r")
                self._last_draw = now
        else:
            decile = int(10 * self.n / self.total) if self.total else 0
            if decile > self._last_decile and decile < 10:
                self._draw(end="\n")
                self._last_decile = decile

    def _draw(self, end: str) -> None:
        frac = min(self.n / self.total, 1.0) if self.total else 1.0
        filled = int(round(frac * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.monotonic() - self.t0
        rate = self.n / elapsed if elapsed > 0 else 0.0
        unit = f" {self.unit}" if self.unit else ""
        self.stream.write(
            f"{self.desc} [{bar}] {100 * frac:5.1f}% {self.n}/{self.total}{unit} "
            f"{elapsed:6.1f}s ({rate:,.0f}{unit}/s){end}"
        )
        self.stream.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.n = max(self.n, self.total) if self.total else self.n
        self._draw(end="\n")


# --------------------------------------------------------------------------------------------
# Tokenization workers
# --------------------------------------------------------------------------------------------


def choose_dtype(vocab_size: int):
    """Token dtype for the .bin file, via megatron-core's own rule (uint16 below 65500 ids,
    int32 otherwise) as used by Megatron-LM's preprocess_data.py."""
    from megatron.core.datasets.indexed_dataset import DType

    return DType.optimal_dtype(vocab_size)


def output_prefix_for_key(output_prefix: os.PathLike | str, key: str) -> str:
    """Megatron-LM naming: ``{output_prefix}_{key}_document``."""
    return f"{output_prefix}_{key}_{DOCUMENT_LEVEL}"


_WORKER: Dict[str, object] = {}


def _init_worker(tokenizer_type: str, tokenizer_model: Optional[str], vocab_size: Optional[int],
                 keys: List[str], append_eod: bool) -> None:
    from megatron_mfsdp.data.datasets import build_tokenizer

    _WORKER["tokenizer"] = build_tokenizer(
        tokenizer_type, tokenizer_model=tokenizer_model, vocab_size=vocab_size
    )
    _WORKER["keys"] = keys
    _WORKER["append_eod"] = append_eod


def _encode(item: Tuple[Dict[str, str], int]) -> Tuple[Dict[str, List[int]], int]:
    doc, units = item
    tok = _WORKER["tokenizer"]
    out = {}
    for k in _WORKER["keys"]:
        ids = list(tok.tokenize(doc[k]))
        if _WORKER["append_eod"]:
            ids.append(tok.eod)
        out[k] = ids
    return out, units


@dataclass
class PreprocessResult:
    output_prefixes: Dict[str, str]
    num_documents: int
    num_tokens: Dict[str, int]
    seconds: float
    dtype: str

    def as_dict(self) -> dict:
        return dict(
            output_prefixes=self.output_prefixes,
            num_documents=self.num_documents,
            num_tokens=self.num_tokens,
            seconds=self.seconds,
            dtype=self.dtype,
        )


def _with_progress_units(
    docs: Iterable[Dict[str, str]], input_path: Path
) -> Iterator[Tuple[Dict[str, str], int]]:
    """Attach to each document its amount of progress (bytes of its jsonl line, or 1 file)."""
    if input_path.is_dir():
        for d in docs:
            yield d, 1
    elif not _is_jsonl(input_path):
        for d in docs:
            yield d, input_path.stat().st_size
    else:
        # approximate bytes per document from its text (exact line length is not tracked)
        for d in docs:
            yield d, sum(len(v.encode("utf-8")) for v in d.values()) + 12 * len(d)


def preprocess(
    input_path: os.PathLike | str,
    output_prefix: os.PathLike | str,
    tokenizer_model: Optional[os.PathLike | str] = None,
    tokenizer_type: str = "SentencePieceTokenizer",
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = True,
    workers: int = 1,
    vocab_size: Optional[int] = None,
    progress: bool = True,
    progress_stream: Optional[TextIO] = None,
    chunksize: int = 16,
) -> PreprocessResult:
    """Tokenize every document of ``input_path`` and write ``{output_prefix}_{key}_document``
    ``.bin``/``.idx`` files with megatron-core's ``IndexedDatasetBuilder``.

    Files are written under temporary names and moved into place with ``os.replace`` (``.bin``
    first, ``.idx`` last), so a reader never sees a half-written dataset.
    All inputs are validated before any work starts (``PreprocessError`` names the flag/file).
    """
    t0 = time.time()
    if tokenizer_type not in SUPPORTED_TOKENIZER_TYPES:
        raise PreprocessError(
            f"--tokenizer-type: unsupported {tokenizer_type!r}; "
            f"choose one of {', '.join(SUPPORTED_TOKENIZER_TYPES)}"
        )
    in_path = check_input_path(input_path)
    if tokenizer_type == "SentencePieceTokenizer":
        tokenizer_model = str(check_tokenizer_model(tokenizer_model))
    elif vocab_size is None:
        raise PreprocessError("--vocab-size is required for the NullTokenizer")
    out_prefix = check_output_prefix(output_prefix)
    keys = list(json_keys)
    if not keys:
        raise PreprocessError("--json-keys: at least one key is required")
    if workers < 1:
        raise PreprocessError(f"--workers must be >= 1, got {workers}")
    # Parse the first document up front: bad JSON / missing keys fail before any work.
    if next(iter_documents(in_path, keys), None) is None:
        raise PreprocessError(f"--input: no documents found in {in_path}")

    from megatron.core.datasets.indexed_dataset import (
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    _init_worker(tokenizer_type, tokenizer_model, vocab_size, keys, append_eod)
    tok = _WORKER["tokenizer"]
    dtype = choose_dtype(tok.vocab_size)

    prefixes = {k: output_prefix_for_key(out_prefix, k) for k in keys}
    tmp_tag = f".tmp{os.getpid()}"
    builders = {
        k: IndexedDatasetBuilder(get_bin_path(prefixes[k] + tmp_tag), dtype=dtype) for k in keys
    }

    total, unit = count_input_units(in_path)
    bar = (
        ProgressBar(total, desc=f"tokenize {in_path.name}", unit=unit, stream=progress_stream)
        if progress
        else None
    )
    items = _with_progress_units(iter_documents(in_path, keys), in_path)
    num_docs = 0
    num_tokens = {k: 0 for k in keys}
    pool = None
    try:
        if workers > 1:
            ctx = multiprocessing.get_context("fork" if sys.platform != "win32" else "spawn")
            pool = ctx.Pool(
                workers,
                initializer=_init_worker,
                initargs=(tokenizer_type, tokenizer_model, vocab_size, keys, append_eod),
            )
            encoded = pool.imap(_encode, items, chunksize=chunksize)
        else:
            encoded = map(_encode, items)
        for out, units in encoded:
            for k in keys:
                ids = out[k]
                if len(ids) == 0:
                    continue  # an empty document without EOD: nothing to store
                builders[k].add_document(ids, [len(ids)])
                num_tokens[k] += len(ids)
            num_docs += 1
            if bar is not None:
                bar.update(units)
        if num_docs == 0:
            raise PreprocessError(f"--input: no documents found in {in_path}")
        for k in keys:
            builders[k].finalize(get_idx_path(prefixes[k] + tmp_tag))
            os.replace(get_bin_path(prefixes[k] + tmp_tag), get_bin_path(prefixes[k]))
            os.replace(get_idx_path(prefixes[k] + tmp_tag), get_idx_path(prefixes[k]))
    except BaseException:
        if pool is not None:
            pool.terminate()
        for k in keys:
            try:
                builders[k].data_file.close()
            except Exception:
                pass
            for path in (get_bin_path(prefixes[k] + tmp_tag), get_idx_path(prefixes[k] + tmp_tag)):
                if os.path.exists(path):
                    os.remove(path)
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        if bar is not None:
            bar.close()
    return PreprocessResult(
        output_prefixes=prefixes,
        num_documents=num_docs,
        num_tokens=num_tokens,
        seconds=time.time() - t0,
        dtype=dtype.__name__,
    )
