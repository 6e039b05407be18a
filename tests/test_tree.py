"""dartcore.tree against independent Python references: a brute-force Eq. (10) on a tiny
index built with dartcore.index.build_index, a linear-scan best-first heap for top_b and
best_first, and dense ancestor masks."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from dartcore import TreeError
from dartcore import tree as T
from dartcore.index import NgramIndex, build_index
from tree_helpers import random_tree

V = 12


@pytest.fixture(scope="module")
def corpus_index(tmp_path_factory):
    rng = np.random.default_rng(7)
    # Skewed token distribution so that trigram/bigram/unigram backoff all occur.
    probs = np.array([0.25, 0.15, 0.12, 0.1, 0.08, 0.08, 0.06, 0.05, 0.04, 0.03, 0.02, 0.02])
    docs = [
        rng.choice(V, size=int(rng.integers(5, 60)), p=probs).astype(np.uint32) for _ in range(12)
    ]
    path = tmp_path_factory.mktemp("idx") / "tiny.idx"
    build_index(docs, path, vocab_size=V)
    return docs, NgramIndex(path)


class Counts:
    """g(v|c) by plain counting over documents (n-grams never cross a document boundary)."""

    def __init__(self, docs):
        self.ctx = Counter()
        self.ngram = Counter()
        for d in docs:
            d = [int(t) for t in d]
            for n in (1, 2, 3):
                for i in range(len(d) - n + 1):
                    self.ngram[tuple(d[i : i + n])] += 1
                    self.ctx[tuple(d[i : i + n - 1])] += 1

    def g(self, context, v, unigram_backoff=True):
        context = tuple(context[-2:])
        lo = 0 if unigram_backoff else 1
        for n in range(len(context), lo - 1, -1):
            c = context[len(context) - n :]
            hit = self.ngram.get(c + (v,), 0)
            if hit:
                return hit / self.ctx[c]
        return 0.0

    def children(self, context, k, unigram_backoff=True):
        context = tuple(context[-2:])
        lo = 0 if unigram_backoff else 1
        for n in range(len(context), lo - 1, -1):
            c = context[len(context) - n :]
            kids = [
                (key[-1], cnt)
                for key, cnt in self.ngram.items()
                if len(key) == n + 1 and key[:-1] == c
            ]
            if kids:
                kids.sort(key=lambda x: (-x[1], x[0]))
                return [(v, cnt / self.ctx[c]) for v, cnt in kids[:k]]
        return []


def select(cands, theta):
    """Best available candidate (parent chosen) by linear scan: score desc, shallower, earlier."""
    chosen, taken = [], set()
    while len(chosen) < theta:
        avail = [
            i
            for i, c in enumerate(cands)
            if i not in taken and (c["parent"] is None or c["parent"] in taken)
        ]
        if not avail:
            break
        best = min(avail, key=lambda i: (-cands[i]["score"], cands[i]["level"], i))
        taken.add(best)
        chosen.append(best)
    return {cands[i]["path"]: cands[i]["score"] for i in chosen}


def keep(cands, level_nodes, w, eos):
    """The best w of a level's new nodes become candidates; the non-EOS ones the next beam."""
    order = sorted(range(len(level_nodes)), key=lambda i: (-level_nodes[i]["score"], i))[:w]
    beam = []
    for i in order:
        cands.append(level_nodes[i])
        if level_nodes[i]["path"][-1] not in eos:
            beam.append(len(cands) - 1)
    return beam


def brute_eq10(
    counts,
    context,
    toks,
    lps,
    *,
    beam_width=20,
    max_nodes=59,
    level_decay=0.9,
    ngram_weight=0.5,
    depth_exponent=0.7,
    eps=1e-10,
    ngram_first_level=True,
    unigram_backoff=True,
    eos_token_ids=(),
):
    d, k = toks.shape
    cands, beam = [], [None]
    for lvl in range(d):
        div = (lvl + 1) ** depth_exponent
        new = []
        for e in beam:
            ppath, ps = ((), 0.0) if e is None else (cands[e]["path"], cands[e]["score"])
            for j in range(k):
                lp = float(lps[lvl, j])
                if lp == -math.inf:
                    continue
                v = int(toks[lvl, j])
                delta = level_decay**lvl * math.log(math.exp(lp) + eps) / div
                if ngram_weight != 0 and (lvl > 0 or ngram_first_level):
                    g = counts.g(list(context) + list(ppath), v, unigram_backoff)
                    delta += ngram_weight / div * math.log(g + eps)
                new.append({"path": ppath + (v,), "score": ps + delta, "level": lvl, "parent": e})
        beam = keep(cands, new, beam_width, eos_token_ids)
    return select(cands, max_nodes)


