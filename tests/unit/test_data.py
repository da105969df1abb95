"""Tests of the data pipeline: corpus -> SentencePiece -> .bin/.idx -> GPTDataset -> micro-batches."""

import hashlib
import importlib.util
import json
import multiprocessing
import time
from pathlib import Path

import numpy
import pytest
import torch

from megatron_mfsdp.data import corpus as corpus_mod
from megatron_mfsdp.data.datasets import (
    build_tokenizer,
    build_train_valid_test_datasets,
    get_microbatch,
    microbatch_indices,
    num_microbatches,
)
from megatron_mfsdp.data.preprocess import PreprocessError, preprocess

REPO = Path(__file__).resolve().parents[2]
SMALL_CAP = 300_000  # bytes of stdlib source for the fast default-corpus tests
SMALL_VOCAB = 1024

DOCS = [
    "def add(a, b):\n    return a + b\n",
    'class Foo:\n    """Docstring with  two  spaces."""\n\n    x = 1\n',
    "  leading spaces and trailing spaces  \n\n\nblank lines above\ttab",
    "unicode: naïve café – 日本語 ✓ and an emoji 🐍",
    "for i in range(10):\n        print(i ** 2)  # deeply indented\n",
]


def _load_tool(name):
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", REPO / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def default_data(tmp_path_factory):
    cache = tmp_path_factory.mktemp("default_data")
    t0 = time.time()
    result = corpus_mod.prepare_default_data(cache, max_bytes=SMALL_CAP, vocab_size=SMALL_VOCAB)
    return cache, result, time.time() - t0


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory, default_data):
    """A SentencePiece model trained in tmp on a tiny jsonl (the DOCS plus a little stdlib)."""
    d = tmp_path_factory.mktemp("tiny_tok")
    src = d / "train.jsonl"
    texts = list(DOCS) + [t for _, t in corpus_mod.iter_stdlib_sources(max_bytes=60_000)]
    with open(src, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    model = corpus_mod.train_sentencepiece(src, d / "tiny", vocab_size=400, hard_vocab_limit=False)
    return model


# ----------------------------------------------------------------------------------------------
# Preprocessing round trip
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_roundtrip(tmp_path, tiny_tokenizer, workers):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    src = tmp_path / "docs.jsonl"
    with open(src, "w", encoding="utf-8") as f:
        for t in DOCS:
            f.write(json.dumps({"text": t, "other": "ignored"}) + "\n")
    res = preprocess(
        src, tmp_path / "out" / "tiny", tokenizer_model=tiny_tokenizer, append_eod=True, workers=workers, progress=False
    )
    prefix = res.output_prefixes["text"]
    assert prefix.endswith("tiny_text_document")
    assert res.num_documents == len(DOCS)
    assert not list((tmp_path / "out").glob("*.tmp*")), "temporary files left behind"

    tok = build_tokenizer("GPTSentencePieceTokenizer", tiny_tokenizer)
    ds = IndexedDataset(prefix)
    assert len(ds) == len(DOCS)
    assert ds.index.dtype == numpy.uint16  # vocab 400 < 65500
    assert int(ds.sequence_lengths.sum()) == res.num_tokens["text"]
    for i, text in enumerate(DOCS):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod == 2
        assert tok.eod not in ids[:-1]
        assert tok.detokenize(ids[:-1]) == text
        assert ids[:-1] == list(tok.tokenize(text))
    del ds


def test_preprocess_text_folder_and_cli(tmp_path, tiny_tokenizer, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text(DOCS[1], encoding="utf-8")
    (folder / "a.txt").write_text(DOCS[0], encoding="utf-8")
    (folder / "sub" / "c.txt").write_text(DOCS[3], encoding="utf-8")
    (folder / ".hidden").write_text("skip me", encoding="utf-8")
    tool = _load_tool("preprocess_data")
    rc = tool.main(
        [
            "--input",
            str(folder),
            "--json-keys",
            "text",
            "--output-prefix",
            str(tmp_path / "f"),
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            str(tiny_tokenizer),
            "--append-eod",
            "--workers",
            "1",
        ]
    )
    assert rc == 0
    err = capsys.readouterr().err
    assert "tokenize texts" in err and "B/s" in err  # tqdm's progress bar ran
    tok = build_tokenizer("GPTSentencePieceTokenizer", tiny_tokenizer)
    ds = IndexedDataset(str(tmp_path / "f_text_document"))
    # sorted by relative path: a.txt, b.txt, sub/c.txt; hidden file skipped
    assert [tok.detokenize(ds[i].tolist()[:-1]) for i in range(len(ds))] == [DOCS[0], DOCS[1], DOCS[3]]
    del ds


# ----------------------------------------------------------------------------------------------
# Bad inputs: errors name the flag / file, before any output is written
# ----------------------------------------------------------------------------------------------


def _cli_error(capsys, argv):
    tool = _load_tool("preprocess_data")
    with pytest.raises(SystemExit) as exc:
        tool.main([*argv, "--tokenizer-type", "SentencePieceTokenizer"])
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_bad_inputs_name_flag_and_file(tmp_path, tiny_tokenizer, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "x = 1"}) + "\n")
    out = tmp_path / "o" / "p"

    missing = tmp_path / "missing.jsonl"
    err = _cli_error(
        capsys, ["--input", str(missing), "--output-prefix", str(out), "--tokenizer-model", str(tiny_tokenizer)]
    )
    assert "--input" in err and str(missing) in err

    missing_model = tmp_path / "nope.model"
    err = _cli_error(
        capsys, ["--input", str(good), "--output-prefix", str(out), "--tokenizer-model", str(missing_model)]
    )
    assert "--tokenizer-model" in err and str(missing_model) in err

    corrupt = tmp_path / "corrupt.model"
    corrupt.write_bytes(b"this is not a sentencepiece model")
    err = _cli_error(capsys, ["--input", str(good), "--output-prefix", str(out), "--tokenizer-model", str(corrupt)])
    assert "--tokenizer-model" in err and str(corrupt) in err

    err = _cli_error(capsys, ["--input", str(good), "--output-prefix", str(out)])
    assert "--tokenizer-type SentencePieceTokenizer needs --tokenizer-model" in err

    wrong_key = tmp_path / "wrong_key.jsonl"
    wrong_key.write_text(json.dumps({"content": "x"}) + "\n")
    err = _cli_error(
        capsys, ["--input", str(wrong_key), "--output-prefix", str(out), "--tokenizer-model", str(tiny_tokenizer)]
    )
    assert str(wrong_key) in err and "'text'" in err and "--json-keys" in err

    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(PreprocessError, match=r"bad\.jsonl:2"):
        preprocess(bad_json, out, tokenizer_model=tiny_tokenizer, progress=False)

    # nothing was written by any failed run
    assert not out.parent.exists() or not any(out.parent.iterdir())

    tok_tool = _load_tool("train_tokenizer")
    with pytest.raises(SystemExit):
        tok_tool.main(["--input", str(missing), "--model-prefix", str(tmp_path / "t")])
    err = capsys.readouterr().err
    assert "--input" in err and str(missing) in err


