"""DARTree: the correction head, the depth-wise batched supertree and the deferred top-B.

References are independent plain loops: per-node sequential correction (walk the path, one
head call per node) and the sequential best-first heap ("pop a node, correct its children,
push"), against which Lemma 1 is checked."""

from __future__ import annotations

import heapq
import itertools

import numpy as np
import pytest
import torch

from dartcore.dartree.head import CorrectionHead
from dartcore.dartree.supertree import NgramTerm, build_supertree, select_top_b
from dartcore.errors import DartError, TreeError

V, H, E = 40, 16, 12


def _setup(seed: int, d: int = 4, rank: int = 8, sharp: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the head's own initialisation
    head = CorrectionHead(H, E, rank=rank)
    with torch.no_grad():  # a non-trivial correction (a fresh head is the identity)
        head.down.weight.copy_(torch.randn(E, rank, generator=g) * 0.7)
        head.base_scale.fill_(0.8)
    head.eval()
    emb = torch.nn.Embedding(V, E)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(V, E, generator=g))
    base = torch.randn(d, V, generator=g) * sharp
    hidden = torch.randn(d, H, generator=g)
    return head, emb, base, hidden


def _sequential_logq(head, emb, base, hidden, t: int, parent: int, k: int) -> dict[int, float]:
    """ln q̃_t(· | H_t, parent) for ONE node, computed on its own."""
    vals, ids = torch.topk(base[t].float(), min(k, base.shape[1]))
    with torch.no_grad():
        logq = head(
            hidden[t].unsqueeze(0), emb(torch.tensor([parent])), emb(ids), vals.unsqueeze(0)
        )[0]
    return {int(i): float(q) for i, q in zip(ids, logq)}


def _path(tree, i: int) -> list[int]:
    out = []
    while i > 0:
        out.append(int(tree.tokens[i]))
        i = int(tree.parents[i])
    return out[::-1]


@pytest.mark.parametrize("seed", range(4))
def test_batched_scores_equal_sequential_correction(seed):
    head, emb, base, hidden = _setup(seed, d=5)
    k, beta, root = 7, -0.2, 3
    st = build_supertree(base, hidden, root, head, emb, k=k, width=6, beta=beta)
    assert st.head_calls == 5  # one batched call per depth
    assert len(st) == 1 + 5 * 6
    for i in range(1, len(st)):
        path = _path(st, i)
        parent, score = root, 0.0
        for t, tok in enumerate(path):
            score += _sequential_logq(head, emb, base, hidden, t, parent, k)[tok] + beta
            parent = tok
        assert st.depths[i] == len(path)
        assert st.scores[i] == pytest.approx(score, abs=1e-5)


def _heap_tree(head, emb, base, hidden, root, *, k, beta, b, eos=None):
    """Sequential best-first construction: pop a node, correct its children, push them.
    Ties: shallower first, then creation order. Returns {path tuple: score} of the b pops."""
    d = base.shape[0]
    counter = itertools.count()
    heap = []

    def push_children(path, score):
        t = len(path)
        if t >= d or (eos is not None and path and path[-1] == eos):
            return
        parent = path[-1] if path else root
        for tok, lq in _sequential_logq(head, emb, base, hidden, t, parent, k).items():
            s = score + lq + beta
            heapq.heappush(heap, (-s, t + 1, next(counter), path + (tok,), s))

    push_children((), 0.0)
    out = {}
    while heap and len(out) < b:
        _, _, _, path, s = heapq.heappop(heap)
        out[path] = s
        push_children(path, s)
    return out