def tree_dict(tree):
    return {
        tuple(int(x) for x in tree.tokens[tree.path(i)[1:]]): float(tree.scores[i])
        for i in range(1, tree.size)
    }


def check_structure(tree, max_nodes):
    assert 1 <= tree.size <= max_nodes + 1
    assert tree.parents[0] == -1 and tree.depths[0] == 0
    for i in range(1, tree.size):
        p = tree.parents[i]
        assert 0 <= p < i
        assert tree.depths[i] == tree.depths[p] + 1
    assert np.all(np.diff(tree.depths) >= 0)
    assert len(tree_dict(tree)) == tree.size - 1  # no duplicate paths


def random_rows(rng, d, k, *, vocab=V, neg_inf=0.1):
    toks = np.stack([rng.permutation(vocab)[:k] for _ in range(d)]).astype(np.int64)
    logits = rng.normal(size=(d, k)).astype(np.float32) * 2
    lps = (logits - np.log(np.exp(logits).sum(-1, keepdims=True))).astype(np.float32)
    lps[rng.random((d, k)) < neg_inf] = -np.inf
    return toks, lps


@pytest.mark.parametrize("seed", range(12))
def test_beam_search_equals_brute_force(corpus_index, seed):
    docs, index = corpus_index
    counts = Counts(docs)
    rng = np.random.default_rng(seed)
    d, k = int(rng.integers(1, 5)), int(rng.integers(1, 6))
    toks, lps = random_rows(rng, d, k)
    context = [int(t) for t in rng.integers(0, V, size=int(rng.integers(1, 4)))]
    kw = dict(
        beam_width=int(rng.integers(1, 5)),
        max_nodes=int(rng.integers(1, 25)),
        ngram_weight=float(rng.choice([0.0, 0.5, 1.0])),
        ngram_first_level=bool(seed % 2),
        unigram_backoff=bool(seed % 3),
        eos_token_ids=(int(rng.integers(0, V)),) if seed % 4 == 0 else (),
    )
    # brute_eq10 is the "beam" candidate set; "all" has its own brute force (test_candidates.py)
    tree = T.beam_search(index, context, toks, lps, candidates="beam", **kw)
    check_structure(tree, kw["max_nodes"])
    assert tree.tokens[0] == context[-1]
    want = brute_eq10(counts, context, toks, lps, **kw)
    got = tree_dict(tree)
    assert set(got) == set(want)
    for p, s in want.items():
        assert got[p] == pytest.approx(s, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("theta", [3, 5, 8])
def test_probability_one_chain_keeps_ancestors(theta):
    """p = 1 at every level: each child outscores its parent by ln(1 + ε) > 0, so a global
    sort-and-cut would keep the deepest nodes; the tree must be the first θ levels."""
    d = 10
    toks = np.arange(2, 2 + d, dtype=np.int64)[:, None]
    lps = np.zeros((d, 1), np.float32)
    tree = T.beam_search(None, [0, 1], toks, lps, max_nodes=theta, ngram_weight=0.0)
    assert tree.tokens.tolist() == list(range(1, 2 + theta))
    assert np.all(np.diff(tree.scores) > 0)
    full = T.beam_search(None, [0, 1], toks, lps, max_nodes=d, ngram_weight=0.0)
    cut = np.argsort(-full.scores[1:], kind="stable")[:theta]
    assert 0 not in cut  # the official sort-and-cut would drop level 0: this pins the case


def test_drafter_only_tree_and_chain():
    rng = np.random.default_rng(3)
    toks, lps = random_rows(rng, 4, 5, neg_inf=0.0)
    chain = T.beam_search(
        None, [9], toks, lps, beam_width=1, max_nodes=4, ngram_weight=0.0, candidates="beam"
    )
    # beam_width = 1 with the "beam" candidates keeps one node per level: the chain of each row's best token.
    assert chain.parents.tolist() == [-1, 0, 1, 2, 3]
    best = [int(toks[r, np.argmax(lps[r])]) for r in range(4)]
    assert chain.tokens[1:].tolist() == best
    with pytest.raises(TreeError, match="needs an n-gram index"):
        T.beam_search(None, [9], toks, lps)
    c = T.chain(9, toks, lps)
    assert c.tokens.tolist() == [9] + toks[:, 0].tolist()
    assert np.allclose(c.scores[1:], np.cumsum(lps[:, 0]))


def test_batch_equals_single_calls(corpus_index):
    _, index = corpus_index
    rng = np.random.default_rng(5)
    rows = [random_rows(rng, 3, 4) for _ in range(5)]
    contexts = [rng.integers(0, V, size=n).tolist() for n in (1, 2, 3, 5, 2)]
    toks = np.stack([r[0] for r in rows])
    lps = np.stack([r[1] for r in rows])
    trees = T.beam_search_batch(index, contexts, toks, lps, beam_width=3, max_nodes=10)
    for t, c, (tk, lp) in zip(trees, contexts, rows):
        s = T.beam_search(index, c, tk, lp, beam_width=3, max_nodes=10)
        for a in ("tokens", "parents", "depths", "scores"):
            np.testing.assert_array_equal(getattr(t, a), getattr(s, a))


@pytest.mark.parametrize("seed", range(6))
def test_ngram_tree_equals_brute_force(corpus_index, seed):
    docs, index = corpus_index
    counts = Counts(docs)
    rng = np.random.default_rng(100 + seed)
    depth, k, w, theta = (
        int(rng.integers(1, 5)),
        int(rng.integers(1, 5)),
        int(rng.integers(1, 4)),
        int(rng.integers(1, 20)),
    )
    context = rng.integers(0, V, size=int(rng.integers(1, 4))).tolist()
    ub = bool(seed % 2)
    tree = T.ngram_tree(
        index, context, depth=depth, k=k, beam_width=w, max_nodes=theta, unigram_backoff=ub
    )
    check_structure(tree, theta)
    cands, beam = [], [None]
    for lvl in range(depth):
        scale = 0.5 / (lvl + 1) ** 0.7
        new = []
        for e in beam:
            ppath, ps = ((), 0.0) if e is None else (cands[e]["path"], cands[e]["score"])
            for v, g in counts.children(list(context) + list(ppath), k, ub):
                new.append(
                    {
                        "path": ppath + (v,),
                        "score": ps + scale * math.log(g + 1e-10),
                        "level": lvl,
                        "parent": e,
                    }
                )
        beam = keep(cands, new, w, ())
    want = select(cands, theta)
    got = tree_dict(tree)
    assert set(got) == set(want)
    for p, s in want.items():
        assert got[p] == pytest.approx(s, rel=1e-9)


def heap_order(parents, scores, b):
    depth = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    taken, out = set(), []
    while len(out) < b:
        avail = [
            i
            for i in range(len(parents))
            if i not in taken and (parents[i] < 0 or parents[i] in taken)
        ]
        if not avail:
            break
        j = min(avail, key=lambda i: (-scores[i], depth[i], i))
        taken.add(j)
        out.append(j)
    return out


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("beta", [0.0, -0.2])
def test_top_b_equals_heap_on_random_supertrees(seed, beta):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 80))
    parents, scores = [], []
    for i in range(n):
        p = int(rng.integers(-1, i))
        q = float(rng.choice([1.0, 0.5, rng.uniform(0.01, 1.0)]))
        parents.append(p)
        scores.append((0.0 if p < 0 else scores[p]) + math.log(q) + beta)
    b = int(rng.integers(1, 90))
    got = T.top_b(np.array(parents), np.array(scores), b)
    assert got.dtype == np.int64
    assert got.tolist() == heap_order(parents, scores, b)