# ----------------------------------------------------------------------------------------------
# Default corpus
# ----------------------------------------------------------------------------------------------


def test_default_corpus_small_cap(default_data):
    cache, result, seconds = default_data
    manifest = json.loads((cache / "manifest.json").read_text())
    # corpus: stdlib sources in hashed-path order under the cap, one {"text"} object per line
    corpus = cache / "corpus" / "stdlib.jsonl"
    lines = corpus.read_text(encoding="utf-8").splitlines()
    texts = [json.loads(line)["text"] for line in lines]
    expected = [t for _, t in corpus_mod.iter_stdlib_sources(max_bytes=SMALL_CAP)]
    assert texts == expected and len(texts) > 5
    assert sum(len(t.encode("utf-8")) for t in texts) <= SMALL_CAP
    assert all(set(json.loads(line)) == {"text"} for line in lines)
    rels = [r for r, _ in corpus_mod.iter_stdlib_sources(max_bytes=SMALL_CAP)]
    assert rels == sorted(rels, key=lambda r: hashlib.sha1(r.encode()).hexdigest())
    assert all("site-packages" not in r for r in rels)

    # tokenizer + indexed data
    tok = build_tokenizer(result["tokenizer_type"], result["tokenizer_model"])
    assert tok.vocab_size == SMALL_VOCAB == manifest["vocab_size"]
    assert result["num_documents"] == len(texts) == manifest["num_documents"]
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(result["data_prefix"])
    assert len(ds) == len(texts)
    assert tok.detokenize(ds[0].tolist()[:-1]) == texts[0]
    assert int(ds.sequence_lengths.sum()) == result["num_tokens"]
    del ds
    assert seconds < 30


