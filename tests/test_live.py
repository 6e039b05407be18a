"""The live n-gram layer (dartcore.live) against independent references: its counts and
suffix matches by brute force over the same documents, the mixed Eq. (10) search against the
brute-force beam search of test_tree.py with a mixed g, and decoders that learn as they serve
stay lossless (greedy equal to Hugging Face generate, single and batched; sampling in
distribution, by the chi-square test of test_decoder_sampling.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from conftest import tiny_model
from dartcore import DartDecoder, DartError, TreeError
from dartcore import tree as T
from dartcore.live import LiveLayer
from dartcore.trees import make_tree_builder
from test_decoder import CharTokenizer
from test_decoder_builders import setup  # noqa: F401 - the tiny target, drafter and index
from test_decoder_sampling import VOCAB, chi_square_p, exact_joint, sample_counts
from test_tree import Counts, V, brute_eq10, corpus_index, random_rows, tree_dict  # noqa: F401

torch.set_num_threads(1)


def live_docs(seed: int, n: int = 6) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V, size=int(rng.integers(2, 40))).tolist() for _ in range(n)]


class MixedCounts:
    """g of the mix by counting: (1 - λ_b) g_static + λ_b g_live, λ_b = w where the live
    documents have b followed by anything; the live g has no unigram level."""

    def __init__(self, static: Counts, live: Counts, weight: float):
        self.static, self.live, self.weight = static, live, weight

    def g(self, context, v, unigram_backoff=True):
        b = (int(context[-1]),)
        lam = self.weight if self.live.ctx.get(b, 0) and self._has_next(b) else 0.0
        s = self.static.g(context, v, unigram_backoff)
        return (1 - lam) * s + lam * self.live.g(context, v, False) if lam else s

    def _has_next(self, b):
        return any(len(k) == 2 and k[0] == b[0] for k in self.live.ngram)


def test_counts_and_suffix_match_equal_brute_force():
    docs = live_docs(3, n=12)
    layer = LiveLayer(V)
    for d in docs:
        layer.insert(d)
    ref = Counts(docs)
    for ctx in ([1], [2, 3], [0, 0], [5, 7], [11]):
        got = layer.probs(ctx, list(range(V)))
        want = [ref.g(ctx, v, unigram_backoff=False) for v in range(V)]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    rng = np.random.default_rng(4)
    for _ in range(40):
        doc = docs[int(rng.integers(len(docs)))]
        i = int(rng.integers(0, max(1, len(doc) - 2)))
        ctx = [int(rng.integers(V))] + doc[i : i + int(rng.integers(2, 6))]
        got = layer.suffix_match(ctx, max_len=5, min_match=2, max_match=4).tolist()
        assert got == brute_suffix(docs, ctx, 5, 2, 4)


def test_a_list_and_an_array_insert_the_same():
    """A list of ints is read as it is; an array, or a list of numpy integers, through an
    array: the layers are the same (eviction included)."""
    docs = live_docs(6, n=8)
    layers = [LiveLayer(V, capacity=64) for _ in range(3)]
    for d in docs:
        layers[0].insert(d)
        layers[1].insert(np.array(d))
        layers[2].insert([np.int64(t) for t in d])
    want = layers[0]
    for other in layers[1:]:
        assert len(other) == len(want) and other.inserted == want.inserted
        for ctx in ([1], [2, 3], [5, 7], docs[-1][-3:]):
            np.testing.assert_array_equal(
                other.probs(ctx, list(range(V))), want.probs(ctx, list(range(V)))
            )
            assert other.suffix_match(ctx, 4).tolist() == want.suffix_match(ctx, 4).tolist()


def brute_suffix(docs, ctx, max_len, min_match, max_match, *, with_length=False):
    """The continuation after the longest match (ties: the latest) of ctx's end, in order
    of insertion, never across documents (``with_length``: and the match's length, 0 when
    the continuation is empty)."""
    if with_length:
        got = brute_suffix(docs, ctx, max_len, min_match, max_match)
        if not got:
            return 0, []
        m = max(
            n
            for doc in docs
            for q in range(1, len(doc))
            for n in [_match_len(doc, q, ctx, max_match)]
            if doc[q : q + max_len] == got
        )
        return m, got
    best = None  # (length, order, continuation)
    order = 0
    for doc in docs:
        for q in range(1, len(doc)):  # the match ends right before q
            m = 0
            while m < min(max_match, len(ctx)) and q - 1 - m >= 0 and doc[q - 1 - m] == ctx[-1 - m]:
                m += 1
            if m >= 2 and (best is None or m >= best[0]):
                best = (m, order, doc[q : q + max_len])
            order += 1
    return best[2] if best is not None and best[0] >= min_match else []


def _match_len(doc, q, ctx, max_match):
    m = 0
    while m < min(max_match, len(ctx)) and q - 1 - m >= 0 and doc[q - 1 - m] == ctx[-1 - m]:
        m += 1
    return m


def test_suffix_lookup_gives_the_length_of_its_match():
    """The match length the chains are sized by: the longest match's, by brute force (of the
    matches whose continuation is the one returned: ties between equally long ones)."""
    docs = live_docs(8, n=10)
    layer = LiveLayer(V)
    for d in docs:
        layer.insert(d)
    rng = np.random.default_rng(9)
    seen = set()
    for _ in range(60):
        doc = docs[int(rng.integers(len(docs)))]
        i = int(rng.integers(0, max(1, len(doc) - 2)))
        ctx = [int(rng.integers(V))] + doc[i : i + int(rng.integers(2, 9))]
        m, got = layer.suffix_lookup(ctx, 5, 2, 6)
        assert (m, got.tolist()) == brute_suffix(docs, ctx, 5, 2, 6, with_length=True)
        seen.add(m)
    assert len(seen - {0}) >= 3, seen  # short and long matches both checked
    assert layer.suffix_lookup(docs[0][:4], 0, 2, 6)[0] == 0


@pytest.mark.parametrize("min_match", [1, 2])
def test_context_match_measures_the_repeat(min_match):
    """The native prompt lookup against a brute force over every start: the latest
    occurrence of the longest recurring end (``max_match`` down to ``min_match`` tokens), what
    followed it, and how deep it matches."""
    from dartcore.trees import context_continuation, context_match

    rng = np.random.default_rng(3 + min_match)
    found = 0
    for _ in range(300):
        ctx = rng.integers(0, 4, size=int(rng.integers(0, 40)))
        m, chain = context_match(ctx, max_len=5, min_match=min_match, max_match=4, measure=30)
        assert chain.tolist() == context_continuation(ctx, max_len=5, min_match=min_match).tolist()
        n, start = len(ctx), None
        for k in range(min(4, n - 1), min_match - 1, -1):
            starts = [i for i in range(n - k) if ctx[i : i + k].tolist() == ctx[n - k :].tolist()]
            if starts:
                start = starts[-1] + k
                break
        if start is None:
            assert (m, chain.tolist()) == (0, [])
            continue
        found += 1
        want = k
        while want < min(30, start) and ctx[start - 1 - want] == ctx[n - 1 - want]:
            want += 1
        assert (m, chain.tolist()) == (want, ctx[start : start + 5].tolist())
    assert found > 100
    assert context_match(np.arange(3), max_len=0)[0] == 0


@pytest.mark.parametrize("seed", range(10))
def test_mixed_search_equals_brute_force(corpus_index, seed):  # noqa: F811
    docs, index = corpus_index
    rng = np.random.default_rng(seed)
    ldocs = live_docs(seed)
    layer = LiveLayer(V)
    for d in ldocs:
        layer.insert(d)
    weight = float(rng.choice([0.0, 0.3, 0.7, 1.0]))
    counts = MixedCounts(Counts(docs), Counts(ldocs), weight)
    d, k = int(rng.integers(1, 5)), int(rng.integers(1, 6))
    toks, lps = random_rows(rng, d, k)
    context = [int(t) for t in rng.integers(0, V, size=int(rng.integers(1, 4)))]
    kw = dict(
        beam_width=int(rng.integers(1, 5)),
        max_nodes=int(rng.integers(1, 25)),
        ngram_weight=float(rng.choice([0.5, 1.0])),
        unigram_backoff=bool(seed % 3),
    )
    tree = T.beam_search(
        index, context, toks, lps, candidates="beam", live=layer, live_weight=weight, **kw
    )
    want = brute_eq10(counts, context, toks, lps, **kw)
    got = tree_dict(tree)
    assert set(got) == set(want)
    for p, s in want.items():
        assert got[p] == pytest.approx(s, rel=1e-9, abs=1e-12)
    # the batched search reads the same mix
    (batched,) = T.beam_search_batch(
        index,
        [context],
        toks[None],
        lps[None],
        candidates="beam",
        live=layer,
        live_weight=weight,
        **kw,
    )
    assert tree_dict(batched) == got


def test_native_searches_default_to_the_one_weight(corpus_index):  # noqa: F811
    """The native searches' live_weight default is the crate's LIVE_WEIGHT, which the package
    exports: a call without it builds the tree of a call with it (and not that of another
    weight)."""
    from dartcore import _native, live

    assert live.LIVE_WEIGHT == _native.LIVE_WEIGHT
    docs, index = corpus_index
    rng = np.random.default_rng(5)
    layer = LiveLayer(V)
    for d in docs[:3]:
        layer.insert(d)
    toks, lps = random_rows(rng, 3, 4)
    ctx = T._tail(docs[0][:5])
    p = T._search_params(None, {"max_nodes": 12}).native()
    inner, lv = T._native_index(index), live.native(layer)
    plain = _native.beam_search(inner, ctx, toks, lps, p, lv)
    weighted = _native.beam_search(inner, ctx, toks, lps, p, lv, live.LIVE_WEIGHT)
    assert all(np.array_equal(a, b) for a, b in zip(plain, weighted))
    other = _native.beam_search(inner, ctx, toks, lps, p, lv, 0.5)
    assert not np.array_equal(plain[3], other[3]), "the weight shows in the scores"
    plain = _native.ngram_tree(inner, ctx, 3, 4, p, lv)
    weighted = _native.ngram_tree(inner, ctx, 3, 4, p, lv, live.LIVE_WEIGHT)
    assert all(np.array_equal(a, b) for a, b in zip(plain, weighted))


def test_empty_layer_changes_no_tree(corpus_index):  # noqa: F811
    docs, index = corpus_index
    rng = np.random.default_rng(0)
    toks, lps = random_rows(rng, 4, 5)
    plain = T.beam_search(index, [1, 2], toks, lps, max_nodes=10)
    mixed = T.beam_search(index, [1, 2], toks, lps, max_nodes=10, live=LiveLayer(V))
    assert tree_dict(mixed) == tree_dict(plain)
    assert tree_dict(T.ngram_tree(index, [1, 2], 3, 4, live=LiveLayer(V))) == tree_dict(
        T.ngram_tree(index, [1, 2], 3, 4)
    )


def test_bad_input_is_refused_and_loses_nothing(corpus_index):  # noqa: F811
    _, index = corpus_index
    for bad in (0, -1, True, 2.5, 2**33):
        with pytest.raises(DartError, match="vocab_size"):
            LiveLayer(bad)
    with pytest.raises(DartError, match="capacity"):
        LiveLayer(V, capacity=2)
    with pytest.raises(DartError, match="capacity"):
        LiveLayer(V, capacity="many")
    layer = LiveLayer(V, capacity=64)
    layer.insert([1, 2, 3])
    for bad in ([1, V, 2], [1, -1], [[1, 2]], ["a"]):
        with pytest.raises(DartError):
            layer.insert(bad)
    assert layer.inserted == 3 and len(layer) == 3
    with pytest.raises(DartError, match="max_len"):
        layer.suffix_match([1, 2], -1)
    toks, lps = random_rows(np.random.default_rng(1), 2, 3)
    with pytest.raises(TreeError, match="live_weight"):
        T.beam_search(index, [1, 2], toks, lps, live=layer, live_weight=1.5)
    with pytest.raises(DartError, match="LiveLayer"):
        T.beam_search(index, [1, 2], toks, lps, live="not a layer")
    with pytest.raises(TreeError, match="live_weight"):
        make_tree_builder("dart+live", live_weight=-0.1)
    with pytest.raises(TreeError, match="min_match"):
        make_tree_builder("suffix", min_match=5, max_match=3)
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(TreeError, match="trust"):
            make_tree_builder("dart+live", trust=bad)
    for bad in (0, -1.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(TreeError, match="spec_factor"):
            make_tree_builder("suffix", spec_factor=bad)
        with pytest.raises(TreeError, match="spec_factor"):
            make_tree_builder("dart+live", spec_factor=bad)
    with pytest.raises(TreeError, match="max_spec"):
        make_tree_builder("dart+live", max_spec=0)
    with pytest.raises(DartError, match="max_len"):
        layer.suffix_lookup([1, 2], -1)


def test_capacity_bounds_the_window_and_clear_forgets():
    layer = LiveLayer(V, capacity=50)
    for d in live_docs(5, n=40):
        layer.insert(d)
    assert len(layer) <= 50
    assert layer.inserted > 50
    layer.clear()
    assert len(layer) == 0 and layer.inserted == 0
    assert layer.suffix_match([1, 2, 3], 4).size == 0


def test_searches_run_while_inserts_go_on(corpus_index):  # noqa: F811
    """Readers on other threads (the GIL released in both) see whole inserts only, and a
    search never fails while the layer changes."""
    _, index = corpus_index
    layer = LiveLayer(V, capacity=4096)
    toks, lps = random_rows(np.random.default_rng(2), 3, 4)
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader():
        try:
            while not stop.is_set():
                T.beam_search(index, [1, 2], toks, lps, max_nodes=8, live=layer)
                chain = layer.suffix_match([7, 8], 2, 2, 2)
                assert chain.size == 0 or chain[0] == 9
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(500):
        layer.insert([7, 8, 9, i % V])
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_insert_of_a_128_token_output_is_fast():
    layer = LiveLayer(49152)
    rng = np.random.default_rng(0)
    for _ in range(200):
        layer.insert(rng.integers(0, 49152, size=512))
    outs = [rng.integers(0, 49152, size=128) for _ in range(200)]
    start = time.perf_counter()
    for o in outs:
        layer.insert(o)
    per = (time.perf_counter() - start) / len(outs)
    assert per < 1e-3, f"{per * 1e6:.0f} us per insert"  # measured ~30 us; generous for CI


@pytest.mark.parametrize("tree", ["dart+live", "dart+mix", "suffix"])
def test_learning_decoders_are_lossless_and_learn(setup, tree):  # noqa: F811
    model, tok, drafter, index, prompts, refs = setup
    dec = DartDecoder(
        model, tok, drafter, index, tree=tree, max_nodes=8, eos_token_ids=(), learn=True
    )
    first, second = [], []
    for prompt, ref in zip(prompts, refs):
        res = dec.generate(prompt, max_new_tokens=24)
        assert res.tokens == ref
        first.append(res.stats.tau)
    assert dec.parts.live.inserted == sum(len(p) + 24 for p in prompts)
    for prompt, ref in zip(prompts, refs):  # the same questions again
        res = dec.generate(prompt, max_new_tokens=24)
        assert res.tokens == ref
        second.append(res.stats.tau)
    if tree != "dart+mix":
        # the served continuations come back as whole chains
        assert min(second) > 2.0 and np.mean(second) > np.mean(first)
    batch = dec.generate_batch(prompts, max_new_tokens=24)
    assert [r.tokens for r in batch] == refs


def test_a_cpu_decoder_given_no_tree_builds_the_judged_live_tree(setup):  # noqa: F811
    """No tree named: the CPU's default, ``dart+live`` with its judge (dart on CUDA); without
    a layer it reads the conversation's own chains, and its outputs are the target's."""
    from dartcore.trees import ChainJudge, LiveBuilder, default_tree

    assert default_tree("cpu") == "dart+live"
    assert default_tree("cuda") == default_tree("cuda:1") == "dart"
    model, tok, drafter, index, prompts, refs = setup
    dec = DartDecoder(model, tok, drafter, index, eos_token_ids=())
    assert dec.tree == "dart+live" and dec.parts.live is None
    assert isinstance(dec.builder, LiveBuilder) and isinstance(dec.builder.judge, ChainJudge)
    for prompt, ref in zip(prompts, refs):
        assert dec.generate(prompt, max_new_tokens=24).tokens == ref
    assert dec.builder.judge.seen.sum() > 0  # it judged the rounds
    assert [r.tokens for r in dec.generate_batch(prompts, max_new_tokens=24)] == refs
    # naming a tree still builds that one
    assert DartDecoder(model, tok, drafter, index, tree="dart").tree == "dart"


def _count_drafts(dec):
    """Wrap the decoder's draft calls; returns the list of rows each one asked for."""
    calls = []
    inner = dec.parts.backend.draft_batch

    def counted(*args, **kwargs):
        calls.append(kwargs.get("rows"))
        return inner(*args, **kwargs)

    dec.parts.backend.draft_batch = counted
    return calls