@pytest.mark.parametrize("seed", range(8))
def test_best_first_equals_exhaustive(seed):
    rng = np.random.default_rng(seed)
    d, k, b = int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.integers(1, 20))
    toks, lps = random_rows(rng, d, k, neg_inf=0.1)
    tree = T.best_first(toks, lps, 3, b)
    check_structure(tree, b)
    # Every path of the full tree; the b best that form a best-first prefix.
    cands = []

    def expand(lvl, path, score, parent):
        if lvl == d:
            return
        for j in range(k):
            if lps[lvl, j] == -np.inf:
                continue
            cands.append(
                {
                    "path": path + (int(toks[lvl, j]),),
                    "score": score + float(lps[lvl, j]),
                    "level": lvl,
                    "parent": parent,
                }
            )
            expand(lvl + 1, cands[-1]["path"], cands[-1]["score"], len(cands) - 1)

    expand(0, (), 0.0, None)
    want = select(cands, b)
    got = tree_dict(tree)
    # Exact ties between different subtrees may resolve differently than this reference's
    # creation order; continuous random log-probs make them measure-zero.
    assert set(got) == set(want)
    for p, s in want.items():
        assert got[p] == pytest.approx(s, abs=1e-6)


@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 130])
def test_ancestor_mask_and_verification_inputs(n):
    t = random_tree(n, vocab_size=50, rng=n)
    check_structure(t, n)
    dense = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j = i
        while j >= 0:
            dense[i, j] = True
            j = int(t.parents[j])
    np.testing.assert_array_equal(t.ancestor_mask(), dense)
    assert t.ancestor_bits().shape == (n, (n + 63) // 64)
    pos, mask = T.verification_inputs(t, prefix_len=17)
    np.testing.assert_array_equal(pos, 17 + t.depths)
    np.testing.assert_array_equal(mask, dense)
    leaves = [i for i in range(n) if i not in set(t.parents.tolist())]
    assert [int(p[-1]) for p in t.paths()] == leaves
    for p in t.paths():
        assert p[0] == 0 and all(t.parents[p[i + 1]] == p[i] for i in range(len(p) - 1))
    kids = t.children()
    assert sum(len(c) for c in kids) == n - 1
    assert all(t.parents[c] == i for i, cs in enumerate(kids) for c in cs)


def test_topk_logprobs_torch_and_numpy():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g, dtype=torch.float64) * 3
    tok_t, lp_t = T.topk_logprobs(logits, 7)
    tok_n, lp_n = T.topk_logprobs(logits.numpy(), 7)
    assert tok_t.dtype == np.int64 and lp_t.dtype == np.float32 and tok_t.shape == (4, 7)
    ref = np.sort(logits.numpy(), axis=-1)[:, ::-1][:, :7]
    ref_lp = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    np.testing.assert_array_equal(tok_t, tok_n)
    np.testing.assert_array_equal(np.take_along_axis(logits.numpy(), tok_t, -1), ref)
    np.testing.assert_allclose(lp_t, ref_lp, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lp_n, ref_lp, rtol=1e-5, atol=1e-6)
    with pytest.raises(TreeError):
        T.topk_logprobs(logits, 51)


