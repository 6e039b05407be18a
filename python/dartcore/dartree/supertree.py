"""DARTree's depth-wise batched supertree and its deferred global top-B.

Per round the drafter gives ``d`` rows of base logits ``z_t`` and hidden states ``H_t``.

1. Depth-wise expansion. At depth ``t + 1`` every active branch (at most ``W``) is run through
   the correction head in ONE batch: ``ln q̃_t(c | H_t, parent)`` over the ``K`` candidates
   ``c ∈ top-K(z_t)``. A child's score is

       s(child) = s(parent) + ln q̃_t(c) + β [+ λ · ln(g(c | ctx) + ε) / (t + 1)^α]

   (the bracket is the ``hybrid`` option: the n-gram term of Eq. (10), ``ctx`` = the last
   two tokens of committed text + path). The global top-``W`` children of the depth become
   the next active branches; all of them are supertree nodes. Branches ending in EOS are kept
   as nodes but not expanded.
2. Deferred top-B. One global top-``B`` over the whole supertree with ancestor-first ties
   (:func:`dartcore.tree.top_b`, Rust). With β ≤ 0 every increment is ≤ 0, so scores never
   increase along a path and this equals the pop order of the sequential heap construction
   ("pop a node, correct its children, push") — DARTree's Lemma 1, pinned by the tests.

Because the head is Markov (its only path state is the parent token), the batched scores are
exactly the per-node sequential ones; the batching only changes how many head calls a round
costs (``d`` instead of ``B``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dartcore.errors import TreeError

__all__ = ["Supertree", "NgramTerm", "build_supertree", "select_top_b", "candidates"]

EmbedFn = Callable[[torch.Tensor], torch.Tensor]  # target ids [n] -> [n, E]
IdMapFn = Callable[[torch.Tensor], torch.Tensor]  # drafter ids -> target ids (same shape)


@dataclass
class Supertree:
    """All nodes DARTree expanded in one round, root first, in depth order.

    Node 0 is the root (parent −1, depth 0, score 0). Within a depth, nodes are in selection
    order (best first). ``tokens`` are target ids.
    """

    tokens: np.ndarray  # int64 [N]
    parents: np.ndarray  # int64 [N]
    depths: np.ndarray  # int64 [N]
    scores: np.ndarray  # float64 [N]
    head_calls: int = 0  # batched head forwards used (one per expanded depth)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class NgramTerm:
    """The n-gram term of Eq. (10) for the ``hybrid`` tree:
    ``weight · ln(g(v | ctx) + eps) / (level + 1)^decay`` with the per-token backed-off
    trigram probability ``g`` of :class:`dartcore.NgramIndex` (``level`` = depth − 1).

    Uses the index's batched ``cond_probs(context, candidates_sorted, unigram_backoff)``
    (one call per branch), or ``prob(context, token, unigram_backoff)`` per candidate for an
    object without it.
    """

    def __init__(
        self,
        index,
        weight: float = 0.5,
        decay: float = 0.7,
        eps: float = 1e-10,
        unigram_backoff: bool = True,
    ):
        if weight < 0 or decay < 0 or eps <= 0:
            raise TreeError("n-gram term needs weight ≥ 0, decay ≥ 0 and eps > 0")
        self.index = index
        self.weight = float(weight)
        self.decay = float(decay)
        self.eps = float(eps)
        self.unigram_backoff = bool(unigram_backoff)

    def _probs(self, context: Sequence[int], cand_sorted: np.ndarray) -> np.ndarray:
        fn = getattr(self.index, "cond_probs", None)
        if fn is not None:  # one native call per branch
            return np.asarray(
                fn(list(context), cand_sorted, self.unigram_backoff), dtype=np.float64
            )
        return np.array(
            [self.index.prob(list(context), int(v), self.unigram_backoff) for v in cand_sorted],
            dtype=np.float64,
        )

    def __call__(
        self, level: int, contexts: Sequence[Sequence[int]], candidates: np.ndarray
    ) -> np.ndarray:
        """``[len(contexts), K]`` float64 terms for the same ``candidates`` (target ids) after
        each context (at most the two last tokens, oldest first)."""
        order = np.argsort(candidates, kind="stable")
        cand_sorted = np.ascontiguousarray(candidates[order].astype(np.uint32))
        out = np.empty((len(contexts), candidates.shape[0]), dtype=np.float64)
        scale = self.weight / float(level + 1) ** self.decay
        for i, ctx in enumerate(contexts):
            g = self._probs(tuple(int(t) for t in ctx[-2:]), cand_sorted)
            out[i, order] = scale * np.log(g + self.eps)
        return out


def candidates(base_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` candidates of every row (fp32): ``(ids [d, k] int64, logits [d, k] float32)``,
    each row sorted by logit descending."""
    if base_logits.dim() != 2:
        raise TreeError(f"base logits must be [d, V], got {tuple(base_logits.shape)}")
    logits = base_logits.detach().float()
    if torch.isnan(logits).any():
        raise TreeError("base logits contain NaN")
    k = min(int(k), logits.shape[1])
    vals, ids = torch.topk(logits, k, dim=-1, sorted=True)
    return ids, vals


