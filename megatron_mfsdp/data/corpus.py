"""The embedded default data: a small code corpus from the Python standard library's own sources.

``prepare_default_data(cache_dir)`` builds, once, and caches::

    cache_dir/
      .lock                           fcntl.flock'ed while building (torchrun ranks may race)
      corpus/stdlib.jsonl             {"text": <source file>} per line, in a fixed hashed order, capped
      tokenizer/spm.model, spm.vocab  SentencePiece BPE model trained on the corpus
      data/stdlib_text_document.bin   megatron-core indexed dataset (uint16 ids, EOD appended)
      data/stdlib_text_document.idx
      manifest.json                   written last; its presence + matching params = cache hit

Every artifact is written under a temporary name and moved into place with ``os.replace``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from typing import Dict, Iterator, Optional, Sequence, Tuple, Union

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_VOCAB_SIZE",
    "default_cache_dir",
    "iter_stdlib_sources",
    "build_default_corpus",
    "train_sentencepiece",
    "prepare_default_data",
]

CACHE_VERSION = 2
DEFAULT_MAX_BYTES = 4_000_000
DEFAULT_MAX_FILE_BYTES = 200_000
DEFAULT_VOCAB_SIZE = 4096
MANIFEST_NAME = "manifest.json"
LOCK_NAME = ".lock"
CORPUS_REL = "corpus/stdlib.jsonl"
TOKENIZER_PREFIX_REL = "tokenizer/spm"
DATA_OUTPUT_PREFIX_REL = "data/stdlib"  # -> data/stdlib_text_document.{bin,idx}
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}

PathLike = Union[str, os.PathLike]


def default_cache_dir() -> Path:
    """``$MEGATRON_MFSDP_DATA_CACHE`` or ``~/.cache/megatron_mfsdp/default_data``."""
    env = os.environ.get("MEGATRON_MFSDP_DATA_CACHE")
    if env:
        return Path(env)
    return Path(os.path.expanduser("~")) / ".cache" / "megatron_mfsdp" / "default_data"


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------


def iter_stdlib_sources(
    max_bytes: int = DEFAULT_MAX_BYTES,
    stdlib_dir: Optional[PathLike] = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> Iterator[Tuple[str, str]]:
    """Yield ``(relative_path, text)`` of the stdlib's ``*.py`` files in the order of a hash of
    their relative path (deterministic, but spread over the whole library, so the size cap and
    the train/valid/test split do not all fall in a few alphabetically adjacent packages),
    skipping tests/site-packages, non-UTF-8, empty and larger-than-``max_file_bytes`` files, and
    stopping before the total UTF-8 size would exceed ``max_bytes``."""
    root = Path(stdlib_dir) if stdlib_dir is not None else Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"Python standard library folder not found: {root}")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py"):
                fp = Path(dirpath) / name
                files.append((fp.relative_to(root).as_posix(), fp))
    files.sort(key=lambda item: (hashlib.sha1(item[0].encode()).hexdigest(), item[0]))
    total = 0
    for rel, fp in files:
        try:
            if fp.stat().st_size > max_file_bytes:
                continue
            text = fp.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip():
            continue
        size = len(text.encode("utf-8"))
        if total + size > max_bytes:
            break
        total += size
        yield rel, text


def build_default_corpus(
    cache_dir: PathLike,
    max_bytes: int = DEFAULT_MAX_BYTES,
    stdlib_dir: Optional[PathLike] = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> Path:
    """Write ``cache_dir/corpus/stdlib.jsonl`` (``{"text": ...}`` per line) and return its path.

    Idempotent: reuses the file when its sidecar ``.meta.json`` records the same parameters.
    """
    out = Path(cache_dir) / CORPUS_REL
    meta_path = out.with_name(out.name + ".meta.json")
    params = _corpus_params(max_bytes, stdlib_dir, max_file_bytes)
    if out.is_file() and meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get("params") == params and meta.get("bytes") == out.stat().st_size:
                return out
        except (OSError, ValueError):
            pass
    buf = io.StringIO()
    num_docs = 0
    text_bytes = 0
    for _, text in iter_stdlib_sources(max_bytes, stdlib_dir, max_file_bytes):
        buf.write(json.dumps({"text": text}, ensure_ascii=False))
        buf.write("\n")
        num_docs += 1
        text_bytes += len(text.encode("utf-8"))
    if num_docs == 0:
        raise RuntimeError(f"no standard-library sources found (max_bytes={max_bytes})")
    data = buf.getvalue().encode("utf-8")
    _atomic_write_bytes(out, data)
    meta = {"params": params, "bytes": len(data), "num_docs": num_docs, "text_bytes": text_bytes}
    _atomic_write_bytes(meta_path, json.dumps(meta, indent=1).encode())
    return out


def _corpus_params(max_bytes, stdlib_dir, max_file_bytes) -> dict:
    root = Path(stdlib_dir) if stdlib_dir is not None else Path(sysconfig.get_paths()["stdlib"])
    return {
        "version": CACHE_VERSION,
        "max_bytes": int(max_bytes),
        "max_file_bytes": int(max_file_bytes),
        "stdlib_dir": str(root.resolve()),
        "python": sys.version.split()[0],
    }


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def _training_sentences(
    input_path: PathLike, json_keys: Sequence[str], max_chars: int
) -> Iterator[str]:
    """Documents cut at line boundaries into pieces of at most ~``max_chars`` characters
    (SentencePiece skips sentences longer than ``max_sentence_length`` bytes)."""
    from megatron_mfsdp.data.preprocess import iter_documents

    for doc in iter_documents(input_path, json_keys):
        for text in doc.values():
            buf: list = []
            n = 0
            for line in text.splitlines(keepends=True):
                if n + len(line) > max_chars and buf:
                    yield "".join(buf)
                    buf, n = [], 0
                buf.append(line)
                n += len(line)
            if buf:
                yield "".join(buf)


def train_sentencepiece(
    corpus_jsonl: PathLike,
    model_prefix: PathLike,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    model_type: str = "bpe",
    json_keys: Sequence[str] = ("text",),
    input_sentence_size: int = 200_000,
    num_threads: int = 1,
    max_chunk_chars: int = 2000,
    hard_vocab_limit: bool = True,
) -> Path:
    """Train a SentencePiece model on a ``.jsonl`` file (or a text file / folder of text files)
    and write ``{model_prefix}.model`` and ``{model_prefix}.vocab`` atomically.

    Settings are chosen for code and for exact round trips: identity normalization, whitespace
    kept (``remove_extra_whitespaces=False``, whitespace-only pieces, no dummy prefix), ``\\n`` as
    a user-defined piece, byte fallback (no unknown characters), digits split. Special ids:
    unk=0, bos=1, eos=2 (= EOD), pad=3. Deterministic: no sentence shuffling, fixed order,
    ``num_threads`` 1 by default.
    """
    import sentencepiece as spm

    from megatron_mfsdp.data.preprocess import check_input_path

    corpus = check_input_path(corpus_jsonl)
    prefix = Path(model_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    model_bytes = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=_training_sentences(corpus, json_keys, max_chunk_chars),
        model_writer=model_bytes,  # no model_prefix: the .model bytes do not embed any path
        vocab_size=int(vocab_size),
        model_type=model_type,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        byte_fallback=True,
        user_defined_symbols=["\n"],
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        input_sentence_size=int(input_sentence_size),
        shuffle_input_sentence=False,
        max_sentence_length=4 * max_chunk_chars + 64,
        num_threads=int(num_threads),
        hard_vocab_limit=hard_vocab_limit,
        minloglevel=2,
    )
    data = model_bytes.getvalue()
    sp = spm.SentencePieceProcessor(model_proto=data)
    # informational .vocab ("piece<TAB>score" per line; newline/tab inside pieces escaped)
    vocab_lines = "".join(
        "{}\t{:g}\n".format(
            sp.id_to_piece(i).replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t"),
            sp.get_score(i),
        )
        for i in range(sp.get_piece_size())
    )
    model = prefix.with_name(prefix.name + ".model")
    _atomic_write_bytes(prefix.with_name(prefix.name + ".vocab"), vocab_lines.encode("utf-8"))
    _atomic_write_bytes(model, data)
    return model


# --------------------------------------------------------------------------------------------
# Everything, cached
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _file_lock(cache_dir: Path):
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / LOCK_NAME, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _result_from_manifest(cache_dir: Path, manifest: dict) -> Dict[str, object]:
    return {
        "data_prefix": str(cache_dir / manifest["data_prefix"]),
        "tokenizer_model": str(cache_dir / manifest["tokenizer_model"]),
        "tokenizer_type": "SentencePieceTokenizer",
        "vocab_size": manifest["vocab_size"],
        "num_documents": manifest["num_documents"],
        "num_tokens": manifest["num_tokens"],
        "manifest": str(cache_dir / MANIFEST_NAME),
    }


def _load_valid_manifest(cache_dir: Path, params: dict) -> Optional[dict]:
    path = cache_dir / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("version") != CACHE_VERSION or manifest.get("params") != params:
        return None
    for rel, size in manifest.get("files", {}).items():
        fp = cache_dir / rel
        if not fp.is_file() or fp.stat().st_size != size:
            return None
    return manifest


def prepare_default_data(
    cache_dir: Optional[PathLike] = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    stdlib_dir: Optional[PathLike] = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    force: bool = False,
    progress: bool = False,
) -> Dict[str, object]:
    """Build (or reuse) corpus -> SentencePiece model -> indexed dataset in ``cache_dir``.

    Returns ``dict(data_prefix=..., tokenizer_model=..., tokenizer_type=..., vocab_size=...,
    num_documents=..., num_tokens=..., manifest=...)``. Safe to call from several processes at
    once: the build runs under an exclusive ``fcntl.flock`` on ``cache_dir/.lock`` and the others
    wait, then reuse the result (cache hit = ``manifest.json`` with matching params).
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache = cache.resolve()
    params = {
        "corpus": _corpus_params(max_bytes, stdlib_dir, max_file_bytes),
        "vocab_size": int(vocab_size),
        "model_type": "bpe",
    }
    if not force:
        manifest = _load_valid_manifest(cache, params)
        if manifest is not None:
            return _result_from_manifest(cache, manifest)

    with _file_lock(cache):
        if not force:
            manifest = _load_valid_manifest(cache, params)
            if manifest is not None:  # another process built it while we waited
                return _result_from_manifest(cache, manifest)
        with contextlib.suppress(FileNotFoundError):
            os.remove(cache / MANIFEST_NAME)
        # megatron-core's GPTDataset index cache is keyed by the dataset config, not by the
        # data's content: drop it with the data, or a rebuilt corpus reads stale indices.
        shutil.rmtree(cache / Path(DATA_OUTPUT_PREFIX_REL).parent, ignore_errors=True)
        timings = {}
        t = time.time()
        corpus = build_default_corpus(cache, max_bytes, stdlib_dir, max_file_bytes)
        timings["corpus_s"] = round(time.time() - t, 3)

        t = time.time()
        model = train_sentencepiece(corpus, cache / TOKENIZER_PREFIX_REL, vocab_size=vocab_size)
        timings["tokenizer_s"] = round(time.time() - t, 3)

        from megatron_mfsdp.data.preprocess import preprocess

        t = time.time()
        result = preprocess(
            corpus,
            cache / DATA_OUTPUT_PREFIX_REL,
            tokenizer_model=model,
            json_keys=("text",),
            append_eod=True,
            workers=1,
            progress=progress,
        )
        timings["preprocess_s"] = round(time.time() - t, 3)

        data_prefix = Path(result.output_prefixes["text"])
        files = [
            corpus,
            model,
            Path(str(data_prefix) + ".bin"),
            Path(str(data_prefix) + ".idx"),
        ]
        manifest = {
            "version": CACHE_VERSION,
            "params": params,
            "data_prefix": data_prefix.relative_to(cache).as_posix(),
            "tokenizer_model": model.relative_to(cache).as_posix(),
            "vocab_size": int(vocab_size),
            "dtype": result.dtype,
            "num_documents": result.num_documents,
            "num_tokens": result.num_tokens["text"],
            "corpus_bytes": corpus.stat().st_size,
            "files": {f.relative_to(cache).as_posix(): f.stat().st_size for f in files},
            "timings": timings,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        _atomic_write_bytes(cache / MANIFEST_NAME, json.dumps(manifest, indent=1).encode())
        return _result_from_manifest(cache, manifest)