@pytest.mark.parametrize(
    "seed,k,b,d", [(0, 5, 9, 4), (1, 6, 14, 4), (2, 4, 20, 5), (3, 8, 6, 3), (4, 3, 30, 5)]
)
@pytest.mark.parametrize("beta", [0.0, -0.2, -1.5])
def test_deferred_top_b_equals_sequential_heap(seed, k, b, d, beta):
    """Lemma 1: with β ≤ 0 the deferred global top-B over the supertree is the heap's pop set
    (W ≥ B, so per-depth pruning cannot drop any node the heap pops)."""
    head, emb, base, hidden = _setup(seed, d=d)
    root = 5
    tree = select_top_b(build_supertree(base, hidden, root, head, emb, k=k, width=b, beta=beta), b)
    want = _heap_tree(head, emb, base, hidden, root, k=k, beta=beta, b=b)
    got = {tuple(_path(tree, i)): float(tree.scores[i]) for i in range(1, len(tree.tokens))}
    assert set(got) == set(want)
    for p, s in want.items():
        assert got[p] == pytest.approx(s, abs=1e-5)
    # A valid tree: root first, depth order, parents earlier, ancestor-closed.
    assert tree.parents[0] == -1 and tree.tokens[0] == root
    assert np.all(np.diff(tree.depths) >= 0)
    assert all(0 <= tree.parents[i] < i for i in range(1, len(tree.tokens)))


def test_lemma1_ties_keep_ancestors():
    """Point-mass corrections with β = 0 give children exactly their parent's score: the
    deferred top-B must still be ancestor-closed and equal the heap (shallower first)."""
    head, emb, base, hidden = _setup(0, d=4)
    base = torch.full((4, V), -1e4)
    base[:, 7] = 1e4  # q̃ = 1 for token 7 on every row, others underflow to 0
    b = 3
    tree = select_top_b(build_supertree(base, hidden, 2, head, emb, k=4, width=4, beta=0.0), b)
    assert [_path(tree, i) for i in range(1, len(tree.tokens))] == [[7], [7, 7], [7, 7, 7]]
    want = _heap_tree(head, emb, base, hidden, 2, k=4, beta=0.0, b=b)
    assert set(want) == {(7,), (7, 7), (7, 7, 7)}


def test_width_prunes_per_depth_and_eos_is_not_expanded():
    head, emb, base, hidden = _setup(5, d=4)
    st0 = build_supertree(base, hidden, 1, head, emb, k=6, width=3, beta=-0.2)
    eos = int(st0.tokens[1])  # make the best depth-1 node an EOS
    st = build_supertree(base, hidden, 1, head, emb, k=6, width=3, beta=-0.2, eos_token_ids=(eos,))
    for t in range(1, 5):
        assert (st.depths == t).sum() <= 3
    eos_nodes = [i for i in range(1, len(st)) if st.tokens[i] == eos]
    assert eos_nodes
    for i in eos_nodes:
        assert not (st.parents == i).any()
    # Per depth, the kept nodes are the best W of all children of the previous depth's nodes.
    for t in range(1, 4):
        parents = np.flatnonzero(st.depths == t)
        parents = [p for p in parents if st.tokens[p] != eos]
        cand = []
        for p in parents:
            lq = _sequential_logq(head, emb, base, hidden, t, int(st.tokens[p]), 6)
            cand += [st.scores[p] + v - 0.2 for v in lq.values()]
        kept = np.sort(st.scores[st.depths == t + 1])[::-1]
        np.testing.assert_allclose(kept, np.sort(cand)[::-1][: len(kept)], atol=1e-5)


class _DictNgram:
    """Brute-force per-token backed-off trigram probabilities from raw text."""

    def __init__(self, text):
        from collections import Counter

        self.c3 = Counter(zip(text, text[1:], text[2:]))
        self.c2 = Counter(zip(text, text[1:]))
        self.c1 = Counter(text)
        self.n = len(text)

    def prob(self, context, v, unigram_backoff=True):
        ctx = list(context)[-2:]
        if len(ctx) == 2 and self.c3[(ctx[0], ctx[1], v)]:
            return self.c3[(ctx[0], ctx[1], v)] / sum(
                c for (a, b, _), c in self.c3.items() if (a, b) == tuple(ctx)
            )
        if ctx and self.c2[(ctx[-1], v)]:
            return self.c2[(ctx[-1], v)] / sum(c for (a, _), c in self.c2.items() if a == ctx[-1])
        return self.c1[v] / self.n if unigram_backoff else 0.0


