"""Tokenizers that give Megatron-LM's token ids for Megatron-LM's ``--tokenizer-type`` flags.

``build_tokenizer`` matches Megatron-LM's training tokenizers, ``build_tokenizer(args)`` in
megatron/training/tokenizer/tokenizer.py at core_v0.16.1 (what ``pretrain_gpt.py`` uses): the
same ids, ``vocab_size``, ``eod``, ``pad``, ``bos``, ``eos`` and special tokens for the same files,
and the same ``unique_identifiers`` (so megatron-core's dataset index caches get the same names).
The engines are the sentencepiece library, transformers' ``AutoTokenizer`` (a local folder only,
never the hub), tiktoken when installed, and our own byte-level BPE for ``GPT2BPETokenizer``.

``build_preprocess_tokenizer`` is what Megatron-LM's tools/preprocess_data.py builds: at
core_v0.16.1 that tool uses megatron-core's newer ``megatron.core.tokenizers`` unless given
``--legacy-tokenizer``, and the two differ (e.g. SentencePieceTokenizer's end-of-document id is
the model's ``</s>`` there and an added ``<EOD>`` piece in training).

Attributes Megatron-LM's class lacks raise, as they do there (``pad`` of GPT2BPETokenizer and
NullTokenizer: ``NotImplementedError``); megatron-core's GPTDataset then uses pad id -1.
"""

from __future__ import annotations

import base64
import json
import os
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path

SUPPORTED_TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "TikTokenizer",
    "NullTokenizer",
)

# GPT-2's pre-tokenizer (OpenAI's encoder.py, also megatron/training/tokenizer/gpt2_tokenization.py).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# --tiktoken-pattern v1 / v2 (PATTERN_TIKTOKEN, PATTERN_TIKTOKEN_V2 in Megatron-LM's tokenizer.py).
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
GPT2_EOD_TOKEN = "<|endoftext|>"


class TokenizerError(ValueError):
    """A user-facing tokenizer error; the message names the flag and/or file."""


def _require_file(path, flag: str, tokenizer_type: str) -> str:
    if path is None:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    p = os.fspath(path)
    if not os.path.isfile(p) or not os.access(p, os.R_OK):
        raise TokenizerError(f"{flag}: file is missing or unreadable: {p}")
    return p


class MegatronCompatTokenizer:
    """What megatron-core's datasets and our preprocessing read from a tokenizer.

    ``unique_identifiers`` is built as Megatron-LM's ``MegatronLegacyTokenizer`` builds it
    (its class name, the paths, then each option as a string)."""

    megatron_class = ""

    def __init__(self, *paths, **options) -> None:
        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = self.megatron_class
        self.unique_identifiers["tokenizer_path"] = [None if p is None else os.fspath(p) for p in paths]
        for key, value in options.items():
            self.unique_identifiers[key] = str(value)
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    def _missing(self, name: str):
        raise NotImplementedError(f"{type(self).__name__} has no attribute {name!r} (nor has Megatron-LM's)")

    cls = property(lambda self: self._missing("cls"))
    sep = property(lambda self: self._missing("sep"))
    mask = property(lambda self: self._missing("mask"))
    pad = property(lambda self: self._missing("pad"))
    bos = property(lambda self: self._missing("bos"))
    eos = property(lambda self: self._missing("eos"))
    eod = property(lambda self: self._missing("eod"))


# --------------------------------------------------------------------------------------------
# GPT-2 byte-level BPE
# --------------------------------------------------------------------------------------------


@lru_cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> character map: the 188 printable Latin-1 bytes stand for
    themselves, the other 68 bytes map to U+0100, U+0101, ... in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


def read_bpe_merges(merge_file: str) -> dict[tuple[str, ...], int]:
    """Merge ranks as Megatron-LM's GPT2Tokenizer reads them: the first line (the
    ``#version`` header) and the text after the last newline are dropped, the rank is the
    line's position, and a repeated pair keeps its last rank."""
    with open(merge_file, encoding="utf-8") as f:
        lines = f.read().split("\n")[1:-1]
    return {tuple(line.split()): rank for rank, line in enumerate(lines)}


