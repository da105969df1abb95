"""tools/preprocess_data.py against Megatron-LM's, and the data-file integrity checks.

How MEGATRON_MD5 was produced: ``DOCS`` written as ``in.jsonl`` (one
``json.dumps({"text": doc, "id": i}, ensure_ascii=False)`` per line), the tokenizer files of
tests/unit/test_tokenizers.py written to ``FX`` as described there, then Megatron-LM's own
tools/preprocess_data.py at tag core_v0.16.1 (PYTHONPATH = that checkout) was run on a fresh copy
of in.jsonl for each entry of ``CONFIGS`` as
``python tools/preprocess_data.py --input in.jsonl --output-prefix out <flags>``; the values are
the md5 sums of its ``out_text_document.bin`` and ``.idx``. Its GPT2BPETokenizer without
``--legacy-tokenizer`` needs the hub, so that case is checked against Hugging Face's GPT-2 in
test_tokenizers.py instead.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import re
import struct
import sys
from pathlib import Path

import numpy
import pytest

from megatron_mfsdp.data import preprocess as preprocess_mod
from megatron_mfsdp.data.checks import check_data_prefixes, check_indexed_dataset
from megatron_mfsdp.data.preprocess import preprocess
from megatron_mfsdp.data.tokenizers import build_tokenizer
from tests.unit.test_tokenizers import (
    TEXT,
    make_gpt2_files,
    make_hf_folder,
    make_sentencepiece_model,
    make_tiktoken_json,
)

REPO = Path(__file__).resolve().parents[2]
DOCS = [TEXT, "", "hello world", "the dog.\n\nit's 678 <|endoftext|>!", "日本語 ✓", " ", "last one </s>"]

SP = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "{FX}/sp_pad.model"]
TIK = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "{FX}/tik/vocab.json", "--tiktoken-pattern", "v2"]
TIK += ["--vocab-size", "300", "--tiktoken-num-special-tokens", "20"]
HF = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "{FX}/hfx/hf"]
GPT2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{FX}/gpt2/vocab.json"]
GPT2 += ["--merge-file", "{FX}/gpt2/merges.txt"]
LLAMA2 = ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "{FX}/sp_pad.model"]
EOD, ONE, LEGACY = ["--append-eod"], ["--workers", "1"], ["--legacy-tokenizer"]
CONFIGS = {
    "sp_new": SP + EOD + ONE,
    "sp_new_noeod": SP + ONE,
    "sp_legacy": SP + EOD + ONE + LEGACY,
    "llama2_new": LLAMA2 + EOD + ONE,
    "llama2_legacy": LLAMA2 + EOD + ONE + LEGACY,
    "gpt2_legacy": GPT2 + EOD + ONE + LEGACY,
    "hf_new": HF + EOD + ONE,
    "hf_legacy": HF + EOD + ONE + LEGACY,
    "tik_new": TIK + EOD + ONE,
    "tik_legacy": TIK + EOD + ONE + LEGACY,
    "sp_part2": SP + EOD + ["--workers", "2", "--partitions", "2"],
    "sp_part3_seq": SP + EOD + ["--workers", "3", "--partitions", "3", "--keep-sequential-samples"],
    "sp_part3": SP + EOD + ["--workers", "3", "--partitions", "3"],
}
MEGATRON_MD5 = {  # (.bin, .idx)
    "sp_new": ("adf17fe1e6f4d20665194a80cb1a4d8f", "043d902bb7d373845977b5d62ec951fe"),
    "sp_new_noeod": ("4ebc72bdf0ce09cad5ba0ca507d12da0", "5477461ea5c2983a79fc7d3ce0bceebf"),
    "sp_legacy": ("486f36abce72926dc7db590949a67318", "e099211719994118f6be3d9cad11ac81"),
    "llama2_new": ("adf17fe1e6f4d20665194a80cb1a4d8f", "043d902bb7d373845977b5d62ec951fe"),
    "llama2_legacy": ("62dc7ba6e506e7a3f1280051efd8ebcf", "e6a4f5549ff9db73c178be105f58e9c8"),
    "gpt2_legacy": ("beb4d59da29af8178b3703ae5e362ec1", "51771f6d7bbe8bc0d81fd0c7c10e3aa4"),
    "hf_new": ("50ad37c2dce87f5e31c7c82efc341d02", "ba35c851dc66bbe93c0fe2439b5477c0"),
    "hf_legacy": ("be76a815cd3c4a290b07ac1ec681cc0a", "83a91708d5683bf1e961ee91ec932b2a"),
    "tik_new": ("171c09c757ac0646d005598916b9f19b", "e4a7ba61174d8869e3a205298d3bab90"),
    "tik_legacy": ("67ac4c23de3e054345487aa4621dbd53", "b15dcc3fa4cc69d9306c22526720db39"),
    "sp_part2": ("7668eb6e9d0bbd5f79c9ba36664c6ca8", "aeeec16815e7dc97d679ab25189c5117"),
    "sp_part3_seq": ("adf17fe1e6f4d20665194a80cb1a4d8f", "043d902bb7d373845977b5d62ec951fe"),
    "sp_part3": ("80688f14317e913512efb420fbd08784", "6796a1bad0aaa47b5e477ba4917f81f4"),
}


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fx")
    make_gpt2_files(d / "gpt2")
    make_sentencepiece_model(d / "sp_pad.model", with_pad=True)
    make_tiktoken_json(d / "tik" / "vocab.json")
    if importlib.util.find_spec("transformers") is not None:
        make_hf_folder(d / "hfx")
    return d


def write_jsonl(path: Path, docs=DOCS) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"text": doc, "id": i}, ensure_ascii=False) + "\n")
    return path


def _load_tool():
    spec = importlib.util.spec_from_file_location("_tool_preprocess_data", REPO / "tools" / "preprocess_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_tool(argv: list[str]) -> int:
    return _load_tool().main([*argv, "--no-progress"])


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_same_files_as_megatron(name, fx, tmp_path):
    if name.startswith("tik"):
        pytest.importorskip("tiktoken")
    if name.startswith("hf"):
        pytest.importorskip("transformers")
    flags = [f.replace("{FX}", str(fx)) for f in CONFIGS[name]]
    src = write_jsonl(tmp_path / "in.jsonl")
    assert run_tool(["--input", str(src), "--output-prefix", str(tmp_path / "out"), *flags]) == 0
    out = tmp_path / "out_text_document"
    assert (md5(out.with_suffix(".bin")), md5(out.with_suffix(".idx"))) == MEGATRON_MD5[name]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out_text_document.bin", "out_text_document.idx"]
    info = check_indexed_dataset(out)
    assert info.num_documents == len(DOCS)


def test_partitions_reorder_documents_as_megatron(fx, tmp_path):
    """Round-robin parts joined in part order: documents 0, 2, 4, 6, then 1, 3, 5."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = [f"hello world {i}" for i in range(7)]
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    sp = fx / "sp_pad.model"
    res = preprocess(src, tmp_path / "p", sp, "GPTSentencePieceTokenizer", workers=2, partitions=2, progress=False)
    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp)
    ds = IndexedDataset(res.output_prefixes["text"])
    assert [tok.detokenize(ds[i].tolist()[:-1]) for i in range(len(ds))] == [docs[i] for i in (0, 2, 4, 6, 1, 3, 5)]
    del ds


