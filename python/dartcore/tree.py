"""Draft trees: DART's Eq. (10) beam search, the n-gram-only tree, DARTree's deferred
top-B, DDTree's best-first heap, and the tensors verification needs.

The searches run in Rust (crate ``dart-tree``, GIL released); trees come back as numpy
arrays, never lists of Python ints.

Where the softmax happens: :func:`topk_logprobs` takes each drafter row's top-k logits and
log-softmaxes over those k values in float32 (the distribution is renormalised inside the
top-k, as in DART). The Rust search then computes p = exp(logprob) and ln(p + ε) in float64.

    >>> tokens, logprobs = topk_logprobs(drafter_logits, k=25)      # [d, V] -> [d, 25] x2
    >>> tree = beam_search(index, context, tokens, logprobs)        # Eq. (10), 59 nodes + root
    >>> positions, mask = verification_inputs(tree, prefix_len=len(context))

A context shorter than two tokens is allowed: the level-0 candidates are then scored with
the bigram (then unigram) statistics of its one token. Only the last two context tokens
are ever read.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from dartcore import _native
from dartcore.errors import TreeError
from dartcore.live import LIVE_WEIGHT

__all__ = [
    "ancestor_mask",
    "is_chain",
    "Tree",
    "verification_inputs",
    "topk_logprobs",
    "SearchParams",
    "TOP_K",
    "NGRAM_DEPTH",
    "MAX_BEAM_WIDTH",
    "beam_search",
    "beam_search_batch",
    "ngram_tree",
    "top_b",
    "best_first",
    "chain",
]


@dataclass(eq=False)
class Tree:
    """A draft tree in depth order, the one tree type from the builders to verification:
    node 0 is the root (the last committed token, parent −1, depth 0, score 0); every other
    node comes after its parent (``parents[i] < i``), ``depths[i] = depths[parents[i]] + 1``
    and the depths never decrease. Within a depth, nodes are in the order the builder chose
    them (best first).

    ``tokens``, ``parents``, ``depths`` are int64[n]; ``scores`` float64[n] (the builder's
    cumulative path score; default 0). The constructor checks all of that
    (:class:`~dartcore.errors.TreeError`); the native searches' trees are valid by
    construction and skip the check."""

    tokens: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    scores: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.tokens = np.asarray(self.tokens, dtype=np.int64)
        self.parents = np.asarray(self.parents, dtype=np.int64)
        self.depths = np.asarray(self.depths, dtype=np.int64)
        n = self.tokens.shape[0] if self.tokens.ndim == 1 else -1
        self.scores = (
            np.zeros(max(n, 0), dtype=np.float64)
            if self.scores is None
            else np.asarray(self.scores, dtype=np.float64)
        )
        if n < 1 or any(a.shape != (n,) for a in (self.parents, self.depths, self.scores)):
            raise TreeError(
                f"tree arrays must be 1-D, non-empty and of one length, got tokens {self.tokens.shape}, parents "
                f"{self.parents.shape}, depths {self.depths.shape}, scores {self.scores.shape}"
            )
        if self.parents[0] != -1 or self.depths[0] != 0:
            raise TreeError("node 0 must be the root (parent -1, depth 0)")
        if n > 1:
            p = self.parents[1:]
            if np.any(p < 0) or np.any(p >= np.arange(1, n)):
                raise TreeError("every non-root node's parent must come before it")
            if np.any(self.depths[1:] != self.depths[p] + 1):
                raise TreeError("depth of a node must be its parent's depth + 1")
            if np.any(np.diff(self.depths) < 0):
                raise TreeError("nodes must be in depth order")

    @property
    def size(self) -> int:
        """Number of nodes, root included."""
        return int(self.tokens.shape[0])

    def __len__(self) -> int:
        return self.size

    def ancestor_bits(self) -> np.ndarray:
        """uint64[n, ceil(n/64)]: bit j (word j // 64, bit j % 64) of row i is set iff node j
        is an ancestor of node i or i itself."""
        return _native.ancestor_bits(np.ascontiguousarray(self.parents, dtype=np.int64))

    def ancestor_mask(self) -> np.ndarray:
        """bool[n, n]: ``mask[i, j]`` iff node j is an ancestor of node i or i itself (the
        tree part of the verification attention mask)."""
        return ancestor_mask(self.parents)

    def children(self) -> list[list[int]]:
        """Child node indices of every node, in node order."""
        out: list[list[int]] = [[] for _ in range(self.size)]
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                out[p].append(i)
        return out

    def path(self, node: int) -> np.ndarray:
        """Node indices from the root (inclusive) to ``node`` (inclusive)."""
        out = [int(node)]
        parents = self.parents
        while parents[out[-1]] >= 0:
            out.append(int(parents[out[-1]]))
        return np.asarray(out[::-1], dtype=np.int64)

    def paths(self) -> list[np.ndarray]:
        """Root-to-leaf paths (node indices, root first), one per leaf, in leaf order;
        ``tree.tokens[path]`` gives a path's tokens."""
        has_child = np.zeros(self.size, dtype=bool)
        has_child[self.parents[self.parents >= 0]] = True
        return [self.path(i) for i in np.flatnonzero(~has_child)]


def _built(arrays) -> Tree:
    """A Tree of arrays fresh from dartcore's native searches: depth order, parents before
    children by construction, so the constructor's check is skipped."""
    tree = object.__new__(Tree)
    tree.tokens, tree.parents, tree.depths, tree.scores = arrays
    return tree


def ancestor_mask(parents: Any) -> np.ndarray:
    """bool[n, n] from a depth-ordered parent array (root −1): ``mask[i, j]`` iff node j is an
    ancestor of node i or i itself. Unpacks the native ancestor bitmask words."""
    parents = np.ascontiguousarray(parents, dtype=np.int64)
    n = len(parents)
    bits = _native.ancestor_bits(parents).astype("<u8", copy=False)
    return np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :n].astype(bool)