class GPT2BPETokenizer(MegatronCompatTokenizer):
    """``--tokenizer-type GPT2BPETokenizer``: vocab.json + merges.txt; eod is ``<|endoftext|>``.

    As in Megatron-LM, ``<|endoftext|>`` written in the text is split like any text, and a
    piece missing from vocab.json gets id 0. ``split_special`` lists strings to map straight to
    their id instead (what the Hugging Face GPT-2 tokenizer does with ``<|endoftext|>``)."""

    megatron_class = "_GPT2BPETokenizer"

    def __init__(self, vocab_file, merge_file, split_special: tuple[str, ...] = ()) -> None:
        import regex

        super().__init__(vocab_file, merge_file)
        vocab_file = _require_file(vocab_file, "--vocab-file", "GPT2BPETokenizer")
        merge_file = _require_file(merge_file, "--merge-file", "GPT2BPETokenizer")
        try:
            with open(vocab_file, encoding="utf-8") as f:
                self.encoder = json.load(f)
        except (ValueError, UnicodeDecodeError) as err:
            raise TokenizerError(f"--vocab-file: {vocab_file} is not a JSON vocabulary ({err})") from err
        if not isinstance(self.encoder, dict) or GPT2_EOD_TOKEN not in self.encoder:
            raise TokenizerError(
                f"--vocab-file: {vocab_file} has no {GPT2_EOD_TOKEN!r} entry (GPT-2's end of document)"
            )
        self.decoder = {v: k for k, v in self.encoder.items()}
        self.bpe_ranks = read_bpe_merges(merge_file)
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self._pattern = regex.compile(GPT2_PATTERN)
        self._special = {t: self.encoder[t] for t in split_special if t in self.encoder}
        self._cache: dict[str, list[str]] = {}

    def bpe(self, word: str) -> list[str]:
        """Merge the lowest-ranked adjacent pair, all its occurrences left to right, until no
        adjacent pair has a rank."""
        if word in self._cache:
            return self._cache[word]
        parts = list(word)
        while len(parts) > 1:
            pairs = set(zip(parts, parts[1:]))
            best = min(pairs, key=lambda pair: self.bpe_ranks.get(pair, float("inf")))
            if best not in self.bpe_ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        self._cache[word] = parts
        return parts

    def _encode_plain(self, text: str) -> list[int]:
        ids = []
        for chunk in self._pattern.findall(text):
            mapped = "".join(self.byte_encoder[b] for b in chunk.encode("utf-8"))
            ids.extend(self.encoder.get(piece, 0) for piece in self.bpe(mapped))
        return ids

    def tokenize(self, text: str) -> list[int]:
        if not self._special:
            return self._encode_plain(text)
        return _split_on_specials(text, self._special, self._encode_plain)

    def detokenize(self, token_ids) -> str:
        text = "".join(self.decoder[int(t)] for t in token_ids)
        return bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")

    vocab_size = property(lambda self: len(self.encoder))
    vocab = property(lambda self: self.encoder)
    inv_vocab = property(lambda self: self.decoder)
    eod = property(lambda self: self.encoder[GPT2_EOD_TOKEN])


def _split_on_specials(text: str, specials: dict[str, int], encode) -> list[int]:
    """Encode ``text`` with every occurrence of a special string replaced by its id: the
    earliest occurrence first, ties to the special listed first (Megatron-LM's
    _SentencePieceTokenizer.tokenize)."""
    ids, pos = [], 0
    order = list(specials)
    while True:
        hits = [(text.find(tok, pos), n) for n, tok in enumerate(order)]
        hits = [h for h in hits if h[0] >= 0]
        if not hits:
            break
        start, n = min(hits)
        ids.extend(encode(text[pos:start]))
        ids.append(specials[order[n]])
        pos = start + len(order[n])
    ids.extend(encode(text[pos:]))
    return ids


# --------------------------------------------------------------------------------------------
# SentencePiece
# --------------------------------------------------------------------------------------------