def test_topk_logprobs_maps_ids_breaks_ties_by_id_and_refuses_nan():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 8192, generator=g) * 4
    id_map = torch.randperm(8192, generator=g) + 100
    tok, lp = T.topk_logprobs(logits, 25)
    mapped, lp2 = T.topk_logprobs(logits, 25, id_map=id_map)
    np.testing.assert_array_equal(mapped, id_map.numpy()[tok])
    np.testing.assert_array_equal(lp, lp2)
    vals, idx = torch.topk(logits, 25)  # an independent reference
    np.testing.assert_array_equal(tok, idx.numpy())
    np.testing.assert_allclose(lp, torch.log_softmax(vals.double(), -1).numpy(), atol=1e-6)
    tied = np.array([[0.0, 2.0, 1.0, 2.0, 2.0, -np.inf]], dtype=np.float32)
    assert T.topk_logprobs(tied, 3)[0].tolist() == [[1, 3, 4]]
    assert np.all(T.topk_logprobs(np.full((1, 4), -np.inf, dtype=np.float32), 2)[1] == -np.inf)
    for bad in (np.nan, np.inf):
        x = logits.clone()
        x[1, 77] = bad
        with pytest.raises(TreeError, match=r"\[1, 77\]"):
            T.topk_logprobs(x, 25)


