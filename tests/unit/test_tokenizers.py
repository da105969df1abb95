"""Megatron-LM-compatible tokenizers (megatron_mfsdp/data/tokenizers.py) against golden values
from Megatron-LM's own tokenizer classes, on tiny tokenizer files built here deterministically:

* ``make_gpt2_files``: a GPT-2 byte-level BPE ``vocab.json`` + ``merges.txt`` learned by a
  plain BPE (ties broken by sort order) on ``BPE_TRAIN_TEXT``; ``drop_piece`` leaves one merged
  piece out of vocab.json (Megatron-LM gives such a piece id 0).
* ``make_sentencepiece_model``: a SentencePiece unigram model written as protobuf bytes by hand
  (no trainer, so the model does not depend on the sentencepiece version).
* ``make_hf_folder``: a local Hugging Face tokenizer folder (BPE on the GPT-2 files, a ``<s>``
  put in front by its post-processor, ``<s> </s> <pad>`` as added special tokens).
* ``make_tiktoken_json``: a tiktoken vocabulary JSON (256 bytes, then the BPE's pieces).

How MEGATRON_GOLDEN was produced: the fixture files below were written to a folder ``FX``
(``FX/gpt2``, ``FX/gpt2drop`` with ``drop_piece=28``, ``FX/sp_pad.model``, ``FX/sp_nopad.model``
with ``with_pad=False``, ``FX/hfx/hf``, ``FX/tik/vocab.json``), then with Megatron-LM at tag
core_v0.16.1 on PYTHONPATH, the classes of megatron/training/tokenizer/tokenizer.py were built
on them exactly as that file's ``build_tokenizer(args)`` builds them: ``_GPT2BPETokenizer(vocab,
merges)``, ``_SentencePieceTokenizer(model, vocab_extra_ids=0 or 3)`` (cases ``*_SP``/``*_SPx3``),
``_GPTSentencePieceTokenizer(model)``, ``_Llama2Tokenizer(model)``, ``_HuggingFaceTokenizer(folder)``,
``_NullTokenizer(1000)`` and ``CustomTikTokenizer(json, PATTERN_TIKTOKEN_V2, 300, 20, None)``.
For each we recorded ``tokenize(TEXT)`` (``"1 2 3 999 0"`` for Null), ``detokenize`` of those ids,
``vocab_size``, ``eod``, ``pad``, ``bos``, ``eos``, ``cls``, ``sep``, ``mask``,
``additional_special_tokens_ids`` (or the exception reading it raised) and
``unique_identifiers`` (paths relative to FX here).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import struct
import sys
from collections import Counter
from pathlib import Path

import pytest

from megatron_mfsdp.data import datasets, tokenizers
from megatron_mfsdp.data.tokenizers import (
    GPT2_PATTERN,
    TokenizerError,
    build_preprocess_tokenizer,
    build_tokenizer,
    bytes_to_unicode,
)

BPE_TRAIN_TEXT = (
    "the quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs!\n"
    "hello world, hello there, world of words: naïve café, 日本語 text, numbers 12345 and 678.\n"
    "def tokenize(text):\n    return [t for t in text.split()]  # it's done, isn't it?\n"
) * 3

# Unicode, blank lines, runs of spaces, a tab, CRLF and strings that look like special tokens.
TEXT = (
    "Hello world! The naïve café – 日本語 ✓ 🐍\n\n  spaced   out\tend\r\n"
    "<|endoftext|> <EOD> <CLS><SEP> <MASK> <s> </s> <pad> <extra_id_0> it's 12345 don't"
)


def _pretokenize(text: str) -> list[str]:
    import regex

    byte_map = bytes_to_unicode()
    return ["".join(byte_map[b] for b in chunk.encode("utf-8")) for chunk in regex.findall(GPT2_PATTERN, text)]


def learn_bpe(text: str, num_merges: int) -> list[tuple[str, str]]:
    """Most frequent adjacent pair first, ties broken by the pair's sort order."""
    words = Counter(tuple(w) for w in _pretokenize(text))
    merges = []
    for _ in range(num_merges):
        pairs = Counter()
        for word, freq in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += freq
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged = Counter()
        for word, freq in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += freq
        words = merged
    return merges


def make_gpt2_files(folder: Path, num_merges: int = 120, drop_piece: int | None = None) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    merges = learn_bpe(BPE_TRAIN_TEXT, num_merges)
    byte_map = bytes_to_unicode()
    vocab = {byte_map[b]: b for b in range(256)}
    for i, (a, b) in enumerate(merges):
        if i != drop_piece and a + b not in vocab:
            vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    vocab_path, merges_path = folder / "vocab.json", folder / "merges.txt"
    vocab_path.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges_path.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    return vocab_path, merges_path


# --- SentencePiece ModelProto, written by hand (sentencepiece_model.proto field numbers) ---


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _bytes_field(number: int, data: bytes | str) -> bytes:
    data = data.encode("utf-8") if isinstance(data, str) else data
    return _field(number, 2, _varint(len(data)) + data)


