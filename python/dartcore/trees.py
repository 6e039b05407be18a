"""Tree builders behind a registry: which draft tree the decoder verifies.

A builder is made once per decoder by a factory, ``factory(**params)``, and is
then called once per round with a :class:`TreeInputs`; it returns a
:class:`dartcore.tree.Tree` whose root (node 0) is the last committed token.
(Any object with int64 ``tokens`` / ``parents`` / ``depths`` in depth
order is accepted.) It declares what it needs, so the decoder skips work nobody reads:
``needs_drafter`` (run the drafter), ``needs_hidden`` (ask the drafter for its
final hidden states too), ``needs_index``.

The node budget. A builder's ``max_nodes`` is what its user asked for (None: no
preference); :func:`node_budget` turns that into the decoder's budget once (the user's
value, one node per drafter row for the chain, else the device's default), and the
decoder hands each round's final budget (that, capped by the room left in the context)
to the builder as ``TreeInputs.max_nodes``. Builders build to exactly that budget and
never clamp it again.

Built in:

==================  ==========================================================
``dart``            Eq. (10) beam search over drafter top-k and the trigram index
``dart-official``   the official DART searcher's tree exactly (``SearchParams.official()``)
``dart-no-ngram``   the same search with ``ngram_weight = 0`` (no index)
``dart-chain``      ``beam_width = 1``, ``max_nodes = d``: one drafter chain
``ngram-only``      trigram-index tree, no drafter
``dart+ngram``      ``dart`` completed by the n-gram-only tree's best new paths
``dart+ctx``        ``dart`` completed by a prompt-lookup chain from the context itself
``dart+live``       ``dart`` with the live layer mixed into g, completed by a suffix-match
                    chain from the context or the live layer (:mod:`dartcore.live`)
``dart+mix``        ``dart`` with the live layer mixed into g
``suffix``          the suffix-match chain alone, no drafter or index (suffix decoding)
``ar``              no draft: the root alone, i.e. plain autoregressive decoding
==================  ==========================================================

Others (DARTree "dartree", "hybrid", DDTree "ddtree") register themselves with
:func:`register_tree_builder`. A decoder given no tree builds :func:`default_tree`'s:
``dart+live`` on the CPU, ``dart`` on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch

from dartcore import _native
from dartcore.errors import TreeError
from dartcore.tree import NGRAM_DEPTH, TOP_K, SearchParams, Tree

__all__ = [
    "TreeInputs",
    "TreeBuilder",
    "register_tree_builder",
    "make_tree_builder",
    "tree_builders",
    "CPU_BLOCKS_MAX_NODES",
    "CPU_MAX_NODES",
    "GPU_MAX_NODES",
    "node_budget",
    "GPU_TREE",
    "CPU_TREE",
    "default_tree",
]

# Default node budget (root excluded) on CPU. The paper's theta = 59 is a GPU budget; on the
# CPU the verify forward's cost grows with every node. Measured with tools/bench_budgets.py
# (SmolLM2-135M, fp32, native CPU path, 9 eval prompts x 64 tokens, T = 0, 2-vCPU box): one
# thread dart 1.39 / 1.33 / 1.32 / 1.37 / 1.22x over AR at 3 / 4 / 5 / 6 / 8 nodes, two threads
# 1.30 / 1.27 / 1.31 / 1.29 / 1.28x (tau 1.71 / 1.77 / 1.84 / 1.89 / 1.94): flat from 3 to 6
# within the noise, more costs more than it gains.
CPU_MAX_NODES = 4
# Default node budget on CPU for a target of GGML block weights (Q4_0 / Q4_1 / Q8_0): on the
# int8 kernels an extra verify row costs its integer products and attention (SmolLM2 Q4_1, 2
# threads, 2-vCPU AVX-512 VNNI Xeon, tools/bench_int8.py: 4.03 / 4.25 / 4.97 ms at 1 / 2 / 4
# rows), and the drafter's forward is a sixth of a one-row step. Measured with
# tools/bench_budgets.py --quantized (SmolLM2's Q4_1 file, 5 chat prompts x 128 tokens, same
# machine, tools/reports/bench_budgets_int8_smollm2.json): dart 1.08 / 1.13 / 1.07 / 1.07 /
# 0.97x over AR at 1 / 2 / 3 / 4 / 6 nodes (tau 1.54 / 1.79 / 1.95 / 2.10 / 2.29), outputs
# identical.
CPU_BLOCKS_MAX_NODES = 2
# Default node budget on CUDA (root excluded): the paper's theta = 59. On a GPU a forward of
# 60 rows costs about what one row costs (launch- and memory-bound), so the budget buys tau
# nearly for free; tools/device_check.sh measures the verify-cost curve and tau per budget
# on an H200 (see README, "On a GPU").
GPU_MAX_NODES = 59
# A suffix-match chain, sized by its evidence as suffix decoding sizes its drafts: a match of m
# tokens (the context's end found m tokens deep in the conversation or in what the server has
# produced) may take SUFFIX_SPEC_FACTOR x m nodes, beyond the round's node budget, up to
# SUFFIX_MAX_NODES -- on the CPU a 16-row verify is one pass of the native layers (their row
# block, dart_linear::MAX_ROWS) and every row after the first costs ~0.3 ms of a ~3 ms int8 step.
# A match of at least SUFFIX_TRUST tokens is a repeat: the live builders then verify the chain
# alone and skip the drafter's forward (see LiveBuilder.plan).
SUFFIX_MAX_NODES = 15
SUFFIX_SPEC_FACTOR = 1.0
SUFFIX_TRUST = 8
# A drafted tree's chain from a match shorter than this takes at most half the node budget
# (see LiveBuilder.__call__).
SUFFIX_SHORT = 4


@dataclass
class TreeInputs:
    """Everything a builder may read for one round."""

    context: np.ndarray  # int64: committed tokens (prompt + output); the LAST one is the root
    logits: Any = None  # torch [d, V_draft] drafter logits (None if no drafter ran)
    hidden: Any = None  # torch [d, H] drafter final hidden states (needs_hidden only)
    drafter: Any = None  # the DartDrafter (for .to_target_ids), or None
    index: Any = None  # NgramIndex or None
    max_depth: int = 1 << 30  # deepest node the decoder can still use this round
    max_nodes: int | None = None  # the round's node budget, root excluded (see node_budget)
    eos_token_ids: tuple[int, ...] = ()
    live: Any = None  # dartcore.live.LiveLayer the decoder learns into, or None
    # the most nodes one chain may take this round (a suffix match's evidence may size it
    # beyond max_nodes: suffix_nodes); None: max_nodes
    max_chain: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def budget(self) -> int:
        """The round's node budget; the caller decides it (:func:`node_budget`)."""
        if self.max_nodes is None:
            raise TreeError(
                "TreeInputs.max_nodes is not set: the caller decides the round's node budget "
                "(dartcore.trees.node_budget(builder, ...))"
            )
        return int(self.max_nodes)