def _engine_outputs(engine, prompts, max_new_tokens: int = 24) -> list[list[int]]:
    """Every prompt through ``engine`` (not learned from), its outputs in order."""
    from dartcore.sampling import SamplingParams

    outs = {}
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_new_tokens=max_new_tokens, learn=False), f"r{i}")
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.tokens
    return [outs[f"r{i}"] for i in range(len(prompts))]


def _learned_live_decoder(setup, trust: int, adapt: bool = False):  # noqa: F811
    """A ``dart+live`` decoder (3-node budget, ``trust``; by default the fixed rule, no judge)
    that has answered every prompt once (the answers checked against the target's)."""
    model, tok, drafter, index, prompts, refs = setup
    dec = DartDecoder(
        model,
        tok,
        drafter,
        index,
        tree="dart+live",
        max_nodes=3,
        eos_token_ids=(),
        learn=True,
        trust=trust,
        adapt=adapt,
    )
    for prompt, ref in zip(prompts, refs):
        assert dec.generate(prompt, max_new_tokens=24).tokens == ref
    return dec


@pytest.mark.parametrize("trust", [0, 4])
def test_a_trusted_suffix_match_skips_the_draft(setup, trust):  # noqa: F811
    """Asked again, ``dart+live`` finds its earlier answers: a match of ``trust`` tokens or
    more is verified as a chain alone, sized by the match beyond the node budget (up to
    SUFFIX_MAX_NODES), without a drafter forward; trust 0 always drafts. Outputs stay the
    target's, single and batched."""
    from dartcore.trees import SUFFIX_MAX_NODES

    model, tok, drafter, index, prompts, refs = setup
    dec = _learned_live_decoder(setup, trust)
    calls = _count_drafts(dec)
    rounds, longest, taus = 0, 0, []
    for prompt, ref in zip(prompts, refs):
        res = dec.generate(prompt, max_new_tokens=24)
        assert res.tokens == ref
        rounds += res.stats.rounds
        longest = max(longest, len(res.stats.budget_hist) - 1)
        taus.append(res.stats.tau)
    if trust == 0:  # every round drafts but a last one with one token left; the drafted
        # tree's chain sized by its match beyond the budget
        assert len(calls) >= rounds - len(prompts) and 3 < longest <= SUFFIX_MAX_NODES
    else:
        assert len(calls) < rounds / 2, (len(calls), rounds)
        assert 3 < longest <= SUFFIX_MAX_NODES
        assert min(taus) > 4.0, taus
    batch = dec.generate_batch(prompts, max_new_tokens=24)
    assert [r.tokens for r in batch] == refs