class _SentencePieceBase(MegatronCompatTokenizer):
    def __init__(self, model_file, tokenizer_type: str, **options) -> None:
        import sentencepiece

        super().__init__(model_file, **options)
        path = _require_file(model_file, "--tokenizer-model", tokenizer_type)
        try:
            self.tokenizer = sentencepiece.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as err:
            raise TokenizerError(f"--tokenizer-model: {path} is not a SentencePiece model ({err})") from err
        self._vocab = {self.tokenizer.id_to_piece(i): i for i in range(len(self.tokenizer))}
        self._inv_vocab = {i: p for p, i in self._vocab.items()}

    def _piece_or(self, piece_id: int, fallback: str) -> str:
        """The piece of a special id, or ``fallback`` when the model has none (id -1)."""
        try:
            return self.tokenizer.id_to_piece(piece_id)
        except IndexError:
            return fallback

    vocab_size = property(lambda self: len(self._vocab))
    vocab = property(lambda self: self._vocab)
    inv_vocab = property(lambda self: self._inv_vocab)
    encoder = vocab
    decoder = inv_vocab


class SentencePieceTokenizer(_SentencePieceBase):
    """``--tokenizer-type SentencePieceTokenizer`` (Megatron-LM's _SentencePieceTokenizer).

    Special pieces are looked up or appended after the model's pieces, in this order:
    ``<CLS> <SEP> <EOD> <MASK>``, the model's pad, bos and eos pieces (``<PAD> <BOS> <EOS>``
    when it has none), then ``<extra_id_0>`` ... for ``--vocab-extra-ids``. ``eod`` is the
    ``<EOD>`` piece, and every special piece written in the text is encoded as its id."""

    megatron_class = "_SentencePieceTokenizer"

    def __init__(self, model_file, vocab_extra_ids: int = 0) -> None:
        super().__init__(model_file, "SentencePieceTokenizer", vocab_extra_ids=vocab_extra_ids)
        self._special_tokens: dict[str, int] = {}
        self._inv_special_tokens: dict[int, str] = {}
        self._cls_id = self._add_special("<CLS>")
        self._sep_id = self._add_special("<SEP>")
        self._eod_id = self._add_special("<EOD>")
        self._mask_id = self._add_special("<MASK>")
        self._pad_id = self._add_special(self._piece_or(self.tokenizer.pad_id(), "<PAD>"))
        self._bos_id = self._add_special(self._piece_or(self.tokenizer.bos_id(), "<BOS>"))
        self._eos_id = self._add_special(self._piece_or(self.tokenizer.eos_id(), "<EOS>"))
        self._t5_tokens = [f"<extra_id_{i}>" for i in range(int(vocab_extra_ids))]
        for token in self._t5_tokens:
            self._add_special(token)

    def _add_special(self, token: str) -> int:
        if token not in self._vocab:
            self._vocab[token] = len(self._vocab)
            self._inv_vocab[self._vocab[token]] = token
        self._special_tokens[token] = self._vocab[token]
        self._inv_special_tokens[self._vocab[token]] = token
        return self._vocab[token]

    def tokenize(self, text: str) -> list[int]:
        return _split_on_specials(text, self._special_tokens, self.tokenizer.encode_as_ids)

    def detokenize(self, ids) -> str:
        """Text between special ids decoded by SentencePiece; each special piece is written
        with a space on both sides (as Megatron-LM does)."""
        ids = [int(i) for i in ids]
        text, last = "", 0
        for i, token_id in enumerate(ids):
            if token_id in self._inv_special_tokens:
                text += self.tokenizer.decode_ids(ids[last:i]) + " "
                text += self._inv_special_tokens[token_id] + " "
                last = i + 1
        return text + self.tokenizer.decode_ids(ids[last:])

    cls = property(lambda self: self._cls_id)
    sep = property(lambda self: self._sep_id)
    pad = property(lambda self: self._pad_id)
    bos = property(lambda self: self._bos_id)
    eod = property(lambda self: self._eod_id)
    eos = property(lambda self: self._eos_id)
    mask = property(lambda self: self._mask_id)
    additional_special_tokens_ids = property(lambda self: [self._vocab[t] for t in self._t5_tokens])


