#!/usr/bin/env python
"""Train a SentencePiece model on a .jsonl file or a folder of text files.

    python tools/train_tokenizer.py --input corpus.jsonl --model-prefix tok/spm --vocab-size 4096

writes ``tok/spm.model`` and ``tok/spm.vocab`` (ids: unk=0, bos=1, eos/EOD=2, pad=3).
"""

import argparse
import sys

from megatron_mfsdp.data.corpus import DEFAULT_VOCAB_SIZE, train_sentencepiece
from megatron_mfsdp.data.preprocess import (
    PreprocessError,
    check_input_path,
    check_output_prefix,
)


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", type=str, required=True, help="a .jsonl file or a folder of text files")
    p.add_argument("--model-prefix", type=str, required=True, help="writes {prefix}.model and {prefix}.vocab")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.add_argument("--model-type", type=str, default="bpe", choices=["bpe", "unigram"])
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument(
        "--input-sentence-size",
        type=int,
        default=200_000,
        help="max number of training chunks read (caps memory and time)",
    )
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument(
        "--no-hard-vocab-limit", action="store_true", help="allow a smaller vocabulary when the corpus is too small"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = get_parser()
    args = parser.parse_args(argv)
    if args.vocab_size < 300:
        parser.error("--vocab-size must be >= 300 (256 byte-fallback pieces + specials)")
    try:
        check_input_path(args.input, "--input")
        check_output_prefix(args.model_prefix, "--model-prefix")
    except PreprocessError as err:
        parser.error(str(err))
    model = train_sentencepiece(
        args.input,
        args.model_prefix,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        json_keys=args.json_keys,
        input_sentence_size=args.input_sentence_size,
        num_threads=args.num_threads,
        hard_vocab_limit=not args.no_hard_vocab_limit,
    )
    print(f"wrote {model}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
