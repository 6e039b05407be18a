"""candidates="beam" | "all" through the Python API and the tree builders: the paper's set
against a plain-Python brute force of its definition on the real-format index."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("dartcore._native", reason="the Rust extension is not built (pip install -e .)")

from dartcore.builders import make_tree_builder  # noqa: E402
from dartcore.errors import TreeError  # noqa: E402
from dartcore.index import NgramIndex, build_index  # noqa: E402
from dartcore.tree import beam_search  # noqa: E402

V = 16


def brute_force(
    index, context, toks, lps, *, w, theta, eos=(), decay=0.9, nw=0.5, expo=0.7, eps=1e-10
):
    """Every expansion a candidate; beam = best w non-EOS of a level; best-first selection."""
    nodes = []  # (path, score, level, parent)
    beam = [None]
    for level in range(toks.shape[0]):
        div = (level + 1) ** expo
        start = len(nodes)
        for e in beam:
            path0, s0 = ([], 0.0) if e is None else (nodes[e][0], nodes[e][1])
            for t, lp in zip(toks[level], lps[level]):
                if lp == -np.inf:
                    continue
                text = list(context) + path0
                g = index.prob(text[-2:], int(t))
                delta = (
                    decay**level * math.log(math.exp(float(lp)) + eps) + nw * math.log(g + eps)
                ) / div
                nodes.append((path0 + [int(t)], s0 + delta, level, e))
        level_ids = [i for i in range(start, len(nodes)) if nodes[i][0][-1] not in eos]
        level_ids.sort(key=lambda i: (-nodes[i][1], i))
        beam = level_ids[:w]
        if not beam:
            break
    chosen, done = [], set()
    while len(chosen) < theta:
        ready = [
            i
            for i in range(len(nodes))
            if i not in done and (nodes[i][3] is None or nodes[i][3] in done)
        ]
        if not ready:
            break
        best = min(ready, key=lambda i: (-nodes[i][1], nodes[i][2], i))
        done.add(best)
        chosen.append(best)
    return sorted((tuple(nodes[i][0]), nodes[i][1]) for i in chosen)


def _paths(tree):
    out = []
    for i in range(1, tree.size):
        path, j = [], i
        while j > 0:
            path.append(int(tree.tokens[j]))
            j = int(tree.parents[j])
        out.append((tuple(reversed(path)), float(tree.scores[i])))
    return sorted(out)


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, V, rng.integers(5, 60)).astype(np.uint32) for _ in range(40)]
    path = tmp_path_factory.mktemp("cand") / "x.idx"
    build_index(docs, path, vocab_size=V)
    return NgramIndex(str(path))


@pytest.mark.parametrize("seed", range(12))
def test_all_equals_brute_force(index, seed):
    rng = np.random.default_rng(seed)
    d, k = int(rng.integers(1, 5)), int(rng.integers(2, 8))
    toks = np.stack([rng.permutation(V)[:k] for _ in range(d)])
    logits = rng.normal(0, 2, (d, k)).astype(np.float32)
    logits[rng.random((d, k)) < 0.15] = 30.0  # near-certain tokens
    lps = (logits - np.log(np.exp(logits.astype(np.float64)).sum(1, keepdims=True))).astype(
        np.float32
    )
    w, theta = int(rng.integers(1, 4)), int(rng.integers(1, 40))
    eos = (int(toks[0, 0]),) if seed % 3 == 0 else ()
    context = rng.integers(0, V, 3).tolist()
    tree = beam_search(
        index,
        context,
        toks,
        lps,
        beam_width=w,
        max_nodes=theta,
        eos_token_ids=eos,
        candidates="all",
    )
    want = brute_force(index, context, toks, lps, w=w, theta=theta, eos=eos)
    got = _paths(tree)
    assert [p for p, _ in got] == [p for p, _ in want]
    np.testing.assert_allclose([s for _, s in got], [s for _, s in want], rtol=1e-9, atol=1e-9)


def test_unknown_candidate_set_is_a_tree_error():
    toks, lps = np.array([[1, 2]]), np.log(np.array([[0.6, 0.4]], dtype=np.float32))
    with pytest.raises(TreeError, match="candidates must be 'beam' or 'all'"):
        beam_search(None, [0], toks, lps, ngram_weight=0.0, candidates="every")


def test_dart_builder_forwards_candidates():
    assert make_tree_builder("dart", candidates="all").search.candidates == "all"
    assert make_tree_builder("dart", candidates="beam").search.candidates == "beam"
    # SearchParams' default, dart-tree's
    assert make_tree_builder("dart").search.candidates == "all"
