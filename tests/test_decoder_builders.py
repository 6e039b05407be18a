"""The built-in tree builders inside DartDecoder on a tiny target with a real
(untrained) DartDrafter and a real n-gram index: greedy output equals Hugging
Face ``generate(do_sample=False)`` for every method, and the bad-input checks
(drafter of another target, index of another tokenizer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_model
from dartcore import DartDecoder, DrafterMismatchError, TokenizerMismatchError
from test_decoder import CharTokenizer, hf_greedy

torch.set_num_threads(1)

pytest.importorskip("dartcore._native")


class FingerprintedCharTokenizer(CharTokenizer):
    """CharTokenizer that dartcore.tokenizers.fingerprint accepts (HF-like API)."""

    def __len__(self):
        return 64

    def convert_tokens_to_ids(self, tokens):
        return [ord(t) - ord("a") for t in tokens]

    def encode(self, text, add_special_tokens=False):
        return [(ord(c) - ord("a")) % 64 for c in text]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from dartcore.drafter import DartDrafter
    from dartcore.index import NgramIndex, build_index
    from dartcore.tokenizers import fingerprint

    model = tiny_model("llama", layers=6)
    model.generation_config.eos_token_id = None
    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(3, 64, size=int(rng.integers(3, 12))).tolist() for _ in range(4)]
    refs = [hf_greedy(model, p, 24) for p in prompts]
    # The index has seen the reference continuations of half the prompts (as a
    # corpus of related text would), plus random documents.
    docs = [np.array(p + r, dtype=np.int64) for p, r in list(zip(prompts, refs))[:2]]
    docs += [rng.integers(0, 64, size=200) for _ in range(20)]
    path = tmp_path_factory.mktemp("idx") / "tiny.idx"
    tok = FingerprintedCharTokenizer()
    build_index(
        docs,
        path,
        vocab_size=64,
        metadata={"tokenizer": {"name": "char", "fingerprint": fingerprint(tok)}},
    )
    index = NgramIndex(path)
    drafter = DartDrafter.from_target(model, d=4)
    return model, tok, drafter, index, prompts, refs


@pytest.mark.parametrize(
    "tree",
    [
        "dart",
        "dart-official",
        "dart-no-ngram",
        "dart-chain",
        "ngram-only",
        "dart+ngram",
        "dart+ctx",
        "ar",
    ],
)
def test_every_builder_is_lossless_under_greedy(setup, tree):
    model, tok, drafter, index, prompts, refs = setup
    dec = (
        DartDecoder(model, tok, drafter, index, tree=tree, max_nodes=8, eos_token_ids=())
        if tree not in ("ar", "dart-chain")
        else DartDecoder(model, tok, drafter, index, tree=tree, eos_token_ids=())
    )
    taus = []
    for prompt, ref in zip(prompts, refs):
        res = dec.generate(prompt, max_new_tokens=24)
        assert res.tokens == ref
        taus.append(res.stats.tau)
    if tree in ("dart", "ngram-only", "dart+ngram"):
        # the index knows two of the continuations: whole paths get accepted
        assert max(taus) > 1.3  # measured 1.44 (dart); random trees give ~1.1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("tree", ["dart", "dart+ctx", "ngram-only"])
def test_builders_on_cuda_take_the_gpu_budget_and_stay_lossless(setup, tree):
    import copy

    from dartcore.trees import CPU_MAX_NODES, GPU_MAX_NODES

    model, tok, drafter, index, prompts, _ = setup
    assert DartDecoder(model, tok, drafter, index, tree=tree).max_nodes == CPU_MAX_NODES
    model, drafter = copy.deepcopy(model).cuda(), copy.deepcopy(drafter)  # drafter left on the CPU
    dec = DartDecoder(model, tok, drafter, index, tree=tree, eos_token_ids=())
    assert dec.max_nodes == GPU_MAX_NODES
    assert DartDecoder(model, tok, drafter, index, tree=tree, max_nodes=7).max_nodes == 7
    if dec.drafter is not None:
        assert next(dec.drafter.parameters()).device.type == "cuda"
    for prompt in prompts:
        assert dec.generate(prompt, max_new_tokens=24).tokens == hf_greedy(model, prompt, 24)


def test_drafter_of_another_target_is_refused(setup):
    from dartcore.drafter import DartDrafter

    model, tok, _, index, *_ = setup
    other = tiny_model("llama", layers=6, hidden=48, heads=4, kv_heads=2)
    with pytest.raises(DrafterMismatchError, match="hidden size"):
        DartDecoder(model, tok, DartDrafter.from_target(other, d=4), index, tree="dart")


def test_index_of_another_tokenizer_is_refused(setup, tmp_path):
    from dartcore.index import NgramIndex, build_index

    model, tok, drafter, *_ = setup
    path = tmp_path / "other.idx"
    build_index(
        [np.arange(10)],
        path,
        vocab_size=64,
        metadata={"tokenizer": {"name": "qwen3", "fingerprint": "0123456789abcdef"}},
    )
    # names both tokenizers, not only their fingerprints
    with pytest.raises(
        TokenizerMismatchError,
        match=r"tokenizer 'qwen3'.*FingerprintedCharTokenizer.*rebuild the index",
    ):
        DartDecoder(model, tok, drafter, NgramIndex(path), tree="dart")


def test_index_without_tokenizer_metadata_warns_and_checks_its_vocabulary(setup, tmp_path):
    from dartcore.index import NgramIndex, build_index

    model, tok, drafter, *_ = setup
    bare = tmp_path / "bare.idx"
    build_index([np.arange(10)], bare, vocab_size=64)
    with pytest.warns(UserWarning, match="records no tokenizer"):
        DartDecoder(model, tok, drafter, NgramIndex(bare), tree="dart")
    wide = tmp_path / "wide.idx"  # more token ids than the target's 64
    build_index([np.arange(100)], wide, vocab_size=100)
    with pytest.raises(
        TokenizerMismatchError, match="vocabulary of 100 tokens but the target only 64"
    ):
        DartDecoder(model, tok, drafter, NgramIndex(wide), tree="dart")


def test_native_cpu_backend_drafts_through_native_draft_and_stays_lossless(setup):
    """The native CPU backend's routing (drafter -> NativeDraft, one-thread rounds), with the
    native layer ops and torch products so that it runs on any CPU."""
    from dartcore.kernels.native_draft import NativeDraft
    from dartcore.models.backend import NativeCpuBackend

    model, tok, drafter, index, prompts, refs = setup
    dec = DartDecoder(model, tok, drafter, index, tree="dart", max_nodes=6, eos_token_ids=())
    dec.backend = NativeCpuBackend(dec.target, lazy_logits=True)
    native = NativeDraft(
        drafter, threads=1, product=lambda w, b: lambda x: torch.nn.functional.linear(x, w, b)
    )
    blocks = []
    inner = native.block
    native.block = lambda *a: blocks.append(inner(*a)) or blocks[-1]
    dec.backend.native_drafts[id(drafter)] = native
    for prompt, ref in zip(prompts, refs):
        assert dec.generate(prompt, max_new_tokens=24).tokens == ref
    assert blocks and all(b is not None for b in blocks)  # every round's draft went native


def _paths(tree):
    """Every node as its token path from the root."""
    out = []
    for i in range(len(tree.tokens)):
        path, node = [], i
        while node >= 0:
            path.append(int(tree.tokens[node]))
            node = int(tree.parents[node])
        out.append(tuple(path[::-1]))
    return out


def test_merge_trees_is_a_budgeted_union_in_depth_order():
    from dartcore.acceptance import flatten
    from dartcore.tree import Tree
    from dartcore.trees import merge_trees

    def tree(tokens, parents):
        parents = np.array(parents)
        depths = np.zeros(len(parents), dtype=np.int64)
        for i in range(1, len(parents)):
            depths[i] = depths[parents[i]] + 1
        return Tree(np.array(tokens), parents, depths)

    a = tree([7, 1, 2, 3], [-1, 0, 0, 1])  # paths 7-1, 7-2, 7-1-3
    b = tree([7, 1, 5, 3, 6, 9], [-1, 0, 0, 1, 1, 4])  # 7-1, 7-5, 7-1-3, 7-1-6, 7-1-6-9
    for budget, want_new in (
        (3, []),
        (4, [(7, 5)]),
        (5, [(7, 5), (7, 1, 6)]),
        (9, [(7, 5), (7, 1, 6), (7, 1, 6, 9)]),
    ):
        m = merge_trees(a, b, budget)
        flatten(m)  # valid: parents first, depth order
        paths = _paths(m)
        assert len(paths) == len(set(paths)) == len(_paths(a)) + len(want_new)
        assert set(_paths(a)) <= set(paths) and set(paths) - set(_paths(a)) == set(want_new)
    # a node of b whose parent did not fit is dropped with its subtree
    m = merge_trees(a, tree([7, 4, 8], [-1, 0, 1]), 3)
    assert set(_paths(m)) == set(_paths(a))
    with pytest.raises(ValueError, match="roots differ"):
        merge_trees(a, tree([8], [-1]), 5)


def _brute_continuation(ctx, max_len, min_match=2, max_match=4):
    """Plain-loop reference of context_continuation."""
    for n in range(min(max_match, len(ctx) - 1), min_match - 1, -1):
        suffix = ctx[len(ctx) - n :]
        for i in range(len(ctx) - n - 1, -1, -1):  # latest earlier start first
            if ctx[i : i + n] == suffix:
                return ctx[i + n : i + n + max_len]
    return []


def test_context_continuation_matches_a_plain_search():
    from dartcore.trees import context_continuation

    rng = np.random.default_rng(3)
    for _ in range(400):
        ctx = rng.integers(0, int(rng.integers(2, 6)), size=int(rng.integers(1, 30))).tolist()
        max_len = int(rng.integers(1, 6))
        got = context_continuation(np.array(ctx), max_len=max_len).tolist()
        assert got == _brute_continuation(ctx, max_len), ctx
    # the longest recurring suffix wins over a later shorter one
    assert context_continuation(
        np.array([1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3]), max_len=2
    ).tolist() == [9, 5]
    assert context_continuation(np.array([4, 5, 6]), max_len=3).tolist() == []


def test_context_union_keeps_the_budget_and_the_continuation(setup):
    from dartcore.acceptance import flatten
    from dartcore.trees import TreeInputs, make_tree_builder, node_budget

    model, tok, drafter, index, prompts, _ = setup
    builder = make_tree_builder("dart+ctx", max_nodes=5, context_nodes=3)
    # suffix (9, 8) recurs: 7, 6, 5, ...
    ctx = np.array([1, 9, 8, 7, 6, 5, 4, 9, 8], dtype=np.int64)
    logits = torch.randn(4, drafter.config.draft_vocab_size)
    budget = node_budget(builder, drafter=drafter)
    assert budget == 5
    tree = flatten(
        builder(
            TreeInputs(context=ctx, logits=logits, drafter=drafter, index=index, max_nodes=budget)
        )
    )
    assert tree.tokens[0] == 8 and len(tree) - 1 <= 5
    assert {(7,), (7, 6), (7, 6, 5)} <= {p[1:] for p in _paths(tree)}
    with pytest.raises(ValueError, match="context_nodes"):
        make_tree_builder("dart+ctx", max_nodes=4, context_nodes=5)


def test_the_builder_receives_the_rounds_final_budget(setup):
    """The budget is decided in one place per round (the decoder's max_nodes capped by the
    room left) and the builder is handed exactly that: every tree it returns fits it, so
    nothing downstream cuts it again."""
    from dartcore.trees import CPU_MAX_NODES, make_tree_builder, register_tree_builder

    model, tok, drafter, index, prompts, _ = setup
    seen = []

    class Spy:
        def __init__(self, inner):
            self.inner = inner
            self.max_nodes, self.needs_drafter = inner.max_nodes, inner.needs_drafter
            self.needs_hidden, self.needs_index = inner.needs_hidden, inner.needs_index

        def __call__(self, inputs):
            tree = self.inner(inputs)
            seen.append((inputs.max_nodes, len(tree) - 1, inputs.max_depth, int(tree.depths.max())))
            return tree

    register_tree_builder(
        "test-spy", lambda **kw: Spy(make_tree_builder("dart", **kw)), replace=True
    )
    for kw, want in (({}, CPU_MAX_NODES), ({"max_nodes": 7}, 7)):
        seen.clear()
        dec = DartDecoder(model, tok, drafter, index, tree="test-spy", eos_token_ids=(), **kw)
        assert dec.max_nodes == want
        dec.generate(prompts[0], max_new_tokens=12)
        assert seen and all(budget == want for budget, *_ in seen[:-1])
        assert all(
            nodes <= budget and depth <= max_depth for budget, nodes, max_depth, depth in seen
        )
    # At the end of the context the room left caps the budget: one place, one value.
    seen.clear()
    prompt = list(prompts[0])
    dec = DartDecoder(
        model,
        tok,
        drafter,
        index,
        tree="test-spy",
        eos_token_ids=(),
        max_nodes=7,
        max_context=len(prompt) + 6,
    )
    dec.generate(prompt, max_new_tokens=50)
    assert min(b for b, *_ in seen) < 7 and all(n <= b for b, n, *_ in seen)