class GPTSentencePieceTokenizer(_SentencePieceBase):
    """``--tokenizer-type GPTSentencePieceTokenizer``: plain SentencePiece ids, the model's own
    vocabulary; eod is the model's eos id, pad/bos its pad/bos ids (-1 when absent)."""

    megatron_class = "_GPTSentencePieceTokenizer"

    def __init__(self, model_file) -> None:
        super().__init__(model_file, "GPTSentencePieceTokenizer", vocab_extra_ids=0)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode_as_ids(text)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode_ids([int(i) for i in ids])

    cls = sep = mask = property(lambda self: -1)
    pad = property(lambda self: self.tokenizer.pad_id())
    bos = property(lambda self: self.tokenizer.bos_id())
    eos = eod = property(lambda self: self.tokenizer.eos_id())
    additional_special_tokens_ids = None


class Llama2Tokenizer(_SentencePieceBase):
    """``--tokenizer-type Llama2Tokenizer``: SentencePiece ids with the bos id in front of every
    text (``tokenize(text, bos=True, eos=False)``); eod is the eos id.

    Like Megatron-LM's _Llama2Tokenizer it has ``bos_id``/``eos_id``/``pad_id`` but no
    ``pad``/``bos``/``eos`` (reading them raises AttributeError there and here)."""

    megatron_class = "_Llama2Tokenizer"

    def __init__(self, model_file) -> None:
        super().__init__(model_file, "Llama2Tokenizer", vocab_extra_ids=0)
        self.n_words = self.tokenizer.vocab_size()
        self.bos_id = self.tokenizer.bos_id()
        self.eos_id = self.tokenizer.eos_id()
        self.pad_id = self.tokenizer.pad_id()
        if self.bos_id < 0:
            raise TokenizerError(
                f"--tokenizer-model: {model_file} has no bos piece, which Llama2Tokenizer puts before every text"
            )

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        return [self.bos_id] * bos + self.tokenizer.encode(text) + [self.eos_id] * eos

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode_ids([int(i) for i in ids])

    def _absent(self, name: str):
        raise AttributeError(f"Llama2Tokenizer has no {name!r} (Megatron-LM's has {name}_id only)")

    cls = sep = mask = property(lambda self: -1)
    eod = property(lambda self: self.eos_id)
    pad = property(lambda self: self._absent("pad"))
    bos = property(lambda self: self._absent("bos"))
    eos = property(lambda self: self._absent("eos"))
    additional_special_tokens_ids = None


# --------------------------------------------------------------------------------------------
# Hugging Face, tiktoken, null
# --------------------------------------------------------------------------------------------


def require_local_folder(path, flag: str = "--tokenizer-model") -> str:
    """A local folder (this project never downloads a tokenizer from the hub)."""
    if path is None:
        raise TokenizerError(f"--tokenizer-type HuggingFaceTokenizer needs {flag} (a local tokenizer folder)")
    p = os.fspath(path)
    if not os.path.isdir(p):
        raise TokenizerError(
            f"{flag}: {p} is not a local folder; HuggingFaceTokenizer loads a saved tokenizer folder "
            "(tokenizer.json / tokenizer_config.json) and never downloads one from the hub"
        )
    return p


class HuggingFaceTokenizer(MegatronCompatTokenizer):
    """``--tokenizer-type HuggingFaceTokenizer``: ``AutoTokenizer`` on a local folder; ids of
    ``tokenizer(text).input_ids`` (with the tokenizer's own special tokens, e.g. a bos);
    ``vocab_size`` is ``len(tokenizer)``, eod/bos/pad its eos/bos/pad token ids (None if unset)."""

    megatron_class = "_HuggingFaceTokenizer"

    def __init__(self, tokenizer_model, trust_remote_code: bool = False) -> None:
        super().__init__(tokenizer_model)
        path = require_local_folder(tokenizer_model)
        try:
            import transformers
        except ImportError as err:
            raise TokenizerError(
                "--tokenizer-type HuggingFaceTokenizer needs transformers: pip install transformers"
            ) from err
        try:
            self._tokenizer = transformers.AutoTokenizer.from_pretrained(
                path, trust_remote_code=trust_remote_code, local_files_only=True
            )
        except Exception as err:  # transformers raises many kinds here; the message says which
            raise TokenizerError(
                f"--tokenizer-model: cannot load a Hugging Face tokenizer from {path} ({err})"
            ) from err
        self._vocab = self._tokenizer.get_vocab()
        self._inv_vocab = {i: t for t, i in self._vocab.items()}

    def tokenize(self, text: str, **kwargs) -> list[int]:
        return self._tokenizer(text, **kwargs).input_ids

    def detokenize(self, token_ids, **kwargs) -> str:
        return self._tokenizer.decode([int(t) for t in token_ids], **kwargs)

    vocab_size = property(lambda self: len(self._tokenizer))
    vocab = property(lambda self: self._vocab)
    inv_vocab = decoder = property(lambda self: self._inv_vocab)
    eod = property(lambda self: self._tokenizer.eos_token_id)
    bos = property(lambda self: self._tokenizer.bos_token_id)
    pad = property(lambda self: self._tokenizer.pad_token_id)