# The tree a decoder builds where its user names none (default_tree). On CUDA the paper's:
# rows are nearly free, and the drafter's tree is what the budget is for.
GPU_TREE = "dart"
# On the CPU every verify row and every drafter forward costs (a drafter forward about a
# fifth of a step on the int8 path), and whether drafting pays depends on the text: so the
# tree whose judge measures, per match length, whether the drafted tree or the context's
# suffix-match chain alone commits more tokens per second (ChainJudge), drafting where it
# pays. SmolLM2, 2-vCPU Xeon, held-out general / built-in prompts, dart-bench: on the int8
# numerics `dart` 0.92 / 1.01x plain steps, this tree 1.10 / 1.03x
# (tools/reports/dart_bench_quantized_smollm2_xeon.json); on the float32 conversion, where
# drafting pays, `dart` 1.34 / 1.62x, this tree 1.67 / 1.74x with its chains
# (tools/reports/dart_bench_fp32_tree_smollm2_xeon.json).
CPU_TREE = "dart+live"


def default_tree(device: str) -> str:
    """The tree builder a decoder on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``...)
    builds when none is named: :data:`GPU_TREE` on CUDA, else :data:`CPU_TREE`."""
    return GPU_TREE if str(device).startswith("cuda") else CPU_TREE


def node_budget(builder, *, drafter=None, device: str = "cpu", blocks: bool = False) -> int:
    """The node budget (root excluded) a decoder gives ``builder``, decided once: the
    builder's ``max_nodes`` where its user set one; for a chain (``chain = True``) one node
    per drafter row; else :data:`CPU_MAX_NODES` on CPU (:data:`CPU_BLOCKS_MAX_NODES` for a
    target of GGML block weights, ``blocks``) and :data:`GPU_MAX_NODES` on CUDA."""
    asked = getattr(builder, "max_nodes", None)
    if asked is not None:
        return int(asked)
    if getattr(builder, "chain", False):
        return int(getattr(drafter, "d", 8))
    if str(device).startswith("cuda"):
        return GPU_MAX_NODES
    return CPU_BLOCKS_MAX_NODES if blocks else CPU_MAX_NODES


class TreeBuilder(Protocol):
    max_nodes: int | None  # the user's budget, or None (see node_budget)
    needs_drafter: bool
    needs_hidden: bool
    needs_index: bool

    def __call__(self, inputs: TreeInputs): ...


_REGISTRY: dict[str, Callable[..., TreeBuilder]] = {}


def register_tree_builder(
    name: str, factory: Callable[..., TreeBuilder], *, replace: bool = False
) -> None:
    """Register ``factory(**params) -> builder`` under ``name``."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"tree builder name must be a non-empty string, got {name!r}")
    if not replace and name in _REGISTRY:
        raise ValueError(f"tree builder {name!r} is already registered (pass replace=True)")
    _REGISTRY[name] = factory


# Modules that register more builders (their ``register()``), loaded on first use so
# that importing dartcore.trees stays light and import cycles cannot form.
_PLUGINS = ("dartcore.dartree.builders",)
_plugins_loaded = False


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    import importlib

    for name in _PLUGINS:
        try:
            module = importlib.import_module(name)
        except ImportError:  # an optional component that is not installed
            continue
        register = getattr(module, "register", None)
        if callable(register):
            register()


def tree_builders() -> list[str]:
    _load_plugins()
    return sorted(_REGISTRY)


def make_tree_builder(name: str, **params) -> TreeBuilder:
    if name not in _REGISTRY:
        _load_plugins()
    factory = _REGISTRY.get(name) if isinstance(name, str) else None
    if factory is None:
        import difflib

        close = difflib.get_close_matches(str(name), tree_builders(), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TreeError(
            f"unknown tree builder {name!r} (the tree= argument){hint} Registered: {tree_builders()}"
        )
    return factory(**params)


def root_only(token: int) -> Tree:
    """The one-node tree."""
    return Tree(tokens=[int(token)], parents=[-1], depths=[0])


def target_topk(inputs: TreeInputs, k: int):
    """Top-k rows of the drafter logits (fp32 log-probs inside the top-k),
    with token ids mapped into the target's vocabulary."""
    from dartcore.tree import topk_logprobs

    if inputs.logits is None:
        raise TreeError("this tree builder needs drafter logits (DartDecoder(..., drafter=...))")
    id_map = getattr(inputs.drafter, "draft_to_target", None)
    # a DartDrafter's reduced vocabulary, mapped in the same pass
    if isinstance(id_map, torch.Tensor):
        return topk_logprobs(inputs.logits, k, id_map=id_map)
    tokens, logprobs = topk_logprobs(inputs.logits, k)
    if inputs.drafter is not None and hasattr(inputs.drafter, "to_target_ids"):
        tokens = (
            inputs.drafter.to_target_ids(torch.as_tensor(tokens)).cpu().numpy().astype(np.int64)
        )
    return tokens, logprobs


def _positive(name: str, value, *, optional: bool = False) -> int | None:
    from dartcore.tree import MAX_NODES, int_arg

    if value is None and optional:
        return None
    return int_arg(name, value, 1, MAX_NODES)


@dataclass
class ArBuilder:
    """No draft: the tree is the root alone, so every round is one plain
    autoregressive step through the same verify/accept code."""

    max_nodes: int | None = None
    needs_drafter: bool = False
    needs_hidden: bool = False
    needs_index: bool = False

    def __call__(self, inputs: TreeInputs) -> Tree:
        return root_only(int(inputs.context[-1]))