def test_default_data_is_cached_and_idempotent(default_data):
    cache, result, _ = default_data
    mtimes = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()}
    t0 = time.time()
    again = corpus_mod.prepare_default_data(cache, max_bytes=SMALL_CAP, vocab_size=SMALL_VOCAB)
    assert time.time() - t0 < 1.0
    assert again == result
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()} == mtimes
    assert (cache / ".lock").exists()


def _run_processes(targets, timeout=120):
    """Run ``fn(*args, queue)`` in fresh (spawned) processes, like independent torchrun ranks;
    return what each put on the queue. Spawn, not fork: forking a process whose OpenMP pool is
    already running can deadlock the child."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(*args, queue)) for fn, args in targets]
    try:
        for p in procs:
            p.start()
        results = [queue.get(timeout=timeout) for _ in procs]
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)


def _prepare_in_child(cache, queue):
    res = corpus_mod.prepare_default_data(cache, max_bytes=100_000, vocab_size=512)
    queue.put(res)


def test_default_data_concurrent_builders(tmp_path):
    """Two processes (like two torchrun ranks) racing on an empty cache get the same result."""
    results = _run_processes([(_prepare_in_child, (tmp_path,)) for _ in range(2)])
    assert results[0] == results[1]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert all((tmp_path / rel).stat().st_size == size for rel, size in manifest["files"].items())
    assert not [p for p in tmp_path.rglob("*.tmp*")], "temporary files left behind"


def test_train_sentencepiece_is_deterministic(tmp_path, default_data):
    cache, _, _ = default_data
    corpus = cache / "corpus" / "stdlib.jsonl"
    a = corpus_mod.train_sentencepiece(corpus, tmp_path / "a", vocab_size=SMALL_VOCAB)
    b = corpus_mod.train_sentencepiece(corpus, tmp_path / "b", vocab_size=SMALL_VOCAB)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() == (cache / "tokenizer" / "spm.model").read_bytes()


# ----------------------------------------------------------------------------------------------
# GPT datasets
# ----------------------------------------------------------------------------------------------

SEQ = 64


@pytest.fixture(scope="session")
def gpt_datasets(default_data, tmp_path_factory):
    _, result, _ = default_data
    tok = build_tokenizer(result["tokenizer_type"], result["tokenizer_model"])
    ds = build_train_valid_test_datasets(
        [200, 20, 10],
        SEQ,
        tokenizer=tok,
        data_prefix=result["data_prefix"],
        split="90,10,0",
        data_cache_path=tmp_path_factory.mktemp("idx_cache"),
    )
    return tok, ds


def test_gpt_dataset_sequences(gpt_datasets):
    tok, (train, valid, test) = gpt_datasets
    assert len(train) >= 200 and valid is not None and len(valid) >= 1
    # a 0-weight (empty) test split is disabled, not a hang
    assert test is None
    for i in (0, 1, len(train) - 1):
        s = train[i]
        assert s["tokens"].shape == (SEQ,) and s["labels"].shape == (SEQ,)
        assert s["tokens"].dtype == torch.int64
        assert torch.equal(s["tokens"][1:], s["labels"][:-1])  # labels are next tokens
        assert s["loss_mask"].shape == (SEQ,) and s["position_ids"].tolist() == list(range(SEQ))
        assert s["attention_mask"].shape == (1, SEQ, SEQ)
        assert int(s["tokens"].max()) < tok.vocab_size
    # deterministic: the same sample twice
    assert torch.equal(train[3]["tokens"], train[3]["tokens"])


def test_mock_gpt_dataset():
    tok = build_tokenizer("NullTokenizer", vocab_size=1000)
    assert tok.eod == 1000 and tok.vocab_size == 1001
    train, valid, test = build_train_valid_test_datasets(
        [50, 10, 10], SEQ, tokenizer=tok, mock=True, create_attention_mask=False
    )
    assert type(train).__name__ == "MockGPTDataset"
    assert len(train) >= 50 and len(valid) >= 10 and len(test) >= 10
    s = train[0]
    assert s["tokens"].shape == (SEQ,) and "attention_mask" not in s
    assert int(s["tokens"].max()) <= tok.eod


def _dist_worker(rank, world, init_file, prefix, model, cache_dir, queue):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tok = build_tokenizer("GPTSentencePieceTokenizer", model)
        train, valid, _ = build_train_valid_test_datasets(
            [100, 10, 10],
            SEQ,
            tokenizer=tok,
            data_prefix=prefix,
            split="90,10,0",
            data_cache_path=cache_dir,
        )
        b = get_microbatch(train, 0, 0, rank, world, 2, 4)
        queue.put((rank, len(train), b["indices"].tolist(), b["tokens"].tolist()))
    finally:
        dist.destroy_process_group()


def test_gpt_dataset_with_gloo(default_data, tmp_path):
    _, result, _ = default_data
    cache_dir = tmp_path / "idx"
    args = (str(tmp_path / "init"), result["data_prefix"], result["tokenizer_model"], str(cache_dir))
    out = sorted(_run_processes([(_dist_worker, (r, 2, *args)) for r in range(2)]))
    assert out[0][1] == out[1][1]  # same dataset length on both ranks
    assert out[0][2] == [0, 1] and out[1][2] == [2, 3]
    # the same samples as a single process reading the same cache
    tok = build_tokenizer(result["tokenizer_type"], result["tokenizer_model"])
    train, _, _ = build_train_valid_test_datasets(
        [100, 10, 10],
        SEQ,
        tokenizer=tok,
        data_prefix=result["data_prefix"],
        split="90,10,0",
        data_cache_path=cache_dir,
    )
    full = get_microbatch(train, 0, 0, 0, 1, 4, 4)["tokens"].tolist()
    assert out[0][3] + out[1][3] == full
    assert len(list(cache_dir.glob("*-GPTDataset-train-shuffle_index.npy"))) == 1


# ----------------------------------------------------------------------------------------------
# DP-invariant micro-batching
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mbs,gbs", [(1, 8), (2, 8), (1, 16), (2, 16)])
def test_microbatch_indices_dp_invariant(mbs, gbs):
    for iteration in (0, 1, 5):
        ref = list(range(iteration * gbs, (iteration + 1) * gbs))
        assert ref == list(range(iteration * gbs, (iteration + 1) * gbs))
        for dp in (1, 2, 4):
            m = num_microbatches(gbs, mbs, dp)
            assert m * mbs * dp == gbs
            # micro-batch k is, concatenated over ranks, the contiguous slice k of the batch
            seen = []
            for k in range(m):
                for r in range(dp):
                    seen += microbatch_indices(iteration, k, r, dp, mbs, gbs)
            assert seen == ref
    with pytest.raises(ValueError):
        num_microbatches(6, 4, 1)
    with pytest.raises(IndexError):
        microbatch_indices(0, num_microbatches(gbs, mbs, 2), 0, 2, mbs, gbs)


def test_get_microbatch_dp_invariant(gpt_datasets):
    _, (train, _, _) = gpt_datasets
    mbs, gbs, iteration = 2, 8, 3
    reference = torch.stack([train[i]["tokens"] for i in list(range(iteration * gbs, (iteration + 1) * gbs))])
    for dp in (1, 2, 4):
        pieces = []
        for k in range(num_microbatches(gbs, mbs, dp)):
            for r in range(dp):
                b = get_microbatch(train, iteration, k, r, dp, mbs, gbs)
                assert b["tokens"].shape == (mbs, SEQ) and b["labels"].shape == (mbs, SEQ)
                assert b["loss_mask"].shape == (mbs, SEQ)
                assert b["position_ids"].shape == (mbs, SEQ)
                assert b["attention_mask"].shape == (mbs, 1, SEQ, SEQ)
                pieces.append(b["tokens"])
        assert torch.equal(torch.cat(pieces), reference)
    with pytest.raises(IndexError, match="samples"):
        get_microbatch(train, len(train) // gbs + 1, 0, 0, 1, mbs, gbs)
    wrapped = get_microbatch(train, len(train) // gbs + 1, 0, 0, 1, mbs, gbs, wrap=True)
    assert int(wrapped["indices"].max()) < len(train)