def read_tiktoken_ranks(path: str, max_vocab: int | None) -> dict[bytes, int]:
    """A tiktoken vocabulary JSON (a list of ``{"rank", "token_bytes", "token_str"}``, ranks
    0.. in order, the first 256 the single bytes), cut to ``max_vocab`` entries."""
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (OSError, ValueError) as err:
        raise TokenizerError(f"--tokenizer-model: cannot read {path} as a tiktoken JSON vocabulary ({err})") from err
    if not isinstance(entries, list):
        raise TokenizerError(f"--tokenizer-model: {path} must hold a JSON list of tokens")
    ranks: dict[bytes, int] = {}
    for i, entry in enumerate(entries[:max_vocab] if max_vocab is not None else entries):
        if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"} or entry["rank"] != i:
            raise TokenizerError(f"--tokenizer-model: {path}: entry {i} is not {{rank: {i}, token_bytes, token_str}}")
        token = base64.b64decode(entry["token_bytes"])
        if i < 256 and token != bytes([i]):
            raise TokenizerError(f"--tokenizer-model: {path}: entry {i} must be the single byte {i}")
        ranks[token] = i
    if len(ranks) != len(entries[:max_vocab] if max_vocab is not None else entries):
        raise TokenizerError(f"--tokenizer-model: {path}: repeated token bytes")
    return ranks


def _tiktoken_specials(special_tokens, num_special_tokens: int, vocab_size: int) -> list[str]:
    """The special tokens, then ``<SPECIAL_i>`` fillers up to ``num_special_tokens``."""
    required = ["<unk>", "<s>", "</s>"]
    specials = list(special_tokens) if special_tokens is not None else list(required)
    if len(set(specials)) != len(specials):
        raise TokenizerError(f"--tokenizer-special-tokens must be unique: {specials}")
    if not len(specials) <= num_special_tokens < vocab_size:
        raise TokenizerError(
            f"--tiktoken-num-special-tokens {num_special_tokens} must be >= the {len(specials)} special "
            f"tokens and < --vocab-size {vocab_size}"
        )
    if not set(required) <= set(specials):
        raise TokenizerError(f"--tokenizer-special-tokens must include {required}")
    return specials + [f"<SPECIAL_{i}>" for i in range(len(specials), num_special_tokens)]


