"""DARTree / hybrid / DDTree tree builders for :class:`dartcore.DartDecoder`.

Registered with :func:`dartcore.trees.register_tree_builder` when this module is imported
(``dartcore.trees`` imports it, so ``DartDecoder(tree="dartree")`` just works):

===========  =============================================================================
``dartree``  correction head over the drafter's top-K (K = 64), depth-wise batched
             supertree (W = 12, β = −0.2), one deferred global top-B
``hybrid``   the same, plus the n-gram term of Eq. (10) in every node's score (needs the
             index)
``ddtree``   DDTree: best-first heap over the raw drafter marginals (top-K per row)
===========  =============================================================================

Budget. ``max_nodes`` is B, the number of nodes besides the root. The paper's B = 64 is a
GPU budget; on CPU the verify forward's cost grows with the node count much earlier, so
unset it is the decoder's device budget (:func:`dartcore.trees.node_budget`: 4 on CPU, 2 for block weights,
59 on CUDA); pass ``max_nodes=64`` for the paper's setting. Each round the builder builds
to the budget the decoder hands it (``TreeInputs.max_nodes``).

Correction head (``head=``): a :class:`~dartcore.dartree.head.CorrectionHead`, a directory
or a built-in name (``"smollm2"``); ``None`` (default) picks the built-in head whose sizes fit
the drafter; ``"untrained"`` is the identity head (q̃ = the marginal renormalised inside the
top-K: DARTree's tree search without a learned correction).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from dartcore.dartree.head import ASSET_DIR, CorrectionHead
from dartcore.dartree.supertree import NgramTerm, build_supertree, select_top_b
from dartcore.errors import DrafterMismatchError, TreeError
from dartcore.trees import TreeInputs, register_tree_builder, root_only

__all__ = ["DartreeBuilder", "DDTreeBuilder", "resolve_head"]


def resolve_head(head, drafter) -> CorrectionHead:
    """The correction head for ``drafter`` (see the module docstring for ``head``)."""
    hidden_size = int(drafter.config.hidden_size)
    embed_dim = int(drafter.target_embedding.weight.shape[1])
    if isinstance(head, CorrectionHead):
        obj = head
    elif head == "untrained":
        obj = CorrectionHead(hidden_size, embed_dim, rank=1).eval()
    elif head is None:
        found = []
        for path in sorted(ASSET_DIR.iterdir()) if ASSET_DIR.is_dir() else []:
            try:
                cand = CorrectionHead.from_pretrained(path)
            except Exception:  # noqa: BLE001 - a broken asset is skipped, the error below says why
                continue
            if (cand.hidden_size, cand.embed_dim) == (hidden_size, embed_dim):
                found.append(cand)
        if not found:
            raise DrafterMismatchError(
                f"no built-in correction head fits this drafter (hidden {hidden_size}, embeddings "
                f"{embed_dim}): train one with `dart-train --correction-head` and pass head=DIR, "
                "or head='untrained'"
            )
        obj = found[0]
    else:
        obj = CorrectionHead.from_pretrained(head)
    obj.check_compatible(hidden_size, embed_dim)
    want = obj.meta.get("drafter_fingerprint")
    if want is not None:
        from dartcore.drafter import drafter_fingerprint

        have = drafter_fingerprint(drafter)
        if have != want:
            # A head trained on another checkpoint of the same drafter still helps (it reads the
            # same kind of hidden state); a wrong-sized one cannot run and was rejected above.
            warnings.warn(
                f"correction head was trained on drafter {want}, this drafter is {have}; "
                "retrain it with `dart-train --correction-head` for the best acceptance",
                stacklevel=3,
            )
    return obj.eval()


@dataclass
class DartreeBuilder:
    """DARTree (``ngram_weight = 0``) or hybrid (``ngram_weight > 0``) tree builder."""

    head: Any = None
    k: int = 64
    width: int = 12
    beta: float = -0.2
    max_nodes: int | None = None
    ngram_weight: float = 0.0
    ngram_decay: float = 0.7
    ngram_eps: float = 1e-10
    unigram_backoff: bool = True
    needs_drafter: bool = True
    needs_hidden: bool = True
    needs_index: bool = False
    _head: CorrectionHead | None = field(default=None, repr=False)
    _head_for: int | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.k <= 0 or self.width <= 0 or (self.max_nodes is not None and self.max_nodes <= 0):
            raise TreeError(
                f"k, width and max_nodes must be positive (k={self.k}, width={self.width}, "
                f"max_nodes={self.max_nodes})"
            )
        if not self.beta <= 0:
            # Lemma 1 (deferred top-B = best-first heap order) needs scores that never increase
            # along a path; top_b stays ancestor-closed anyway, but the equivalence is lost.
            raise TreeError(f"beta must be ≤ 0 (DARTree's depth penalty), got {self.beta}")
        if self.ngram_weight < 0:
            raise TreeError(f"ngram_weight must be ≥ 0, got {self.ngram_weight}")
        self.needs_index = self.ngram_weight > 0

    def _head_of(self, drafter) -> CorrectionHead:
        if self._head is None or self._head_for != id(drafter):
            self._head = resolve_head(self.head, drafter)
            self._head_for = id(drafter)
        return self._head

    def __call__(self, inputs: TreeInputs):
        root = int(inputs.context[-1])
        if inputs.logits is None or inputs.hidden is None or inputs.drafter is None:
            raise TreeError(
                "the DARTree builders need the drafter's logits and hidden states "
                "(DartDecoder(..., drafter=...))"
            )
        depth = min(int(inputs.logits.shape[0]), int(inputs.max_depth))
        budget = inputs.budget()
        if depth <= 0:
            return root_only(root)
        ngram = None
        if self.ngram_weight > 0:
            if inputs.index is None:
                raise TreeError(
                    "tree='hybrid' needs an n-gram index: pass index= to DartDecoder (--index for "
                    "dart-generate), or use tree='dartree'"
                )
            ngram = NgramTerm(
                inputs.index,
                weight=self.ngram_weight,
                decay=self.ngram_decay,
                eps=self.ngram_eps,
                unigram_backoff=self.unigram_backoff,
            )
        drafter = inputs.drafter
        st = build_supertree(
            inputs.logits,
            inputs.hidden,
            root,
            self._head_of(drafter),
            drafter.embed,
            k=self.k,
            width=self.width,
            beta=self.beta,
            to_target=drafter.to_target_ids,
            eos_token_ids=tuple(inputs.eos_token_ids),
            ngram=ngram,
            context=inputs.context[:-1],
            depth=depth,
        )
        return select_top_b(st, budget)


@dataclass
class DDTreeBuilder:
    """DDTree: the ``max_nodes`` best nodes of a best-first heap over the raw drafter
    marginals (log-softmax inside the top-``k`` of every row), no correction."""

    k: int = 64
    max_nodes: int | None = None
    needs_drafter: bool = True
    needs_hidden: bool = False
    needs_index: bool = False

    def __post_init__(self):
        if self.k <= 0 or (self.max_nodes is not None and self.max_nodes <= 0):
            raise TreeError(
                f"k and max_nodes must be positive (k={self.k}, max_nodes={self.max_nodes})"
            )

    def __call__(self, inputs: TreeInputs):
        from dartcore.tree import best_first
        from dartcore.trees import target_topk

        root = int(inputs.context[-1])
        tokens, logprobs = target_topk(inputs, self.k)
        depth = min(tokens.shape[0], int(inputs.max_depth))
        budget = inputs.budget()
        if depth <= 0:
            return root_only(root)
        return best_first(tokens[:depth], logprobs[:depth], root, budget)


def _params(cls, params: dict[str, Any], fixed: dict[str, Any]):
    known = {
        f for f in cls.__dataclass_fields__ if not f.startswith("_") and not f.startswith("needs_")
    }
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(
            f"unknown tree parameters {unknown}; {cls.__name__} takes {sorted(known - set(fixed))}"
        )
    return cls(**{**params, **fixed})


def _dartree(**params) -> DartreeBuilder:
    if "ngram_weight" in params:
        raise ValueError("tree='dartree' has no n-gram term; use tree='hybrid' (ngram_weight=...)")
    return _params(DartreeBuilder, params, {})


def _hybrid(**params) -> DartreeBuilder:
    params.setdefault("ngram_weight", 0.5)
    if params["ngram_weight"] <= 0:
        raise ValueError(
            "tree='hybrid' needs ngram_weight > 0 (use tree='dartree' without the n-gram term)"
        )
    return _params(DartreeBuilder, params, {})


def _ddtree(**params) -> DDTreeBuilder:
    return _params(DDTreeBuilder, params, {})


def register() -> None:
    """Register ``dartree``, ``hybrid`` and ``ddtree`` (idempotent)."""
    register_tree_builder("dartree", _dartree, replace=True)
    register_tree_builder("hybrid", _hybrid, replace=True)
    register_tree_builder("ddtree", _ddtree, replace=True)


register()