def test_bad_input_raises_tree_error(corpus_index):
    _, index = corpus_index
    toks = np.array([[1, 2], [3, 4]])
    lps = np.array([[-0.1, -2.0], [-0.5, -1.0]], np.float32)
    T.beam_search(index, [1], toks, lps)  # one-token context: backs off, no error
    bad = lps.copy()
    bad[1, 0] = np.nan
    with pytest.raises(TreeError, match="NaN|nan"):
        T.beam_search(index, [1, 2], toks, bad)
    with pytest.raises(TreeError, match="shape"):
        T.beam_search(index, [1, 2], toks, lps[:, :1])
    with pytest.raises(TreeError, match="max_nodes"):
        T.beam_search(index, [1, 2], toks, lps, max_nodes=0)
    with pytest.raises(TreeError, match="vocabulary"):
        T.beam_search(index, [1, 2], toks + V, lps)
    with pytest.raises(TreeError, match="vocabulary"):
        T.beam_search(index, [1, V], toks, lps)
    with pytest.raises(TreeError):
        T.beam_search(index, [-1, 2], toks, lps)
    with pytest.raises(TreeError, match="empty"):
        T.beam_search(index, [], toks, lps)
    with pytest.raises(TreeError, match="twice"):
        T.beam_search(index, [1], np.array([[1, 1], [3, 4]]), lps)
    with pytest.raises(TreeError):
        T.top_b(np.array([-1, 5]), np.array([0.0, -1.0]), 2)
    with pytest.raises(TreeError):
        T.top_b(np.array([-1, 0]), np.array([0.0, -1.0]), 0)
    with pytest.raises(TreeError):
        T.best_first(toks, bad, 0, 4)
    with pytest.raises(TreeError):
        T.ngram_tree(None, [1, 2])
    # −inf is allowed and means impossible.
    inf = lps.copy()
    inf[0, 0] = -np.inf
    t = T.beam_search(index, [1, 2], toks, inf)
    assert 1 not in t.tokens[t.depths == 1].tolist()


def test_search_params_defaults_are_the_papers_and_round_trip_to_rust(corpus_index):
    """SearchParams' defaults come from dart-tree (written once there) and equal the paper's
    (brute_eq10's signature, stated independently); every field reaches the native struct:
    a SearchParams with every field off its default gives the brute-force tree."""
    import inspect

    from dartcore import _native

    p = T.SearchParams()
    paper = {
        k: v.default
        for k, v in inspect.signature(brute_eq10).parameters.items()
        if v.default is not inspect.Parameter.empty
    }
    # candidates: the paper's "all" (the `dart` tree's); brute_eq10 is the "beam" set, "all" has its own
    # brute force (test_candidates.py)
    assert {f: getattr(p, f) for f in T.SearchParams.fields()} == {
        **paper,
        "eos_token_ids": (),
        "candidates": "all",
    }
    assert set(_native.search_defaults()) | {"eos_token_ids"} == T.SearchParams.fields()
    assert set(p.native()) == T.SearchParams.fields()
    docs, index = corpus_index
    counts = Counts(docs)
    rng = np.random.default_rng(5)
    toks, lps = random_rows(rng, 4, 5, neg_inf=0.0)
    context = [3, 1]
    odd = T.SearchParams(
        beam_width=3,
        max_nodes=9,
        level_decay=0.6,
        ngram_weight=1.3,
        depth_exponent=1.1,
        eps=1e-4,
        ngram_first_level=False,
        unigram_backoff=False,
        eos_token_ids=(int(toks[0, 0]),),
        candidates="beam",
    )
    assert all(getattr(odd, f) != getattr(p, f) for f in T.SearchParams.fields() - {"candidates"})
    got = tree_dict(T.beam_search(index, context, toks, lps, odd))
    want = brute_eq10(
        counts,
        context,
        toks,
        lps,
        **{f: getattr(odd, f) for f in T.SearchParams.fields() - {"candidates"}},
    )
    assert set(got) == set(want)
    for path, s in want.items():
        assert got[path] == pytest.approx(s, rel=1e-9, abs=1e-12)
    # keyword overrides on top of a params object
    assert (
        tree_dict(T.beam_search(index, context, toks, lps, odd, max_nodes=2)).keys()
        == brute_eq10(
            counts,
            context,
            toks,
            lps,
            **{
                **{f: getattr(odd, f) for f in T.SearchParams.fields() - {"candidates"}},
                "max_nodes": 2,
            },
        ).keys()
    )


