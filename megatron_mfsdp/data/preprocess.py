"""Tokenize raw documents into megatron-core indexed datasets (``.bin``/``.idx``), as Megatron-LM's
tools/preprocess_data.py (core_v0.16.1) does, with the same files for the same input and flags.

* Input: a JSON-lines file (``.gz`` too), a glob pattern of them, or (our extra) a folder of
  UTF-8 text files, each one document (every non-hidden regular file below it, sorted by
  relative path). A JSON value may be a string or a list of strings (sentences, as
  ``--split-sentences`` leaves them).
* Output: ``{output_prefix}_{key}_document`` (``_sentence`` with ``--split-sentences``) per
  ``--json-keys`` key, written through megatron-core's ``IndexedDatasetBuilder``; every
  document gets an entry, an empty one too, and the eod id follows a non-empty document with
  ``--append-eod``. Data type ``DType.optimal_dtype(vocab_size)`` (uint16 below 65500).
* ``--partitions N``: input line ``i`` goes to part ``i % N`` (``--keep-sequential-samples``:
  consecutive runs of ``ceil(lines / N)`` lines); the parts are written side by side and
  joined with ``IndexedDatasetBuilder.add_index`` in part order, so the documents come out in
  that order, as in Megatron-LM. One pool of ``--workers`` processes encodes for all parts.
* Everything is checked before any work (a full pass over the input: errors name the file
  and line), and files are written under temporary names then moved into place with
  ``os.replace`` (``.bin`` first, ``.idx`` last); a failure leaves nothing behind.
"""

from __future__ import annotations

import glob
import gzip
import json
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .tokenizers import SUPPORTED_TOKENIZER_TYPES, TokenizerError, build_preprocess_tokenizer

__all__ = ["SUPPORTED_TOKENIZER_TYPES", "PreprocessError", "PreprocessResult", "preprocess", "iter_documents"]

_MAX_SPLIT_CHARS = 1_000_000  # Megatron-LM hands the sentence splitter at most this much text at a time


class PreprocessError(ValueError):
    """A user-facing input error; the message names the offending flag and/or file."""


def _has_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def check_input_path(path, flag: str = "--input") -> Path:
    """A readable file, a readable folder holding at least one file, or a glob matching files."""
    p = Path(path)
    if not p.exists() and _has_glob(str(path)):
        if not [m for m in glob.glob(str(path)) if os.path.isfile(m)]:
            raise PreprocessError(f"{flag}: no files match the pattern {path}")
        return p
    if not p.exists():
        raise PreprocessError(f"{flag}: input path does not exist: {p}")
    if not os.access(p, os.R_OK):
        raise PreprocessError(f"{flag}: input is not readable: {p}")
    if p.is_dir():
        if not _text_files(p):
            raise PreprocessError(f"{flag}: input folder contains no (non-hidden) files: {p}")
    elif not p.is_file():
        raise PreprocessError(f"{flag}: input is neither a regular file nor a folder: {p}")
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


def _input_sources(input_path) -> tuple[list[Path], bool]:
    """(files, whether they are JSON lines): a folder's text files, or JSON-lines file(s)."""
    p = check_input_path(input_path)
    if p.is_dir():
        return _text_files(p), False
    if p.is_file():
        return [p], True
    return sorted(Path(m) for m in glob.glob(str(input_path)) if os.path.isfile(m)), True


# --------------------------------------------------------------------------------------------
# Reading documents
# --------------------------------------------------------------------------------------------

Record = tuple[int, str, int, bytes]  # (input line index over all files, file, line or 0, raw bytes)


def _records(sources: list[Path], jsonl: bool) -> Iterator[Record]:
    """Every non-blank line of the JSON-lines files (numbered over all files, blank lines
    included, as Megatron-LM's partitioning counts them), or every text file whole."""
    index = 0
    for path in sources:
        if not jsonl:
            yield index, str(path), 0, path.read_bytes()
            index += 1
            continue
        opener = gzip.open if path.suffix == ".gz" else open
        try:
            with opener(path, "rb") as f:
                for lineno, raw in enumerate(f, start=1):
                    if raw.strip():
                        yield index, str(path), lineno, raw
                    index += 1
        except OSError as err:  # unreadable, or a .gz that is not gzip
            raise PreprocessError(f"{path}: cannot read ({err})") from err


def _json_value(where: str, obj: dict, key: str) -> str | list[str]:
    if key not in obj:
        raise PreprocessError(f"{where}: missing key {key!r} (given by --json-keys)")
    value = obj[key]
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return value
    raise PreprocessError(f"{where}: value of key {key!r} is neither a string nor a list of strings")


