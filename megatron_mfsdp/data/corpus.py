"""The embedded default data: a small code corpus from the Python standard library's own
sources, a SentencePiece tokenizer trained on it, and its megatron indexed dataset.

``prepare_default_data(cache_dir)`` builds them once and caches::

    cache_dir/
      .lock                           held while building (torchrun ranks may race)
      corpus/stdlib.jsonl             {"text": <source file>} per line, in a fixed hashed order, capped
      tokenizer/spm.model, spm.vocab  SentencePiece BPE model trained on the corpus
      data/stdlib_text_document.bin   megatron-core indexed dataset (uint16 ids, EOD appended)
      data/stdlib_text_document.idx
      manifest.json                   written last; present with matching parameters = cache hit

Every file is written under a temporary name and moved into place with ``os.replace``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from filelock import FileLock

CACHE_VERSION = 3
DEFAULT_MAX_BYTES = 4_000_000
DEFAULT_MAX_FILE_BYTES = 200_000
DEFAULT_VOCAB_SIZE = 4096
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}

PathLike = str | os.PathLike


def default_cache_dir() -> Path:
    """``$MEGATRON_MFSDP_DATA_CACHE`` or ``~/.cache/megatron_mfsdp/default_data``."""
    env = os.environ.get("MEGATRON_MFSDP_DATA_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "megatron_mfsdp" / "default_data"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def iter_stdlib_sources(
    max_bytes: int = DEFAULT_MAX_BYTES, stdlib_dir: PathLike | None = None, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
) -> Iterator[tuple[str, str]]:
    """``(relative_path, text)`` of the stdlib's ``*.py`` files in the order of a hash of their
    path (deterministic, but spread over the whole library, so the size cap and the split do
    not fall in a few adjacent packages), skipping tests, non-UTF-8, empty and oversized files,
    and stopping before the total UTF-8 size would exceed ``max_bytes``."""
    root = Path(stdlib_dir) if stdlib_dir is not None else Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"Python standard library folder not found: {root}")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS and not d.startswith(".")]
        files += [
            (Path(dirpath, n).relative_to(root).as_posix(), Path(dirpath, n)) for n in filenames if n.endswith(".py")
        ]
    files.sort(key=lambda item: (hashlib.sha1(item[0].encode()).hexdigest(), item[0]))
    total = 0
    for rel, fp in files:
        try:
            text = fp.read_text(encoding="utf-8") if fp.stat().st_size <= max_file_bytes else ""
        except (OSError, UnicodeDecodeError):
            continue
        size = len(text.encode("utf-8"))
        if not text.strip():
            continue
        if total + size > max_bytes:
            break
        total += size
        yield rel, text


def _training_sentences(input_path: PathLike, json_keys: Sequence[str], max_chars: int) -> Iterator[str]:
    """Documents cut at line boundaries into pieces of at most ~``max_chars`` characters
    (SentencePiece skips sentences longer than ``max_sentence_length`` bytes)."""
    from .preprocess import iter_documents

    for doc in iter_documents(input_path, json_keys):
        for text in doc.values():
            buf, n = [], 0
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

    Settings suit code and exact round trips: identity normalization, whitespace kept, ``\\n``
    as a piece, byte fallback (no unknown characters), digits split. Special ids: unk=0, bos=1,
    eos=2 (= EOD), pad=3. Deterministic: fixed order, no shuffling, one thread by default."""
    import sentencepiece as spm

    from .preprocess import check_input_path

    corpus = check_input_path(corpus_jsonl)
    prefix = Path(model_prefix)
    model_bytes = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=_training_sentences(corpus, json_keys, max_chunk_chars),
        model_writer=model_bytes,  # no model_prefix: the .model bytes embed no path
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
    escape = str.maketrans({"\\": "\\\\", "\n": "\\n", "\t": "\\t"})
    vocab = "".join(f"{sp.id_to_piece(i).translate(escape)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
    atomic_write_bytes(prefix.with_name(prefix.name + ".vocab"), vocab.encode("utf-8"))
    model = prefix.with_name(prefix.name + ".model")
    atomic_write_bytes(model, data)
    return model


def _params(max_bytes, vocab_size, stdlib_dir, max_file_bytes) -> dict:
    root = Path(stdlib_dir) if stdlib_dir is not None else Path(sysconfig.get_paths()["stdlib"])
    return {
        "version": CACHE_VERSION,
        "max_bytes": int(max_bytes),
        "max_file_bytes": int(max_file_bytes),
        "stdlib_dir": str(root.resolve()),
        "python": sys.version.split()[0],
        "vocab_size": int(vocab_size),
    }


def _cached(cache: Path, params: dict) -> dict[str, object] | None:
    """The manifest's result if every file it lists is there with its size, else None."""
    try:
        manifest = json.loads((cache / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("params") != params:
        return None
    if any(
        not (cache / rel).is_file() or (cache / rel).stat().st_size != size for rel, size in manifest["files"].items()
    ):
        return None
    return {
        "data_prefix": str(cache / manifest["data_prefix"]),
        "tokenizer_model": str(cache / manifest["tokenizer_model"]),
        # eod = the model's eos (2), as in the data; Megatron-LM's SentencePieceTokenizer would add <EOD>
        "tokenizer_type": "GPTSentencePieceTokenizer",
        "vocab_size": manifest["vocab_size"],
        "num_documents": manifest["num_documents"],
        "num_tokens": manifest["num_tokens"],
        "manifest": str(cache / "manifest.json"),
    }


def _build(cache: Path, params: dict, max_bytes, vocab_size, stdlib_dir, max_file_bytes, progress) -> None:
    from .preprocess import preprocess

    (cache / "manifest.json").unlink(missing_ok=True)
    # megatron-core's GPTDataset index cache is keyed by the dataset config, not by the data's
    # content: drop it with the data, or a rebuilt corpus reads stale indices.
    shutil.rmtree(cache / "data", ignore_errors=True)
    t0 = time.time()
    texts = [
        json.dumps({"text": t}, ensure_ascii=False) + "\n"
        for _, t in iter_stdlib_sources(max_bytes, stdlib_dir, max_file_bytes)
    ]
    if not texts:
        raise RuntimeError(f"no standard-library sources found (max_bytes={max_bytes})")
    corpus = cache / "corpus" / "stdlib.jsonl"
    atomic_write_bytes(corpus, "".join(texts).encode("utf-8"))
    model = train_sentencepiece(corpus, cache / "tokenizer" / "spm", vocab_size=vocab_size)
    result = preprocess(
        corpus,
        cache / "data" / "stdlib",
        tokenizer_model=model,
        tokenizer_type="GPTSentencePieceTokenizer",
        append_eod=True,
        progress=progress,
    )
    prefix = Path(result.output_prefixes["text"])
    files = [corpus, model, Path(f"{prefix}.bin"), Path(f"{prefix}.idx")]
    manifest = {
        "params": params,
        "data_prefix": prefix.relative_to(cache).as_posix(),
        "tokenizer_model": model.relative_to(cache).as_posix(),
        "vocab_size": int(vocab_size),
        "num_documents": result.num_documents,
        "num_tokens": result.num_tokens["text"],
        "build_seconds": round(time.time() - t0, 3),
        "files": {f.relative_to(cache).as_posix(): f.stat().st_size for f in files},
    }
    atomic_write_bytes(cache / "manifest.json", json.dumps(manifest, indent=1).encode())


def prepare_default_data(
    cache_dir: PathLike | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    stdlib_dir: PathLike | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    force: bool = False,
    progress: bool = False,
) -> dict[str, object]:
    """Build (or reuse) corpus -> SentencePiece model -> indexed dataset in ``cache_dir``.

    Returns ``dict(data_prefix, tokenizer_model, tokenizer_type, vocab_size, num_documents,
    num_tokens, manifest)``. Safe from several processes at once: the build runs under an
    exclusive file lock and the others wait, then reuse the result."""
    cache = (Path(cache_dir) if cache_dir is not None else default_cache_dir()).resolve()
    params = _params(max_bytes, vocab_size, stdlib_dir, max_file_bytes)
    if not force and (hit := _cached(cache, params)) is not None:
        return hit
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache / ".lock")):
        if force or _cached(cache, params) is None:  # another process may have built it while we waited
            _build(cache, params, max_bytes, vocab_size, stdlib_dir, max_file_bytes, progress)
        return _cached(cache, params)