def _int_field(number: int, value: int) -> bytes:
    return _field(number, 0, _varint(value))


NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
SP_WORDS = [
    "▁the", "▁hello", "▁world", "▁Hello", "▁it", "'s", "▁don", "'t", "▁end", "▁out", "▁spaced",
    "▁caf", "é", "▁na", "ï", "ve", "▁", "e", "t", "o", "l", "d", "s", "n", "a", "r", "H", "w",
    "p", "c", "1", "2", "3", "4", "5", "!", "<", ">", "/", "|", "x", "i", "_", "0", "E", "O", "D",
    "C", "L", "S", "P", "M", "A", "K", "\n", "\t", "\r",
]  # fmt: skip


def make_sentencepiece_model(path: Path, with_pad: bool = True) -> Path:
    """A unigram model: ``<unk> <s> </s>`` (and ``<pad>``), 256 byte pieces, a user-defined
    ``<MASK>``, then ``SP_WORDS`` with falling scores; dummy prefix on, spaces kept."""
    pieces = [("<unk>", 0.0, UNKNOWN), ("<s>", 0.0, CONTROL), ("</s>", 0.0, CONTROL)]
    pieces += [("<pad>", 0.0, CONTROL)] if with_pad else []
    pieces += [(f"<0x{b:02X}>", 0.0, BYTE) for b in range(256)]
    pieces += [("<MASK>", 0.0, USER_DEFINED)]
    pieces += [(w, -1.0 - 0.25 * k, NORMAL) for k, w in enumerate(SP_WORDS)]
    proto = b"".join(
        _bytes_field(1, _bytes_field(1, p) + _field(2, 5, struct.pack("<f", s)) + _int_field(3, t))
        for p, s, t in pieces
    )
    trainer = _int_field(3, 1) + _int_field(4, len(pieces)) + _int_field(35, 1)
    trainer += _int_field(43, 3) if with_pad else _int_field(43, -1)
    normalizer = _bytes_field(1, "identity") + _int_field(3, 1) + _int_field(4, 0) + _int_field(5, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(proto + _bytes_field(2, trainer) + _bytes_field(3, normalizer))
    return path


def make_hf_folder(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab_path, merges_path = make_gpt2_files(folder / "bpe")
    vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
    merges = [tuple(line.split()) for line in merges_path.read_text(encoding="utf-8").split("\n")[1:-1]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(str(folder / "hf"))
    return folder / "hf"


def make_tiktoken_json(path: Path) -> Path:
    byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
    tokens = [bytes([b]) for b in range(256)]
    for a, b in learn_bpe(BPE_TRAIN_TEXT, 120):
        merged = bytes(byte_decoder[c] for c in a + b)
        if merged not in tokens:
            tokens.append(merged)
    entries = [
        {"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("utf-8", "replace")}
        for i, t in enumerate(tokens)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries), encoding="utf-8")
    return path


# fmt: off
MEGATRON_GOLDEN = {
    'gpt2': {
        'vocab_size': 377,
        'eod': 376,
        'pad': NotImplementedError,
        'bos': NotImplementedError,
        'eos': NotImplementedError,
        'cls': NotImplementedError,
        'sep': NotImplementedError,
        'mask': NotImplementedError,
        'additional_special_tokens_ids': AttributeError,
        'uid': {
            'class': '_GPT2BPETokenizer',
            'tokenizer_path': ['gpt2/vocab.json', 'gpt2/merges.txt'],
        },
        'detok': TEXT,
        'ids': [
            72, 101, 108, 108, 111, 284, 33, 365, 277, 307, 369, 32, 226, 128, 147, 32, 359, 32, 226, 156, 147, 32,
            240, 159, 144, 141, 10, 10, 32, 32, 115, 112, 97, 99, 101, 100, 279, 278, 117, 116, 9, 320, 100, 13, 10,
            60, 124, 320, 260, 102, 348, 124, 62, 32, 60, 69, 79, 68, 62, 32, 60, 67, 76, 83, 62, 60, 83, 69, 80, 62,
            32, 60, 77, 65, 83, 75, 62, 32, 60, 115, 62, 32, 60, 47, 115, 62, 32, 60, 112, 97, 100, 62, 32, 60, 262,
            114, 97, 95, 105, 100, 95, 48, 62, 282, 285, 363, 264, 110, 286
        ],
    },
    'gpt2drop': {
        'vocab_size': 376,
        'eod': 375,
        'pad': NotImplementedError,
        'bos': NotImplementedError,
        'eos': NotImplementedError,
        'cls': NotImplementedError,
        'sep': NotImplementedError,
        'mask': NotImplementedError,
        'additional_special_tokens_ids': AttributeError,
        'uid': {
            'class': '_GPT2BPETokenizer',
            'tokenizer_path': ['gpt2drop/vocab.json', 'gpt2drop/merges.txt'],
        },
        'detok': (
            'Hello\x00! The naïve café – 日本語 ✓ 🐍\n\n  spaced   out\tend\r\n<|endo'
            'ftext|> <EOD> <CLS><SEP> <MASK> <s> </s> <pad> <extra_id_0> '
            "it's 12345 don't"
        ),
        'ids': [
            72, 101, 108, 108, 111, 0, 33, 364, 277, 306, 368, 32, 226, 128, 147, 32, 358, 32, 226, 156, 147, 32, 240,
            159, 144, 141, 10, 10, 32, 32, 115, 112, 97, 99, 101, 100, 279, 278, 117, 116, 9, 319, 100, 13, 10, 60,
            124, 319, 260, 102, 347, 124, 62, 32, 60, 69, 79, 68, 62, 32, 60, 67, 76, 83, 62, 60, 83, 69, 80, 62, 32,
            60, 77, 65, 83, 75, 62, 32, 60, 115, 62, 32, 60, 47, 115, 62, 32, 60, 112, 97, 100, 62, 32, 60, 262, 114,
            97, 95, 105, 100, 95, 48, 62, 282, 284, 362, 264, 110, 285
        ],
    },
    'sp_pad_SP': {
        'vocab_size': 321,
        'eod': 320,
        'pad': 3,
        'bos': 1,
        'eos': 2,
        'cls': 318,
        'sep': 319,
        'mask': 260,
        'additional_special_tokens_ids': [],
        'uid': {
            'class': '_SentencePieceTokenizer',
            'tokenizer_path': ['sp_pad.model'],
            'vocab_extra_ids': '0',
        },
        'detok': (
            'Hello world! The naïve café – 日本語 ✓ 🐍\n\n  spaced   out\tend\r\n<'
            '|endoftext|>  <EOD>   <CLS>  <SEP>   <MASK>   <s>   </s>   <'
            "pad>  <extra_id_0> it's 12345 don't"
        ),
        'ids': [
            264, 263, 296, 277, 88, 108, 278, 274, 275, 276, 272, 273, 277, 230, 132, 151, 277, 234, 155, 169, 234,
            160, 176, 236, 174, 162, 277, 230, 160, 151, 277, 244, 163, 148, 145, 315, 315, 277, 271, 277, 277, 270,
            316, 278, 284, 282, 317, 315, 297, 300, 278, 284, 282, 280, 106, 279, 278, 301, 279, 300, 298, 277, 320,
            277, 277, 318, 319, 277, 277, 260, 277, 277, 1, 277, 277, 2, 277, 277, 3, 277, 277, 297, 278, 301, 279,
            286, 285, 303, 302, 282, 303, 304, 298, 265, 266, 277, 291, 292, 293, 294, 295, 267, 268
        ],
    },
    'sp_pad_SPx3': {
        'vocab_size': 324,
        'eod': 320,
        'pad': 3,
        'bos': 1,
        'eos': 2,
        'cls': 318,
        'sep': 319,
        'mask': 260,
        'additional_special_tokens_ids': [
            321, 322, 323
        ],
        'uid': {
            'class': '_SentencePieceTokenizer',
            'tokenizer_path': ['sp_pad.model'],
            'vocab_extra_ids': '3',
        },
        'detok': (
            'Hello world! The naïve café – 日本語 ✓ 🐍\n\n  spaced   out\tend\r\n<'
            '|endoftext|>  <EOD>   <CLS>  <SEP>   <MASK>   <s>   </s>   <'
            "pad>   <extra_id_0>  it's 12345 don't"
        ),
        'ids': [
            264, 263, 296, 277, 88, 108, 278, 274, 275, 276, 272, 273, 277, 230, 132, 151, 277, 234, 155, 169, 234,
            160, 176, 236, 174, 162, 277, 230, 160, 151, 277, 244, 163, 148, 145, 315, 315, 277, 271, 277, 277, 270,
            316, 278, 284, 282, 317, 315, 297, 300, 278, 284, 282, 280, 106, 279, 278, 301, 279, 300, 298, 277, 320,
            277, 277, 318, 319, 277, 277, 260, 277, 277, 1, 277, 277, 2, 277, 277, 3, 277, 277, 321, 277, 265, 266,
            277, 291, 292, 293, 294, 295, 267, 268
        ],
    },
    'sp_pad_GPTSP': {
        'vocab_size': 318,
        'eod': 2,
        'pad': 3,
        'bos': 1,
        'eos': 2,
        'cls': -1,
        'sep': -1,
        'mask': -1,
        'additional_special_tokens_ids': None,
        'uid': {
            'class': '_GPTSentencePieceTokenizer',
            'tokenizer_path': ['sp_pad.model'],
            'vocab_extra_ids': '0',
        },
        'detok': TEXT,
        'ids': [
            264, 263, 296, 277, 88, 108, 278, 274, 275, 276, 272, 273, 277, 230, 132, 151, 277, 234, 155, 169, 234,
            160, 176, 236, 174, 162, 277, 230, 160, 151, 277, 244, 163, 148, 145, 315, 315, 277, 271, 277, 277, 270,
            316, 278, 284, 282, 317, 315, 297, 300, 278, 284, 282, 280, 106, 279, 278, 301, 279, 300, 298, 277, 297,
            305, 306, 307, 298, 277, 297, 308, 309, 310, 298, 297, 310, 305, 311, 298, 277, 260, 277, 297, 283, 298,
            277, 297, 299, 283, 298, 277, 297, 289, 285, 282, 298, 277, 297, 278, 301, 279, 286, 285, 303, 302, 282,
            303, 304, 298, 265, 266, 277, 291, 292, 293, 294, 295, 267, 268
        ],
    },
    'sp_pad_Llama2': {
        'vocab_size': 318,
        'eod': 2,
        'pad': AttributeError,
        'bos': AttributeError,
        'eos': AttributeError,
        'cls': -1,
        'sep': -1,
        'mask': -1,
        'additional_special_tokens_ids': None,
        'uid': {
            'class': '_Llama2Tokenizer',
            'tokenizer_path': ['sp_pad.model'],
            'vocab_extra_ids': '0',
        },
        'detok': TEXT,
        'ids': [
            1, 264, 263, 296, 277, 88, 108, 278, 274, 275, 276, 272, 273, 277, 230, 132, 151, 277, 234, 155, 169, 234,
            160, 176, 236, 174, 162, 277, 230, 160, 151, 277, 244, 163, 148, 145, 315, 315, 277, 271, 277, 277, 270,
            316, 278, 284, 282, 317, 315, 297, 300, 278, 284, 282, 280, 106, 279, 278, 301, 279, 300, 298, 277, 297,
            305, 306, 307, 298, 277, 297, 308, 309, 310, 298, 297, 310, 305, 311, 298, 277, 260, 277, 297, 283, 298,
            277, 297, 299, 283, 298, 277, 297, 289, 285, 282, 298, 277, 297, 278, 301, 279, 286, 285, 303, 302, 282,
            303, 304, 298, 265, 266, 277, 291, 292, 293, 294, 295, 267, 268
        ],
    },
    'sp_nopad_SP': {
        'vocab_size': 321,
        'eod': 319,
        'pad': 320,
        'bos': 1,
        'eos': 2,
        'cls': 317,
        'sep': 318,
        'mask': 259,
        'additional_special_tokens_ids': [],
        'uid': {
            'class': '_SentencePieceTokenizer',
            'tokenizer_path': ['sp_nopad.model'],
            'vocab_extra_ids': '0',
        },
        'detok': (
            'Hello world! The naïve café – 日本語 ✓ 🐍\n\n  spaced   out\tend\r\n<'
            '|endoftext|>  <EOD>   <CLS>  <SEP>   <MASK>   <s>   </s>  <p'
            "ad> <extra_id_0> it's 12345 don't"
        ),
        'ids': [
            263, 262, 295, 276, 87, 107, 277, 273, 274, 275, 271, 272, 276, 229, 131, 150, 276, 233, 154, 168, 233,
            159, 175, 235, 173, 161, 276, 229, 159, 150, 276, 243, 162, 147, 144, 314, 314, 276, 270, 276, 276, 269,
            315, 277, 283, 281, 316, 314, 296, 299, 277, 283, 281, 279, 105, 278, 277, 300, 278, 299, 297, 276, 319,
            276, 276, 317, 318, 276, 276, 259, 276, 276, 1, 276, 276, 2, 276, 276, 296, 288, 284, 281, 297, 276, 296,
            277, 300, 278, 285, 284, 302, 301, 281, 302, 303, 297, 264, 265, 276, 290, 291, 292, 293, 294, 266, 267
        ],
    },
    'sp_nopad_SPx3': {
        'vocab_size': 324,
        'eod': 319,
        'pad': 320,
        'bos': 1,
        'eos': 2,
        'cls': 317,
        'sep': 318,
        'mask': 259,
        'additional_special_tokens_ids': [
            321, 322, 323
        ],
        'uid': {
            'class': '_SentencePieceTokenizer',
            'tokenizer_path': ['sp_nopad.model'],
            'vocab_extra_ids': '3',
        },
        'detok': (
            'Hello world! The naïve café – 日本語 ✓ 🐍\n\n  spaced   out\tend\r\n<'
            '|endoftext|>  <EOD>   <CLS>  <SEP>   <MASK>   <s>   </s>  <p'
            "ad>  <extra_id_0>  it's 12345 don't"
        ),
        'ids': [
            263, 262, 295, 276, 87, 107, 277, 273, 274, 275, 271, 272, 276, 229, 131, 150, 276, 233, 154, 168, 233,
            159, 175, 235, 173, 161, 276, 229, 159, 150, 276, 243, 162, 147, 144, 314, 314, 276, 270, 276, 276, 269,
            315, 277, 283, 281, 316, 314, 296, 299, 277, 283, 281, 279, 105, 278, 277, 300, 278, 299, 297, 276, 319,
            276, 276, 317, 318, 276, 276, 259, 276, 276, 1, 276, 276, 2, 276, 276, 296, 288, 284, 281, 297, 276, 321,
            276, 264, 265, 276, 290, 291, 292, 293, 294, 266, 267
        ],
    },
    'sp_nopad_GPTSP': {
        'vocab_size': 317,
        'eod': 2,
        'pad': -1,
        'bos': 1,
        'eos': 2,
        'cls': -1,
        'sep': -1,
        'mask': -1,
        'additional_special_tokens_ids': None,
        'uid': {
            'class': '_GPTSentencePieceTokenizer',
            'tokenizer_path': ['sp_nopad.model'],
            'vocab_extra_ids': '0',
        },
        'detok': TEXT,
        'ids': [
            263, 262, 295, 276, 87, 107, 277, 273, 274, 275, 271, 272, 276, 229, 131, 150, 276, 233, 154, 168, 233,
            159, 175, 235, 173, 161, 276, 229, 159, 150, 276, 243, 162, 147, 144, 314, 314, 276, 270, 276, 276, 269,
            315, 277, 283, 281, 316, 314, 296, 299, 277, 283, 281, 279, 105, 278, 277, 300, 278, 299, 297, 276, 296,
            304, 305, 306, 297, 276, 296, 307, 308, 309, 297, 296, 309, 304, 310, 297, 276, 259, 276, 296, 282, 297,
            276, 296, 298, 282, 297, 276, 296, 288, 284, 281, 297, 276, 296, 277, 300, 278, 285, 284, 302, 301, 281,
            302, 303, 297, 264, 265, 276, 290, 291, 292, 293, 294, 266, 267
        ],
    },
    'sp_nopad_Llama2': {
        'vocab_size': 317,
        'eod': 2,
        'pad': AttributeError,
        'bos': AttributeError,
        'eos': AttributeError,
        'cls': -1,
        'sep': -1,
        'mask': -1,
        'additional_special_tokens_ids': None,
        'uid': {
            'class': '_Llama2Tokenizer',
            'tokenizer_path': ['sp_nopad.model'],
            'vocab_extra_ids': '0',
        },
        'detok': TEXT,
        'ids': [
            1, 263, 262, 295, 276, 87, 107, 277, 273, 274, 275, 271, 272, 276, 229, 131, 150, 276, 233, 154, 168, 233,
            159, 175, 235, 173, 161, 276, 229, 159, 150, 276, 243, 162, 147, 144, 314, 314, 276, 270, 276, 276, 269,
            315, 277, 283, 281, 316, 314, 296, 299, 277, 283, 281, 279, 105, 278, 277, 300, 278, 299, 297, 276, 296,
            304, 305, 306, 297, 276, 296, 307, 308, 309, 297, 296, 309, 304, 310, 297, 276, 259, 276, 296, 282, 297,
            276, 296, 298, 282, 297, 276, 296, 288, 284, 281, 297, 276, 296, 277, 300, 278, 285, 284, 302, 301, 281,
            302, 303, 297, 264, 265, 276, 290, 291, 292, 293, 294, 266, 267
        ],
    },
    'hf': {
        'vocab_size': 380,
        'eod': 378,
        'pad': 379,
        'bos': 377,
        'eos': NotImplementedError,
        'cls': NotImplementedError,
        'sep': NotImplementedError,
        'mask': NotImplementedError,
        'additional_special_tokens_ids': AttributeError,
        'uid': {
            'class': '_HuggingFaceTokenizer',
            'tokenizer_path': ['hfx/hf'],
        },
        'detok': (
            '<s>Hello world! The naïve café – 日本語 ✓ 🐍\n\n  spaced   out\tend'
            '\r\n<|endoftext|> <EOD> <CLS><SEP> <MASK> <s> </s> <pad> <extr'
            "a_id_0> it's 12345 don't"
        ),
        'ids': [
            377, 72, 101, 108, 108, 111, 284, 33, 365, 277, 307, 369, 32, 226, 128, 147, 32, 359, 32, 226, 156, 147,
            32, 240, 159, 144, 141, 10, 10, 32, 32, 115, 112, 97, 99, 101, 100, 279, 278, 117, 116, 9, 320, 100, 13,
            10, 60, 124, 320, 260, 102, 348, 124, 62, 32, 60, 69, 79, 68, 62, 32, 60, 67, 76, 83, 62, 60, 83, 69, 80,
            62, 32, 60, 77, 65, 83, 75, 62, 32, 377, 32, 378, 32, 379, 32, 60, 262, 114, 97, 95, 105, 100, 95, 48, 62,
            282, 285, 363, 264, 110, 286
        ],
    },
    'null': {
        'vocab_size': 1001,
        'eod': 1000,
        'pad': NotImplementedError,
        'bos': NotImplementedError,
        'eos': NotImplementedError,
        'cls': -1,
        'sep': -1,
        'mask': -1,
        'additional_special_tokens_ids': None,
        'uid': {
            'class': '_NullTokenizer',
            'tokenizer_path': [None],
            'vocab_size': '1000',
        },
        'detok': '1 2 3 999 0',
        'ids': [
            1, 2, 3, 999, 0
        ],
    },
    'tik': {
        'vocab_size': 300,
        'eod': 2,
        'pad': AttributeError,
        'bos': 1,
        'eos': 2,
        'cls': NotImplementedError,
        'sep': NotImplementedError,
        'mask': NotImplementedError,
        'additional_special_tokens_ids': AttributeError,
        'uid': {
            'class': 'CustomTikTokenizer',
            'tokenizer_path': ['tik/vocab.json'],
            'pattern': (
                '[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{'
                'Lm}\\p{Lo}\\p{M}]+|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}'
                '\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\'
                'r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+'
            ),
            'vocab_size': '300',
            'num_special_tokens': '20',
            'special_tokens': 'None',
        },
        'detok': TEXT,
        'ids': [
            92, 121, 128, 128, 131, 286, 292, 53, 52, 104, 276, 297, 117, 215, 195, 138, 121, 52, 119, 117, 122, 215,
            189, 52, 246, 148, 167, 52, 250, 171, 185, 250, 176, 192, 252, 190, 178, 52, 246, 176, 167, 52, 260, 179,
            164, 161, 30, 30, 52, 52, 135, 132, 117, 119, 121, 120, 299, 298, 137, 136, 29, 121, 130, 120, 33, 30, 80,
            144, 121, 130, 280, 122, 136, 282, 144, 82, 52, 80, 89, 99, 88, 82, 52, 80, 87, 96, 103, 82, 80, 103, 89,
            100, 82, 52, 80, 97, 85, 103, 95, 82, 52, 80, 135, 82, 52, 80, 67, 135, 82, 52, 80, 132, 117, 120, 82, 52,
            80, 282, 134, 117, 115, 125, 120, 115, 68, 82, 279, 136, 59, 135, 52, 69, 70, 71, 72, 73, 284, 130, 59,
            136
        ],
    },
}

# fmt: on


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Path:
    """The fixture folder FX of the module docstring."""
    d = tmp_path_factory.mktemp("fx")
    make_gpt2_files(d / "gpt2")
    make_gpt2_files(d / "gpt2drop", drop_piece=28)
    make_sentencepiece_model(d / "sp_pad.model", with_pad=True)
    make_sentencepiece_model(d / "sp_nopad.model", with_pad=False)
    make_tiktoken_json(d / "tik" / "vocab.json")
    if importlib.util.find_spec("transformers") is not None:
        make_hf_folder(d / "hfx")
    return d


def _sp_builders():
    for model in ("sp_pad", "sp_nopad"):
        yield f"{model}_SP", ("SentencePieceTokenizer", {"tokenizer_model": f"{model}.model"})
        yield f"{model}_SPx3", ("SentencePieceTokenizer", {"tokenizer_model": f"{model}.model", "vocab_extra_ids": 3})
        yield f"{model}_GPTSP", ("GPTSentencePieceTokenizer", {"tokenizer_model": f"{model}.model"})
        yield f"{model}_Llama2", ("Llama2Tokenizer", {"tokenizer_model": f"{model}.model"})


# case -> (--tokenizer-type, arguments; file arguments relative to FX)
BUILDS = {
    "gpt2": ("GPT2BPETokenizer", {"vocab_file": "gpt2/vocab.json", "merge_file": "gpt2/merges.txt"}),
    "gpt2drop": ("GPT2BPETokenizer", {"vocab_file": "gpt2drop/vocab.json", "merge_file": "gpt2drop/merges.txt"}),
    **dict(_sp_builders()),
    "hf": ("HuggingFaceTokenizer", {"tokenizer_model": "hfx/hf"}),
    "null": ("NullTokenizer", {"vocab_size": 1000}),
    "tik": (
        "TikTokenizer",
        {
            "tokenizer_model": "tik/vocab.json",
            "tiktoken_pattern": "v2",
            "vocab_size": 300,
            "tiktoken_num_special_tokens": 20,
        },
    ),
}
FILE_ARGS = ("tokenizer_model", "vocab_file", "merge_file")


def build(case: str, fx: Path):
    tokenizer_type, kwargs = BUILDS[case]
    kwargs = {k: str(fx / v) if k in FILE_ARGS else v for k, v in kwargs.items()}
    return build_tokenizer(tokenizer_type, **kwargs)


def _read(tok, name):
    """The attribute's value, or the class of the exception reading it raises."""
    try:
        return getattr(tok, name)
    except Exception as err:
        return type(err)


ATTRIBUTES = ("vocab_size", "eod", "pad", "bos", "eos", "cls", "sep", "mask", "additional_special_tokens_ids")


@pytest.mark.parametrize("case", sorted(MEGATRON_GOLDEN))
def test_ids_and_special_tokens_match_megatron(case, fx):
    if case == "tik":
        pytest.importorskip("tiktoken")
    if case == "hf":
        pytest.importorskip("transformers")
    gold = MEGATRON_GOLDEN[case]
    tok = build(case, fx)
    ids = tok.tokenize("1 2 3 999 0" if case == "null" else TEXT)
    assert [int(i) for i in ids] == gold["ids"]
    assert {a: _read(tok, a) for a in ATTRIBUTES} == {a: gold[a] for a in ATTRIBUTES}
    assert tok.detokenize(ids) == gold["detok"]
    paths = [None if p is None else str(fx / p) for p in gold["uid"]["tokenizer_path"]]
    assert dict(tok.unique_identifiers) == {**gold["uid"], "tokenizer_path": paths}
    assert json.loads(tok.unique_description) == dict(tok.unique_identifiers)


def test_goldens_exercise_the_quirks():
    """The golden text hits what an implementation could get wrong: a piece missing from
    vocab.json is id 0; ``<EOD>`` etc. in the text are special ids for SentencePieceTokenizer
    (appended after the model's pieces, a user-defined ``<MASK>`` reused), plain text otherwise."""
    assert 0 in MEGATRON_GOLDEN["gpt2drop"]["ids"] and 0 not in MEGATRON_GOLDEN["gpt2"]["ids"]
    sp = MEGATRON_GOLDEN["sp_nopad_SP"]
    n = sp["vocab_size"] - 4  # the model's pieces; <CLS> <SEP> <EOD> <PAD> appended, <MASK> reused
    assert (sp["cls"], sp["sep"], sp["eod"], sp["pad"]) == (n, n + 1, n + 2, n + 3)
    assert all(i in sp["ids"] for i in (sp["cls"], sp["sep"], sp["eod"], sp["mask"], sp["bos"], sp["eos"]))
    assert MEGATRON_GOLDEN["sp_pad_SPx3"]["additional_special_tokens_ids"] == [321, 322, 323]
    assert 321 in MEGATRON_GOLDEN["sp_pad_SPx3"]["ids"] and 321 not in MEGATRON_GOLDEN["sp_pad_SP"]["ids"]
    assert MEGATRON_GOLDEN["sp_pad_Llama2"]["ids"] == [1] + MEGATRON_GOLDEN["sp_pad_GPTSP"]["ids"]


def test_golden_comparison_catches_a_wrong_merge_order(fx, tmp_path):
    """The same merges in reverse priority give other ids: the golden test sees merge order."""
    lines = (fx / "gpt2" / "merges.txt").read_text(encoding="utf-8").split("\n")
    (tmp_path / "merges.txt").write_text("\n".join([lines[0], *reversed(lines[1:-1]), ""]), encoding="utf-8")
    tok = build_tokenizer(
        "GPT2BPETokenizer", vocab_file=str(fx / "gpt2/vocab.json"), merge_file=tmp_path / "merges.txt"
    )
    assert tok.tokenize(TEXT) != MEGATRON_GOLDEN["gpt2"]["ids"]
    assert tok.vocab_size == MEGATRON_GOLDEN["gpt2"]["vocab_size"]  # only the order differs


def test_golden_comparison_catches_an_off_by_one_in_special_ids(fx):
    """Special pieces appended one id too far give other ids and another eod."""

    class OffByOne(tokenizers.SentencePieceTokenizer):
        def _add_special(self, token):
            if token not in self._vocab:
                self._vocab[token] = len(self._vocab) + 1
                self._inv_vocab[self._vocab[token]] = token
            self._special_tokens[token] = self._vocab[token]
            self._inv_special_tokens[self._vocab[token]] = token
            return self._vocab[token]

    wrong = OffByOne(str(fx / "sp_nopad.model"))
    gold = MEGATRON_GOLDEN["sp_nopad_SP"]
    assert wrong.tokenize(TEXT) != gold["ids"] and wrong.eod != gold["eod"]


def test_merges_file_is_read_as_megatron_reads_it(tmp_path):
    """First line dropped whatever it says, text after the last newline dropped, a repeated
    pair keeps its last rank (megatron/training/tokenizer/gpt2_tokenization.py, GPT2Tokenizer)."""
    (tmp_path / "m.txt").write_text("a b\nc d\ne f\nc d\ng h", encoding="utf-8")
    assert tokenizers.read_bpe_merges(tmp_path / "m.txt") == {("c", "d"): 2, ("e", "f"): 1}


def test_gpt2_byte_map_is_a_bijection_onto_printable_characters():
    table = tokenizers.bytes_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"
    assert all(c.isprintable() and not c.isspace() for c in table.values())


def test_preprocess_gpt2_matches_hugging_face_gpt2(fx):
    """Megatron-LM's tools/preprocess_data.py without --legacy-tokenizer encodes GPT-2 BPE with
    Hugging Face's GPT2Tokenizer, where ``<|endoftext|>`` in the text is the eod id."""
    transformers = pytest.importorskip("transformers")
    vocab = json.loads((fx / "gpt2/vocab.json").read_text(encoding="utf-8"))
    merges = [tuple(m.split()) for m in (fx / "gpt2/merges.txt").read_text(encoding="utf-8").split("\n")[1:-1]]
    hf = transformers.GPT2Tokenizer(vocab=vocab, merges=merges)
    files = {"vocab_file": str(fx / "gpt2/vocab.json"), "merge_file": str(fx / "gpt2/merges.txt")}
    new = build_preprocess_tokenizer("GPT2BPETokenizer", **files)
    legacy = build_preprocess_tokenizer("GPT2BPETokenizer", legacy_tokenizer=True, **files)
    assert new.tokenize(TEXT) == hf(TEXT, add_special_tokens=False).input_ids
    assert new.eod == hf.eos_token_id and new.tokenize("<|endoftext|>") == [new.eod]
    assert legacy.tokenize(TEXT) == MEGATRON_GOLDEN["gpt2"]["ids"] != new.tokenize(TEXT)


def test_preprocess_sentencepiece_is_megatron_core_s(fx):
    """Without --legacy-tokenizer the SentencePiece types are megatron-core's tokenizer:
    plain ids, eod = the model's eos, the model's vocabulary size."""
    model = str(fx / "sp_pad.model")
    for tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        tok = build_preprocess_tokenizer(tokenizer_type, tokenizer_model=model)
        gold = MEGATRON_GOLDEN["sp_pad_GPTSP"]
        assert (list(tok.tokenize(TEXT)), tok.eod, tok.vocab_size) == (gold["ids"], gold["eos"], gold["vocab_size"])
    legacy = build_preprocess_tokenizer("SentencePieceTokenizer", tokenizer_model=model, legacy_tokenizer=True)
    assert legacy.eod == MEGATRON_GOLDEN["sp_pad_SP"]["eod"]


def test_errors_name_the_flag_or_file(fx, tmp_path):
    def error(tokenizer_type, **kwargs):
        with pytest.raises(TokenizerError) as info:
            build_tokenizer(tokenizer_type, **kwargs)
        return str(info.value)

    assert "--tokenizer-type" in error("BertWordPieceCase")
    assert "--vocab-file" in error("GPT2BPETokenizer", merge_file=str(fx / "gpt2/merges.txt"))
    missing = str(tmp_path / "nope.txt")
    assert "--merge-file" in (
        e := error("GPT2BPETokenizer", vocab_file=str(fx / "gpt2/vocab.json"), merge_file=missing)
    )
    assert missing in e
    (tmp_path / "v.json").write_text('{"a": 0}')
    msg = error("GPT2BPETokenizer", vocab_file=str(tmp_path / "v.json"), merge_file=str(fx / "gpt2/merges.txt"))
    assert "--vocab-file" in msg and "<|endoftext|>" in msg
    (tmp_path / "bad.model").write_bytes(b"not a model")
    for tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        assert "--tokenizer-model" in error(tokenizer_type)
        assert str(tmp_path / "bad.model") in error(tokenizer_type, tokenizer_model=str(tmp_path / "bad.model"))
    assert "--vocab-size" in error("NullTokenizer")
    assert "--tiktoken-pattern" in error("TikTokenizer", tokenizer_model=str(fx / "tik/vocab.json"))


def test_hugging_face_tokenizer_is_local_only(tmp_path):
    """A hub name is refused before transformers is asked (no download, ever)."""
    with pytest.raises(TokenizerError, match="--tokenizer-model: gpt2 is not a local folder"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model="gpt2")
    with pytest.raises(TokenizerError, match="--tokenizer-model"):
        build_preprocess_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "absent"))


def test_tiktokenizer_without_tiktoken_says_what_to_install(fx, monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken now raises ImportError
    kwargs = {"tokenizer_model": str(fx / "tik/vocab.json"), "tiktoken_pattern": "v2", "vocab_size": 300}
    for build_fn in (build_tokenizer, build_preprocess_tokenizer):
        with pytest.raises(TokenizerError, match=r"--tokenizer-type TikTokenizer needs the tiktoken package: pip"):
            build_fn("TikTokenizer", **kwargs)


def test_datasets_build_tokenizer_delegates_and_keeps_its_signature(fx):
    tok = datasets.build_tokenizer("NullTokenizer", None, 1000)
    assert (tok.eod, tok.vocab_size) == (1000, 1001)
    sp = datasets.build_tokenizer("SentencePieceTokenizer", str(fx / "sp_pad.model"), vocab_extra_ids=3)
    assert sp.vocab_size == MEGATRON_GOLDEN["sp_pad_SPx3"]["vocab_size"]
    gpt2 = datasets.build_tokenizer(
        "GPT2BPETokenizer", vocab_file=fx / "gpt2/vocab.json", merge_file=fx / "gpt2/merges.txt"
    )
    assert gpt2.tokenize(TEXT) == MEGATRON_GOLDEN["gpt2"]["ids"]


def test_gpt_dataset_accepts_the_tokenizers(fx):
    """megatron-core's GPTDataset reads vocab_size, eod, pad (a raising pad means -1) and
    hashes unique_identifiers; MockGPTDataset draws ids below vocab_size."""
    for case in ("gpt2", "sp_pad_SP", "null"):
        tok = build(case, fx)
        train, _, _ = datasets.build_train_valid_test_datasets(
            [8, 2, 2], 16, tokenizer=tok, mock=True, create_attention_mask=False
        )
        sample = train[0]
        assert sample["tokens"].shape == (16,) and int(sample["tokens"].max()) <= tok.eod < tok.vocab_size
        assert train._pad_token_id == (-1 if case != "sp_pad_SP" else 3)