@pytest.mark.parametrize("budget", ["adaptive", 0])
def test_the_engine_verifies_a_trusted_repeat_where_it_stopped_drafting(setup, budget, monkeypatch):  # noqa: F811
    """A controller that gives a sequence no nodes (drafting judged not to pay) still lets a
    trusted repeat through, as a chain within the verify's room, without a draft; a fixed
    budget of 0 (speculation off) plans nothing. Outputs stay the target's."""
    from dartcore.engine import Engine

    model, tok, drafter, index, prompts, refs = setup
    dec = _learned_live_decoder(setup, 4)
    engine = Engine(dec, max_batch=1, budget=budget)
    if engine.controller is not None:
        monkeypatch.setattr(engine.controller, "draws", lambda accs, caps: [0] * len(caps))
    calls = _count_drafts(dec)
    assert _engine_outputs(engine, prompts) == refs
    assert not calls, "drafted at budget 0"
    chains = [n for st in engine.stats.steps for n in st.budgets if n > 0]
    if budget == "adaptive":
        assert chains and max(chains) > 3, chains  # beyond the decoder's budget
    else:
        assert not chains


def test_suffix_chains_are_sized_by_their_match():
    """A match of m tokens takes spec_factor x m nodes: at least the budget, at most the
    builder's depth and the round's room."""
    from dartcore.trees import TreeInputs

    ctx = np.array([9, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 3, 4, 5, 6], dtype=np.int64)
    # the end (3 4 5 6) occurs at 3..6, matching 4 tokens deep (2 != 0 before it)
    b = make_tree_builder("suffix", spec_factor=1.0)
    tree = b(TreeInputs(context=ctx, max_nodes=1, max_chain=15))
    assert tree.tokens.tolist() == [6, 7, 8, 0, 0]  # 4 = the match's length
    tree = b(TreeInputs(context=ctx, max_nodes=6, max_chain=15))
    assert tree.tokens.tolist() == [6, 7, 8, 0, 0, 3, 4]  # the budget, 6 nodes
    tree = make_tree_builder("suffix", spec_factor=0.5)(
        TreeInputs(context=ctx, max_nodes=1, max_chain=15)
    )
    assert tree.tokens.tolist() == [6, 7, 8]
    tree = make_tree_builder("suffix", spec_factor=4.0)(
        TreeInputs(context=ctx, max_nodes=1, max_chain=3)
    )
    assert tree.tokens.tolist() == [6, 7, 8, 0]  # the round's room
    tree = make_tree_builder("suffix", spec_factor=4.0)(
        TreeInputs(context=ctx, max_nodes=1, max_chain=15, max_depth=2)
    )
    assert tree.tokens.tolist() == [6, 7, 8]  # its deepest usable node
    tree = b(TreeInputs(context=ctx, max_nodes=2))  # no room given: the budget
    assert tree.tokens.tolist() == [6, 7, 8]
    live = make_tree_builder("dart+live", trust=5)
    assert live.plan(TreeInputs(context=ctx, max_nodes=2, max_chain=15)) is None  # 4 < 5
    live = make_tree_builder("dart+live", trust=4)
    planned = live.plan(TreeInputs(context=ctx, max_nodes=2, max_chain=15))
    assert planned.tokens.tolist() == [6, 7, 8, 0, 0]