class TikTokenizer(MegatronCompatTokenizer):
    """``--tokenizer-type TikTokenizer`` (Megatron-LM's CustomTikTokenizer): ids 0..n-1 are the
    special tokens (``<unk> <s> </s>`` by default, then ``<SPECIAL_i>``), the file's tokens
    follow; ``tokenize`` is tiktoken's ``encode_ordinary``; eod is ``</s>``; no pad."""

    megatron_class = "CustomTikTokenizer"

    def __init__(self, path, pattern: str, vocab_size=None, num_special_tokens=1000, special_tokens=None) -> None:
        pat_str = TIKTOKEN_PATTERNS[pattern] if pattern in TIKTOKEN_PATTERNS else pattern
        super().__init__(
            path,
            pattern=pat_str,
            vocab_size=vocab_size,
            num_special_tokens=num_special_tokens,
            special_tokens=special_tokens,
        )
        tiktoken = import_tiktoken()
        path = _require_file(path, "--tokenizer-model", "TikTokenizer")
        if not path.endswith(".json"):
            raise TokenizerError(f"--tokenizer-model: TikTokenizer reads a .json vocabulary, got {path}")
        self._vocab_size = int(vocab_size) if vocab_size is not None else 2**17
        specials = _tiktoken_specials(special_tokens, int(num_special_tokens), self._vocab_size)
        ranks = read_tiktoken_ranks(path, self._vocab_size - len(specials))
        ranks = {token: rank + len(specials) for token, rank in ranks.items()}
        special_ids = {token: i for i, token in enumerate(specials)}
        if len(ranks) + len(specials) != self._vocab_size:
            raise TokenizerError(
                f"--tokenizer-model: {path} has {len(ranks)} tokens; --vocab-size {self._vocab_size} needs "
                f"{self._vocab_size - len(specials)} after {len(specials)} special tokens"
            )
        self._unk_id, self._bos_id, self._eos_id = (special_ids[t] for t in ("<unk>", "<s>", "</s>"))
        self._model = tiktoken.Encoding(
            name=Path(path).parent.name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=special_ids
        )
        self._token_to_id = {**ranks, **special_ids}
        self._id_to_token = {v: k for k, v in self._token_to_id.items()}

    def tokenize(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        return [self._bos_id] * bos + self._model.encode_ordinary(text) + [self._eos_id] * eos

    def detokenize(self, tokens) -> str:
        return self._model.decode([int(t) for t in tokens])

    def _absent_pad(self):
        raise AttributeError("TikTokenizer has no pad id (Megatron-LM's CustomTikTokenizer never sets one)")

    vocab_size = property(lambda self: self._vocab_size)
    vocab = encoder = property(lambda self: self._token_to_id)
    inv_vocab = decoder = property(lambda self: self._id_to_token)
    bos = property(lambda self: self._bos_id)
    eos = eod = property(lambda self: self._eos_id)
    unk = property(lambda self: self._unk_id)
    pad = property(lambda self: self._absent_pad())


def import_tiktoken():
    try:
        import tiktoken
    except ImportError as err:
        raise TokenizerError("--tokenizer-type TikTokenizer needs the tiktoken package: pip install tiktoken") from err
    return tiktoken


class NullTokenizer(MegatronCompatTokenizer):
    """``--tokenizer-type NullTokenizer --vocab-size N``: text is space-separated ids; eod is N
    and ``vocab_size`` is N + 1 (the ids and the eod)."""

    megatron_class = "_NullTokenizer"

    def __init__(self, vocab_size) -> None:
        super().__init__(None, vocab_size=vocab_size)
        self._eod_id = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split(" ")]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(x)) for x in ids)

    vocab_size = property(lambda self: self._eod_id + 1)
    eod = property(lambda self: self._eod_id)
    cls = sep = mask = property(lambda self: -1)
    additional_special_tokens_ids = None


# --------------------------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------------------------


def build_tokenizer(
    tokenizer_type: str,
    *,
    tokenizer_model=None,
    vocab_file=None,
    merge_file=None,
    vocab_size: int | None = None,
    vocab_extra_ids: int = 0,
    tokenizer_special_tokens: list[str] | None = None,
    tiktoken_pattern: str | None = None,
    tiktoken_num_special_tokens: int = 1000,
    trust_remote_code: bool = False,
):
    """The tokenizer Megatron-LM's ``build_tokenizer(args)`` (training) builds for these flags
    (arguments named as Megatron-LM's ``args``). Errors name the flag that is wrong."""
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model, vocab_extra_ids=vocab_extra_ids)
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model, trust_remote_code=trust_remote_code)
    if tokenizer_type == "TikTokenizer":
        if tiktoken_pattern not in TIKTOKEN_PATTERNS:
            raise TokenizerError(
                f"--tokenizer-type TikTokenizer needs --tiktoken-pattern v1 or v2, got {tiktoken_pattern}"
            )
        return TikTokenizer(
            tokenizer_model, tiktoken_pattern, vocab_size, tiktoken_num_special_tokens, tokenizer_special_tokens
        )
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or int(vocab_size) < 1:
            raise TokenizerError("--tokenizer-type NullTokenizer needs --vocab-size >= 1")
        return NullTokenizer(vocab_size)
    raise TokenizerError(
        f"--tokenizer-type: unsupported {tokenizer_type!r}; choose one of {', '.join(SUPPORTED_TOKENIZER_TYPES)}"
    )