def is_chain(tree: Tree) -> bool:
    """Whether every node of ``tree`` is its predecessor's child (a single path from the
    root; its ancestor mask is the causal one)."""
    n = len(tree.parents)
    return bool(np.array_equal(tree.parents, np.arange(-1, n - 1)))


def verification_inputs(tree: Tree, prefix_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions int64[n], mask bool[n, n]) for the target's tree forward: node i sits at
    position ``prefix_len + depth(i)`` (the root, the bonus token, at ``prefix_len``) and
    attends to the whole prefix (not in the mask) plus its ancestors and itself."""
    if prefix_len < 0:
        raise TreeError(f"prefix_len must be >= 0, got {prefix_len}")
    return tree.depths + int(prefix_len), tree.ancestor_mask()


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def topk_logprobs(logits: Any, k: int, id_map: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` tokens of every row of ``logits`` ([d, V] torch tensor or numpy array) and
    their log-probabilities renormalised inside the top-k: log-softmax over the k logits
    (in float64, rounded to float32 once). Returns (tokens int64[d, k], logprobs float32[d, k]),
    each row in descending order (equal logits: the lower id first). This is the one place
    where Eq. (10)'s p_l is formed. ``id_map`` (int64[V]) maps the ids, e.g. a drafter's
    reduced vocabulary to the target's. CPU inputs take one native pass per row (a few
    microseconds for 8,192 logits; the framework's top-k took ~100 µs for four such rows on
    one thread of the dev box); other devices use the framework's top-k. NaN or +inf logits
    raise :class:`~dartcore.errors.TreeError`."""
    k = int(k)
    if _is_torch(logits):
        x = logits.detach()
        if x.dim() == 1:
            x = x[None]
        if x.dim() != 2:
            raise TreeError(f"logits must be [d, V], got shape {tuple(x.shape)}")
        if x.device.type != "cpu":
            import torch

            if not 1 <= k <= x.shape[-1]:
                raise TreeError(
                    f"k = {k} must be in 1..={x.shape[-1]} (the vocabulary of the logits)"
                )
            if not bool(torch.isfinite(x).logical_or(x == float("-inf")).all()):
                raise TreeError("logits hold NaN or +inf (the drafter's logits overflowed?)")
            vals, idx = torch.topk(x.float(), k, dim=-1)
            lp = torch.log_softmax(vals.double(), dim=-1).float()
            tokens = idx.cpu().numpy().astype(np.int64)
            if id_map is not None:
                tokens = _id_map(id_map)[tokens]
            return tokens, lp.cpu().numpy()
        x = x.float().contiguous().numpy()
    else:
        x = np.ascontiguousarray(logits, dtype=np.float32)
        if x.ndim == 1:
            x = x[None]
        if x.ndim != 2:
            raise TreeError(f"logits must be [d, V], got shape {x.shape}")
    return _native.topk_logprobs(x, k, None if id_map is None else _id_map(id_map))