def test_a_short_matchs_chain_takes_at_most_half_a_drafted_tree():
    """In a drafted ``dart+live`` tree the chain of a match of ``short`` (4) tokens or more
    takes the budget, the drafter's tree the one node left; a shorter match's chain (a few
    common tokens recur anywhere) at most half the budget, the drafter's tree the rest."""
    from dartcore.trees import LiveBuilder, TreeInputs, chain_tree

    asked = []

    def dart(inputs):  # the drafter's tree: a chain of its own tokens
        asked.append(inputs.max_nodes)
        return chain_tree(int(inputs.context[-1]), np.arange(100, 100 + inputs.max_nodes))

    deep3 = np.array([9, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 4, 5, 6], dtype=np.int64)
    tree = LiveBuilder(dart=dart)(TreeInputs(context=deep3, max_nodes=4, max_chain=15))
    assert asked == [2] and sorted(tree.tokens[1:].tolist()) == [7, 8, 100, 101]
    asked.clear()
    tree = LiveBuilder(dart=dart, short=0)(TreeInputs(context=deep3, max_nodes=4, max_chain=15))
    assert asked == [1] and sorted(tree.tokens[1:].tolist()) == [0, 7, 8, 100]
    asked.clear()
    deep4 = np.array([9, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 3, 4, 5, 6], dtype=np.int64)
    tree = LiveBuilder(dart=dart)(TreeInputs(context=deep4, max_nodes=4, max_chain=15))
    assert asked == [1] and sorted(tree.tokens[1:].tolist()) == [0, 7, 8, 100]
    for bad in (-1, 1.5, True):
        with pytest.raises(TreeError, match="short"):
            make_tree_builder("dart+live", short=bad)