@dataclass
class BeamBuilder:
    """Eq. (10) beam search over the drafter's top-k rows (and the index when
    ``search.ngram_weight > 0``). ``chain``: one node per drafter row (``dart-chain``)."""

    search: SearchParams = field(default_factory=SearchParams)
    k: int = TOP_K
    max_nodes: int | None = None
    chain: bool = False
    live_weight: float | None = None  # mix the round's live layer into g (dartcore.live)
    needs_drafter: bool = True
    needs_hidden: bool = False
    needs_index: bool = True

    def __post_init__(self):
        from dartcore.tree import int_arg

        self.k = int_arg("k", self.k, 1, 2**31 - 1)
        self.max_nodes = _positive("max_nodes", self.max_nodes, optional=True)
        self.needs_index = self.search.ngram_weight > 0

    def __call__(self, inputs: TreeInputs) -> Tree:
        from dartcore.tree import beam_search

        budget = inputs.budget()
        tokens, logprobs = target_topk(inputs, self.k)
        depth = min(tokens.shape[0], inputs.max_depth)
        if depth <= 0:
            return root_only(int(inputs.context[-1]))
        index = inputs.index if self.needs_index else None
        if self.needs_index and index is None:
            raise TreeError(
                "the 'dart' tree builder needs an n-gram index: pass index= to DartDecoder "
                "(--index for dart-generate), or use tree='dart-no-ngram'"
            )
        live = inputs.live if self.live_weight is not None else None
        return beam_search(
            index,
            inputs.context,
            tokens[:depth],
            logprobs[:depth],
            self.search,
            live=live,
            live_weight=self.live_weight if live is not None else 0.0,
            max_nodes=budget,
            eos_token_ids=tuple(inputs.eos_token_ids),
        )


@dataclass
class NgramBuilder:
    """A tree from the trigram index alone (no drafter)."""

    depth: int = NGRAM_DEPTH
    k: int = TOP_K
    max_nodes: int | None = None
    search: SearchParams = field(default_factory=SearchParams)
    needs_drafter: bool = False
    needs_hidden: bool = False
    needs_index: bool = True

    def __post_init__(self):
        self.max_nodes = _positive("max_nodes", self.max_nodes, optional=True)

    def __call__(self, inputs: TreeInputs) -> Tree:
        from dartcore.tree import ngram_tree

        if inputs.index is None:
            raise TreeError(
                "the 'ngram-only' tree builder needs an n-gram index: pass index= to DartDecoder "
                "(--index for dart-generate)"
            )
        budget = inputs.budget()
        depth = min(self.depth, inputs.max_depth)
        if depth <= 0:
            return root_only(int(inputs.context[-1]))
        return ngram_tree(
            inputs.index, inputs.context, depth, self.k, self.search, max_nodes=budget
        )


def merge_trees(first, second, max_nodes: int) -> Tree:
    """Union of two trees with the same root: every node of ``first``, then the
    nodes of ``second`` (in its order, so a node comes after its parent) whose
    path is new, until ``max_nodes`` nodes besides the root. Returned in depth
    order."""
    from dartcore.acceptance import flatten

    a, b = flatten(first), flatten(second)
    if int(a.tokens[0]) != int(b.tokens[0]):
        raise TreeError(f"merge_trees: roots differ ({int(a.tokens[0])} vs {int(b.tokens[0])})")
    tokens, parents, depths = (
        [int(t) for t in a.tokens],
        [int(p) for p in a.parents],
        [int(d) for d in a.depths],
    )
    child = {(parents[i], tokens[i]): i for i in range(1, len(tokens))}
    where = [0] * len(b)  # node of b -> merged node
    for j in range(1, len(b)):
        parent = where[int(b.parents[j])]
        if parent < 0:  # its parent did not fit
            where[j] = -1
            continue
        key = (parent, int(b.tokens[j]))
        if key in child:
            where[j] = child[key]
        elif len(tokens) - 1 < max_nodes:
            where[j] = child[key] = len(tokens)
            tokens.append(key[1])
            parents.append(parent)
            depths.append(depths[parent] + 1)
        else:
            where[j] = -1
    order = sorted(range(len(tokens)), key=lambda i: (depths[i], i))  # stable: parents stay first
    remap = {old: new for new, old in enumerate(order)}
    return Tree(
        tokens=[tokens[i] for i in order],
        parents=[remap[parents[i]] if parents[i] >= 0 else -1 for i in order],
        depths=[depths[i] for i in order],
    )


