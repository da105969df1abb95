#!/usr/bin/env python
"""Tokenize a .jsonl file (or a folder of text files) into megatron indexed .bin/.idx files.

Megatron-LM style flags, e.g.::

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \
        --output-prefix data/my --tokenizer-type SentencePieceTokenizer \
        --tokenizer-model spm.model --append-eod --workers 2

writes ``data/my_text_document.bin`` and ``data/my_text_document.idx``.
Inputs (flag and file) are checked before any work starts.
"""

import argparse
import sys

from megatron_mfsdp.data.preprocess import (
    SUPPORTED_TOKENIZER_TYPES,
    PreprocessError,
    preprocess,
)


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_argument_group("input data")
    g.add_argument(
        "--input", type=str, required=True, help="a .jsonl file (one JSON object per line) or a folder of text files"
    )
    g.add_argument(
        "--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON line (default: text)"
    )
    g = p.add_argument_group("tokenizer")
    g.add_argument(
        "--tokenizer-type", type=str, default="SentencePieceTokenizer", choices=list(SUPPORTED_TOKENIZER_TYPES)
    )
    g.add_argument("--tokenizer-model", type=str, default=None, help="SentencePiece .model file")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocab size")
    g.add_argument(
        "--append-eod", action="store_true", help="append the tokenizer's end-of-document id to every document"
    )
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", type=str, required=True, help="writes {prefix}_{key}_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = get_parser()
    args = parser.parse_args(argv)
    try:
        result = preprocess(
            args.input,
            args.output_prefix,
            tokenizer_model=args.tokenizer_model,
            tokenizer_type=args.tokenizer_type,
            json_keys=args.json_keys,
            append_eod=args.append_eod,
            workers=args.workers,
            vocab_size=args.vocab_size,
            progress=not args.no_progress,
        )
    except PreprocessError as err:
        parser.error(str(err))  # exits with status 2
    for key, prefix in result.output_prefixes.items():
        print(
            f"{key}: {result.num_documents} documents, {result.num_tokens[key]} tokens "
            f"({result.dtype}) -> {prefix}.bin/.idx",
            file=sys.stderr,
        )
    print(f"done in {result.seconds:.2f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
