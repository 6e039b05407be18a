"""ngram-build --from-dart-trie: the official DART .trie of the Dolma sample converts to an
index with exactly the independently counted n-grams, equal to the index ngram-build counts
from the same corpus; truncated, foreign and wrapped-count files get clear errors."""

from __future__ import annotations

import gzip
import json
import lzma
import struct
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("dartcore._native", reason="the Rust extension is not built (pip install -e .)")

from dartcore.cli.ngram_build import main  # noqa: E402
from dartcore.dart_trie import convert_dart_trie  # noqa: E402
from dartcore.errors import IndexBuildError, IndexFormatError  # noqa: E402
from dartcore.index import NgramIndex  # noqa: E402


def run(*args) -> int:
    return main([str(a) for a in args])


@pytest.fixture(scope="module")
def official(test_data, tmp_path_factory):
    """A directory holding the official .trie of the Dolma sample (it ships xz-compressed)."""
    d = tmp_path_factory.mktemp("official-dart")
    packed = test_data / "official-dart" / "dolma-sample-qwen3.trie.xz"
    (d / "dolma-sample-qwen3.trie").write_bytes(lzma.decompress(packed.read_bytes()))
    return d


@pytest.fixture(scope="module")
def expected(test_data):
    with gzip.open(test_data / "official-dart" / "expected_counts.json.gz", "rt") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def converted(official, tmp_path_factory):
    out = tmp_path_factory.mktemp("trie") / "from-trie.idx"
    assert (
        run(
            "--from-dart-trie",
            official / "dolma-sample-qwen3.trie",
            "--tokenizer",
            "qwen3",
            "--output",
            out,
            "--memory",
            "2G",
            "--quiet",
        )
        == 0
    )
    return out


def _check_counts(path: Path, expected: dict) -> None:
    idx = NgramIndex(str(path))
    s = idx.stats()
    assert (s["unigram_nodes"], s["bigram_nodes"], s["trigram_nodes"]) == (
        expected["n_unigram"],
        expected["n_bigram"],
        expected["n_trigram"],
    )
    assert s["documents"] == expected["documents"] and s["tokens"] == expected["tokens"]
    total1, total2 = Counter(), Counter()
    for a, _b, n in expected["bigram"]:
        total1[a] += n
    for a, b, _c, n in expected["trigram"]:
        total2[(a, b)] += n
    for a, n in expected["unigram"].items():
        assert idx.count([], int(a)) == (n, expected["tokens"])
    for a, b, n in expected["bigram"]:
        assert idx.count([a], b) == (n, total1[a])
    for a, b, c, n in expected["trigram"]:
        assert idx.count([a, b], c) == (n, total2[(a, b)])


def test_sample_trie_has_the_reference_counts(converted, expected, official):
    _check_counts(converted, expected)
    meta = NgramIndex(str(converted)).metadata
    assert meta["origin"]["format"] == "dart-trie"
    assert meta["origin"]["file"] == "dolma-sample-qwen3.trie"
    assert meta["origin"]["bytes"] == (official / "dolma-sample-qwen3.trie").stat().st_size
    assert meta["tokenizer"]["name"] == "qwen3" and meta["tokenizer"]["vocab_size"] == 151669


def test_sample_trie_equals_the_corpus_index(converted, expected, test_data, tmp_path):
    """The corpus build of the same documents has the same counts; every query agrees."""
    corpus_idx = tmp_path / "corpus.idx"
    assert (
        run(
            "--corpus",
            "dolma",
            "--corpus-dir",
            test_data / "dolma-sample",
            "--tokenizer",
            "qwen3",
            "--output",
            corpus_idx,
            "--memory",
            "4G",
            "--quiet",
        )
        == 0
    )
    _check_counts(corpus_idx, expected)
    a, b = NgramIndex(str(converted)), NgramIndex(str(corpus_idx))
    sa, sb = a.stats(), b.stats()
    for k in ("unigram_nodes", "bigram_nodes", "trigram_nodes", "documents", "tokens"):
        assert sa[k] == sb[k]
    for x, y, _ in expected["bigram"]:
        for ctx in ([x], [x, y]):
            ta, ca, tota, oa = a.children(ctx, 40)
            tb, cb, totb, ob = b.children(ctx, 40)
            assert (list(ta), list(ca), tota, oa) == (list(tb), list(cb), totb, ob)