@dataclass
class UnionBuilder:
    """DART's Eq. (10) tree with ``budget - ngram_nodes`` nodes (at least one), completed up
    to the budget by the n-gram-only tree's best new paths. ``ngram_nodes`` default: a third
    of the budget (at least one). Eq. (10) only re-weights the drafter's top-k tokens, so a
    continuation the index is sure of but the drafter ranks below k never enters a DART tree;
    with a domain-matched index the n-gram-only tree alone matches DART's tau on this CPU
    (see README)."""

    dart: BeamBuilder
    ngram: NgramBuilder
    ngram_nodes: int | None = None
    max_nodes: int | None = None
    needs_drafter: bool = True
    needs_hidden: bool = False
    needs_index: bool = True

    def __call__(self, inputs: TreeInputs) -> Tree:
        budget = inputs.budget()
        ngram_nodes = self.ngram_nodes if self.ngram_nodes is not None else max(1, budget // 3)
        first = self.dart(replace(inputs, max_nodes=max(1, budget - ngram_nodes)))
        second = self.ngram(inputs)
        return merge_trees(first, second, budget)


def context_continuation(
    context: np.ndarray, *, max_len: int, min_match: int = 2, max_match: int = 4
) -> np.ndarray:
    """Prompt-lookup draft: the tokens that followed the latest earlier occurrence of the
    context's longest suffix (``max_match`` down to ``min_match`` tokens) inside the context
    itself, at most ``max_len`` of them; empty when no suffix recurs."""
    return context_match(context, max_len=max_len, min_match=min_match, max_match=max_match)[1]


def context_match(
    context: np.ndarray,
    *,
    max_len: int,
    min_match: int = 2,
    max_match: int = 4,
    measure: int = 2 * SUFFIX_MAX_NODES,
) -> tuple[int, np.ndarray]:
    """:func:`context_continuation` and how deep the occurrence it continues matches the
    context's end (counted up to ``measure`` tokens; 0 when nothing recurs). Native
    (``dart_live::context_match``): ~1 µs where numpy's scan took ~12."""
    ctx = np.ascontiguousarray(context, dtype=np.int64)
    m, chain = _native.context_match(ctx, max_len, min_match, max_match, measure)
    return int(m), chain


@dataclass
class ContextUnionBuilder:
    """DART's Eq. (10) tree completed with a prompt-lookup chain: the continuation of the
    latest earlier occurrence of the context's last 2-4 tokens in the prompt + output so far
    (:func:`context_continuation`). The index knows the corpus, not this conversation; code
    and arithmetic answers repeat names and numbers of their prompt. The chain takes up to
    ``context_nodes`` of the budget (default: all of it) and the DART tree the rest (at
    least one node); where they share a prefix the merged tree is smaller. With no recurring
    suffix the DART tree gets the whole budget."""

    dart: BeamBuilder
    context_nodes: int | None = None
    max_nodes: int | None = None
    depth: int = NGRAM_DEPTH
    min_match: int = 2
    max_match: int = 4
    needs_drafter: bool = True
    needs_hidden: bool = False
    needs_index: bool = True

    def __call__(self, inputs: TreeInputs) -> Tree:
        budget = inputs.budget()
        chain_nodes = budget if self.context_nodes is None else self.context_nodes
        chain = context_continuation(
            inputs.context,
            max_len=min(self.depth, inputs.max_depth, budget, chain_nodes),
            min_match=self.min_match,
            max_match=self.max_match,
        )
        n = len(chain)
        if n == 0:
            return self.dart(inputs)
        chain_tree = Tree(
            tokens=np.concatenate(([int(inputs.context[-1])], chain)),
            parents=np.arange(-1, n, dtype=np.int64),
            depths=np.arange(n + 1, dtype=np.int64),
        )
        first = self.dart(replace(inputs, max_nodes=max(1, budget - n)))
        return merge_trees(first, chain_tree, budget)


def suffix_lookup(
    inputs: TreeInputs, max_len: int, *, min_match: int = 2, max_match: int = 16
) -> tuple[int, np.ndarray]:
    """The suffix-match draft of a round and the length of the match it continues (0: none):
    the continuation (at most ``max_len`` tokens) of the context's end found in the context
    itself (:func:`context_match`: the latest occurrence of its last 2-4 tokens) or in the
    round's live layer (the longest earlier match of ``min_match``..``max_match`` tokens in
    what the decoder has served), whichever repeats more of the context's end (the
    conversation, the most specific evidence, on ties). Empty when neither matches."""
    if max_len <= 0:
        return 0, np.zeros(0, dtype=np.int64)
    m, own = context_match(
        inputs.context, max_len=max_len, min_match=min_match, max_match=min(4, max_match)
    )
    if inputs.live is None:
        return m, own
    m_live, served = inputs.live.suffix_lookup(inputs.context, max_len, min_match, max_match)
    return (m_live, served) if m_live > m else (m, own)


def chain_room(inputs: TreeInputs, cap: int) -> int:
    """The most nodes a suffix-match chain may take this round: ``cap``, the round's
    ``max_chain`` (at least its budget) and its deepest usable node."""
    budget = inputs.budget()
    room = budget if inputs.max_chain is None else max(budget, int(inputs.max_chain))
    return max(0, min(cap, room, inputs.max_depth))


def suffix_nodes(inputs: TreeInputs, match: int, factor: float, cap: int) -> int:
    """The nodes a suffix-match chain continuing a ``match``-token match may take: ``factor``
    x ``match``, at least the round's budget, within :func:`chain_room`."""
    return min(max(inputs.budget(), int(factor * match)), chain_room(inputs, cap))


def chain_tree(root: int, chain: np.ndarray) -> Tree:
    n = len(chain)
    return Tree(
        tokens=np.concatenate(([int(root)], np.asarray(chain, dtype=np.int64))),
        parents=np.arange(-1, n, dtype=np.int64),
        depths=np.arange(n + 1, dtype=np.int64),
    )


@dataclass
class SuffixBuilder:
    """``suffix``: the suffix-match chain alone (:func:`suffix_lookup`), no drafter, no
    index -- the baseline a suffix-decoding peer runs, its length sized by the match as
    suffix decoding sizes it (:func:`suffix_nodes`: ``spec_factor`` x the match, at least the
    budget, at most ``depth``). The root alone when nothing matches."""

    max_nodes: int | None = None
    depth: int = SUFFIX_MAX_NODES
    min_match: int = 2
    max_match: int = 16
    spec_factor: float = SUFFIX_SPEC_FACTOR
    needs_drafter: bool = False
    needs_hidden: bool = False
    needs_index: bool = False

    def __call__(self, inputs: TreeInputs) -> Tree:
        return sized_chain(inputs, self.depth, self.spec_factor, self.min_match, self.max_match)[1]


def sized_chain(
    inputs: TreeInputs,
    cap: int,
    factor: float,
    min_match: int,
    max_match: int,
    found: tuple[int, np.ndarray] | None = None,
) -> tuple[int, Tree]:
    """The length of the round's suffix match (:func:`suffix_lookup` within
    :func:`chain_room`, or ``found``; 0: none) and its chain cut to :func:`suffix_nodes`
    (the root alone when nothing matches)."""
    if found is None:
        found = suffix_lookup(
            inputs, chain_room(inputs, cap), min_match=min_match, max_match=max_match
        )
    m, chain = found
    return m, chain_tree(int(inputs.context[-1]), chain[: suffix_nodes(inputs, m, factor, cap)])


# Match lengths the ChainJudge tells apart: none, 1-2, 3, 4-5, 6-7, 8-11, 12-15, 16 or more.
JUDGE_EDGES = (0, 1, 3, 4, 6, 8, 12, 16)


@dataclass
class ChainJudge:
    """Learns, per length of the round's suffix match (:data:`JUDGE_EDGES`) shorter than
    ``trust`` (a longer one is a repeat: its chain is verified alone, unjudged), which round
    commits more tokens per second: the suffix-match chain verified alone, without the
    drafter's forward (the root alone -- a plain step -- when nothing matches), or the
    drafted tree. Rates are sums of the tokens rounds committed and of their wall time from
    plan to accept (a draft that caught up on skipped positions charged a steady draft's
    time: :meth:`observe`), aged by ``decay`` with every round of that length, so that both
    rates speak of the same stretch of text (a round's time grows with its context).

    A drafted round also tells what the chain alone would have committed: the drafted tree
    holds the chain, so its verify checks the chain's nodes, and the chain alone commits its
    prefix that the committed tokens repeat plus the target's next token
    (:meth:`observe_chain`; exact under greedy decoding, one coupling of the draws under
    sampling). So the chain alone's tokens per round are measured in every round; its own
    rounds are needed only for their time.

    A kind is measured once its own rounds' aged weight reaches ``measured`` (the chain's
    tokens too), and stays so until the weight falls below ``stale`` (about 45 rounds of that
    length without one of its rounds; a fifth of it, about 100 rounds, where one kind was
    more than 15% ahead). While both are measured the round is of the kind with the better
    rate, kept until the other is ``margin`` ahead; while one is not, every other round is
    of that kind until it is. So the kind not chosen is measured again, a few rounds in every
    45-100, which keeps the comparison current. A measurement is not free: a draft after
    rounds without one first catches up on their positions (on the int8 CPU path about a
    round's time), so each measurement again that leaves the choice as it was halves
    ``stale`` for that length, down to ``stale / 2 ** patience`` (about 140 rounds between
    measurements, 190 where one kind is far ahead), and one that changes it starts over.
    The drafter's yield also depends on the request (a translation, a revision of code):
    the rates are the judge's across requests, so a request keeps, in its own notes
    (``request``, :meth:`choose`), what its drafted rounds committed beyond the chain alone
    against what the judge expected of them at their lengths. A drafted round's tokens are
    then reckoned as the chain alone's plus the drafter's extra scaled by that ratio, drawn
    towards 1 by ``shrink`` expected tokens, so a request whose drafts commit little more
    than its chains turns to the chain alone within a few drafted rounds.
    Speed only: every tree is verified, so outputs never depend on it."""

    trust: int = SUFFIX_TRUST
    decay: float = 0.97
    shrink: float = 3.0
    measured: float = 2.0
    stale: float = 0.5
    margin: float = 0.05
    patience: int = 4
    # per length: the drafted rounds' tokens; per kind (0: drafted, 1: the chain alone) and
    # length: the rounds' seconds and count; all aged
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(len(JUDGE_EDGES)))
    seconds: np.ndarray = field(default_factory=lambda: np.zeros((2, len(JUDGE_EDGES))))
    weight: np.ndarray = field(default_factory=lambda: np.zeros((2, len(JUDGE_EDGES))))
    # what the chain alone committed or, in the drafted rounds, would have (aged, per length)
    chain_tokens: np.ndarray = field(default_factory=lambda: np.zeros(len(JUDGE_EDGES)))
    chain_weight: np.ndarray = field(default_factory=lambda: np.zeros(len(JUDGE_EDGES)))
    fresh: np.ndarray = field(default_factory=lambda: np.zeros((2, len(JUDGE_EDGES)), dtype=bool))
    far: np.ndarray = field(default_factory=lambda: np.zeros(len(JUDGE_EDGES), dtype=bool))
    seen: np.ndarray = field(default_factory=lambda: np.zeros(len(JUDGE_EDGES), dtype=np.int64))
    alone: np.ndarray = field(default_factory=lambda: np.zeros(len(JUDGE_EDGES), dtype=bool))
    steady_s: float | None = None  # a steady draft's seconds (decayed mean)
    # per length: measurements again that left the choice as it was (each halves `stale`),
    # and the choice a kind gone stale is being measured again against (-1: none)
    calm: np.ndarray = field(default_factory=lambda: np.zeros(len(JUDGE_EDGES), dtype=np.int64))
    before: np.ndarray = field(default_factory=lambda: np.full(len(JUDGE_EDGES), -1))

    def __post_init__(self):
        _count("patience", self.patience, "measured again at the same pace")

    @staticmethod
    def bucket(match: int) -> int:
        return int(np.searchsorted(JUDGE_EDGES, match, side="right")) - 1

    def rate(self, alone: bool, b: int, request: dict | None = None) -> float | None:
        """Tokens per second of the rounds of kind ``alone`` at bucket ``b``; None while not
        measured. The chain alone: its tokens per round (its own rounds and what the drafted
        rounds showed it would have committed) over its own rounds' seconds per round. A
        drafted round in a request with notes (:meth:`choose`): the chain's tokens plus the
        drafter's extra (:meth:`extra`) scaled by the request's :meth:`yield_ratio`."""
        k = int(alone)
        if not self.fresh[k, b] or self.seconds[k, b] <= 0.0:
            return None
        per_round = self._per_round(alone, b)
        extra = None if alone or not request else self.extra(b)
        if extra is not None:
            per_round += (self.yield_ratio(request) - 1.0) * extra
        return float(per_round * self.weight[k, b] / self.seconds[k, b])

    def _per_round(self, alone: bool, b: int) -> float | None:
        """Tokens a round of kind ``alone`` at bucket ``b`` commits (the chain alone: its own
        rounds and what the drafted rounds showed); None before any."""
        tokens, w = (
            (self.chain_tokens[b], self.chain_weight[b])
            if alone
            else (self.tokens[b], self.weight[0, b])
        )
        return float(tokens / w) if w > 0.0 else None

    def extra(self, b: int) -> float | None:
        """What a drafted round at bucket ``b`` commits beyond the chain alone (tokens per
        round, at least 0); None while either is unknown."""
        drafted, chain = self._per_round(False, b), self._per_round(True, b)
        return None if drafted is None or chain is None else max(drafted - chain, 0.0)

    def yield_ratio(self, request: dict) -> float:
        """How this request's drafted rounds fared: the tokens they committed beyond the
        chain alone over what :meth:`extra` expected of them, each side plus ``shrink``
        (1 before its first draft)."""
        got, expected = request.get("extra", 0.0), request.get("expected", 0.0)
        return (got + self.shrink) / (expected + self.shrink)

    def observe_request(self, request: dict, b: int, extra: int) -> None:
        """A drafted round of the request with notes ``request`` at bucket ``b`` committed
        ``extra`` tokens beyond its chain alone (called before the round updates the rates,
        whose expectation it is measured against)."""
        # against a measured expectation only: a cold length's guesses would steer a request
        expected = self.extra(b) if self.fresh[:, b].all() else None
        if expected is not None:
            request["extra"] = request.get("extra", 0.0) + extra
            request["expected"] = request.get("expected", 0.0) + expected

    def choose(self, match: int, request: dict | None = None) -> tuple[bool, int]:
        """(verify the chain alone?, the bucket to report the round under); ``request``: the
        notes of the request the round is of (kept from round to round by the caller, filled
        by :meth:`observe_request`)."""
        b = self.bucket(match)
        if match >= self.trust:  # a repeat: the chain alone, as without a judge
            return True, b
        self.seen[b] += 1
        self.seconds[:, b] *= self.decay
        self.weight[:, b] *= self.decay
        for arr in (self.tokens, self.chain_tokens, self.chain_weight):
            arr[b] *= self.decay
        # a kind far behind the other is measured again about half as often, and a length
        # whose measurements kept confirming its choice less often still
        stale = (self.stale / 5.0 if self.far[b] else self.stale) / 2.0 ** self.calm[b]
        for k in (0, 1):
            w = self.weight[k, b] if k == 0 else min(self.weight[1, b], self.chain_weight[b])
            if w >= self.measured:
                self.fresh[k, b] = True
            elif w < stale and self.fresh[k, b]:
                self.fresh[k, b] = False
                if self.fresh[1 - k, b]:  # a choice stands: this kind is measured against it
                    self.before[b] = int(self.alone[b])
        chain, draft = self.rate(True, b), self.rate(False, b, request)
        if chain is not None and draft is not None:
            alone = bool(self.alone[b])
            # the other side must be ahead by `margin` to take over: timing noise alone
            # should not flip a length back and forth
            if chain > draft * (1.0 + self.margin) or draft > chain * (1.0 + self.margin):
                alone = chain > draft
            if alone != bool(self.alone[b]):  # a new choice: measured again soon
                self.calm[b] = 0
            elif self.before[b] >= 0:  # a measurement again that confirmed the choice
                self.calm[b] = min(self.calm[b] + 1, self.patience)
            self.before[b] = -1
            self.alone[b] = alone
            self.far[b] = max(chain, draft) > 1.15 * min(chain, draft)
            return alone, b
        # a kind to measure: every other round of it (a draft first where neither is)
        turn = bool(self.seen[b] % 2 == 0)
        return (turn if chain is None else not turn), b

    def observe(self, alone: bool, b: int, tokens: int, seconds: float, drafted=None) -> None:
        """A round at bucket ``b`` committed ``tokens`` in ``seconds``; ``drafted``: its
        draft's ``(seconds, steady)`` (:func:`dartcore.rounds.draft`). A draft that caught up
        on the positions of rounds without one (or on the prompt) is charged a steady
        draft's time: that reading is work the skipped rounds' drafts would have done, and
        charging it to the draft would make every stretch without one longer."""
        if drafted is not None:
            draft_s, steady = drafted
            if steady:
                self.steady_s = (
                    draft_s if self.steady_s is None else 0.9 * self.steady_s + 0.1 * draft_s
                )
            elif self.steady_s is not None:
                seconds += min(self.steady_s - draft_s, 0.0)
        k = int(alone)
        self.seconds[k, b] += seconds
        self.weight[k, b] += 1.0
        if alone:
            self.observe_chain(b, tokens)
        else:
            self.tokens[b] += tokens

    def observe_chain(self, b: int, tokens: int) -> None:
        """The chain alone at bucket ``b`` committed ``tokens`` in a round of its own, or a
        drafted round showed that it would have."""
        self.chain_tokens[b] += tokens
        self.chain_weight[b] += 1.0