def _core_tokenizer_args(tokenizer_type: str, options: dict):
    """The ``args`` megatron-core's ``megatron.core.tokenizers.text.utils.build_tokenizer`` reads."""
    from argparse import Namespace

    return Namespace(
        tokenizer_type=tokenizer_type,
        tokenizer_model=options.get("tokenizer_model"),
        vocab_file=options.get("vocab_file"),
        merge_file=options.get("merge_file"),
        vocab_size=options.get("vocab_size"),
        tokenizer_special_tokens=options.get("tokenizer_special_tokens"),
        tokenizer_metadata=options.get("tokenizer_metadata"),
        tokenizer_sentencepiece_legacy=options.get("tokenizer_sentencepiece_legacy", False),
        tokenizer_hf_use_fast=options.get("tokenizer_hf_use_fast", False),
        tokenizer_hf_include_special_tokens=options.get("tokenizer_hf_include_special_tokens", False),
        trust_remote_code=options.get("trust_remote_code", False),
        tiktoken_pattern=options.get("tiktoken_pattern"),
        tiktoken_num_special_tokens=options.get("tiktoken_num_special_tokens", 1000),
    )


_FILE_OPTIONS = ("tokenizer_model", "vocab_file", "merge_file")
_LEGACY_OPTIONS = (
    "tokenizer_model",
    "vocab_file",
    "merge_file",
    "vocab_size",
    "tokenizer_special_tokens",
    "tiktoken_pattern",
    "tiktoken_num_special_tokens",
    "trust_remote_code",
)


def build_preprocess_tokenizer(tokenizer_type: str, *, legacy_tokenizer: bool = False, **options):
    """The tokenizer Megatron-LM's tools/preprocess_data.py (core_v0.16.1) encodes with.

    ``legacy_tokenizer`` (``--legacy-tokenizer``): ``build_tokenizer`` with vocab_extra_ids 0
    (that tool overrides ``--vocab-extra-ids`` with 0). Otherwise megatron-core's
    ``megatron.core.tokenizers`` as that tool builds it, except two things that would need the
    hub there: GPT2BPETokenizer is our BPE with ``<|endoftext|>`` in the text mapped to its id
    (as the Hugging Face GPT-2 tokenizer it loads does), and HuggingFaceTokenizer must be a
    local folder. ``options`` are ``build_tokenizer``'s keyword arguments plus
    tokenizer_metadata, tokenizer_sentencepiece_legacy, tokenizer_hf_use_fast and
    tokenizer_hf_include_special_tokens."""
    if tokenizer_type not in SUPPORTED_TOKENIZER_TYPES:
        build_tokenizer(tokenizer_type)  # raises the unsupported-type error
    options = {k: os.fspath(v) if k in _FILE_OPTIONS and v is not None else v for k, v in options.items()}
    if legacy_tokenizer:
        return build_tokenizer(tokenizer_type, **{k: options[k] for k in _LEGACY_OPTIONS if k in options})
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(options.get("vocab_file"), options.get("merge_file"), split_special=(GPT2_EOD_TOKEN,))
    if tokenizer_type == "HuggingFaceTokenizer":
        require_local_folder(options.get("tokenizer_model"))
    elif tokenizer_type == "TikTokenizer":
        import_tiktoken()
    if tokenizer_type == "NullTokenizer" and not options.get("vocab_size"):
        raise TokenizerError("--tokenizer-type NullTokenizer needs --vocab-size >= 1")
    if tokenizer_type != "NullTokenizer":
        _require_path(tokenizer_type, options.get("tokenizer_model"))
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer as build_core_tokenizer

    try:
        return build_core_tokenizer(_core_tokenizer_args(tokenizer_type, options))
    except (AssertionError, ValueError, OSError, RuntimeError) as err:
        flag = (
            "--vocab-size" if tokenizer_type == "NullTokenizer" else f"--tokenizer-model {options['tokenizer_model']}"
        )
        raise TokenizerError(
            f"{flag}: megatron.core.tokenizers cannot build a {tokenizer_type} from it ({err})"
        ) from err


def _require_path(tokenizer_type: str, path) -> None:
    if path is None:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model")
    if not os.path.exists(os.fspath(path)):
        raise TokenizerError(f"--tokenizer-model: no such file or folder: {os.fspath(path)}")