def test_hybrid_adds_eq10_ngram_term():
    head, emb, base, hidden = _setup(7, d=3)
    rng = np.random.default_rng(0)
    text = [int(x) for x in rng.integers(0, V, 400)]
    index = _DictNgram(text)
    term = NgramTerm(index, weight=0.5, decay=0.7, eps=1e-10)
    k, beta, root, last = 6, -0.2, 4, 9
    st = build_supertree(
        base, hidden, root, head, emb, k=k, width=5, beta=beta, ngram=term, context=[11, last]
    )
    for i in range(1, len(st)):
        path = _path(st, i)
        seq = [last, root] + path
        parent, score = root, 0.0
        for t, tok in enumerate(path):
            score += _sequential_logq(head, emb, base, hidden, t, parent, k)[tok] + beta
            g = index.prob(seq[t : t + 2], tok)
            score += 0.5 * np.log(g + 1e-10) / (t + 1) ** 0.7
            parent = tok
        assert st.scores[i] == pytest.approx(score, abs=1e-5)


def test_untrained_head_is_renormalised_marginal():
    head = CorrectionHead(H, E, rank=4)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 10, generator=g)
    with torch.no_grad():
        out = head(torch.randn(H), torch.randn(3, E), torch.randn(10, E), logits)
    np.testing.assert_allclose(out.exp().sum(-1).numpy(), 1.0, rtol=1e-6)
    ref = logits - torch.logsumexp(logits, -1, keepdim=True)
    torch.testing.assert_close(out, ref)


def test_head_save_load_roundtrip(tmp_path):
    head, emb, base, hidden = _setup(1)
    head.meta["drafter_fingerprint"] = "abc"
    head.save(tmp_path / "h")
    back = CorrectionHead.from_pretrained(tmp_path / "h")
    for (n1, p1), (n2, p2) in zip(head.state_dict().items(), back.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert back.meta == {"drafter_fingerprint": "abc"}
    back.check_compatible(H, E, "abc")
    from dartcore.errors import DrafterMismatchError

    with pytest.raises(DrafterMismatchError):
        back.check_compatible(H, E, "other")
    with pytest.raises(DrafterMismatchError):
        back.check_compatible(H + 1, E)
    with pytest.raises(FileNotFoundError):
        CorrectionHead.from_pretrained(tmp_path / "missing")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"format": "other"}')
    with pytest.raises(DartError):
        CorrectionHead.from_pretrained(tmp_path / "bad")


def test_bad_input_is_a_tree_error():
    head, emb, base, hidden = _setup(2)
    with pytest.raises(TreeError):
        build_supertree(base, hidden[:2], 1, head, emb)
    with pytest.raises(TreeError):
        build_supertree(base, hidden, 1, head, emb, width=0)
    nan = base.clone()
    nan[1, 3] = float("nan")
    with pytest.raises(TreeError):
        build_supertree(nan, hidden, 1, head, emb)
    with pytest.raises(TreeError):
        build_supertree(base[0], hidden, 1, head, emb)


def test_ngram_term_reads_the_real_index(tmp_path):
    """NgramTerm's batched query (sorted candidates, results put back in candidate order)
    equals the index's per-token probability."""
    from dartcore.index import NgramIndex, build_index

    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 20, 300) for _ in range(3)]
    build_index(docs, tmp_path / "t.idx", vocab_size=V)
    index = NgramIndex(tmp_path / "t.idx")
    term = NgramTerm(index, weight=0.5, decay=0.7, eps=1e-10)
    cands = np.array([17, 3, 39, 0, 8, 12], dtype=np.int64)  # 39 never occurs: unigram 0
    contexts = [(4, 5), (7,), (19, 2)]
    got = term(2, contexts, cands)
    for i, ctx in enumerate(contexts):
        for j, v in enumerate(cands):
            want = 0.5 * np.log(index.prob(list(ctx), int(v)) + 1e-10) / 3**0.7
            assert got[i, j] == pytest.approx(want, rel=1e-12)