def _sentence_splitter(lang="english", keep_newlines=False):
    class Split:
        def tokenize(self, text):
            return [s + "." for s in text.split(".") if s] if "." in text else [text]

    return Split()


def test_split_sentences_writes_sentence_level_files(fx, tmp_path, monkeypatch):
    """One sequence per non-empty sentence, eod on the last one, ``_sentence`` file names."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    monkeypatch.setattr(preprocess_mod, "load_sentence_splitter", _sentence_splitter)
    src = write_jsonl(tmp_path / "in.jsonl", ["one. two. three.", "no end", ""])
    sp = fx / "sp_pad.model"
    res = preprocess(src, tmp_path / "s", sp, "GPTSentencePieceTokenizer", split_sentences=True, workers=2)
    assert res.output_prefixes["text"] == f"{tmp_path / 's'}_text_sentence"
    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp)
    ds = IndexedDataset(res.output_prefixes["text"])
    sentences = ["one.", " two.", " three."]
    lengths = [len(tok.tokenize(s)) for s in sentences]
    assert ds.sequence_lengths.tolist() == [*lengths[:2], lengths[2] + 1, len(tok.tokenize("no end")) + 1]
    assert ds.document_indices.tolist() == [0, 3, 4, 4]  # the empty document has no sequence
    assert ds[2].tolist()[-1] == tok.eod
    del ds


def test_list_values_are_sentences_and_glob_gz_inputs_are_read_in_order(fx, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for name, docs in (("b.jsonl.gz", [["x y", "z"]]), ("a.jsonl.gz", [["hello"], ["world"]])):
        with gzip.open(tmp_path / name, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    sp = fx / "sp_pad.model"
    res = preprocess(str(tmp_path / "*.jsonl.gz"), tmp_path / "g", sp, "GPTSentencePieceTokenizer", progress=False)
    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp)
    ds = IndexedDataset(res.output_prefixes["text"])
    lengths = [len(tok.tokenize(s)) for s in ("hello", "world", "x y", "z")]
    assert ds.sequence_lengths.tolist() == [lengths[0] + 1, lengths[1] + 1, lengths[2], lengths[3] + 1]
    assert ds.document_indices.tolist() == [0, 1, 2, 4] and res.num_documents == 3
    del ds
    assert list(preprocess_mod.iter_documents(str(tmp_path / "*.jsonl.gz"))) == [
        {"text": "hello"},
        {"text": "world"},
        {"text": "x y z"},
    ]


def test_log_interval_prints_megatron_progress_lines(fx, tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl")
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "o"), *[f.replace("{FX}", str(fx)) for f in SP]]
    assert run_tool([*argv, "--log-interval", "3"]) == 0
    err = capsys.readouterr().err
    assert err.count("Processed ") == len(DOCS) // 3 and "Processed 6 documents (" in err


# Sentences as Megatron-LM's punkt splitter gives them, produced with nltk 3.10.4 and Megatron-LM
# core_v0.16.1's tools/preprocess_data.py: PunktSentenceTokenizer(train_text=params) (plain) and
# PunktSentenceTokenizer(train_text=params, lang_vars=CustomLanguageVars()) (--keep-newlines), for
# PunktParameters with abbrev_types {"dr", "mr"}.
PUNKT_TEXTS = [
    "Mr. Smith went.\nHe saw Dr. Jones.\n\n\nEnd? Yes.  \n",
    "First one. Second one!\n\nThird here.  Fourth.",
]
PUNKT_PLAIN = [
    ["Mr. Smith went.", "He saw Dr. Jones.", "End?", "Yes."],
    ["First one.", "Second one!", "Third here.", "Fourth."],
]
PUNKT_KEEP_NEWLINES = [
    ["Mr. Smith went.\n", "He saw Dr. Jones.\n\n\n", "End? ", "Yes."],
    ["First one. ", "Second one!\n\n", "Third here.  ", "Fourth."],
]


@pytest.fixture
def punkt_data(tmp_path, monkeypatch):
    """nltk's ``punkt_tab`` data for "english", written here (abbreviations dr, mr), and the
    only folder nltk searches."""
    nltk = pytest.importorskip("nltk")
    folder = tmp_path / "nltk_data" / "tokenizers" / "punkt_tab" / "english"
    folder.mkdir(parents=True)
    (folder / "abbrev_types.txt").write_text("dr\nmr\n", encoding="utf-8")
    for name in ("collocations.tab", "sent_starters.txt", "ortho_context.tab"):
        (folder / name).write_text("", encoding="utf-8")
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "nltk_data")])
    return nltk


def test_sentence_splitter_matches_megatron(punkt_data):
    plain = preprocess_mod.load_sentence_splitter("english")
    keep = preprocess_mod.load_sentence_splitter("english", keep_newlines=True)
    assert [plain.tokenize(t) for t in PUNKT_TEXTS] == PUNKT_PLAIN
    assert [keep.tokenize(t) for t in PUNKT_TEXTS] == PUNKT_KEEP_NEWLINES


def test_split_sentences_keep_newlines_end_to_end(fx, tmp_path, punkt_data):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    src = write_jsonl(tmp_path / "in.jsonl", PUNKT_TEXTS)
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "o"), *[f.replace("{FX}", str(fx)) for f in SP]]
    assert run_tool([*argv, "--split-sentences", "--keep-newlines", "--append-eod", "--workers", "2"]) == 0
    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=fx / "sp_pad.model")
    ds = IndexedDataset(str(tmp_path / "o_text_sentence"))
    expected = [tok.tokenize(s) for doc in PUNKT_KEEP_NEWLINES for s in doc]
    expected[3] += [tok.eod]
    expected[7] += [tok.eod]
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    assert ds.document_indices.tolist() == [0, 4, 8]
    del ds


def test_split_sentences_without_punkt_data_names_the_flag(punkt_data, tmp_path, monkeypatch):
    monkeypatch.setattr(punkt_data.data, "path", [str(tmp_path / "empty")])
    with pytest.raises(preprocess_mod.PreprocessError, match=r"--split-sentences needs nltk and its punkt"):
        preprocess_mod.load_sentence_splitter("english")


# --------------------------------------------------------------------------------------------
# Errors: named flag / file (and line), before any output is written
# --------------------------------------------------------------------------------------------


def _cli_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        run_tool(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_bad_input_lines_are_named_and_nothing_is_written(fx, tmp_path, capsys):
    out = tmp_path / "o" / "p"
    sp = [f.replace("{FX}", str(fx)) for f in SP]
    cases = {
        b'{"text": "ok"}\n\n{"text": "caf\xe9"}\n': r"bad\.jsonl:3: not UTF-8 text",
        b'{"text": "ok"}\n{not json\n': r"bad\.jsonl:2: invalid JSON",
        b'{"text": "ok"}\n{"content": "x"}\n': r"bad\.jsonl:2: missing key 'text' \(given by --json-keys\)",
        b'{"text": 3}\n': r"bad\.jsonl:1: value of key 'text' is neither a string nor a list of strings",
        b"[1, 2]\n": r"bad\.jsonl:1: expected a JSON object per line",
    }
    for content, message in cases.items():
        (tmp_path / "bad.jsonl").write_bytes(content)
        assert re.search(
            message, _cli_error(capsys, ["--input", str(tmp_path / "bad.jsonl"), "--output-prefix", str(out), *sp])
        )
    assert not out.parent.exists() or not any(out.parent.iterdir())


def test_bad_flags_are_named(fx, tmp_path, capsys, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl")
    base = ["--input", str(src), "--output-prefix", str(tmp_path / "o")]
    sp = [f.replace("{FX}", str(fx)) for f in SP]
    assert "--tokenizer-type is required" in _cli_error(capsys, base)
    assert "--keep-newlines only applies with --split-sentences" in _cli_error(capsys, [*base, *sp, "--keep-newlines"])
    assert "--partitions must be >= 1" in _cli_error(capsys, [*base, *sp, "--partitions", "0"])
    assert "--json-keys: repeated key" in _cli_error(capsys, [*base, *sp, "--json-keys", "text", "text"])
    missing = tmp_path / "missing.jsonl"
    err = _cli_error(capsys, ["--input", str(missing), "--output-prefix", str(tmp_path / "o"), *sp])
    assert "--input" in err and str(missing) in err
    assert "--input: no files match" in _cli_error(capsys, ["--input", str(tmp_path / "*.nope"), *base[2:], *sp])
    (tmp_path / "fake.jsonl.gz").write_bytes(b"not gzip")
    err = _cli_error(capsys, ["--input", str(tmp_path / "fake.jsonl.gz"), *base[2:], *sp])
    assert f"{tmp_path / 'fake.jsonl.gz'}: cannot read" in err
    monkeypatch.setitem(sys.modules, "nltk", None)  # as on a machine without nltk
    err = _cli_error(capsys, [*base, *sp, "--split-sentences"])
    assert "--split-sentences needs nltk" in err and "nltk.downloader" in err
    assert not list(tmp_path.glob("o*"))


# --------------------------------------------------------------------------------------------
# Integrity checks of .bin/.idx pairs
# --------------------------------------------------------------------------------------------


@pytest.fixture
def dataset(fx, tmp_path) -> Path:
    src = write_jsonl(tmp_path / "in.jsonl")
    res = preprocess(src, tmp_path / "d", fx / "sp_pad.model", "GPTSentencePieceTokenizer", progress=False)
    return Path(res.output_prefixes["text"])


def test_check_accepts_a_good_pair_and_reports_its_shape(dataset):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    info = check_indexed_dataset(dataset)
    ds = IndexedDataset(str(dataset))
    assert (info.num_sequences, info.num_documents) == (len(ds), len(ds.document_indices) - 1)
    assert info.num_tokens == int(ds.sequence_lengths.sum()) and info.dtype is numpy.uint16
    del ds
    assert check_data_prefixes(["0.5", str(dataset), "0.5", str(dataset)]) == [info, info]


def test_check_names_a_truncated_or_padded_bin(dataset):
    data = dataset.with_suffix(".bin").read_bytes()
    dataset.with_suffix(".bin").write_bytes(data[:-2])
    with pytest.raises(ValueError, match=rf"{dataset}\.bin: {len(data) - 2} bytes, shorter than the {len(data)}"):
        check_indexed_dataset(dataset)
    dataset.with_suffix(".bin").write_bytes(data + b"\0\0")
    with pytest.raises(ValueError, match=rf"{dataset}\.bin: .* longer than"):
        check_indexed_dataset(dataset)


def test_check_names_a_truncated_or_foreign_idx(dataset):
    idx = dataset.with_suffix(".idx")
    data = idx.read_bytes()
    for cut in (len(data) - 8, 20):
        idx.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=rf"{idx}: .*truncated"):
            check_indexed_dataset(dataset)
    idx.write_bytes(b"NOTANIDX!" + data[9:])
    with pytest.raises(ValueError, match=rf"{idx}: not a megatron indexed-dataset index"):
        check_indexed_dataset(dataset)
    idx.write_bytes(data[:17] + bytes([9]) + data[18:])
    with pytest.raises(ValueError, match=rf"{idx}: unknown dtype code 9"):
        check_indexed_dataset(dataset)
    (num_sequences,) = struct.unpack("<Q", data[18:26])
    last_pointer = 34 + 4 * num_sequences + 8 * (num_sequences - 1)
    idx.write_bytes(data[:last_pointer] + struct.pack("<q", 999) + data[last_pointer + 8 :])
    with pytest.raises(ValueError, match=rf"{idx}: sequence offsets do not follow"):
        check_indexed_dataset(dataset)
    idx.unlink()
    with pytest.raises(ValueError, match=rf"{idx}: missing"):
        check_indexed_dataset(dataset)