def _id_map(id_map: Any) -> np.ndarray:
    if _is_torch(id_map):
        id_map = id_map.detach().cpu().numpy()
    return np.ascontiguousarray(id_map, dtype=np.int64)


def _native_index(index: Any):
    if index is None:
        return None
    inner = getattr(index, "_inner", index)
    if not isinstance(inner, _native.NgramIndex):
        raise TypeError(f"index must be a dartcore.NgramIndex or None, got {type(index).__name__}")
    return inner


def _ids(x: Any, ndim: int, what: str) -> np.ndarray:
    if _is_torch(x):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        if a.size and not np.issubdtype(a.dtype, np.number):
            raise TreeError(f"{what} must hold integer token ids, got dtype {a.dtype}")
        if a.size and not np.all(np.mod(a, 1) == 0):
            raise TreeError(f"{what} must hold integer token ids")
    a = np.ascontiguousarray(a, dtype=np.int64)
    if a.ndim != ndim:
        raise TreeError(f"{what} must be {ndim}-D, got shape {a.shape}")
    return a


def _logprobs(x: Any, ndim: int, what: str) -> np.ndarray:
    if _is_torch(x):
        x = x.detach().float().cpu().numpy()
    a = np.ascontiguousarray(x, dtype=np.float32)
    if a.ndim != ndim:
        raise TreeError(f"{what} must be {ndim}-D, got shape {a.shape}")
    return a


def _tail(context: Any) -> np.ndarray:
    """The last two context tokens as int64[<=2] (all the searches read)."""
    if _is_torch(context):
        context = context.detach().reshape(-1)[-2:].cpu().numpy()
    elif isinstance(context, (list, tuple)):
        context = context[-2:]
    return _ids(np.asarray(context).reshape(-1)[-2:], 1, "context")


# Largest accepted beam width. A search costs ~width² (d = 8, k = 25, 59 nodes on the dev box:
# 0.5 ms at 20, 8.6 ms at 1,000, 113 ms at 4,096, 2.2 s at 10**5), and width beyond the node
# budget cannot change the tree: with scores that never increase along a path the tree's
# nodes of one level are that level's best, so entries ranked below ``max_nodes`` are never
# in it (tests/test_tree.py). 4096 is far above any budget in use (the paper's 59, DARTree's 64).
MAX_BEAM_WIDTH = 4096
# Largest node budget: the native tree indexes nodes with i32.
MAX_NODES = 2**31 - 2
# Eq. (10)'s candidate sets: "beam", each level's best ``beam_width`` expansions; "all", every
# expansion of every level (the paper's).
CANDIDATE_SETS = ("beam", "all")

# the one place the defaults are written: dart-tree's SearchParams
_DEFAULTS = _native.search_defaults()
# The tree builders' other two constants: k, the candidates per level (a drafter row's top-k, or
# a node's top-k index children), and the n-gram-only tree's depth (DART's d = 8 rows).
TOP_K = 25
NGRAM_DEPTH = 8