def parse_record(source: str, lineno: int, raw: bytes, keys: Sequence[str]) -> dict[str, str | list[str]]:
    """``{key: text}`` of one input line (or text file); errors say ``FILE:LINE: ...``."""
    where = f"{source}:{lineno}" if lineno else source
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PreprocessError(f"{where}: not UTF-8 text ({err})") from err
    if not lineno:
        return {k: text for k in keys}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise PreprocessError(f"{where}: invalid JSON ({err})") from err
    if not isinstance(obj, dict):
        raise PreprocessError(f"{where}: expected a JSON object per line")
    return {k: _json_value(where, obj, k) for k in keys}


def iter_documents(input_path, json_keys: Sequence[str] = ("text",)) -> Iterator[dict[str, str]]:
    """``{key: text}`` per document (a list of sentences joined by spaces); errors name the
    file (and line of a JSON-lines file)."""
    sources, jsonl = _input_sources(input_path)
    for _, source, lineno, raw in _records(sources, jsonl):
        doc = parse_record(source, lineno, raw, json_keys)
        yield {k: v if isinstance(v, str) else " ".join(v) for k, v in doc.items()}


# --------------------------------------------------------------------------------------------
# Sentence splitting (nltk punkt, as Megatron-LM)
# --------------------------------------------------------------------------------------------


def _install_hint(lang: str) -> str:
    return (
        f"--split-sentences needs nltk and its punkt sentence data for --lang {lang}: pip install nltk, then "
        "python -m nltk.downloader -d DIR punkt_tab punkt (DIR on nltk's search path, e.g. $NLTK_DATA)"
    )


def keep_newlines_splitter(nltk, params):
    """A punkt splitter that keeps the whitespace after a sentence end (newlines included) with
    that sentence: Megatron-LM's ``--keep-newlines`` changes punkt's period-context pattern so,
    matching ``\\s*`` after the sentence end and any non-space run as the next token."""

    class NewlineKeepingVars(nltk.tokenize.punkt.PunktLanguageVars):
        _period_context_fmt = r"""
            \S*                          # word characters before the candidate end
            %(SentEndChars)s             # a sentence-ending character
            \s*                          # any whitespace, newlines included, stays here
            (?=(?P<after_tok>
                %(NonWord)s              # followed by punctuation
                |
                (?P<next_tok>\S+)        # or by the next word, with no whitespace required
            ))"""

    return nltk.tokenize.punkt.PunktSentenceTokenizer(train_text=params, lang_vars=NewlineKeepingVars())


def load_sentence_splitter(lang: str = "english", keep_newlines: bool = False):
    """nltk's punkt splitter for ``lang`` (``punkt_tab`` data, or the older ``punkt`` pickle);
    a clear error when nltk or the data is missing (this project never downloads it)."""
    try:
        import nltk
    except ImportError as err:
        raise PreprocessError(_install_hint(lang)) from err
    splitter = None
    try:
        nltk.data.find(f"tokenizers/punkt_tab/{lang}/")
        splitter = nltk.tokenize.punkt.PunktTokenizer(lang)
    except (LookupError, AttributeError):
        try:
            splitter = nltk.data.load(f"tokenizers/punkt/{lang}.pickle")
        except (LookupError, ValueError, OSError) as err:
            raise PreprocessError(_install_hint(lang)) from err
    return keep_newlines_splitter(nltk, splitter._params) if keep_newlines else splitter


# --------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------


@dataclass
class _Job:
    """Everything the workers need; checked once in the parent."""

    sources: list[Path]
    jsonl: bool
    keys: list[str]
    tokenizer_type: str
    tokenizer_options: dict
    append_eod: bool = True
    split_sentences: bool = False
    keep_newlines: bool = False
    lang: str = "english"
    partitions: int = 1
    keep_sequential_samples: bool = False
    log_interval: int = 1000
    prefixes: dict[str, str] = field(default_factory=dict)
    num_records: int = 0
    num_lines: int = 0
    num_bytes: int = 0


_WORKER: dict[str, object] = {}


def _init_worker(job: _Job) -> None:
    """Build the tokenizer (and the sentence splitter) once per process."""
    _WORKER["job"] = job
    _WORKER["tokenizer"] = build_preprocess_tokenizer(job.tokenizer_type, **job.tokenizer_options)
    _WORKER["splitter"] = load_sentence_splitter(job.lang, job.keep_newlines) if job.split_sentences else None


def _sentences(value: str | list[str], splitter) -> list[str]:
    if isinstance(value, list):
        return value
    if splitter is None:
        return [value]
    chunks = range(0, len(value), _MAX_SPLIT_CHARS)
    return [s for i in chunks for s in splitter.tokenize(value[i : i + _MAX_SPLIT_CHARS])]