BAD_SEARCH_ARGS = [
    # ~2 s of search unchecked
    ({"beam_width": 10**5}, TreeError, r"beam_width = 100000 .*\[1, 4096\]"),
    ({"beam_width": 10**7}, TreeError, r"beam_width"),
    ({"beam_width": 0}, TreeError, r"beam_width"),
    ({"beam_width": -3}, TreeError, r"beam_width"),
    ({"beam_width": 2.5}, TypeError, r"beam_width"),
    ({"beam_width": True}, TypeError, r"beam_width"),
    # was "failed to extract field"
    ({"max_nodes": 2**64}, TreeError, r"max_nodes .*\[1, 2147483646\]"),
    ({"max_nodes": -1}, TreeError, r"max_nodes"),
    ({"max_nodes": "59"}, TypeError, r"max_nodes"),
    ({"eps": -1e-3}, TreeError, r"eps"),
    ({"level_decay": float("nan")}, TreeError, r"level_decay"),
    ({"ngram_weight": float("inf")}, TreeError, r"ngram_weight"),
    ({"depth_exponent": None}, TypeError, r"depth_exponent"),
    ({"ngram_first_level": "yes"}, TypeError, r"ngram_first_level"),
    ({"eos_token_ids": [2**70]}, TreeError, r"eos_token_ids"),
    ({"eos_token_ids": [1.5]}, TypeError, r"eos_token_ids"),
    ({"beam_widht": 3}, TypeError, r"beam_widht"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD_SEARCH_ARGS)
def test_bad_search_arguments_name_the_argument_and_its_range(corpus_index, kwargs, error, match):
    _, index = corpus_index
    toks = np.array([[1, 2], [3, 4]])
    lps = np.array([[-0.1, -2.0], [-0.5, -1.0]], np.float32)
    with pytest.raises(error, match=match):
        T.beam_search(index, [1, 2], toks, lps, **kwargs)
    with pytest.raises(error, match=match):
        T.beam_search_batch(index, [[1, 2]], toks[None], lps[None], **kwargs)
    with pytest.raises(error, match=match):
        T.SearchParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"depth": -1}, TreeError, r"depth"),
        ({"depth": 2**20}, TreeError, r"depth .*\[0, 65535\]"),
        ({"depth": 2.0}, TypeError, r"depth"),
        ({"k": 2**62}, TreeError, r"k = .*\[0, 4294967295\]"),
        ({"k": -1}, TreeError, r"k"),
        ({"max_nodes": 2**64}, TreeError, r"max_nodes"),
    ],
)
def test_bad_ngram_tree_arguments_name_the_argument(corpus_index, kwargs, error, match):
    _, index = corpus_index
    with pytest.raises(error, match=match):
        T.ngram_tree(index, [1, 2], **kwargs)
    with pytest.raises(TreeError, match="index="):
        T.ngram_tree(None, [1, 2])


def test_ngram_tree_k_is_capped_at_the_vocabulary(corpus_index):
    _, index = corpus_index
    a = T.ngram_tree(index, [1, 2], depth=3, k=V, max_nodes=30)
    b = T.ngram_tree(index, [1, 2], depth=3, k=2**32 - 1, max_nodes=30)
    assert tree_dict(a) == tree_dict(b)


def test_widest_beam_equals_a_beam_as_wide_as_the_budget():
    """Why MAX_BEAM_WIDTH may cap the width: beyond the node budget the tree does not change."""
    rng = np.random.default_rng(3)
    toks, lps = random_rows(rng, 6, 8, vocab=50, neg_inf=0.0)
    for theta in (4, 20):
        a = T.beam_search(
            None, [1, 2], toks, lps, beam_width=theta, max_nodes=theta, ngram_weight=0.0
        )
        b = T.beam_search(
            None, [1, 2], toks, lps, beam_width=T.MAX_BEAM_WIDTH, max_nodes=theta, ngram_weight=0.0
        )
        assert tree_dict(a) == tree_dict(b)
