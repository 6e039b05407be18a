"""NgramIndex and the builder against an independent reference: a plain Python counter over
random small corpora (every context, every answer), plus bad input, sharing and fork."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest

from dartcore.errors import DartError, IndexBuildError, IndexFormatError
from dartcore.index import IndexBuilder, NgramIndex, build_index, merge_runs, parse_size


class Ref:
    """Plain counts over the documents (the definitions of FORMAT.md, no pruning)."""

    def __init__(self, docs: list[list[int]]):
        self.tokens = sum(len(d) for d in docs)
        self.c1: Counter = Counter()
        self.c2: Counter = Counter()
        self.c3: Counter = Counter()
        self.t1: Counter = Counter()
        self.t2: Counter = Counter()
        for d in docs:
            for i, a in enumerate(d):
                self.c1[a] += 1
                if i + 1 < len(d):
                    self.c2[(a, d[i + 1])] += 1
                    self.t1[a] += 1
                if i + 2 < len(d):
                    self.c3[(a, d[i + 1], d[i + 2])] += 1
                    self.t2[(a, d[i + 1])] += 1
        self.kids: dict[tuple, list] = defaultdict(list)
        for (a, b), c in self.c2.items():
            self.kids[(a,)].append((b, c))
        for (a, b, x), c in self.c3.items():
            self.kids[(a, b)].append((x, c))
        self.kids[()] = list(self.c1.items())
        for v in self.kids.values():
            v.sort(key=lambda tc: (-tc[1], tc[0]))

    def total(self, ctx: tuple) -> int:
        return {
            0: self.tokens,
            1: self.t1.get(ctx, 0) if not ctx else self.t1.get(ctx[0], 0),
            2: self.t2.get(ctx, 0),
        }[len(ctx)]

    def children(self, ctx, k):
        ctx = tuple(ctx)
        for n, order in ((2, 3), (1, 2)):
            if len(ctx) >= n and self.kids.get(ctx[len(ctx) - n :]):
                c = ctx[len(ctx) - n :]
                return self.kids[c][:k], self.total(c), order
        return self.kids[()][:k], self.tokens, 1 if self.tokens else 0

    def prob(self, ctx, v, uni=True):
        ctx = tuple(ctx)
        for n, table in ((2, self.c3), (1, self.c2)):
            if len(ctx) >= n:
                c = ctx[len(ctx) - n :]
                cnt = table.get(c + (v,), 0)
                if cnt:
                    return cnt / self.total(c)
        if (uni or not ctx) and self.tokens:
            return self.c1.get(v, 0) / self.tokens
        return 0.0


def random_docs(rng, n_docs, vocab, max_len):
    # skewed token distribution so that contexts repeat and have many children
    p = 1.0 / np.arange(1, vocab + 1) ** 1.1
    p /= p.sum()
    return [
        list(map(int, rng.choice(vocab, size=int(rng.integers(0, max_len)), p=p)))
        for _ in range(n_docs)
    ]


@pytest.mark.parametrize("seed,vocab,spill", [(0, 12, False), (1, 40, True), (2, 70, False)])
def test_every_context_matches_plain_counter(tmp_path, seed, vocab, spill):
    rng = np.random.default_rng(seed)
    docs = random_docs(rng, 120, vocab, 80)
    ref = Ref(docs)
    out = tmp_path / "x.idx"
    opts = {"memory_limit": 1 << 20} if spill else {}
    summary = build_index(
        [np.array(d, dtype=np.int64) for d in docs],
        out,
        vocab_size=vocab,
        metadata={"tokenizer": {"name": "test", "fingerprint": "abc"}},
        **opts,
    )
    assert summary["tokens"] == ref.tokens and summary["documents"] == len(docs)
    idx = NgramIndex(out)
    idx.verify()
    assert idx.vocab_size == vocab
    assert idx.metadata["tokenizer"]["fingerprint"] == "abc"
    st = idx.stats()
    assert st["trigram_nodes"] == len(ref.c3) and st["bigram_nodes"] == len(ref.c2)
    assert st["unigram_nodes"] == len(ref.c1) and st["nodes"] == len(ref.c1) + len(ref.c2) + len(
        ref.c3
    )
    contexts = (
        [()] + [(a,) for a in range(vocab)] + [(a, b) for a in range(vocab) for b in range(vocab)]
    )
    cands = np.arange(vocab, dtype=np.uint32)
    for ctx in contexts:
        for k in (1, 5, 25, 40):
            toks, cnts, total, order = idx.children(list(ctx), k)
            want, wtotal, worder = ref.children(ctx, k)
            assert [(int(t), int(c)) for t, c in zip(toks, cnts)] == want, (ctx, k)
            assert (total, order) == (wtotal, worder), ctx
        for uni in (True, False):
            got = idx.cond_probs(list(ctx), cands, unigram_backoff=uni)
            want = [ref.prob(ctx, int(v), uni) for v in cands]
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-15)
        v = int(rng.integers(0, vocab))
        assert idx.prob(list(ctx), v) == pytest.approx(ref.prob(ctx, v), abs=1e-15)
    # batch == single, padding where a context has fewer than k children
    pairs = np.array([(a, b) for a in range(vocab) for b in range(vocab)], dtype=np.int64)
    toks, cnts, totals, orders = idx.children_batch(pairs, 7)
    assert toks.shape == (len(pairs), 7) and cnts.dtype == np.uint64 and orders.dtype == np.uint8
    for i, (a, b) in enumerate(pairs):
        want, wtotal, worder = ref.children((int(a), int(b)), 7)
        row = [(int(t), int(c)) for t, c in zip(toks[i], cnts[i]) if t != 2**32 - 1]
        assert row == want and totals[i] == wtotal and orders[i] == worder
        assert all(c == 0 for t, c in zip(toks[i], cnts[i]) if t == 2**32 - 1)


def test_count_exact_context(tmp_path):
    docs = [[1, 2, 3, 1, 2, 4], [1, 2]]
    build_index([np.array(d) for d in docs], tmp_path / "i.idx", vocab_size=8)
    idx = NgramIndex(tmp_path / "i.idx")
    assert idx.count([], 1) == (3, 8)
    assert idx.count([1], 2) == (3, 3)  # total(1): occurrences of 1 followed by a token
    assert idx.count([1, 2], 3) == (1, 2)  # the document-final (1, 2) is not followed
    assert idx.count([5, 5], 3) == (0, 0)
    assert idx.count([2], 7) == (0, 2)


def test_pruning_options(tmp_path):
    rng = np.random.default_rng(5)
    docs = random_docs(rng, 200, 30, 60)
    ref = Ref(docs)
    build_index([np.array(d) for d in docs], tmp_path / "p.idx", vocab_size=30, min_count=3)
    idx = NgramIndex(tmp_path / "p.idx")
    idx.verify()
    assert idx.stats()["trigram_nodes"] == sum(1 for c in ref.c3.values() if c >= 3)
    # totals keep the pre-pruning definition
    for (a, b), t in list(ref.t2.items())[:50]:
        toks, _, total, order = idx.children([a, b], 5)
        if order == 3:
            assert total == t
    build_index([np.array(d) for d in docs], tmp_path / "c.idx", vocab_size=30, max_children=2)
    idx = NgramIndex(tmp_path / "c.idx")
    for a in range(30):
        toks, cnts, _, order = idx.children([a], 10)
        if order == 2:
            assert len(toks) <= 2
            assert [(int(t), int(c)) for t, c in zip(toks, cnts)] == ref.kids[(a,)][:2]


def test_builder_map_reduce_and_npy_inputs(tmp_path):
    rng = np.random.default_rng(3)
    docs = [np.array(d, dtype=np.uint32) for d in random_docs(rng, 90, 25, 50)]
    npy = []
    for i, d in enumerate(docs[:30]):
        p = tmp_path / f"d{i}.npy"
        np.save(p, d)
        npy.append(str(p))
    single = build_index(npy + docs[30:], tmp_path / "single.idx", vocab_size=25, metadata={"m": 1})
    runs = []
    for shard in (docs[:45], docs[45:]):
        b = IndexBuilder(25, memory_limit="1M")
        b.add_many(shard[:-1])
        b.add(shard[-1])
        assert b.documents == len(shard)
        runs += b.write_runs(tmp_path / "runs")
    s = merge_runs(runs, tmp_path / "merged.idx", vocab_size=25, metadata={"m": 1})
    assert s["documents"] == single["documents"] == 90
    assert (tmp_path / "merged.idx").read_bytes() == (tmp_path / "single.idx").read_bytes()


def test_empty_corpus_is_valid(tmp_path):
    s = build_index([], tmp_path / "e.idx", vocab_size=100)
    assert s["tokens"] == 0
    idx = NgramIndex(tmp_path / "e.idx")
    idx.verify()
    toks, cnts, total, order = idx.children([1, 2])
    assert len(toks) == 0 and total == 0 and order == 0
    assert idx.prob([1, 2], 3) == 0.0


def test_bad_tokens_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="out of range"):
        build_index([np.array([1, 2, 10])], tmp_path / "x.idx", vocab_size=10)
    with pytest.raises(ValueError):
        build_index([np.array([1, -2])], tmp_path / "x.idx", vocab_size=10)
    assert not (tmp_path / "x.idx").exists()
    b = IndexBuilder(10)
    with pytest.raises(ValueError):
        b.add(np.array([3, 11], dtype=np.uint32))  # native check
    build_index([np.array([1, 2, 3])], tmp_path / "ok.idx", vocab_size=10)
    idx = NgramIndex(tmp_path / "ok.idx")
    with pytest.raises(ValueError):
        idx.children([1, 10])
    with pytest.raises(ValueError):
        idx.prob([1], 10)
    with pytest.raises(ValueError):
        idx.children_batch(np.array([[1, 99]]), 3)
    with pytest.raises(ValueError):
        IndexBuilder(0)
    with pytest.raises(ValueError):
        parse_size("lots")
    assert parse_size("2G") == 2 << 30 and parse_size("512MiB") == 512 << 20


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        NgramIndex(tmp_path / "missing.idx")
    (tmp_path / "empty.idx").write_bytes(b"")
    with pytest.raises(IndexFormatError):
        NgramIndex(tmp_path / "empty.idx")
    (tmp_path / "junk.idx").write_bytes(b"GGUF" + b"\0" * 1000)
    with pytest.raises(IndexFormatError, match="magic"):
        NgramIndex(tmp_path / "junk.idx")
    build_index([np.array([1, 2, 3, 4, 1, 2])], tmp_path / "ok.idx", vocab_size=10)
    good = (tmp_path / "ok.idx").read_bytes()
    bad = bytearray(good)
    bad[8] = 2  # version 2
    (tmp_path / "v2.idx").write_bytes(bytes(bad))
    with pytest.raises(IndexFormatError, match="version"):
        NgramIndex(tmp_path / "v2.idx")
    (tmp_path / "trunc.idx").write_bytes(good[:-8])
    with pytest.raises(IndexFormatError, match="truncated"):
        NgramIndex(tmp_path / "trunc.idx")
    # a body flip passes the O(1) open but not verify()
    bad = bytearray(good)
    bad[-3] ^= 0xFF
    (tmp_path / "flip.idx").write_bytes(bytes(bad))
    idx = NgramIndex(tmp_path / "flip.idx")
    with pytest.raises(IndexFormatError, match="checksum"):
        idx.verify()
    assert issubclass(IndexFormatError, DartError)


def test_random_mutations_never_crash(tmp_path):
    """Header/section parsing under random byte flips and truncations: a clean
    IndexFormatError or a working index, never a crash (the Rust proptest covers more)."""
    rng = np.random.default_rng(0)
    docs = random_docs(rng, 40, 20, 40)
    build_index([np.array(d) for d in docs], tmp_path / "ok.idx", vocab_size=20)
    good = (tmp_path / "ok.idx").read_bytes()
    p = tmp_path / "m.idx"
    for trial in range(300):
        b = bytearray(good)
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(0, 800 if trial % 2 else len(b)))
            b[i] ^= int(rng.integers(1, 256))
        if trial % 5 == 0:
            b = b[: int(rng.integers(0, len(b)))]
        p.write_bytes(bytes(b))
        try:
            idx = NgramIndex(p)
        except IndexFormatError:
            continue
        for ctx in ([1, 2], [3], []):
            try:
                idx.children(ctx, 30)
            except IndexFormatError:
                pass
            idx.prob(ctx, 4)
        try:
            idx.verify()
        except IndexFormatError:
            pass


def test_interrupted_build_leaves_nothing(tmp_path):
    """A builder killed mid-build leaves no file at the output path (temp + rename)."""
    out = tmp_path / "never.idx"
    code = f"""