def _encode(record: Record) -> tuple[int, dict[str, tuple[list[int], list[int]]], int]:
    """(input line index, {key: (ids, sentence lengths)}, bytes read) of one document."""
    job, tok = _WORKER["job"], _WORKER["tokenizer"]
    index, source, lineno, raw = record
    doc = parse_record(source, lineno, raw, job.keys)
    out = {}
    for key in job.keys:
        ids, lengths = [], []
        for sentence in _sentences(doc[key], _WORKER["splitter"]):
            sentence_ids = [int(i) for i in tok.tokenize(sentence)]
            if sentence_ids:
                ids += sentence_ids
                lengths.append(len(sentence_ids))
        if ids and job.append_eod:
            ids.append(int(tok.eod))
            lengths[-1] += 1
        out[key] = (ids, lengths)
    return index, out, len(raw)


def _partition_of(job: _Job, index: int) -> int:
    if job.partitions == 1:
        return 0
    if job.keep_sequential_samples:
        return index // math.ceil(job.num_lines / job.partitions)
    return index % job.partitions


# --------------------------------------------------------------------------------------------
# Checks, then the run
# --------------------------------------------------------------------------------------------


@dataclass
class PreprocessResult:
    output_prefixes: dict[str, str]
    num_documents: int
    num_tokens: dict[str, int]
    seconds: float
    dtype: str


def _scan_input(job: _Job) -> None:
    """Read and parse every document once before any work: a bad line fails here, naming
    ``FILE:LINE``; counts lines (for ``--keep-sequential-samples``) and bytes (progress)."""
    for _, source, lineno, raw in _records(job.sources, job.jsonl):
        parse_record(source, lineno, raw, job.keys)
        job.num_records += 1
        job.num_bytes += len(raw)
    job.num_lines = sum(_count_lines(p) for p in job.sources) if job.jsonl else job.num_records
    if job.num_records == 0:
        raise PreprocessError(f"--input: no documents found in {', '.join(map(str, job.sources))}")


def _count_lines(path: Path) -> int:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return sum(1 for _ in f)


def _check_flags(json_keys, workers: int, partitions: int, log_interval: int, keep_newlines, split_sentences) -> None:
    if not json_keys:
        raise PreprocessError("--json-keys: at least one key is required")
    if len(set(json_keys)) != len(json_keys):
        raise PreprocessError(f"--json-keys: repeated key in {list(json_keys)}")
    if workers < 1:
        raise PreprocessError(f"--workers must be >= 1, got {workers}")
    if partitions < 1:
        raise PreprocessError(f"--partitions must be >= 1, got {partitions}")
    if log_interval < 0:
        raise PreprocessError(f"--log-interval must be >= 0, got {log_interval}")
    if keep_newlines and not split_sentences:
        raise PreprocessError("--keep-newlines only applies with --split-sentences")


def _prepare(job: _Job, output_prefix):
    """All checks (flags, tokenizer, splitter, output folder, every input line); the tokenizer."""
    try:
        tokenizer = build_preprocess_tokenizer(job.tokenizer_type, **job.tokenizer_options)
    except TokenizerError as err:
        raise PreprocessError(str(err)) from err
    if job.split_sentences:
        load_sentence_splitter(job.lang, job.keep_newlines)
    out = check_output_prefix(output_prefix)
    level = "sentence" if job.split_sentences else "document"
    job.prefixes = {k: f"{out}_{k}_{level}" for k in job.keys}
    _scan_input(job)
    return tokenizer


def _temp_prefix(prefix: str, part: int | None = None) -> str:
    return f"{prefix}{'' if part is None else f'.part{part}'}.tmp{os.getpid()}"


def _open_builders(job: _Job, dtype) -> dict[str, list]:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path

    parts = [None] if job.partitions == 1 else list(range(job.partitions))
    return {
        k: [IndexedDatasetBuilder(get_bin_path(_temp_prefix(job.prefixes[k], p)), dtype=dtype) for p in parts]
        for k in job.keys
    }


