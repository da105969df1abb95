#!/usr/bin/env python
"""Tokenize JSON lines (or a folder of text files) into megatron indexed .bin/.idx files.

Megatron-LM's tools/preprocess_data.py command line (core_v0.16.1), e.g.::

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \
        --output-prefix data/my --tokenizer-type GPT2BPETokenizer \
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --append-eod --workers 8

writes ``data/my_text_document.bin`` and ``data/my_text_document.idx`` (``_sentence`` with
``--split-sentences``), the same files Megatron-LM writes for the same input and flags.
Inputs (flags and files, every input line) are checked before any work starts.
Extras: ``--input`` may be a folder of text files (one document each), ``--workers``
defaults to 1, and a progress bar runs on stderr (``--no-progress`` turns it off).
"""

import argparse
import sys

from megatron_mfsdp.data.preprocess import SUPPORTED_TOKENIZER_TYPES, PreprocessError, preprocess


def _add_tokenizer_args(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's tokenizer flags (megatron/training/arguments.py, _add_tokenizer_args)."""
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", type=str, default=None, choices=list(SUPPORTED_TOKENIZER_TYPES))
    g.add_argument("--tokenizer-model", type=str, default=None, help="SentencePiece/tiktoken file or HF folder")
    g.add_argument("--vocab-file", type=str, default=None, help="GPT-2 BPE vocab.json")
    g.add_argument("--merge-file", type=str, default=None, help="GPT-2 BPE merges.txt")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer ids / TikTokenizer vocabulary")
    g.add_argument("--padded-vocab-size", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument(
        "--vocab-extra-ids", type=int, default=0, help="accepted; Megatron-LM's preprocess_data.py sets it to 0"
    )
    g.add_argument("--tokenizer-metadata", type=str, default=None)
    g.add_argument("--tokenizer-special-tokens", type=str, nargs="+", default=None)
    g.add_argument("--legacy-tokenizer", action="store_true", help="encode with the training tokenizers")
    g.add_argument("--tiktoken-pattern", type=str, default=None, help="v1 or v2")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    g.add_argument("--tiktoken-special-tokens", type=str, nargs="+", default=None, help="accepted, unused (as there)")
    g.add_argument("--tokenizer-sentencepiece-legacy", action="store_true")
    g.add_argument("--tokenizer-hf-use-fast", action="store_true")
    g.add_argument("--tokenizer-hf-include-special-tokens", action="store_true")
    g.add_argument("--trust-remote-code", action="store_true")


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _add_tokenizer_args(p)
    g = p.add_argument_group("input data")
    g.add_argument("--input", type=str, required=True, help="JSON-lines file(s) (a glob too) or a folder of texts")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON line")
    g.add_argument("--split-sentences", action="store_true", help="split documents into sentences (nltk punkt)")
    g.add_argument("--keep-newlines", action="store_true", help="keep newlines between sentences when splitting")
    g = p.add_argument_group("tokenization process")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document id to every document")
    g.add_argument("--lang", type=str, default="english", help="language of nltk's sentence splitter")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", type=str, required=True, help="writes {prefix}_{key}_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    g.add_argument("--partitions", type=int, default=1, help="input parts, joined in part order")
    g.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines")
    g.add_argument("--keep-sequential-samples", action="store_true", help="parts are runs of lines (keeps order)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def _tokenizer_options(args: argparse.Namespace) -> dict:
    return {
        "tokenizer_special_tokens": args.tokenizer_special_tokens,
        "tokenizer_metadata": args.tokenizer_metadata,
        "tiktoken_pattern": args.tiktoken_pattern,
        "tiktoken_num_special_tokens": args.tiktoken_num_special_tokens,
        "tokenizer_sentencepiece_legacy": args.tokenizer_sentencepiece_legacy,
        "tokenizer_hf_use_fast": args.tokenizer_hf_use_fast,
        "tokenizer_hf_include_special_tokens": args.tokenizer_hf_include_special_tokens,
        "trust_remote_code": args.trust_remote_code,
    }


def main(argv: list[str] | None = None) -> int:
    parser = get_parser()
    args = parser.parse_args(argv)
    if args.tokenizer_type is None:
        parser.error(f"--tokenizer-type is required (one of {', '.join(SUPPORTED_TOKENIZER_TYPES)})")
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
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            legacy_tokenizer=args.legacy_tokenizer,
            tokenizer_options=_tokenizer_options(args),
            split_sentences=args.split_sentences,
            keep_newlines=args.keep_newlines,
            lang=args.lang,
            partitions=args.partitions,
            keep_sequential_samples=args.keep_sequential_samples,
            log_interval=args.log_interval,
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