def test_a_shared_layer_must_cover_the_target(setup):  # noqa: F811
    model, tok, drafter, index, *_ = setup
    with pytest.raises(DartError, match="vocabulary"):
        DartDecoder(model, tok, drafter, index, tree="dart+live", learn=LiveLayer(10))
    shared = LiveLayer(64)
    a = DartDecoder(model, tok, drafter, index, tree="suffix", learn=shared, eos_token_ids=())
    b = DartDecoder(model, tok, drafter, index, tree="suffix", learn=shared, eos_token_ids=())
    a.generate([1, 5, 6, 7], max_new_tokens=8)
    assert b.parts.live is shared and shared.inserted == 12


def test_sampling_with_a_learning_layer_matches_the_target():
    model = tiny_model("llama", vocab_size=VOCAB, seed=1)
    exact = exact_joint(model, 1.0, 0, 1.0)
    dec = DartDecoder(
        model, CharTokenizer(), tree="suffix", max_nodes=6, eos_token_ids=(), learn=True
    )
    # what it serves repeats the prompt, so the layer's chains get drafted and accepted
    counts, _, tau = sample_counts(dec, range(800), temperature=1.0, top_k=0, top_p=1.0)
    assert tau > 1.05
    assert chi_square_p(counts, exact) > 1e-3


