"""Hostile input at the index API and the bindings: every bad argument is a TypeError /
ValueError / DartError naming the argument, never a panic, an abort, a hang or a silently
converted answer; index paths that are not regular files; the verify levels against
damaged files. Answers of accepted calls are checked against the plain counter of
test_index.Ref."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dartcore import _native
from dartcore.errors import DartError, IndexFormatError, IndexPathError, InternalError
from dartcore.index import NgramIndex, build_index

sys.path.insert(0, str(Path(__file__).parent))
from test_index import Ref, random_docs  # noqa: E402

VOCAB = 30


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(7)
    docs = random_docs(rng, 60, VOCAB, 60)
    path = tmp_path_factory.mktemp("hostile") / "h.idx"
    build_index([np.array(d) for d in docs], path, vocab_size=VOCAB)
    return path, Ref(docs), docs


@pytest.fixture
def idx(corpus):
    return NgramIndex(corpus[0])


# ---- panics ---------------------------------------------------------------------------------


@pytest.mark.parametrize("in_pool", [False, True])
def test_panic_is_internal_error_naming_the_call(in_pool):
    with pytest.raises(InternalError, match=r"_testing\.panic.*boom 42") as e:
        _native._testing.panic("boom 42", in_pool=in_pool)
    assert isinstance(e.value, Exception) and isinstance(e.value, DartError)
    # the pool still works after a worker panicked
    assert _native._testing.pool_ping() > 0


def test_bench_helpers_are_private():
    for name in ("bench_children", "bench_cond_probs", "bench_beam_search", "pool_ping"):
        assert not hasattr(_native, name), name
    from dartcore._native import _bench, _testing

    assert callable(_bench.bench_children) and callable(_bench.bench_beam_search)
    assert callable(_testing.pool_ping)
    import dartcore

    assert not any(n.startswith("bench") for n in dartcore.__all__)


def test_errors_are_the_python_classes(idx, tmp_path):
    import dartcore.errors

    (tmp_path / "junk.idx").write_bytes(b"junk" * 100)
    with pytest.raises(IndexFormatError) as e:
        NgramIndex(tmp_path / "junk.idx")
    assert type(e.value) is dartcore.errors.IndexFormatError


# ---- query arguments ------------------------------------------------------------------------

BAD = [
    # (method, args, kwargs, exception, text the message must contain)
    ("children", ([1.7],), {}, TypeError, "context"),
    ("children", ([float("nan")],), {}, TypeError, "context"),
    ("children", ("12",), {}, TypeError, "context"),
    ("children", (b"12",), {}, TypeError, "context"),
    ("children", ([[1, 2], [3, 4]],), {}, TypeError, "context"),
    ("children", (np.array([[1, 2], [3, 4]]),), {}, ValueError, "context"),
    ("children", ([True, 2],), {}, TypeError, "context"),
    ("children", (np.array([True, False]),), {}, TypeError, "context"),
    ("children", (np.array([1.0, 2.0]),), {}, TypeError, "context"),
    ("children", (5,), {}, TypeError, "context"),
    ("children", (None,), {}, TypeError, "context"),
    ("children", ([1, VOCAB],), {}, ValueError, "context"),
    ("children", ([-1],), {}, ValueError, "context"),
    ("children", ([2**70],), {}, ValueError, "context"),
    ("children", (np.array([2**63], dtype=np.uint64),), {}, ValueError, "context"),
    ("children", ([1, 2], 2.5), {}, TypeError, "k"),
    ("children", ([1, 2], "5"), {}, TypeError, "k"),
    ("children", ([1, 2], True), {}, TypeError, "k"),
    ("children", ([1, 2], None), {}, TypeError, "k"),
    ("children", ([1, 2], float("nan")), {}, TypeError, "k"),
    ("children", ([1, 2], -1), {}, ValueError, "k"),
    ("children_batch", (np.array([[1.5, 2]]), 3), {}, TypeError, "contexts"),
    ("children_batch", (np.array([[1, np.nan]]), 3), {}, TypeError, "NaN"),
    ("children_batch", (np.array([1, 2]), 3), {}, ValueError, "contexts"),
    ("children_batch", (np.array([[1, 2, 3]]), 3), {}, ValueError, "contexts"),
    ("children_batch", ([[1, 2], [3]], 3), {}, ValueError, "contexts"),
    ("children_batch", ([[1, 2], [3, True]], 3), {}, TypeError, "contexts"),
    ("children_batch", (np.array([[1, VOCAB]]), 3), {}, ValueError, "contexts"),
    ("children_batch", (np.array([[1, 2]]), 2.5), {}, TypeError, "k"),
    ("children_batch", (np.array([[1, 2]]), -3), {}, ValueError, "k"),
    ("prob", ([1], VOCAB), {}, ValueError, "token"),
    ("prob", ([1], 1.0), {}, TypeError, "token"),
    ("prob", ([1], True), {}, TypeError, "token"),
    ("prob", ([1], "3"), {}, TypeError, "token"),
    ("prob", ([1.5], 3), {}, TypeError, "context"),
    ("prob", ([1], 3), {"unigram_backoff": 1}, TypeError, "unigram_backoff"),
    ("cond_probs", ([1], np.array([3, VOCAB])), {}, ValueError, "candidates_sorted"),
    ("cond_probs", ([1], np.array([3, 2])), {}, ValueError, "candidates_sorted"),
    ("cond_probs", ([1], [float("nan")]), {}, TypeError, "candidates_sorted"),
    ("cond_probs", ([1], np.array([1.0, 2.0])), {}, TypeError, "candidates_sorted"),
    ("cond_probs", ([1], np.array([[1, 2]])), {}, ValueError, "candidates_sorted"),
    ("cond_probs", ("1", np.array([1, 2])), {}, TypeError, "context"),
    ("count", ([1, 2, 3], 2), {}, ValueError, "context"),
    ("count", ([1], 2.0), {}, TypeError, "token"),
    ("verify", ("fast",), {}, ValueError, "level"),
]


@pytest.mark.parametrize(
    "method,args,kwargs,exc,name", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)]
)
def test_bad_argument_names_it(idx, method, args, kwargs, exc, name):
    with pytest.raises(exc, match=name):
        getattr(idx, method)(*args, **kwargs)


def test_bad_constructor_arguments(corpus, tmp_path):
    path = corpus[0]
    with pytest.raises(TypeError, match="path"):
        NgramIndex(5)
    with pytest.raises(ValueError, match="verify"):
        NgramIndex(path, verify="fast")
    with pytest.raises(TypeError, match="prefault"):
        NgramIndex(path, prefault="yes")


def test_huge_k_is_capped_not_allocated(idx, corpus):
    """k beyond what the index can return answers as k = max_children (the distinct tokens
    seen) instead of aborting on a k-sized allocation or panicking on capacity overflow."""
    _, ref, _ = corpus
    assert idx.max_children == len(ref.c1)
    for k in (3 * 10**9, 2**62, 10**30):
        toks, cnts, total, order = idx.children([1, 2], k)
        want, wtotal, worder = ref.children((1, 2), k)
        assert [(int(t), int(c)) for t, c in zip(toks, cnts)] == want
        assert (total, order) == (wtotal, worder)
    pairs = np.array([[1, 2], [3, 4], [5, 6], [0, 0]])
    for k in (3 * 10**9, 2**62):
        toks, cnts, totals, orders = idx.children_batch(pairs, k)
        assert toks.shape == (4, idx.max_children)
        for i, (a, b) in enumerate(pairs):
            want, wtotal, _ = ref.children((int(a), int(b)), k)
            assert [(int(t), int(c)) for t, c in zip(toks[i], cnts[i]) if t != 2**32 - 1] == want
            assert totals[i] == wtotal


def test_huge_batch_is_an_error_not_an_abort(idx):
    """An answer over 1 GiB (12 bytes a cell) is refused before anything is allocated."""
    n = (1 << 30) // (12 * idx.max_children) + 1
    contexts = np.tile(np.array([[1, 2]], dtype=np.uint32), (n, 1))
    with pytest.raises(ValueError, match="split the contexts"):
        idx.children_batch(contexts, 2**62)


def test_native_layer_rechecks_ranges(idx):
    """The private native methods check what the wrapper checks, for callers that skip it."""
    with pytest.raises(ValueError, match="context"):
        idx._inner.children([1, VOCAB], 3)
    with pytest.raises(ValueError, match="candidates_sorted"):
        idx._inner.cond_probs([1], np.array([2, VOCAB], dtype=np.uint32))
    with pytest.raises(ValueError, match="token"):
        idx._inner.prob([1], VOCAB)
    with pytest.raises(ValueError, match="verify"):
        idx._inner.verify("fast")


def test_cond_probs_out_of_vocab_raises_like_prob(idx):
    with pytest.raises(ValueError, match="out of range"):
        idx.prob([1], VOCAB)
    with pytest.raises(ValueError, match="out of range"):
        idx.cond_probs([1], np.array([0, VOCAB]))


def test_accepted_id_types_answer_alike(idx, corpus):
    """Python ints, numpy integer scalars and integer arrays of any width are the same ids."""
    _, ref, _ = corpus
    want = idx.children([3, 4], 5)
    for ctx in (
        [np.int64(3), np.uint8(4)],
        (3, 4),
        np.array([3, 4], dtype=np.uint16),
        range(3, 5),
        np.array([3, 4], dtype=object),
    ):
        got = idx.children(ctx, np.int32(5))
        assert [a.tolist() for a in got[:2]] == [a.tolist() for a in want[:2]] and got[2:] == want[
            2:
        ]
    assert idx.prob(np.array([3, 4]), np.int16(5)) == pytest.approx(ref.prob((3, 4), 5), abs=1e-15)
    cands = np.arange(VOCAB, dtype=np.int64)
    np.testing.assert_allclose(
        idx.cond_probs([3], cands), [ref.prob((3,), int(v)) for v in cands], atol=1e-15
    )
    assert idx.children([], 0)[0].size == 0


# ---- paths ----------------------------------------------------------------------------------


def test_directory_is_index_path_error(tmp_path):
    with pytest.raises(IndexPathError, match="is a directory") as e:
        NgramIndex(tmp_path)
    assert isinstance(e.value, OSError) and str(tmp_path) in str(e.value)


def test_device_is_index_path_error():
    if not Path("/dev/null").exists():
        pytest.skip("no /dev/null")
    with pytest.raises(IndexPathError, match="character device"):
        NgramIndex("/dev/null")


def test_fifo_is_refused_without_blocking(tmp_path):
    """Opening a FIFO would block until a writer appears; it is refused at once. Run in a
    child with a timeout so that a regression fails the test instead of hanging the suite."""
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    fifo = tmp_path / "pipe.idx"
    os.mkfifo(fifo)
    code = textwrap.dedent(f"""
        from dartcore.errors import IndexPathError
        from dartcore.index import NgramIndex
        try:
            NgramIndex({str(fifo)!r})
        except IndexPathError as e:
            assert "FIFO" in str(e), e
            print("refused")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "refused", r.stderr