def chain_commits(chain: np.ndarray, new: list[int]) -> int:
    """The tokens a chain verified alone commits, given ``new``, the tokens a tree holding
    it committed: the chain's prefix that ``new`` repeats, then the target's next token
    (a lower bound where ``new`` ends inside the chain)."""
    n = min(len(chain), len(new))
    same = np.asarray(chain[:n], dtype=np.int64) == np.asarray(new[:n], dtype=np.int64)
    k = n if bool(same.all()) else int(np.argmin(same))
    return k + 1 if k < len(new) else k


@dataclass
class LiveBuilder:
    """``dart+live``: Eq. (10) with the live layer mixed into g (``dart.live_weight``),
    completed by the suffix-match chain (:func:`suffix_lookup`) as ``dart+ctx`` completes it
    with the context's own chain; ``dart+mix`` (``suffix=False``): the mix alone. Without a
    live layer (a decoder that does not learn) g is the index's alone and the chain the
    context's own: ``dart+mix`` is ``dart``, and ``dart+live`` completes it as ``dart+ctx``
    does while its judge still plans the rounds it measured faster without a draft (the CPU's
    default tree, :func:`default_tree`).
    (``suffix``, not ``chain``: a builder's ``chain`` means one node per drafter row to
    :func:`node_budget`.)

    Before any draft, :meth:`plan` may give the round's tree as the suffix-match chain alone,
    sized by the match as ``suffix`` sizes it (the root alone when nothing matches): that
    round's drafter forward is skipped. Which rounds: every match of ``trust`` tokens or more
    (a repeat is better evidence than the drafter's guess, and on a CPU the drafter costs a
    fifth of a step); with ``adapt`` (the default), for a sequence verified alone, also the
    shorter matches (or none) where its :class:`ChainJudge` has measured the chain alone to
    commit more tokens per second than a draft. ``trust`` 0: always draft. A sequence the
    engine's controller has stopped drafting (budget 0) gets the chain of a ``trust``-token
    match."""

    dart: BeamBuilder
    suffix: bool = True
    max_nodes: int | None = None
    depth: int = NGRAM_DEPTH
    min_match: int = 2
    max_match: int = 16
    trust: int = SUFFIX_TRUST
    max_spec: int = SUFFIX_MAX_NODES
    spec_factor: float = SUFFIX_SPEC_FACTOR
    short: int = SUFFIX_SHORT
    adapt: bool = True
    judge: ChainJudge | None = None
    needs_drafter: bool = True
    needs_hidden: bool = False
    needs_index: bool = True
    sizes_chains: bool = True  # its trees may fill the round's chain room (rounds.search)

    def __post_init__(self):
        if self.adapt and self.judge is None:
            self.judge = ChainJudge(trust=self.trust)

    def plan(self, inputs: TreeInputs) -> Tree | None:
        """The round's tree when it needs no draft, else None (the round drafts and calls the
        builder)."""
        return self.decide(inputs)[0]

    def decide(
        self, inputs: TreeInputs, *, judged: bool = True
    ) -> tuple[Tree | None, tuple | None]:
        """:meth:`plan` and what the judge is to be told of the round (``(alone, bucket,
        chain, request)`` for :meth:`observe`: the chain of a drafted round, the request's
        notes from ``inputs.extra``; None where it did not choose). ``judged=False``: the
        fixed rule (a sequence verified with others, whose round takes the whole step's
        time: there the engine's controller decides who drafts)."""
        if not self.suffix or self.trust <= 0:
            return None, None
        found = self._lookup(inputs)
        m, tree = sized_chain(
            inputs, self.max_spec, self.spec_factor, self.min_match, self.max_match, found
        )
        if self.judge is None or not judged or inputs.budget() == 0:
            return (tree if m >= self.trust else None), None
        request = inputs.extra.get("request")
        alone, b = self.judge.choose(m, request)
        # a drafted round carries the chain it passed over, to tell the judge what the chain
        # alone would have committed (ChainJudge.observe_chain), and the request's notes
        return (tree if alone else None), (alone, b, None if alone else tree.tokens[1:], request)

    def _lookup(self, inputs: TreeInputs) -> tuple[int, np.ndarray]:
        """The round's suffix lookup within its chain room, once a round: :meth:`decide` and
        the drafted tree read the same one (kept in ``inputs.extra``, which the round's
        search gets from its plan)."""
        found = inputs.extra.get("suffix_lookup")
        if found is None:
            found = inputs.extra["suffix_lookup"] = suffix_lookup(
                inputs,
                chain_room(inputs, self.max_spec),
                min_match=self.min_match,
                max_match=self.max_match,
            )
        return found

    def observe(self, note: tuple, new: list[int], seconds: float, drafted=None) -> None:
        """A round :meth:`decide` noted committed the tokens ``new`` in ``seconds``
        (``drafted``: see :meth:`ChainJudge.observe`)."""
        if self.judge is None:
            return
        alone, b, chain, request = note
        if chain is not None:
            would = chain_commits(chain, new)
            if request is not None:
                self.judge.observe_request(request, b, len(new) - would)
        self.judge.observe(alone, b, len(new), seconds, drafted)
        if chain is not None:
            self.judge.observe_chain(b, would)

    def __call__(self, inputs: TreeInputs) -> Tree:
        budget = inputs.budget()
        if not self.suffix:
            return self.dart(inputs)
        m, chain = self._lookup(inputs)
        # the tree takes the chain's size (its match's, at most depth, beyond the budget where
        # the round has room; a short match: the budget): the drafter's tree the nodes the
        # chain leaves, at least one, and the chain the rest. A match shorter than `short` is
        # weak evidence (a few common tokens recur anywhere): its chain at most half the budget
        n = min(len(chain), suffix_nodes(inputs, m, self.spec_factor, self.depth))
        if m < self.short:
            n = min(n, max(1, budget // 2))
        if n == 0:
            return self.dart(inputs)
        first = self.dart(replace(inputs, max_nodes=max(1, budget - n)))
        root = int(inputs.context[-1])
        return merge_trees(first, chain_tree(root, chain[:n]), max(budget, n))


def reads_live(builder) -> bool:
    """Whether a tree builder reads the round's live layer (``TreeInputs.live``): its suffix
    chain (``dart+live``, ``suffix``) or its mixed g (``dart+mix``)."""
    if isinstance(builder, (LiveBuilder, SuffixBuilder)):
        return True
    return getattr(builder, "live_weight", None) is not None


def _split(params: dict[str, Any], known: set[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    own = {k: v for k, v in params.items() if k in known}
    rest = {k: v for k, v in params.items() if k not in known}
    return own, rest


def _search(params: dict[str, Any]) -> SearchParams:
    """The builder's SearchParams from its remaining keyword arguments (a clear error for a
    misspelt one). ``max_nodes`` is the builder's, not the search's: it is decided per round."""
    unknown = sorted(set(params) - SearchParams.fields() - {"max_nodes", "eos_token_ids"})
    if unknown:
        raise TypeError(
            f"unknown tree parameter(s) {unknown}; the search takes {sorted(SearchParams.fields())}"
        )
    return SearchParams(**{k: v for k, v in params.items() if k != "max_nodes"})


def _dart(k: int = TOP_K, max_nodes: int | None = None, **params) -> BeamBuilder:
    # Every default (the candidate set included) is SearchParams' own, i.e. dart-tree's.
    return BeamBuilder(search=_search(params), k=k, max_nodes=max_nodes)


def _dart_official(k: int = TOP_K, max_nodes: int | None = None, **params) -> BeamBuilder:
    # The official searcher's tree, exactly: its 60 nodes unless max_nodes says otherwise;
    # other search parameters override the preset's.
    _search(params)  # a clear error for a misspelt parameter
    search = SearchParams.official(**params)
    return BeamBuilder(
        search=search, k=k, max_nodes=search.max_nodes if max_nodes is None else max_nodes
    )


def _dart_no_ngram(**params) -> BeamBuilder:
    params = {**params, "ngram_weight": 0.0}
    return _dart(**params)


def _dart_chain(d: int | None = None, **params) -> BeamBuilder:
    # max_nodes = d: default d = the drafter's number of rows (node_budget).
    builder = _dart(**{**params, "beam_width": 1, "max_nodes": d})
    builder.chain = True
    return builder


def _ngram_only(
    depth: int = NGRAM_DEPTH, k: int = TOP_K, max_nodes: int | None = None, **params
) -> NgramBuilder:
    return NgramBuilder(depth=depth, k=k, max_nodes=max_nodes, search=_search(params))


def _dart_union(
    max_nodes: int | None = None, ngram_nodes: int | None = None, depth: int = NGRAM_DEPTH, **params
) -> UnionBuilder:
    max_nodes = _positive("max_nodes", max_nodes, optional=True)
    if ngram_nodes is not None:
        ngram_nodes = _positive("ngram_nodes", ngram_nodes)
        if max_nodes is not None and not ngram_nodes < max_nodes:
            raise TreeError(
                f"ngram_nodes must be in [1, max_nodes), got {ngram_nodes} of {max_nodes}"
            )
    elif max_nodes is not None and max_nodes < 2:
        raise TreeError(
            f"tree='dart+ngram' needs max_nodes >= 2 (one DART node, one n-gram node), got {max_nodes}"
        )
    return UnionBuilder(
        dart=_dart(**params),
        ngram=NgramBuilder(depth=depth),
        ngram_nodes=ngram_nodes,
        max_nodes=max_nodes,
    )


def _dart_context(
    max_nodes: int | None = None,
    context_nodes: int | None = None,
    depth: int = NGRAM_DEPTH,
    min_match: int = 2,
    max_match: int = 4,
    **params,
) -> ContextUnionBuilder:
    # Suffix match of 2-4 tokens: 1-4, 3-4 and 2-8 gave the same tau within +-0.04 on 30 eval
    # prompts (dart-bench --n 10, T = 0: 2.19 / 2.12 / 2.10 for 2-4).
    # Default: the chain may take the whole budget (the DART tree keeps at least one node).
    # tau at 4 nodes (9 eval prompts x 64 tokens, GSM8K / HumanEval / CodeAlpaca): chain of
    # at most 2 nodes 2.03 / 1.95 / 1.89, 3 nodes 2.03 / 1.97 / 1.89, 4 nodes 2.03 / 2.03 / 1.89.
    max_nodes = _positive("max_nodes", max_nodes, optional=True)
    if context_nodes is not None:
        context_nodes = _positive("context_nodes", context_nodes)
        if max_nodes is not None and context_nodes > max_nodes:
            raise TreeError(
                f"context_nodes must be in [1, max_nodes], got {context_nodes} of {max_nodes}"
            )
    return ContextUnionBuilder(
        dart=_dart(**params),
        context_nodes=context_nodes,
        max_nodes=max_nodes,
        depth=depth,
        min_match=min_match,
        max_match=max_match,
    )


def _count(name: str, value, zero: str) -> int:
    """An int >= 0 (``zero``: what 0 means), else a TreeError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TreeError(f"{name} must be an int >= 0 (0: {zero}), got {value!r}")
    return value


def _live_weight(value) -> float:
    from dartcore.live import LIVE_WEIGHT

    w = LIVE_WEIGHT if value is None else value
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= float(w) <= 1.0:
        raise TreeError(f"live_weight must be a number in [0, 1], got {value!r}")
    return float(w)


def _matches(min_match, max_match) -> tuple[int, int]:
    lo = _positive("min_match", min_match)
    hi = _positive("max_match", max_match)
    if lo > hi:
        raise TreeError(f"min_match {lo} > max_match {hi}")
    return lo, hi


def _spec_factor(value) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0.0 < float(value) <= 64.0
    ):
        raise TreeError(f"spec_factor must be a number in (0, 64], got {value!r}")
    return float(value)


def _dart_live(
    max_nodes: int | None = None,
    live_weight: float | None = None,
    depth: int = NGRAM_DEPTH,
    min_match: int = 2,
    max_match: int = 16,
    *,
    suffix: bool = True,
    trust: int = SUFFIX_TRUST,
    max_spec: int = SUFFIX_MAX_NODES,
    spec_factor: float = SUFFIX_SPEC_FACTOR,
    short: int = SUFFIX_SHORT,
    adapt: bool = True,
    **params,
) -> LiveBuilder:
    dart = _dart(**params)
    dart.live_weight = _live_weight(live_weight)
    lo, hi = _matches(min_match, max_match)
    _count("trust", trust, "always draft")
    _count("short", short, "a chain's size never halved")
    if not isinstance(adapt, bool):
        raise TreeError(f"adapt must be True or False, got {adapt!r}")
    return LiveBuilder(
        dart=dart,
        suffix=suffix,
        max_nodes=_positive("max_nodes", max_nodes, optional=True),
        depth=_positive("depth", depth),
        min_match=lo,
        max_match=hi,
        trust=trust,
        max_spec=_positive("max_spec", max_spec),
        spec_factor=_spec_factor(spec_factor),
        short=short,
        adapt=adapt,
    )


def _dart_mix(max_nodes: int | None = None, live_weight: float | None = None, **params):
    return _dart_live(max_nodes=max_nodes, live_weight=live_weight, suffix=False, **params)


def _suffix(
    max_nodes: int | None = None,
    depth: int = SUFFIX_MAX_NODES,
    min_match: int = 2,
    max_match: int = 16,
    spec_factor: float = SUFFIX_SPEC_FACTOR,
) -> SuffixBuilder:
    lo, hi = _matches(min_match, max_match)
    return SuffixBuilder(
        max_nodes=_positive("max_nodes", max_nodes, optional=True),
        depth=_positive("depth", depth),
        min_match=lo,
        max_match=hi,
        spec_factor=_spec_factor(spec_factor),
    )


def _ar(**params) -> ArBuilder:
    if params:
        raise TypeError(f"the 'ar' tree builder takes no parameters, got {sorted(params)}")
    return ArBuilder()


register_tree_builder("dart", _dart)
register_tree_builder("dart-official", _dart_official)
register_tree_builder("dart-no-ngram", _dart_no_ngram)
register_tree_builder("dart-chain", _dart_chain)
register_tree_builder("ngram-only", _ngram_only)
register_tree_builder("dart+ngram", _dart_union)
register_tree_builder("dart+ctx", _dart_context)
register_tree_builder("dart+live", _dart_live)
register_tree_builder("dart+mix", _dart_mix)
register_tree_builder("suffix", _suffix)
register_tree_builder("ar", _ar)