def test_a_request_opts_out_of_learning():
    from dartcore.serve.protocol import APIError, parse_chat

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat(body, ("m",)).params.learn is True
    assert parse_chat({**body, "dart": {"learn": False}}, ("m",)).params.learn is False
    assert parse_chat({**body, "dart": {"learn": True, "stats": True}}, ("m",)).want_stats
    for bad in ({"learn": 1}, {"learn": "no"}, {"forget": True}):
        with pytest.raises(APIError, match="learn"):
            parse_chat({**body, "dart": bad}, ("m",))


def test_the_engine_learns_what_it_finishes_unless_told_not_to(setup):  # noqa: F811
    from dartcore.engine import Engine
    from dartcore.sampling import SamplingParams

    model, tok, drafter, index, prompts, refs = setup
    dec = DartDecoder(
        model, tok, drafter, index, tree="suffix", max_nodes=6, eos_token_ids=(), learn=True
    )
    engine = Engine(dec, max_batch=4, budget=6)
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_new_tokens=24, learn=i % 2 == 0), f"r{i}")
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.tokens
    assert [outs[f"r{i}"] for i in range(len(prompts))] == refs
    learned = sum(len(p) + 24 for i, p in enumerate(prompts) if i % 2 == 0)
    assert dec.parts.live.inserted == learned


def _judge_ticks(judge, match: int, n: int) -> list[bool]:
    return [judge.choose(match)[0] for _ in range(n)]


def _judge_rounds(judge, n, chain, chain_s, drafted, drafted_s, *, match=3, request=None):
    """``n`` rounds at ``match``-token matches, each of the kind ``judge`` picks: the chain
    alone commits ``chain`` tokens in ``chain_s``, a drafted round ``drafted`` in
    ``drafted_s`` (and shows the chain's ``chain``; ``request``: the notes it is told the
    draft's extra in). Returns the picks (True: the chain alone)."""
    picks = []
    for _ in range(n):
        alone, at = judge.choose(match, request)
        picks.append(alone)
        if alone:
            judge.observe(True, at, chain, chain_s)
        else:
            if request is not None:
                judge.observe_request(request, at, drafted - chain)
            judge.observe(False, at, drafted, drafted_s)
            judge.observe_chain(at, chain)
    return picks


def test_the_chain_judge_follows_its_prior_until_both_sides_are_measured():
    """A match of ``trust`` tokens or more is a repeat, verified alone, not judged; unmeasured,
    a shorter one drafts and tries the chain alone every other round."""
    from dartcore.trees import ChainJudge

    judge = ChainJudge(trust=4)
    assert _judge_ticks(judge, 9, 8) == [True] * 8
    assert _judge_ticks(judge, 3, 8) == [False, True] * 4
    assert _judge_ticks(judge, 0, 4) == [False, True] * 2
    assert [ChainJudge.bucket(m) for m in (0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 15, 16, 40)] == [
        0,
        1,
        1,
        2,
        3,
        3,
        4,
        4,
        5,
        5,
        6,
        6,
        7,
        7,
    ]