@torch.inference_mode()
def build_supertree(
    base_logits: torch.Tensor,
    hidden: torch.Tensor,
    root_token: int,
    head,
    embed: EmbedFn,
    *,
    k: int = 64,
    width: int = 12,
    beta: float = -0.2,
    to_target: IdMapFn | None = None,
    eos_token_ids: Sequence[int] = (),
    ngram: NgramTerm | None = None,
    context: Sequence[int] = (),
    depth: int | None = None,
) -> Supertree:
    """Depth-wise batched DARTree supertree.

    base_logits ``[d, V_draft]`` and hidden ``[d, H]``: the drafter's rows; root_token: the
    bonus token (target id); head: a :class:`~dartcore.dartree.head.CorrectionHead`; embed:
    target ids -> token embeddings. k/width/beta: K, W, β. to_target: drafter ids -> target
    ids (identity if None). eos_token_ids: nodes with these tokens are not expanded.
    ngram/context: the hybrid term and the committed tokens before
    the root (only the last one is used). depth: expand only the first ``depth`` rows.
    """
    if width <= 0 or k <= 0:
        raise TreeError(f"k and width must be positive, got k={k}, width={width}")
    if not np.isfinite(beta):
        raise TreeError(f"beta must be finite, got {beta}")
    if hidden.dim() != 2 or hidden.shape[0] != base_logits.shape[0]:
        raise TreeError(
            f"hidden must be [d, H] with d = {base_logits.shape[0]}, got {tuple(hidden.shape)}"
        )
    d = base_logits.shape[0] if depth is None else min(int(depth), base_logits.shape[0])
    cand_ids, cand_logits = candidates(base_logits[:d], k)
    cand_tgt = to_target(cand_ids) if to_target is not None else cand_ids
    cand_tgt = cand_tgt.to(torch.long)
    kk = int(cand_tgt.shape[1])
    cand_emb = embed(cand_tgt.reshape(-1)).float()  # [d*K, E]
    cand_np = cand_tgt.cpu().numpy()
    # The head's hidden part once for all depths; the parent part per depth for the active
    # branches only (their tokens are earlier candidates, or the root: row 0 of all_emb).
    hid_feat = head.hidden_features(hidden[:d].detach())  # [d, r]
    root_emb = embed(torch.as_tensor([int(root_token)], dtype=torch.long)).float()
    all_emb = torch.cat([root_emb, cand_emb])  # [1 + d*K, E]
    cand_emb = cand_emb.view(d, kk, -1)

    eos = {int(t) for t in eos_token_ids}
    tokens = [int(root_token)]
    parents = [-1]
    depths = [0]
    scores = [0.0]
    emb_row = [0]  # row of all_emb holding each node's token
    # Path tails for the n-gram context: the last two tokens of committed text + path.
    tails: list[tuple[int, ...]] = [tuple(int(t) for t in context[-1:]) + (int(root_token),)]
    active = np.array([0], dtype=np.int64)
    calls = 0
    for t in range(d):
        if active.size == 0:
            break
        rows = torch.as_tensor([emb_row[i] for i in active], dtype=torch.long)
        par_feat = head.parent_features(all_emb[rows])  # [n, r]
        logq = head.score(hid_feat[t : t + 1], par_feat, cand_emb[t], cand_logits[t])  # [n, K]
        calls += 1
        inc = logq.double().cpu().numpy() + beta
        if ngram is not None and ngram.weight > 0:
            inc = inc + ngram(t, [tails[i] for i in active], cand_np[t])
        child = np.asarray([scores[i] for i in active], dtype=np.float64)[:, None] + inc  # [n, K]
        if np.isnan(child).any():
            raise TreeError(f"NaN score at depth {t + 1}")
        keep = _top_w(child.reshape(-1), width)
        new_active = []
        for f in keep.tolist():
            p = int(active[f // kk])
            j = f % kk
            tok = int(cand_np[t, j])
            tokens.append(tok)
            parents.append(p)
            depths.append(t + 1)
            scores.append(float(child.flat[f]))
            emb_row.append(1 + t * kk + j)
            tails.append((tails[p] + (tok,))[-2:])
            if tok not in eos:
                new_active.append(len(tokens) - 1)
        active = np.asarray(new_active, dtype=np.int64)
    return Supertree(
        np.asarray(tokens, dtype=np.int64),
        np.asarray(parents, dtype=np.int64),
        np.asarray(depths, dtype=np.int64),
        np.asarray(scores, dtype=np.float64),
        calls,
    )


def _top_w(flat: np.ndarray, width: int) -> np.ndarray:
    """Indices of the ``width`` largest scores, best first; ties go to the lower index (the
    better-ranked parent, then the higher base logit). argpartition + a sort of the few
    survivors: a full stable argsort of W·K scores costs ~0.2 ms per depth."""
    if flat.size <= width:
        return np.lexsort((np.arange(flat.size), -flat))
    thr = np.partition(flat, flat.size - width)[flat.size - width]  # the width-th largest
    cand = np.flatnonzero(flat >= thr)  # ≥ width indices (ties at the threshold included)
    return cand[np.lexsort((cand, -flat[cand]))][:width]


def select_top_b(tree: Supertree, b: int):
    """The deferred global top-``b`` non-root nodes of a supertree as a
    :class:`dartcore.tree.Tree` (root + at most ``b`` nodes, depth order, best first within a
    depth). Uses the Rust :func:`dartcore.tree.top_b` (ancestor-first ties)."""
    from dartcore.tree import Tree, top_b

    if b <= 0:
        raise TreeError(f"tree budget b must be positive, got {b}")
    n = len(tree) - 1
    if n == 0:
        picked = np.zeros(0, dtype=np.int64)
    else:
        # top_b's supertree has an implicit root: node i here is node i + 1 of ours.
        sub_parents = np.ascontiguousarray(tree.parents[1:] - 1, dtype=np.int64)
        picked = (
            np.sort(
                np.asarray(
                    top_b(sub_parents, np.ascontiguousarray(tree.scores[1:]), b), dtype=np.int64
                )
            )
            + 1
        )
    keep = np.concatenate([[0], picked])  # supertree order is depth order, best first in a depth
    remap = np.full(len(tree), -1, dtype=np.int64)
    remap[keep] = np.arange(keep.size)
    parents = np.where(tree.parents[keep] >= 0, remap[np.maximum(tree.parents[keep], 0)], -1)
    if (parents[1:] < 0).any():
        raise TreeError("top_b returned a set that is not ancestor-closed")
    return Tree(
        tokens=tree.tokens[keep],
        parents=parents,
        depths=tree.depths[keep],
        scores=tree.scores[keep],
    )
