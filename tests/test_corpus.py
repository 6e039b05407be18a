"""Corpus readers: every kind, discovery errors, damaged input counted (or
fatal under strict), streaming."""

from __future__ import annotations

import gzip
import json
import random

import numpy as np
import pytest
import zstandard

from dartcore.corpus import open_corpus
from dartcore.errors import CorpusError


def _docs(n, seed=0):
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    return [
        f"doc {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(5, 60)))
        for i in range(n)
    ]


def _jsonl(texts, **extra):
    return "".join(
        json.dumps({"id": str(i), "text": t, "source": "test", **extra}) + "\n"
        for i, t in enumerate(texts)
    )


def test_dolma_sample(test_data):
    corpus = open_corpus("dolma", corpus_dir=test_data / "dolma-sample")
    docs = list(corpus)
    # Independent reader: gzip + json, file by file in sorted order.
    expected = []
    for path in sorted((test_data / "dolma-sample" / "documents").iterdir()):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            expected += [json.loads(line)["text"] for line in f if line.strip()]
    assert docs == expected and len(docs) == 30
    s = corpus.stats
    assert s.documents == 30 and s.files == s.files_done == 3 and s.problems() == 0
    assert s.bytes_read == s.bytes_total == sum(p.stat().st_size for p in corpus.shards)
    desc = corpus.description()
    assert desc["kind"] == "dolma" and len(desc["files"]) == 3


def test_dolma_dir_from_env_and_all_compressions(tmp_path, monkeypatch):
    docs = _docs(90)
    d = tmp_path / "dolma" / "documents" / "sub"
    d.mkdir(parents=True)
    with gzip.open(d / "a.json.gz", "wt") as f:
        f.write(_jsonl(docs[:30]))
    (d / "b.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(_jsonl(docs[30:60]).encode())
    )
    (d / "c.jsonl").write_text(_jsonl(docs[60:]))
    (d / "ignored.txt").write_text("not a shard")
    monkeypatch.setenv("DOLMA_DIR", str(tmp_path / "dolma"))
    corpus = open_corpus("dolma")
    assert [p.name for p in corpus.shards] == ["a.json.gz", "b.jsonl.zst", "c.jsonl"]
    assert list(corpus) == docs


def test_dolma_missing_names_paths_and_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.delenv("DOLMA_DIR", raising=False)
    with pytest.raises(CorpusError, match=r"DOLMA_DIR.*huggingface.co/datasets/allenai/dolma"):
        open_corpus("dolma")
    with pytest.raises(CorpusError, match=rf"searched: .*{tmp_path}.*allenai/dolma"):
        open_corpus("dolma", corpus_dir=tmp_path)  # empty directory
    with pytest.raises(CorpusError, match="does not exist"):
        open_corpus("dolma", corpus_dir=tmp_path / "nope")


def test_unknown_kind_lists_kinds():
    with pytest.raises(CorpusError, match="dolma, jsonl, text, npy"):
        open_corpus("parquet", corpus_dir=".")


def test_jsonl_nested_field_and_files_glob(tmp_path):
    lines = [json.dumps({"meta": {"body": t}}) for t in ["one", "two", "three"]]
    (tmp_path / "x.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "y.jsonl").write_text(json.dumps({"meta": {"body": "four"}}) + "\n")
    corpus = open_corpus("jsonl", corpus_dir=tmp_path, files="*.jsonl", text_field="meta.body")
    assert list(corpus) == ["one", "two", "three", "four"]


def test_json_array_file(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"output": "x = 1"}, {"output": "y = 2"}]))
    assert list(open_corpus("jsonl", files=[tmp_path / "a.json"], text_field="output")) == [
        "x = 1",
        "y = 2",
    ]


def test_malformed_lines_counted_and_reported(tmp_path):
    good = _docs(5)
    body = (
        _jsonl(good[:2])
        + "{broken json\n"
        + "[1, 2, 3]\n"
        + json.dumps({"id": "x", "body": "no text field"})
        + "\n"
        + "\n"
        + _jsonl(good[2:])
    )
    (tmp_path / "s.jsonl").write_text(body)
    corpus = open_corpus("jsonl", corpus_dir=tmp_path)
    assert list(corpus) == good
    assert corpus.stats.bad_lines == 3
    assert any("s.jsonl:3: malformed JSON" in m for m in corpus.stats.messages)
    assert any("s.jsonl:5: no string field 'text'" in m for m in corpus.stats.messages)
    with pytest.raises(CorpusError, match="s.jsonl:3: malformed JSON.*--strict"):
        list(open_corpus("jsonl", corpus_dir=tmp_path, strict=True))