def test_memory_limit_far_below_the_data(official, expected, tmp_path):
    """A 1 MiB budget forces many sorted chunks and runs: the same counts."""
    out = tmp_path / "small-mem.idx"
    from dartcore import _native
    from dartcore.tokenizers import load_tokenizer

    _native.convert_dart_trie(
        str(official / "dolma-sample-qwen3.trie"),
        str(out),
        vocab_size=load_tokenizer("qwen3").vocab_size,
        memory_limit=1 << 20,
    )
    _check_counts(out, expected)


def test_progress_is_reported(official, tmp_path):
    seen = []
    from dartcore import _native

    _native.convert_dart_trie(
        str(official / "dolma-sample-qwen3.trie"),
        str(tmp_path / "p.idx"),
        vocab_size=151669,
        progress=lambda stage, done, total: seen.append((stage, done, total)),
    )
    size = (official / "dolma-sample-qwen3.trie").stat().st_size
    assert ("read", size, size) in seen and seen[-1] == ("write", 1, 1)


# ----------------------------------------------------------------------------- bad input


def _node_offsets(data: bytes) -> list[int]:
    """Byte offset of every node record (an independent walk of the format)."""
    _, n = struct.unpack_from("<QQ", data, 0)
    offs, off = [], 16
    for _ in range(n):
        offs.append(off)
        (nch,) = struct.unpack_from("<Q", data, off + 16)
        off += 24 + 12 * nch
    assert off == len(data)
    return offs


@pytest.fixture(scope="module")
def trie_bytes(official):
    return (official / "dolma-sample-qwen3.trie").read_bytes()


def _convert(tmp_path, data: bytes):
    src = tmp_path / "bad.trie"
    src.write_bytes(data)
    out = tmp_path / "bad.idx"
    try:
        return convert_dart_trie(src, out, memory=1 << 30)
    finally:
        assert not out.exists()  # nothing written on failure
        # temp dir removed
        assert not [p for p in tmp_path.iterdir() if p.name.startswith("dart-trie-convert-")]


@pytest.mark.parametrize("cut", [5, 16, 1000, -7, -1])
def test_truncated_file(tmp_path, trie_bytes, cut):
    with pytest.raises(IndexFormatError, match="truncated|shorter than"):
        _convert(tmp_path, trie_bytes[:cut])


def test_foreign_files(tmp_path, trie_bytes, converted):
    with pytest.raises(IndexFormatError, match="not a DART TrieNgram"):
        _convert(tmp_path, converted.read_bytes())  # a dartcore index
    with pytest.raises(IndexFormatError, match="order field 4"):
        _convert(tmp_path, struct.pack("<Q", 4) + trie_bytes[8:])
    with pytest.raises(IndexFormatError, match="follow the last"):
        _convert(tmp_path, trie_bytes + b"\0" * 24)


def test_negative_count_names_the_node(tmp_path, trie_bytes):
    offs = _node_offsets(trie_bytes)
    data = bytearray(trie_bytes)
    struct.pack_into("<i", data, offs[3] + 12, -5)
    with pytest.raises(
        IndexFormatError, match=r"node 3 \(token \d+, depth \d\) has count -5.*wrapped"
    ):
        _convert(tmp_path, bytes(data))


def test_wrapped_count_below_children_names_the_node(tmp_path, trie_bytes):
    offs = _node_offsets(trie_bytes)
    data = bytearray(trie_bytes)
    # node 1 is a unigram with children (its count 4 is its bigrams' sum); 1 is below it
    (nch,) = struct.unpack_from("<Q", data, offs[1] + 16)
    assert nch > 0
    struct.pack_into("<i", data, offs[1] + 12, 1)
    with pytest.raises(
        IndexFormatError, match=r"node 1 \(token \d+, depth 1\) has count 1 but its children sum"
    ):
        _convert(tmp_path, bytes(data))


def test_refuses_to_write_over_the_input(tmp_path, trie_bytes):
    src = tmp_path / "x.trie"
    src.write_bytes(trie_bytes)
    with pytest.raises(IndexBuildError, match="is the input"):
        convert_dart_trie(src, src)
    assert src.read_bytes() == trie_bytes
    assert run("--from-dart-trie", src, "--output", src, "--quiet") == 2
    assert (
        run(
            "--from-dart-trie", tmp_path / "missing.trie", "--output", tmp_path / "o.idx", "--quiet"
        )
        == 2
    )
