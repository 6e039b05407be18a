"""ngram-build end to end: counts equal a plain-Python reference, resume gives
the same bytes, map/reduce parts merge to the same index, the npy path, a
memory limit far below the data, and bad input."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("dartcore._native", reason="the Rust extension is not built (pip install -e .)")

from dartcore.cli.ngram_build import main  # noqa: E402
from dartcore.index import NgramIndex  # noqa: E402
from dartcore.tokenizers import load_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer("qwen3")


def reference_counts(docs: list[np.ndarray]):
    """Unigram/bigram/trigram counters of documents (EOS already appended), in plain Python."""
    c1, c2, c3 = Counter(), Counter(), Counter()
    for d in docs:
        d = [int(t) for t in d]
        for i in range(len(d)):
            c1[d[i]] += 1
            if i + 1 < len(d):
                c2[(d[i], d[i + 1])] += 1
            if i + 2 < len(d):
                c3[(d[i], d[i + 1], d[i + 2])] += 1
    return c1, c2, c3


def assert_index_matches(path: Path, docs: list[np.ndarray]) -> None:
    c1, c2, c3 = reference_counts(docs)
    idx = NgramIndex(str(path))
    stats = idx.stats()
    assert stats["tokens"] == sum(c1.values())
    assert stats["documents"] == len(docs)
    assert (stats["unigram_nodes"], stats["bigram_nodes"], stats["trigram_nodes"]) == (
        len(c1),
        len(c2),
        len(c3),
    )
    total1, total2 = Counter(), Counter()
    for (a, _b), n in c2.items():
        total1[a] += n
    for (a, b, _c), n in c3.items():
        total2[(a, b)] += n
    tokens = sum(c1.values())
    for a, n in c1.items():
        assert idx.count([], a) == (n, tokens)
    for (a, b), n in c2.items():
        assert idx.count([a], b) == (n, total1[a])
    for (a, b, c), n in c3.items():
        assert idx.count([a, b], c) == (n, total2[(a, b)])
    # Children of a few frequent contexts, in the index's order: count desc, token asc.
    by_ctx: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for (a, b, c), n in c3.items():
        by_ctx.setdefault((a, b), []).append((c, n))
    for ctx, _ in Counter({k: len(v) for k, v in by_ctx.items()}).most_common(20):
        expect = sorted(by_ctx[ctx], key=lambda cn: (-cn[1], cn[0]))
        toks, counts, total, order = _children(idx, list(ctx), len(expect) + 5)
        assert order == 3 and total == total2[ctx]
        assert list(zip(toks, counts)) == expect


def _children(idx, context, k):
    out = idx.children(context, k)
    if isinstance(out, tuple) and len(out) == 4:
        toks, counts, total, order = out
    else:  # a result object
        toks, counts, total, order = out.tokens, out.counts, out.total, out.order
    return [int(t) for t in toks], [int(c) for c in counts], int(total), int(order)


def dolma_docs(test_data: Path, tok) -> list[np.ndarray]:
    """Documents of the sample read and tokenised independently (gzip + json + encode)."""
    docs = []
    for path in sorted((test_data / "dolma-sample" / "documents").iterdir()):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    ids = tok.encode(json.loads(line)["text"])
                    docs.append(np.append(ids, np.uint32(tok.eos_id)))
    return docs


def run(*args: str) -> int:
    return main([str(a) for a in args])


# ----------------------------------------------------------------------------- end to end


def test_dolma_sample_counts_equal_reference(test_data, qwen3, tmp_path, capsys):
    out = tmp_path / "qwen3-dolma.idx"
    assert (
        run(
            "--corpus",
            "dolma",
            "--corpus-dir",
            test_data / "dolma-sample",
            "--tokenizer",
            "qwen3",
            "--output",
            out,
            "--memory",
            "4G",
            "--quiet",
        )
        == 0
    )
    docs = dolma_docs(test_data, qwen3)
    assert_index_matches(out, docs)
    meta = NgramIndex(str(out)).metadata
    assert meta["tokenizer"] == {
        "name": "qwen3",
        "fingerprint": qwen3.fingerprint,
        "vocab_size": 151669,
        "eos_id": 151643,
    }
    assert meta["documents"] == 30 and meta["tokens"] == sum(len(d) for d in docs)
    assert meta["corpus"]["kind"] == "dolma" and len(meta["corpus"]["files"]) == 3
    assert not (tmp_path / "qwen3-dolma.idx.work").exists()  # work dir removed after success


def test_summary_and_progress(test_data, tmp_path, capsys):
    out = tmp_path / "s.idx"
    assert (
        run("--corpus-dir", test_data / "dolma-sample", "--output", out, "--memory", "4G", "--json")
        == 0
    )
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["documents"] == 30 and summary["file_bytes"] == out.stat().st_size
    assert summary["nodes"]["total"] == sum(
        summary["nodes"][k] for k in ("unigram", "bigram", "trigram")
    )
    assert summary["peak_rss_bytes"] > 0 and summary["wall_s"] > 0
    assert "docs/s" in captured.err and "Mtok/s" in captured.err and "MiB read" in captured.err
    assert run("--corpus-dir", test_data / "dolma-sample", "--output", out, "--memory", "4G") == 0
    text = capsys.readouterr().out
    for word in ("documents", "tokens", "nodes", "trigram", "file size", "wall time", "peak RSS"):
        assert word in text


def test_max_docs_and_max_tokens(test_data, qwen3, tmp_path):
    docs = dolma_docs(test_data, qwen3)
    out = tmp_path / "m.idx"
    assert (
        run("--corpus-dir", test_data / "dolma-sample", "--output", out, "--max-docs", 7, "--quiet")
        == 0
    )
    assert_index_matches(out, docs[:7])
    # --max-tokens: whole documents, up to and including the one that reaches the limit.
    limit = sum(len(d) for d in docs[:12]) - 5
    assert (
        run(
            "--corpus-dir",
            test_data / "dolma-sample",
            "--output",
            out,
            "--max-tokens",
            limit,
            "--quiet",
        )
        == 0
    )
    assert_index_matches(out, docs[:12])


# ----------------------------------------------------------------------------- resume, map/reduce


def _many_shards(tmp_path: Path, n_shards=6, docs_per=40, seed=0) -> Path:
    rng = np.random.default_rng(seed)
    words = [
        "the",
        "cat",
        "sat",
        "on",
        "a",
        "mat",
        "and",
        "then",
        "it",
        "ran",
        "away",
        "quickly",
        "über",
        "猫",
    ]
    root = tmp_path / "corpus"
    (root / "documents").mkdir(parents=True)
    for s in range(n_shards):
        with gzip.open(root / "documents" / f"part-{s:03d}.json.gz", "wt", encoding="utf-8") as f:
            for i in range(docs_per):
                text = " ".join(rng.choice(words, size=int(rng.integers(3, 80))))
                f.write(json.dumps({"id": f"{s}-{i}", "text": text, "source": "test"}) + "\n")
    return root


def test_resume_after_interruption_is_byte_identical(tmp_path):
    corpus = _many_shards(tmp_path)
    clean = tmp_path / "clean.idx"
    assert run("--corpus-dir", corpus, "--output", clean, "--quiet") == 0
    resumed = tmp_path / "resumed.idx"
    # Simulated Ctrl-C after 2 shards: exit 130, manifest keeps 2 shards, no temp files.
    assert (
        run("--corpus-dir", corpus, "--output", resumed, "--quiet", "--stop-after-shards", 2) == 130
    )
    work = tmp_path / "resumed.idx.work"
    manifest = json.loads((work / "manifest.json").read_text())
    assert sorted(manifest["shards"]) == ["0", "1"]
    assert not any(p.name.startswith("tmp-") or p.name.endswith(".partial") for p in work.iterdir())
    assert not resumed.exists()
    # Without --resume the half-done work dir is refused, not silently overwritten.
    assert run("--corpus-dir", corpus, "--output", resumed, "--quiet") == 2
    assert run("--corpus-dir", corpus, "--output", resumed, "--quiet", "--resume") == 0
    assert resumed.read_bytes() == clean.read_bytes()


def test_sigint_in_subprocess_then_resume(tmp_path):
    corpus = _many_shards(tmp_path, n_shards=40, docs_per=300, seed=1)
    clean = tmp_path / "clean.idx"
    assert run("--corpus-dir", corpus, "--output", clean, "--quiet") == 0
    out = tmp_path / "killed.idx"
    work = tmp_path / "killed.idx.work"
    env = dict(
        os.environ, PYTHONPATH=str(REPO / "python") + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    cmd = [
        sys.executable,
        "-m",
        "dartcore.cli.ngram_build",
        "--corpus-dir",
        str(corpus),
        "--output",
        str(out),
        "--quiet",
        "--batch-bytes",
        "4K",
    ]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if json.loads((work / "manifest.json").read_text())["shards"]:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("the build finished before the signal arrived")
    assert proc.returncode == 130, err
    assert "--resume" in err
    done = json.loads((work / "manifest.json").read_text())["shards"]
    assert 0 < len(done) < 40
    assert not any(p.name.startswith("tmp-") or p.name.endswith(".partial") for p in work.iterdir())
    assert run("--corpus-dir", corpus, "--output", out, "--quiet", "--resume") == 0
    assert out.read_bytes() == clean.read_bytes()


def test_map_parts_then_reduce_equals_one_command_build(tmp_path):
    corpus = _many_shards(tmp_path, n_shards=5)
    one = tmp_path / "one.idx"
    assert run("--corpus-dir", corpus, "--output", one, "--quiet") == 0
    for part in ("0/2", "1/2"):
        w = tmp_path / f"w{part[0]}"
        assert run("map", "--corpus-dir", corpus, "--work-dir", w, "--part", part, "--quiet") == 0
    two = tmp_path / "two.idx"
    # One part alone is incomplete: reduce refuses it.
    assert run("reduce", "--work-dir", tmp_path / "w0", "--output", two, "--quiet") == 2
    assert (
        run(
            "reduce",
            "--work-dir",
            tmp_path / "w0",
            "--work-dir",
            tmp_path / "w1",
            "--output",
            two,
            "--quiet",
        )
        == 0
    )
    assert two.read_bytes() == one.read_bytes()
    three = tmp_path / "three.idx"
    assert (
        run(
            "reduce",
            "--work-dir",
            tmp_path / "w0",
            "--work-dir",
            tmp_path / "w1",
            "--output",
            three,
            "--quiet",
            "--reduce-partitions",
            3,
        )
        == 0
    )
    assert three.read_bytes() == one.read_bytes()


def test_help_documents_map_and_reduce(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for word in (
        "ngram-build map",
        "ngram-build reduce",
        "--resume",
        "--memory",
        "--max-tokens",
        "--strict",
    ):
        assert word in text


# ----------------------------------------------------------------------------- npy and memory


def test_npy_corpus(test_data, qwen3, tmp_path):
    docs = dolma_docs(test_data, qwen3)
    flat = np.concatenate(docs)  # EOS between (and after) documents: the Dolma tokenizer's layout
    d = tmp_path / "npy"
    d.mkdir()
    np.save(d / "a.npy", flat[: len(np.concatenate(docs[:10]))])
    flat[len(np.concatenate(docs[:10])) :].tofile(d / "b.npy")  # raw memmap, no header
    out = tmp_path / "npy.idx"
    assert (
        run(
            "--corpus", "npy", "--corpus-dir", d, "--tokenizer", "qwen3", "--output", out, "--quiet"
        )
        == 0
    )
    assert_index_matches(out, docs)


def _tiny_tokenizer(tmp_path: Path, vocab: int) -> Path:
    """A word-level tokenizer.json with `vocab` ids (EOS = 0); cheap to load."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    words = {"</s>": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = tokenizers.Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    d = tmp_path / "tiny-tokenizer"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    return d