def test_invalid_utf8(tmp_path):
    raw = b'{"text": "caf\xe9 ok"}\n' + _jsonl(["fine"]).encode()
    (tmp_path / "u.jsonl").write_bytes(raw)
    corpus = open_corpus("jsonl", corpus_dir=tmp_path)
    assert list(corpus) == ["caf\ufffd ok", "fine"]
    assert corpus.stats.invalid_utf8 == 1
    (tmp_path / "t.txt").write_bytes(b"bad \xff\xfe bytes\n")
    text = open_corpus("text", files=[tmp_path / "t.txt"])
    assert list(text) == ["bad \ufffd\ufffd bytes\n"] and text.stats.invalid_utf8 == 1


def _corrupt_middle(data: bytes) -> bytes:
    bad = bytearray(data)
    mid = len(bad) // 2
    for i in range(mid, mid + 64):
        bad[i] ^= 0x5A
    return bytes(bad)


@pytest.mark.parametrize("codec", ["gzip-truncated", "gzip-garbled", "zstd-garbled"])
def test_corrupt_stream_mid_file(tmp_path, codec):
    docs = _docs(8000, seed=1)
    payload = _jsonl(docs).encode()
    if codec.startswith("gzip"):
        blob = gzip.compress(payload)
        blob = blob[: len(blob) // 2] if codec == "gzip-truncated" else _corrupt_middle(blob)
        name = "bad.json.gz"
    else:
        blob = _corrupt_middle(zstandard.ZstdCompressor(write_checksum=True).compress(payload))
        name = "bad.jsonl.zst"
    (tmp_path / name).write_bytes(blob)
    (tmp_path / "zz-good.jsonl").write_text(_jsonl(["after the bad file"]))
    corpus = open_corpus("jsonl", corpus_dir=tmp_path)
    got = list(corpus)
    assert corpus.stats.corrupt_streams == 1
    assert got[-1] == "after the bad file"  # the next file is still read
    msg = next(m for m in corpus.stats.messages if ": corrupt " in m)
    assert name in msg and "byte offset" in msg
    if codec == "gzip-truncated":
        # Everything decoded before the break is kept, in order, intact.
        kept = got[:-1]
        assert 0 < len(kept) < len(docs) and kept == docs[: len(kept)]
    # Under strict the first problem stops the build: the broken stream, or the
    # garbage lines a garbled deflate block decodes to before gzip's CRC check.
    first = (
        f"{name}: corrupt .*byte offset"
        if codec != "gzip-garbled"
        else rf"{name}(: corrupt|:\d+: malformed)"
    )
    with pytest.raises(CorpusError, match=first):
        list(open_corpus("jsonl", corpus_dir=tmp_path, strict=True))


def test_text_files_one_document_each(tmp_path):
    (tmp_path / "a.txt").write_text("first file\nline two\n")
    (tmp_path / "b.txt.gz").write_bytes(gzip.compress(b"second file"))
    corpus = open_corpus("text", corpus_dir=tmp_path)
    assert list(corpus) == ["first file\nline two\n", "second file"]


def test_huge_text_file_split_at_lines(tmp_path, monkeypatch):
    import dartcore.corpus as corpus_mod

    monkeypatch.setattr(corpus_mod, "MAX_TEXT_DOCUMENT_BYTES", 1000)
    lines = [f"line {i} " + "x" * 50 + "\n" for i in range(100)]
    (tmp_path / "big.txt").write_text("".join(lines))
    corpus = open_corpus("text", corpus_dir=tmp_path)
    docs = list(corpus)
    assert "".join(docs) == "".join(lines)  # split only at line breaks, nothing lost
    assert len(docs) > 1 and all(d.endswith("\n") for d in docs)
    assert corpus.stats.split_documents == len(docs) - 1


def test_huge_json_document(tmp_path):
    big = "word " * 400_000  # 2 MB in one line
    (tmp_path / "h.jsonl").write_text(_jsonl(["small", big, "tail"]))
    assert [len(d) for d in open_corpus("jsonl", corpus_dir=tmp_path)] == [5, len(big), 4]


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_npy_tokens_split_at_eos(tmp_path, dtype):
    eos = 7
    rng = np.random.default_rng(0)
    docs = [rng.integers(8, 1000, size=rng.integers(0, 50)).astype(dtype) for _ in range(200)]
    flat = np.concatenate([np.append(d, dtype(eos)) for d in docs])
    # Dolma's tokenizer writes raw memmaps named .npy; the second file is headerless.
    half = len(flat) // 2
    cut = int(np.flatnonzero(flat[:half] == eos)[-1]) + 1
    np.save(tmp_path / "a.npy", flat[:cut])
    flat[cut:].tofile(tmp_path / "b.npy")
    corpus = open_corpus(
        "npy",
        corpus_dir=tmp_path,
        eos_id=eos,
        vocab_size=1000,
        token_dtype=np.dtype(dtype).name,
    )
    got = list(corpus)
    # Empty documents (EOS EOS) come back empty: the caller still counts their EOS.
    assert [g.tolist() for g in got] == [d.tolist() for d in docs]
    assert all(g.dtype == np.uint32 for g in got)


def test_npy_out_of_vocabulary(tmp_path):
    np.save(tmp_path / "a.npy", np.array([1, 2, 5000, 0], dtype=np.uint16))
    with pytest.raises(CorpusError, match="outside the tokenizer's vocabulary"):
        list(open_corpus("npy", corpus_dir=tmp_path, eos_id=0, vocab_size=100))


def test_npy_window_boundaries(tmp_path, monkeypatch):
    # Documents that span the memory-mapped windows come back whole.
    import dartcore.corpus as corpus_mod

    monkeypatch.setattr(corpus_mod, "_NPY_WINDOW", 16)
    docs = [
        np.arange(10 + i, 10 + i + n, dtype=np.uint32) for i, n in enumerate([3, 40, 0, 17, 1, 33])
    ]
    flat = np.concatenate([np.append(d, np.uint32(1)) for d in docs])[:-1]  # no trailing EOS
    np.save(tmp_path / "w.npy", flat)
    got = list(open_corpus("npy", corpus_dir=tmp_path, eos_id=1, vocab_size=100))
    assert [g.tolist() for g in got] == [d.tolist() for d in docs]


def test_streaming_reads_in_bounded_pieces(tmp_path, monkeypatch):
    """The reader never asks the file for more than a buffer at a time."""
    import dartcore.corpus as corpus_mod

    docs = _docs(10000, seed=3)
    (tmp_path / "s.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(_jsonl(docs).encode())
    )
    with gzip.open(tmp_path / "t.json.gz", "wt") as f:
        f.write(_jsonl(docs))
    sizes = []
    real = corpus_mod._CountingReader.readinto

    def spy(self, b):
        sizes.append(len(b))
        return real(self, b)

    monkeypatch.setattr(corpus_mod._CountingReader, "readinto", spy)
    corpus = open_corpus("jsonl", corpus_dir=tmp_path)
    assert list(corpus) == docs + docs
    total = sum(p.stat().st_size for p in corpus.shards)
    assert max(sizes) <= (1 << 17) + 16 < total  # zstd asks for its own block size + a few bytes
    assert len(sizes) > 2


def test_two_d_npy_is_an_error_not_flattened(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(8, dtype=np.uint32))
    np.save(tmp_path / "b.npy", np.arange(12, dtype=np.uint32).reshape(3, 4))
    corpus = open_corpus("npy", corpus_dir=tmp_path, eos_id=7, vocab_size=100)
    # Checked up front (before any shard is read) and again while reading.
    with pytest.raises(CorpusError, match=r"b\.npy.*1-D.*shape \(3, 4\)") as e:
        corpus.check_headers()
    assert "reshape(-1)" in str(e.value)
    with pytest.raises(CorpusError, match=r"shape \(3, 4\)"):
        list(corpus)


def test_npy_headers_checked_before_the_build_starts(tmp_path, capsys):
    pytest.importorskip("dartcore._native")
    from dartcore.cli.ngram_build import main

    d = tmp_path / "tok"
    d.mkdir()
    for i in range(3):
        np.save(d / f"{i}.npy", np.arange(50, dtype=np.uint32))
    np.save(d / "3.npy", np.zeros((2, 5), np.uint32))
    assert (
        main(
            [
                "--corpus",
                "npy",
                "--corpus-dir",
                str(d),
                "--tokenizer",
                "qwen3",
                "--output",
                str(tmp_path / "x.idx"),
                "--quiet",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "CorpusError" in err and "3.npy" in err and "1-D" in err
    assert not (tmp_path / "x.idx.work").exists()