def test_the_chain_judge_picks_the_faster_rounds_and_learns_the_chain_from_drafted_ones():
    from dartcore.trees import ChainJudge

    judge = ChainJudge(trust=8)
    b = ChainJudge.bucket(3)
    judge.observe(False, b, 2, 0.010, (0.004, True))  # a steady draft of 4 ms
    judge.observe(False, b, 2, 0.050, (0.045, False))  # a catch-up, charged 4 ms: 9 ms
    assert judge.steady_s == pytest.approx(0.004)
    assert judge.seconds[0, b] == pytest.approx(0.010 + 0.009)

    judge = ChainJudge(trust=8)

    def rounds(n, chain, chain_s, drafted, drafted_s):
        return _judge_rounds(judge, n, chain, chain_s, drafted, drafted_s)

    # the chain alone: 2 tokens in 3 ms; drafting: 2 in 5 ms
    picks = rounds(4, 2, 0.003, 2, 0.005)
    assert picks == [False, True, False, True]  # both measured, every other round
    picks = rounds(200, 2, 0.003, 2, 0.005)
    assert judge.rate(True, b) == pytest.approx(2 / 0.003)
    assert judge.rate(False, b) == pytest.approx(2 / 0.005)
    # the chain alone; a draft a few rounds in every ~45, to measure it again
    assert 2 <= picks[-180:].count(False) <= 12, picks
    # now the chain alone commits 1 token (333/s), drafting still 2 in 5 ms (400/s); the
    # drafted rounds that measure drafting again show it, and the judge turns to drafting
    picks = rounds(300, 1, 0.003, 2, 0.005)
    # the chain alone's tokens per round, from its own rounds and the drafted ones
    assert judge.chain_tokens[b] / judge.chain_weight[b] == pytest.approx(1.0, rel=0.02)
    assert picks[-150:].count(False) > 140  # drafting, the chain alone only timed again
    assert 1 <= picks[-150:].count(True) <= 10, picks
    assert judge.rate(True, ChainJudge.bucket(9)) is None  # other lengths: unmeasured


def test_the_chain_judge_measures_a_confirmed_choice_less_often():
    """Each measurement again that confirms the choice halves how often the length is
    measured (a draft after chain-alone rounds first catches up on them); a change of the
    world is still found as soon as without that patience."""
    from dartcore.trees import ChainJudge

    def run(judge, plan):
        picks = []
        for n, chain, drafted in plan:  # the chain alone 3 ms a round, a drafted one 5 ms
            picks += _judge_rounds(judge, n, chain, 0.003, drafted, 0.005)
        return picks

    steady = [(1000, 2, 2)]  # the chain alone always faster
    calm, eager = run(ChainJudge(trust=8), steady), run(ChainJudge(trust=8, patience=0), steady)
    assert calm[-500:].count(False) <= eager[-500:].count(False) // 2
    assert 1 <= calm[-500:].count(False)  # still measured again
    judge = ChainJudge(trust=8)
    assert judge.calm[ChainJudge.bucket(3)] == 0
    run(judge, steady)
    assert judge.calm[ChainJudge.bucket(3)] == judge.patience
    # then drafting wins: found within the rounds the eager judge needs too
    changed = [(1000, 2, 2), (300, 1, 2)]
    for patience in (0, 4):
        picks = run(ChainJudge(trust=8, patience=patience), changed)[1000:]
        first = next(i for i in range(len(picks) - 10) if not any(picks[i : i + 10]))
        assert first < 120, (patience, first)
    with pytest.raises(TreeError, match="patience"):
        ChainJudge(patience=-1)


def test_chain_commits_is_what_the_chain_alone_commits():
    """What a drafted round tells of its chain alone equals a greedy walk of the chain alone
    (brute force) wherever the round's tree holds the chain, and never exceeds it where the
    tree holds only part of it."""
    from dartcore.trees import chain_commits, chain_tree, merge_trees

    rng = np.random.default_rng(3)
    table = rng.integers(0, 3, size=(3,) * 4)  # the target: next token of the last 4

    def target(ctx):
        return int(table[tuple(ctx[-4:])])

    def walk(tree, ctx):  # greedy: the committed tokens (accepted path + the bonus)
        kids = {}
        for i in range(1, len(tree)):
            kids.setdefault(int(tree.parents[i]), {})[int(tree.tokens[i])] = i
        node, new = 0, []
        while True:
            t = target(ctx + new)
            new.append(t)
            node = kids.get(node, {}).get(t)
            if node is None:
                return new

    for _ in range(400):
        ctx = rng.integers(0, 3, size=6).tolist()
        chain = rng.integers(0, 3, size=int(rng.integers(1, 6)))
        other = chain_tree(ctx[-1], rng.integers(0, 3, size=int(rng.integers(1, 4))))
        alone = len(walk(chain_tree(ctx[-1], chain), ctx))
        full = merge_trees(other, chain_tree(ctx[-1], chain), 16)
        assert chain_commits(chain, walk(full, ctx)) == alone
        cut = merge_trees(other, chain_tree(ctx[-1], chain), int(rng.integers(1, 4)))
        assert chain_commits(chain, walk(cut, ctx)) <= alone