import os, numpy as np
from dartcore.index import IndexBuilder
b = IndexBuilder(1000, memory_limit="1M", temp_dir={str(tmp_path)!r})
rng = np.random.default_rng(0)
b.add_many([rng.integers(0, 1000, 5000).astype(np.uint32) for _ in range(40)])
os._exit(3)  # dies before finish()
"""
    r = subprocess.run([sys.executable, "-c", code])
    assert r.returncode == 3
    assert not out.exists()
    assert not list(tmp_path.glob("*.idx"))


def test_two_processes_share_clean_pages(tmp_path):
    """Two processes mapping the same index hold it as shared clean pages (page cache),
    not private copies (/proc/PID/smaps)."""
    if not Path("/proc/self/smaps").exists():
        pytest.skip("no /proc/PID/smaps on this system")
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 5000, 20000).astype(np.uint32) for _ in range(20)]
    out = tmp_path / "big.idx"
    build_index(docs, out, vocab_size=5000)
    size = out.stat().st_size
    code = f"""
import sys, numpy as np
from dartcore.index import NgramIndex
idx = NgramIndex({str(out)!r}, prefault=True)
for a in range(0, 5000, 7):
    idx.children([a, (a * 13) % 5000], 25)
sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.readline()
"""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            smaps = Path(f"/proc/{p.pid}/smaps").read_text()
            block = _mapping_block(smaps, str(out))
            assert block is not None, "index not mapped"
            f = {
                k: int(v.split()[0])
                for k, v in (line.split(":", 1) for line in block[1:] if ":" in line)
                if v.strip().endswith("kB")
            }
            assert f["Shared_Clean"] > 0, block
            assert f["Private_Dirty"] == 0, block
            # prefaulted: mostly resident, shared
            assert f["Shared_Clean"] * 1024 >= 0.5 * size, block
            assert f["Pss"] < f["Rss"], block  # two processes split the pages
    finally:
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
            p.wait(timeout=30)


def _mapping_block(smaps: str, path: str):
    lines = smaps.splitlines()
    for i, line in enumerate(lines):
        if line.rstrip().endswith(path):
            j = i + 1
            while j < len(lines) and ":" in lines[j].split()[0]:
                j += 1
            return lines[i:j]
    return None


def test_fork_after_parallel_build_does_not_hang(tmp_path):
    """A child forked after the owned pool ran jobs can still build and query."""
    code = f"""