def test_symlink_to_index_opens(corpus, tmp_path):
    link = tmp_path / "link.idx"
    link.symlink_to(corpus[0])
    assert NgramIndex(link, verify="quick").vocab_size == VOCAB


# ---- verify levels --------------------------------------------------------------------------


def _sections(path: Path) -> list[tuple[str, int, int]]:
    """(name, offset, length) of every section, from the section table (FORMAT.md)."""
    data = path.read_bytes()
    names = NgramIndex(path).stats()["sections"]
    out = []
    for i, name in enumerate(names):
        o = 256 + 32 * i
        off = int.from_bytes(data[o + 8 : o + 16], "little")
        ln = int.from_bytes(data[o + 16 : o + 24], "little")
        out.append((name, off, ln))
    return out


def test_quick_catches_a_flip_in_every_small_section(corpus, tmp_path):
    """Every section of a small index is under the quick CRC bound: one flipped byte in any of
    them passes the O(1) open ("header") and is caught by "quick" and "full"."""
    path = corpus[0]
    good = path.read_bytes()
    NgramIndex(path, verify="quick").verify("full")
    checked = 0
    for name, off, ln in _sections(path):
        if ln == 0:
            continue
        for pos in (off, off + ln // 2, off + ln - 1):
            bad = bytearray(good)
            bad[pos] ^= 0x5A
            p = tmp_path / f"{name}-{pos}.idx"
            p.write_bytes(bytes(bad))
            idx = NgramIndex(p)  # header level: the body is not read
            with pytest.raises(IndexFormatError, match="checksum mismatch in section " + name):
                NgramIndex(p, verify="quick")
            with pytest.raises(IndexFormatError):
                idx.verify("quick")
            with pytest.raises(IndexFormatError):
                NgramIndex(p, verify="full")
            checked += 1
    assert checked >= 30


def test_quick_catches_header_and_table_damage(corpus, tmp_path):
    good = corpus[0].read_bytes()
    for pos in (20, 60, 256 + 8):  # vocab size, a node count, a section offset
        bad = bytearray(good)
        bad[pos] ^= 0x01
        p = tmp_path / f"h{pos}.idx"
        p.write_bytes(bytes(bad))
        with pytest.raises(IndexFormatError, match="checksum"):
            NgramIndex(p, verify="quick")


def test_verify_levels_accept_intact_indexes(tmp_path):
    rng = np.random.default_rng(11)
    for i, (vocab, n) in enumerate([(5, 10), (200, 300), (3000, 40)]):
        docs = random_docs(rng, n, vocab, 400)
        p = tmp_path / f"ok{i}.idx"
        build_index([np.array(d) for d in docs], p, vocab_size=vocab)
        for level in ("header", "quick", "full"):
            NgramIndex(p, verify=level).verify(level)
    build_index([], tmp_path / "empty.idx", vocab_size=10)
    NgramIndex(tmp_path / "empty.idx", verify="quick").verify("full")


# ---- fuzz (in a child process: an abort fails the test instead of killing the suite) -------

FUZZ_INDEX = r"""
import math, sys
import numpy as np
from hypothesis import given, settings, strategies as st, HealthCheck
sys.path.insert(0, TESTS)
from test_index import Ref
from dartcore.errors import DartError
from dartcore.index import NgramIndex

idx = NgramIndex(PATH)
ref = Ref(DOCS)
V = idx.vocab_size
ALLOWED = (TypeError, ValueError, DartError)

ints = st.one_of(st.integers(-3, V + 3), st.integers(-2**70, 2**70), st.sampled_from([0, 1, V - 1, V, 2**31, 2**32, 2**63, 2**64]),
                 st.integers(0, V - 1).map(np.int64))
junk = st.one_of(st.floats(allow_nan=True), st.booleans(), st.none(), st.text(max_size=3), st.binary(max_size=3))
dtypes = st.sampled_from([np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64, np.float32, np.float64, np.bool_])

@st.composite
def arrays(draw, ndim):
    shape = tuple(draw(st.integers(0, 4)) for _ in range(ndim))
    dt = draw(dtypes)
    vals = draw(st.lists(st.integers(-5, V + 5), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    with np.errstate(all="ignore"):
        return np.array(vals).astype(dt).reshape(shape)

context = st.one_of(st.lists(ints, max_size=5), st.lists(st.one_of(ints, junk), max_size=4),
                    st.lists(st.lists(ints, max_size=3), max_size=3), arrays(1), arrays(2), junk, st.text(max_size=4))
ks = st.one_of(ints, junk)

def valid_ids(x):
    return isinstance(x, list) and all(type(t) is int and 0 <= t < V for t in x)

def call(f, *a, **kw):
    try:
        return True, f(*a, **kw)
    except ALLOWED:
        return False, None

@settings(max_examples=MAX, deadline=None, suppress_health_check=list(HealthCheck))
@given(context, ks)
def test_children(ctx, k):
    ok, r = call(idx.children, ctx, k)
    if valid_ids(ctx) and type(k) is int and k >= 0:
        assert ok, (ctx, k)
        toks, cnts, total, order = r
        want, wtotal, worder = ref.children(tuple(ctx), k)
        assert [(int(t), int(c)) for t, c in zip(toks, cnts)] == want and (total, order) == (wtotal, worder)
    elif ok:
        toks = r[0]
        assert len(toks) <= idx.max_children

@settings(max_examples=MAX, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(arrays(2), arrays(1), st.lists(st.lists(ints, max_size=3), max_size=4), junk), ks)
def test_children_batch(ctxs, k):
    ok, r = call(idx.children_batch, ctxs, k)
    if ok:
        assert r[0].shape[0] == r[2].shape[0] and r[0].shape[1] <= idx.max_children

@settings(max_examples=MAX, deadline=None, suppress_health_check=list(HealthCheck))
@given(context, st.one_of(ints, junk), st.one_of(st.booleans(), junk))
def test_prob_and_count(ctx, token, uni):
    ok, p = call(idx.prob, ctx, token, uni)
    if valid_ids(ctx) and type(token) is int and 0 <= token < V and type(uni) is bool:
        assert ok and math.isclose(p, ref.prob(tuple(ctx), token, uni), abs_tol=1e-15)
    call(idx.count, ctx, token)

@settings(max_examples=MAX, deadline=None, suppress_health_check=list(HealthCheck))
@given(context, st.one_of(arrays(1), arrays(2), st.lists(st.one_of(ints, junk), max_size=5), junk))
def test_cond_probs(ctx, cands):
    ok, r = call(idx.cond_probs, ctx, cands)
    if ok:
        assert r.shape == (len(cands),) and np.all((r >= 0) & (r <= 1))

for t in (test_children, test_children_batch, test_prob_and_count, test_cond_probs):
    t()
print("fuzzed")
"""

FUZZ_TREE = r"""
import sys
import numpy as np
from hypothesis import given, settings, strategies as st, HealthCheck
from dartcore.errors import DartError
from dartcore.index import NgramIndex
from dartcore.tree import beam_search

idx = NgramIndex(PATH)
V = idx.vocab_size
ALLOWED = (TypeError, ValueError, DartError)
ints = st.one_of(st.integers(-3, 70), st.sampled_from([0, 2**31, 2**32, 2**63, 2**64, 2**70, -2**70]))
junk = st.one_of(st.floats(allow_nan=True), st.booleans(), st.none(), st.text(max_size=2))
reals = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3), junk)

@st.composite
def rows(draw):
    d, k = draw(st.integers(0, 4)), draw(st.integers(0, 5))
    toks = draw(st.one_of(
        st.lists(st.integers(-2, V + 2), min_size=d * k, max_size=d * k).map(lambda v: np.array(v, dtype=np.int64).reshape(d, k)),
        st.just(np.zeros((d, k))), st.just(np.zeros(d * k, dtype=np.int64)), junk))
    lps = draw(st.one_of(
        st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=d * k, max_size=d * k)
          .map(lambda v: np.array(v, dtype=np.float32).reshape(d, k)),
        st.just(np.full((d, k), -1.0, dtype=np.float32)), st.just(np.zeros((d, k + 1), dtype=np.float32)), junk))
    return toks, lps

@settings(max_examples=MAX, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(st.lists(st.one_of(ints, junk), max_size=4), st.just([1, 2]), junk), rows(),
       st.fixed_dictionaries({}, optional={
           "beam_width": st.one_of(ints, junk), "max_nodes": st.one_of(ints, junk), "level_decay": reals,
           "ngram_weight": reals, "depth_exponent": reals, "eps": reals, "ngram_first_level": st.one_of(st.booleans(), junk),
           "unigram_backoff": st.one_of(st.booleans(), junk), "eos_token_ids": st.one_of(st.lists(ints, max_size=3), junk)}),
       st.booleans())
def test_beam_search(ctx, r, kw, with_index):
    toks, lps = r
    try:
        beam_search(idx if with_index else None, ctx, toks, lps, **kw)
    except ALLOWED:
        pass

test_beam_search()
print("fuzzed")
"""


def _fuzz(script: str, corpus, max_examples: int) -> None:
    path, _, docs = corpus
    head = f"TESTS = {str(Path(__file__).parent)!r}\nPATH = {str(path)!r}\nDOCS = {docs!r}\nMAX = {max_examples}\n"
    r = subprocess.run(
        [sys.executable, "-c", head + script], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("fuzzed"), (
        f"exit {r.returncode} (negative: killed by that signal)\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    )


def test_fuzz_index_query_api(corpus):
    pytest.importorskip("hypothesis")
    _fuzz(FUZZ_INDEX, corpus, 300)


def test_fuzz_beam_search_arguments(corpus):
    pytest.importorskip("hypothesis")
    _fuzz(FUZZ_TREE, corpus, 400)