def _int_arg(name: str, value: Any, lo: int, hi: int, error=TreeError) -> int:
    """``value`` as an int in ``[lo, hi]`` (bool, float, str refused), else ``error`` naming it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"{name} must be an integer in [{lo}, {hi}], got {value!r} ({type(value).__name__})"
        )
    if not lo <= int(value) <= hi:
        raise error(f"{name} = {value} is out of range: must be an integer in [{lo}, {hi}]")
    return int(value)


int_arg = _int_arg  # public: the tree builders (dartcore.trees) check their integers with it too


def _float_arg(name: str, value: Any, lo: float = -math.inf, error=TreeError) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise TypeError(f"{name} must be a finite number, got {value!r} ({type(value).__name__})")
    v = float(value)
    if not math.isfinite(v) or v < lo:
        raise error(f"{name} = {value} is invalid: must be a finite number >= {lo}")
    return v


@dataclass(frozen=True)
class SearchParams:
    """Every constant of Eq. (10) and of the n-gram-only tree, with the ``dart`` tree's defaults
    (read from dart-tree's ``SearchParams::default()``, where they are written once), handed
    to the native search as one struct. Validated on construction: a clear
    :class:`~dartcore.errors.TreeError` (or ``TypeError``) naming the field.

    ``beam_width`` in [1, MAX_BEAM_WIDTH]; ``max_nodes`` (θ, nodes besides the root) in
    [1, MAX_NODES]; ``eps`` >= 0; the weights finite; ``eos_token_ids``: tokens never expanded."""

    beam_width: int = _DEFAULTS["beam_width"]
    max_nodes: int = _DEFAULTS["max_nodes"]
    level_decay: float = _DEFAULTS["level_decay"]
    ngram_weight: float = _DEFAULTS["ngram_weight"]
    depth_exponent: float = _DEFAULTS["depth_exponent"]
    eps: float = _DEFAULTS["eps"]
    ngram_first_level: bool = _DEFAULTS["ngram_first_level"]
    unigram_backoff: bool = _DEFAULTS["unigram_backoff"]
    eos_token_ids: tuple[int, ...] = ()
    candidates: str = _DEFAULTS["candidates"]

    def __post_init__(self) -> None:
        put = object.__setattr__  # frozen: normalise once here
        put(self, "beam_width", _int_arg("beam_width", self.beam_width, 1, MAX_BEAM_WIDTH))
        put(self, "max_nodes", _int_arg("max_nodes", self.max_nodes, 1, MAX_NODES))
        for name in ("level_decay", "ngram_weight", "depth_exponent"):
            put(self, name, _float_arg(name, getattr(self, name)))
        put(self, "eps", _float_arg("eps", self.eps, lo=0.0))
        for name in ("ngram_first_level", "unigram_backoff"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
            put(self, name, bool(getattr(self, name)))
        eos = self.eos_token_ids
        eos = () if eos is None else ((eos,) if isinstance(eos, (int, np.integer)) else tuple(eos))
        put(self, "eos_token_ids", tuple(_int_arg("eos_token_ids", t, 0, 2**63 - 1) for t in eos))
        if self.candidates not in CANDIDATE_SETS:
            raise TreeError(f"candidates must be 'beam' or 'all', got {self.candidates!r}")

    @classmethod
    def fields(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))

    @classmethod
    def official(cls, **changes: Any) -> SearchParams:
        """The official DART searcher's tree, exactly (dart-tree's ``SearchParams::official()``):
        the paper's constants, every expansion a candidate, no n-gram term at level 0, no
        unigram level, 60 nodes besides the root; ``changes`` override fields."""
        return cls(**{**_native.search_official(), **changes})

    def replace(self, **changes: Any) -> SearchParams:
        return dataclasses.replace(self, **changes)

    def native(self) -> dict[str, Any]:
        """The struct the bindings read (``dartcore-py``'s ``Params``): a new dict each call,
        its values made once per (frozen) instance -- a search runs every round."""
        fields = self.__dict__.get("_native_fields")
        if fields is None:
            fields = self.__dict__["_native_fields"] = dataclasses.asdict(self)
        return fields | {"eos_token_ids": list(self.eos_token_ids)}


def _search_params(params: SearchParams | None, overrides: dict[str, Any]) -> SearchParams:
    if params is not None and not isinstance(params, SearchParams):
        raise TypeError(f"params must be a dartcore.tree.SearchParams, got {type(params).__name__}")
    base = params if params is not None else _DEFAULT_PARAMS
    if not overrides:
        return base
    try:  # a builder passes the same overrides round after round: validated once
        # (the types too: True == 1, but max_nodes=True is refused)
        key = (base, tuple((k, type(v), v) for k, v in sorted(overrides.items())))
        made = _REPLACED.get(key)
    except TypeError:  # an unhashable value (a list of EOS ids): no reuse
        key, made = None, None
    if made is not None:  # its names were checked when it was made
        return made
    unknown = sorted(set(overrides) - SearchParams.fields())
    if unknown:
        raise TypeError(
            f"unknown search parameter(s) {unknown}; SearchParams has {sorted(SearchParams.fields())}"
        )
    if key is None:
        return base.replace(**overrides)
    if len(_REPLACED) >= 256:
        _REPLACED.clear()
    made = _REPLACED[key] = base.replace(**overrides)
    return made


_DEFAULT_PARAMS = SearchParams()
# (base params, sorted overrides) -> the validated params (see _search_params)
_REPLACED: dict[tuple, SearchParams] = {}


def beam_search(
    index: Any,
    context: Any,
    topk_tokens: Any,
    topk_logprobs: Any,
    params: SearchParams | None = None,
    *,
    live: Any = None,
    live_weight: float = LIVE_WEIGHT,
    **overrides: Any,
) -> Tree:
    """DART's Eq. (10) beam search; the tree has at most ``max_nodes`` nodes plus the root.

    ``params``: a :class:`SearchParams` (default: the paper's), ``overrides`` any of its
    fields (``beam_width=...``, ``max_nodes=...``).
    ``context``: committed tokens (at least one; the last is the root, the last two the
    trigram context of level 0). ``topk_tokens`` int [d, k] and ``topk_logprobs`` float32
    [d, k]: row l = top-k of drafter row l with log-probs renormalised in the top-k (see
    :func:`topk_logprobs`); −inf marks an impossible token (never a candidate). For a node v
    at level l with trigram context c::

        Δs = (level_decay**l · ln(p_l(v) + ε) + ngram_weight · ln(g(v|c) + ε)) / (l+1)**depth_exponent

    with g backed off per token (trigram, bigram, then unigram if ``unigram_backoff``);
    ``ngram_first_level=False`` drops the n-gram term at level 0 (DART's official code).
    Each level expands the ``beam_width`` best non-EOS candidates by row l; every expanded
    node is a candidate and the tree is picked best-first (ancestor-closed by construction).
    ``index=None`` is allowed only with ``ngram_weight=0`` (the drafter-only tree);
    ``beam_width=1`` gives a chain. ``candidates="all"``: every expansion of every level is a
    candidate of the tree, not only each level's best ``beam_width`` (the paper's set).
    ``live``: a :class:`dartcore.live.LiveLayer` whose counts g mixes in with weight
    ``live_weight`` (see :mod:`dartcore.live`)."""
    p = _search_params(params, overrides)
    arrays = _native.beam_search(
        _native_index(index),
        _tail(context),
        _ids(topk_tokens, 2, "topk_tokens"),
        _logprobs(topk_logprobs, 2, "topk_logprobs"),
        p.native(),
        _live(live),
        float(live_weight),
    )
    return _built(arrays)


def beam_search_batch(
    index: Any,
    contexts: Any,
    topk_tokens: Any,
    topk_logprobs: Any,
    params: SearchParams | None = None,
    *,
    live: Any = None,
    live_weight: float = LIVE_WEIGHT,
    **overrides: Any,
) -> list[Tree]:
    """:func:`beam_search` for B sequences at once on dartcore's thread pool
    (``dartcore.index.set_num_threads`` / ``DART_NUM_THREADS``): ``contexts`` is a [B, L]
    array or a sequence of B 1-D token sequences (any lengths ≥ 1); ``topk_tokens`` /
    ``topk_logprobs`` are [B, d, k]. Returns B trees, equal to B single calls."""
    p = _search_params(params, overrides)
    tails = [_tail(c) for c in contexts]
    offsets = np.zeros(len(tails) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([t.shape[0] for t in tails])
    flat = np.concatenate(tails) if tails else np.zeros(0, dtype=np.int64)
    out = _native.beam_search_batch(
        _native_index(index),
        flat,
        offsets,
        _ids(topk_tokens, 3, "topk_tokens"),
        _logprobs(topk_logprobs, 3, "topk_logprobs"),
        p.native(),
        _live(live),
        float(live_weight),
    )
    return [_built(a) for a in out]


# Deepest n-gram-only tree: the native tree stores levels as u16.
MAX_DEPTH = 2**16 - 1


def ngram_tree(
    index: Any,
    context: Any,
    depth: int = NGRAM_DEPTH,
    k: int = TOP_K,
    params: SearchParams | None = None,
    *,
    live: Any = None,
    live_weight: float = LIVE_WEIGHT,
    **overrides: Any,
) -> Tree:
    """The n-gram-only tree (no drafter): level l expands each beam entry by the index's
    top-``k`` children of its trigram context (longest suffix with continuations), scored by
    the n-gram term alone, ``ngram_weight · ln(g + ε) / (l+1)**depth_exponent``; beam and
    best-first selection as in :func:`beam_search`. ``depth`` in [0, MAX_DEPTH], ``k`` in
    [0, 2**32 - 1] (capped at the index's vocabulary); ``level_decay`` and
    ``ngram_first_level`` do not apply."""
    if index is None:
        raise TreeError("ngram_tree needs an n-gram index (the index= argument)")
    inner = _native_index(index)
    depth = _int_arg("depth", depth, 0, MAX_DEPTH)
    # More children than the vocabulary cannot exist: k is capped there (no allocation scales with it).
    k = min(_int_arg("k", k, 0, 2**32 - 1), int(inner.vocab_size))
    p = _search_params(params, overrides)
    return _built(
        _native.ngram_tree(
            inner, _tail(context), depth, k, p.native(), _live(live), float(live_weight)
        )
    )


def _live(live: Any):
    from dartcore.live import native

    return native(live)


def top_b(parents: Any, scores: Any, b: int) -> np.ndarray:
    """DARTree's deferred pruning: the global top-``b`` nodes of a supertree as int64 node
    indices in rank order (``np.sort`` for topological order). ``parents[i]`` is −1 for a
    child of the implicit root, else an earlier node. Ranked by score, ties ancestor-first
    (shallower, then lower index) — by Lemma 1 the best-first heap's pop order when scores
    never increase along a path (β ≤ 0). Ranks by the path minimum of the scores, so the
    result is ancestor-closed even when a child outscores its parent."""
    b = _int_arg("b", b, 0, MAX_NODES)
    return _native.top_b(
        _ids(parents, 1, "parents"), np.ascontiguousarray(scores, dtype=np.float64).reshape(-1), b
    )


def best_first(tokens: Any, logprobs: Any, root_token: int, b: int) -> Tree:
    """DDTree's tree: best-first search over factorised marginals. ``tokens`` int [d, K] and
    ``logprobs`` [d, K] (row l = candidates for depth l+1); a node's score is the sum of its
    path's log-probs; the ``b`` best nodes are popped from a heap that starts at the root's
    children (ties: shallower, then earlier parent, then higher log-prob). −inf = impossible."""
    b = _int_arg("b", b, 0, MAX_NODES)
    root = _int_arg("root_token", root_token, 0, 2**32 - 1)
    return _built(
        _native.best_first(_ids(tokens, 2, "tokens"), _logprobs(logprobs, 2, "logprobs"), root, b)
    )


def chain(root_token: int, tokens: Any, logprobs: Any = None) -> Tree:
    """A single path: the root, then ``tokens`` (1-D: one token per level; 2-D [d, k]: the
    first column, i.e. the top-1 of every drafter row). Scores are the cumulative
    ``logprobs`` (same shape rules) or 0."""
    t = _ids(tokens, np.ndim(tokens) if not _is_torch(tokens) else tokens.dim(), "tokens")
    if t.ndim == 2:
        t = t[:, 0]
    elif t.ndim != 1:
        raise TreeError(f"tokens must be 1-D or [d, k], got shape {t.shape}")
    n = t.shape[0]
    if logprobs is None:
        lp = np.zeros(n, dtype=np.float64)
    else:
        lp = np.asarray(
            _logprobs(logprobs, 2 if np.ndim(logprobs) == 2 else 1, "logprobs"), dtype=np.float64
        )
        lp = lp[:, 0] if lp.ndim == 2 else lp
        if lp.shape != (n,):
            raise TreeError(f"logprobs must match tokens ({n} levels), got shape {lp.shape}")
    return Tree(
        tokens=np.concatenate([[int(root_token)], t]),
        parents=np.arange(-1, n, dtype=np.int64),
        depths=np.arange(n + 1, dtype=np.int64),
        scores=np.concatenate([[0.0], np.cumsum(lp)]),
    )