import os, sys, numpy as np
from dartcore import _native
from dartcore.index import build_index, NgramIndex, set_num_threads
set_num_threads(2)
rng = np.random.default_rng(0)
docs = [rng.integers(0, 300, 40000).astype(np.uint32) for _ in range(8)]
build_index(docs, {str(tmp_path / "a.idx")!r}, vocab_size=300)
assert _native._testing.pool_ping() > 0
pid = os.fork()
if pid == 0:
    build_index(docs, {str(tmp_path / "b.idx")!r}, vocab_size=300)
    idx = NgramIndex({str(tmp_path / "b.idx")!r})
    idx.children_batch(np.array([[1, 2]] * 100), 5)
    os._exit(0 if _native._testing.pool_ping() > 0 else 1)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""
    r = subprocess.run([sys.executable, "-c", code], timeout=120)
    assert r.returncode == 0
    assert (tmp_path / "a.idx").read_bytes() == (tmp_path / "b.idx").read_bytes()


def test_thread_count_and_numa(tmp_path):
    from dartcore import _native

    _native.set_num_threads(3)
    assert _native.num_threads() == 3
    with pytest.raises(ValueError):
        _native.set_num_threads(0)
    root = tmp_path / "sys"
    for n, cpus in ((0, "0-1\n"), (1, "2,5\n")):
        d = root / "devices/system/node" / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus)
    assert _native.numa_topology(str(root)) == [(0, [0, 1]), (1, [2, 5])]
    _native.set_num_threads(max(1, os.cpu_count() or 1))


def test_metadata_and_stats(tmp_path):
    meta = {
        "tokenizer": {"name": "qwen3", "fingerprint": "f00"},
        "corpus": "unit",
        "documents": 1,
        "tokens": 4,
        "build": {"min_count": 1},
    }
    s = IndexBuilder(10)
    s.add(np.array([1, 2, 3, 4], dtype=np.uint32))
    summary = s.finish(tmp_path / "m.idx", meta)
    with pytest.raises(IndexBuildError):
        s.finish(tmp_path / "m2.idx", meta)  # a builder is consumed by finish
    idx = NgramIndex(tmp_path / "m.idx")
    assert idx.metadata == meta
    st = idx.stats()
    assert st["bytes"] == summary["bytes"] == (tmp_path / "m.idx").stat().st_size
    assert st["nodes"] == 4 + 3 + 2 and st["bytes_per_node"] == pytest.approx(st["bytes"] / 9)
    assert json.loads(idx._inner.metadata_json()) == meta