def test_the_judge_hears_of_every_round_it_chose_and_outputs_stay_the_targets(setup):  # noqa: F811
    """``dart+live`` with its judge (the default): each round it decided is observed once,
    with that round's committed tokens; a judge that found plain steps faster than drafting
    plans the root alone where nothing matches (no drafter forward); outputs never change,
    single and batched."""
    from dartcore.trees import ChainJudge

    model, tok, drafter, index, prompts, refs = setup
    dec = _learned_live_decoder(setup, 8, adapt=True)
    heard = []
    inner = dec.parts.builder.observe
    dec.parts.builder.observe = lambda note, n, *a: (heard.append((note, n)), inner(note, n, *a))
    res = dec.generate(prompts[0], max_new_tokens=24)
    assert res.tokens == refs[0]
    assert sum(len(n) for _, n in heard) <= len(res.tokens)
    assert len(heard) >= res.stats.rounds - 1
    judge = dec.parts.builder.judge
    judge.tokens[:], judge.seconds[:], judge.weight[:] = 10.0, 1.0, 10.0
    # the chain alone (or the root alone) always 2x the draft
    judge.chain_tokens[:], judge.chain_weight[:] = 20.0, 10.0
    calls = _count_drafts(dec)
    fresh = [1] + np.random.default_rng(7).integers(3, 64, size=9).tolist()
    ref = DartDecoder(model, tok, None, None, tree="ar", eos_token_ids=()).generate(
        fresh, max_new_tokens=24
    )
    got = dec.generate(fresh, max_new_tokens=24)
    assert got.tokens == ref.tokens
    assert len(calls) < got.stats.rounds / 4, (len(calls), got.stats.rounds)  # exploration only
    assert got.stats.budget_hist[0] > 0  # root-alone rounds
    assert isinstance(judge, ChainJudge)
    batch = dec.generate_batch(prompts, max_new_tokens=24)
    assert [r.tokens for r in batch] == refs


def test_adapt_must_be_a_bool():
    with pytest.raises(TreeError, match="adapt"):
        make_tree_builder("dart+live", adapt=1)
    assert make_tree_builder("dart+live", adapt=False).judge is None


def test_the_judge_decides_only_for_a_sequence_verified_alone(setup):  # noqa: F811
    """In a step shared by several sequences a round's time is the whole step's, and the
    engine's controller decides who drafts: the judge is not consulted there (the fixed rule
    plans), and at one sequence it is. Outputs stay the target's."""
    from dartcore.engine import Engine

    model, tok, drafter, index, prompts, refs = setup
    dec = _learned_live_decoder(setup, 8, adapt=True)
    judge = dec.parts.builder.judge
    asked = []
    inner = judge.choose
    judge.choose = lambda m, *a: (asked.append(m), inner(m, *a))[1]
    for batch in (len(prompts), 1):
        asked.clear()
        engine = Engine(dec, max_batch=batch, budget=3)
        assert _engine_outputs(engine, prompts) == refs
        alone = [st.sequences for st in engine.stats.steps].count(1)
        if batch > 1:  # the last of a batch may run alone once the others are done
            assert len(asked) <= alone < len(engine.stats.steps), (len(asked), alone)
        else:
            assert asked and len(asked) <= alone


def test_the_chain_judge_follows_a_request_whose_drafts_add_little():
    """The rates are the judge's across requests; a request whose drafted rounds commit no
    more than their chains would alone turns to the chain alone within a few drafted rounds,
    while the next request (its own notes) drafts again, and a request whose drafts do as
    the judge expects keeps drafting."""
    from dartcore.trees import ChainJudge

    judge = ChainJudge(trust=8)

    def rounds(n, request, extra):
        """``n`` rounds where nothing matches: the chain alone (a plain step) commits 1 token
        in 3 ms, a drafted round 1 + ``extra`` in 4 ms."""
        return _judge_rounds(judge, n, 1, 0.003, 1 + extra, 0.004, match=0, request=request)

    rounds(300, None, 1)  # drafting: 500 tokens/s against the plain step's 333
    b = ChainJudge.bucket(0)
    assert judge.extra(b) == pytest.approx(1.0)
    assert rounds(20, {}, 1).count(False) >= 18  # a request as expected: drafting
    hard: dict = {}
    picks = rounds(40, hard, 0)  # its drafts commit what the plain step would
    first = picks.index(True)
    assert 5 <= first <= 15, picks
    assert picks[first:].count(False) <= 3, picks  # then the chain alone, measured again seldom
    assert judge.yield_ratio(hard) < 0.5
    assert rounds(10, {}, 1).count(False) >= 9  # the next request drafts again
    assert judge.yield_ratio({}) == 1.0