def test_memory_limit_far_below_distinct_trigrams(tmp_path):
    """12M random tokens from 60k ids: ~12M distinct trigrams (~190 MB as sorted
    (key, count) pairs, ~96 MB as raw keys) through a 160 MiB process budget, of
    which the interpreter and the batches in flight take about two thirds."""
    vocab = 60_000
    tokdir = _tiny_tokenizer(tmp_path, vocab)
    rng = np.random.default_rng(0)
    d = tmp_path / "npy"
    d.mkdir()
    n = 12_000_000
    for s in range(3):
        toks = rng.integers(1, vocab, size=n // 3, dtype=np.uint32)
        toks[rng.integers(0, n // 3, size=n // 6000)] = 0  # EOS every ~2000 tokens
        toks[-1] = 0
        np.save(d / f"s{s}.npy", toks)
    limit = 160 << 20
    out = tmp_path / "mem.idx"
    env = dict(
        os.environ, PYTHONPATH=str(REPO / "python") + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dartcore.cli.ngram_build",
            "--corpus",
            "npy",
            "--corpus-dir",
            str(d),
            "--tokenizer",
            str(tokdir),
            "--output",
            str(out),
            "--memory",
            str(limit),
            "--quiet",
            "--json",
            "--keep-work",
            "--threads",
            "2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["nodes"]["trigram"] > 11_000_000  # distinct trigrams far above what fits
    runs = list((tmp_path / "mem.idx.work").rglob("*.dartrun"))
    assert len(runs) > 2  # the builder really spilled
    assert summary["peak_rss_bytes"] <= 1.10 * limit, {
        k: summary[k] for k in ("peak_rss_bytes", "builder_memory_bytes", "map_s", "reduce_s")
    }
    stats = NgramIndex(str(out)).stats()
    assert stats["tokens"] == n


# ----------------------------------------------------------------------------- bad input


def test_unknown_corpus_and_tokenizer(test_data, tmp_path, capsys):
    assert (
        run(
            "--corpus",
            "parquet",
            "--corpus-dir",
            test_data / "dolma-sample",
            "--output",
            tmp_path / "x",
        )
        == 2
    )
    assert "dolma, jsonl, text, npy" in capsys.readouterr().err
    assert (
        run(
            "--corpus-dir",
            test_data / "dolma-sample",
            "--tokenizer",
            "gpt-17",
            "--output",
            tmp_path / "x",
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "TokenizerError" in err and "qwen3" in err and "smollm2" in err


def test_empty_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DOLMA_DIR", raising=False)
    (tmp_path / "empty").mkdir()
    assert run("--corpus-dir", tmp_path / "empty", "--output", tmp_path / "x.idx") == 2
    err = capsys.readouterr().err
    assert "CorpusError" in err and str(tmp_path / "empty") in err and "allenai/dolma" in err
    assert run("--output", tmp_path / "x.idx") == 2  # no --corpus-dir, no $DOLMA_DIR
    assert "DOLMA_DIR" in capsys.readouterr().err


def test_output_not_writable_fails_before_work(test_data, tmp_path, capsys):
    t0 = time.monotonic()
    assert (
        run(
            "--corpus-dir",
            test_data / "dolma-sample",
            "--output",
            tmp_path / "no" / "such" / "x.idx",
        )
        == 2
    )
    assert "does not exist" in capsys.readouterr().err
    assert run("--corpus-dir", test_data / "dolma-sample", "--output", tmp_path) == 2
    assert "is a directory" in capsys.readouterr().err
    assert time.monotonic() - t0 < 5  # nothing was tokenised
    assert not any(p.name.endswith(".work") for p in tmp_path.iterdir())
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        assert run("--corpus-dir", test_data / "dolma-sample", "--output", ro / "x.idx") == 2
        assert "not writable" in capsys.readouterr().err


def test_damaged_corpus_counted_or_strict(tmp_path, qwen3, capsys):
    root = tmp_path / "c"
    (root / "documents").mkdir(parents=True)
    good = [f"document number {i} with some text" for i in range(50)]
    payload = "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(good)).encode()
    blob = gzip.compress(payload)
    (root / "documents" / "a.json.gz").write_bytes(blob[: len(blob) - 20])  # truncated stream
    (root / "documents" / "b.jsonl").write_bytes(
        b'{"text": "fine one"}\n{oops\n{"text": "caf\xe9"}\n{"no_text": 1}\n{"text": "fine two"}\n'
    )
    out = tmp_path / "d.idx"
    assert run("--corpus-dir", root, "--output", out, "--json") == 0
    cap = capsys.readouterr()
    summary = json.loads(cap.out.strip().splitlines()[-1])
    p = summary["corpus_problems"]
    assert p["corrupt_streams"] == 1 and p["bad_lines"] == 2 and p["invalid_utf8"] == 1
    assert "a.json.gz: corrupt gzip stream" in cap.err and "byte offset" in cap.err
    meta = NgramIndex(str(out)).metadata
    assert meta["corpus"]["corrupt_streams"] == 1 and meta["corpus"]["bad_lines"] == 2
    # Kept: the documents before the break, then b.jsonl's three readable lines.
    assert meta["documents"] == summary["documents"] and 3 < meta["documents"] < 53
    assert run("--corpus-dir", root, "--output", tmp_path / "strict.idx", "--strict") == 2
    assert "--strict" in capsys.readouterr().err
    assert not (tmp_path / "strict.idx").exists()


def test_huge_document_and_non_utf8_text(tmp_path, qwen3):
    d = tmp_path / "t"
    d.mkdir()
    huge = ("lorem ipsum dolor sit amet " * 40_000) + "\n"  # ~1 MB, one document
    (d / "huge.txt").write_text(huge)
    (d / "latin1.txt").write_bytes("na\u00efve caf\u00e9\n".encode("latin-1"))
    out = tmp_path / "t.idx"
    assert run("--corpus", "text", "--corpus-dir", d, "--output", out, "--quiet") == 0
    eos = np.uint32(qwen3.eos_id)
    docs = [
        np.append(qwen3.encode(huge), eos),
        np.append(qwen3.encode("na\ufffdve caf\ufffd\n"), eos),
    ]
    assert_index_matches(out, docs)


def test_work_dir_cleanup_keeps_user_files(tmp_path):
    corpus = _many_shards(tmp_path, n_shards=2)
    work = tmp_path / "mywork"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    out = tmp_path / "w.idx"
    assert run("--corpus-dir", corpus, "--output", out, "--work-dir", work, "--quiet") == 0
    assert out.is_file()
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt"]


def test_min_count_reaches_the_index(test_data, qwen3, tmp_path):
    out = tmp_path / "mc.idx"
    assert (
        run(
            "--corpus-dir", test_data / "dolma-sample", "--output", out, "--min-count", 2, "--quiet"
        )
        == 0
    )
    c1, c2, c3 = reference_counts(dolma_docs(test_data, qwen3))
    idx = NgramIndex(str(out))
    s = idx.stats()
    assert s["unigram_nodes"] == len(c1)  # unigrams are kept
    assert s["bigram_nodes"] == sum(1 for n in c2.values() if n >= 2)
    assert s["trigram_nodes"] == sum(1 for n in c3.values() if n >= 2)
    assert idx.metadata["build"]["min_count"] == 2
    (a, b, c), n = c3.most_common(1)[0]
    assert idx.count([a, b], c)[0] == n


@pytest.mark.slow
def test_smollm2_index_records_the_hf_fingerprint(test_data, qwen3, tmp_path):
    """What the decoder compares: the index's recorded fingerprint and
    fingerprint() of the target's Hugging Face tokenizer."""
    from dartcore.models.hub import load_hf_tokenizer
    from dartcore.tokenizers import fingerprint

    out = tmp_path / "smol.idx"
    assert (
        run(
            "--corpus-dir",
            test_data / "dolma-sample",
            "--tokenizer",
            "smollm2",
            "--output",
            out,
            "--max-docs",
            5,
            "--quiet",
        )
        == 0
    )
    hf = load_hf_tokenizer("smollm2")
    meta = NgramIndex(str(out)).metadata["tokenizer"]
    assert meta["fingerprint"] == fingerprint(hf) != qwen3.fingerprint
    assert meta["vocab_size"] == len(hf) and meta["eos_id"] == hf.eos_token_id
    docs = []
    for path in sorted((test_data / "dolma-sample" / "documents").iterdir()):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            docs += [json.loads(line)["text"] for line in f if line.strip()]
    ref = [
        np.array(hf.encode(t, add_special_tokens=False) + [hf.eos_token_id], dtype=np.uint32)
        for t in docs[:5]
    ]
    assert_index_matches(out, ref)