def _finish_outputs(job: _Job, builders: dict[str, list], dtype) -> None:
    """Finalize each part, join the parts in order, and move the files into place."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    for k in job.keys:
        final = _temp_prefix(job.prefixes[k])
        if job.partitions == 1:
            builders[k][0].finalize(get_idx_path(final))
        else:
            for p, builder in enumerate(builders[k]):
                builder.finalize(get_idx_path(_temp_prefix(job.prefixes[k], p)))
            merged = IndexedDatasetBuilder(get_bin_path(final), dtype=dtype)
            for p in range(job.partitions):
                merged.add_index(_temp_prefix(job.prefixes[k], p))
            merged.finalize(get_idx_path(final))
    for k in job.keys:
        final = _temp_prefix(job.prefixes[k])
        os.replace(get_bin_path(final), get_bin_path(job.prefixes[k]))
        os.replace(get_idx_path(final), get_idx_path(job.prefixes[k]))


def _remove_temporaries(job: _Job, builders: dict[str, list]) -> None:
    for k in job.keys:
        for builder in builders.get(k, []):
            builder.data_file.close()
        for p in [None, *range(job.partitions)]:
            for ext in (".bin", ".idx"):
                Path(_temp_prefix(job.prefixes[k], p) + ext).unlink(missing_ok=True)


class _Progress:
    """A tqdm bar over input bytes, plus Megatron-LM's "Processed N documents" line every
    ``--log-interval`` documents."""

    def __init__(self, job: _Job, enabled: bool, name: str) -> None:
        from tqdm import tqdm

        self.bar = tqdm(desc=f"tokenize {name}", total=job.num_bytes, unit="B", unit_scale=True, disable=not enabled)
        self.interval, self.count, self.nbytes, self.start = job.log_interval, 0, 0, time.time()

    def update(self, nbytes: int) -> None:
        self.count += 1
        self.nbytes += nbytes
        self.bar.update(nbytes)
        if self.interval and self.count % self.interval == 0:
            elapsed = max(time.time() - self.start, 1e-9)
            line = (
                f"Processed {self.count} documents ({self.count / elapsed:.1f} docs/s, "
                f"{self.nbytes / elapsed / 1024 / 1024:.2f} MB/s)."
            )
            if self.bar.disable:
                print(line, file=sys.stderr)
            else:
                self.bar.write(line, file=sys.stderr)


def _encode_all(job: _Job, builders, workers: int, progress: _Progress) -> dict[str, int]:
    """Encode every document (in a pool when ``workers > 1``) into its part's builders."""
    records = _records(job.sources, job.jsonl)
    pool = None
    if workers > 1:
        pool = multiprocessing.get_context("fork").Pool(workers, initializer=_init_worker, initargs=(job,))
    num_tokens = {k: 0 for k in job.keys}
    try:
        for index, out, nbytes in pool.imap(_encode, records, chunksize=32) if pool else map(_encode, records):
            part = _partition_of(job, index)
            for k, (ids, lengths) in out.items():
                builders[k][part].add_document(ids, lengths)
                num_tokens[k] += len(ids)
            progress.update(nbytes)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return num_tokens


def preprocess(
    input_path,
    output_prefix,
    tokenizer_model=None,
    tokenizer_type: str = "GPTSentencePieceTokenizer",
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = True,
    workers: int = 1,
    vocab_size: int | None = None,
    progress: bool = True,
    *,
    vocab_file=None,
    merge_file=None,
    legacy_tokenizer: bool = False,
    tokenizer_options: dict | None = None,
    split_sentences: bool = False,
    keep_newlines: bool = False,
    lang: str = "english",
    partitions: int = 1,
    keep_sequential_samples: bool = False,
    log_interval: int = 1000,
) -> PreprocessResult:
    """Tokenize ``input_path`` into ``{output_prefix}_{key}_{document|sentence}.bin/.idx``.

    Arguments mirror Megatron-LM's tools/preprocess_data.py flags; ``tokenizer_options`` takes
    the other tokenizer flags by their ``args`` names (e.g. ``tokenizer_special_tokens``,
    ``tiktoken_pattern``, ``tokenizer_hf_include_special_tokens``). ``legacy_tokenizer`` picks
    the training tokenizers (``--legacy-tokenizer``), else megatron-core's newer ones, as that
    tool does."""
    from megatron.core.datasets.indexed_dataset import DType

    t0 = time.time()
    _check_flags(list(json_keys), workers, partitions, log_interval, keep_newlines, split_sentences)
    sources, jsonl = _input_sources(input_path)
    options = {"tokenizer_model": tokenizer_model, "vocab_file": vocab_file, "merge_file": merge_file}
    options.update(vocab_size=vocab_size, legacy_tokenizer=legacy_tokenizer, **(tokenizer_options or {}))
    job = _Job(sources, jsonl, list(json_keys), tokenizer_type, options, append_eod, split_sentences)
    job.keep_newlines, job.lang, job.partitions = keep_newlines, lang, partitions
    job.keep_sequential_samples, job.log_interval = keep_sequential_samples, log_interval
    tokenizer = _prepare(job, output_prefix)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    _WORKER.update(job=job, tokenizer=tokenizer, splitter=None)
    if split_sentences:
        _WORKER["splitter"] = load_sentence_splitter(lang, keep_newlines)
    builders: dict[str, list] = {}
    bar = _Progress(job, progress, Path(str(input_path)).name)
    try:
        builders = _open_builders(job, dtype)
        num_tokens = _encode_all(job, builders, workers, bar)
        _finish_outputs(job, builders, dtype)
    except BaseException:
        _remove_temporaries(job, builders)
        raise
    finally:
        bar.bar.close()
    if partitions > 1:
        _remove_temporaries(job, {})
    return PreprocessResult(job.prefixes, job.num_records, num_tokens, time.time() - t0, dtype.__name__)
