"""Tree verification: flatten a tree for one target forward, then walk it.

Flattening (ARCHITECTURE.md "Verification"): node 0 is the root (the bonus
token of the previous round, already committed but not yet run through the
target), the other nodes follow in depth order; node n sits at position
``prefix_len + depth[n]`` and sees the cached prefix, its ancestors and
itself.

Acceptance walks from the root. At a node the target's next token is chosen
with the one :class:`~dartcore.sampling.Sampler` the AR loop also uses (argmax
when greedy, a warped draw otherwise). If that token is a child of the node the
walk moves there; otherwise it is the bonus token and the walk stops. Greedy:
the longest path whose every token is the argmax of its parent's logits.
Sampling: each committed token is one draw from exactly the AR distribution
given the committed prefix, so the output distribution is the target's
(lossless for any tree that does not depend on the target's random draws).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dartcore.errors import TreeError
from dartcore.sampling import Sampler
from dartcore.tree import ancestor_mask  # re-exported: the decoder's mask comes from the native bits

__all__ = ["FlatTree", "flatten", "ancestor_mask", "accept", "Acceptance", "prune"]


@dataclass
class FlatTree:
    tokens: np.ndarray  # int64 [n]
    parents: np.ndarray  # int64 [n], -1 for the root
    depths: np.ndarray  # int64 [n]

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def _check(tokens, parents, depths) -> FlatTree:
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    parents = np.asarray(parents, dtype=np.int64).reshape(-1)
    depths = np.asarray(depths, dtype=np.int64).reshape(-1)
    n = tokens.shape[0]
    if n == 0 or parents.shape[0] != n or depths.shape[0] != n:
        raise TreeError(f"tree arrays must be non-empty and equally long, got {n}, {parents.shape[0]}, {depths.shape[0]}")
    if parents[0] != -1 or depths[0] != 0:
        raise TreeError("node 0 must be the root (parent -1, depth 0)")
    if n > 1:
        child = np.arange(1, n)
        p = parents[1:]
        if np.any(p < 0) or np.any(p >= child):
            raise TreeError("every non-root node's parent must come before it")
        if np.any(depths[1:] != depths[p] + 1):
            raise TreeError("depth of a node must be its parent's depth + 1")
        if np.any(np.diff(depths) < 0):
            raise TreeError("nodes must be in depth order")
    return FlatTree(tokens, parents, depths)


def flatten(tree) -> FlatTree:
    """Validate a tree (anything with ``tokens``, ``parents``, ``depths``). Trees fresh from
    dartcore's native searches are valid by construction and pass unchecked."""
    if getattr(tree, "_valid", False):  # a dartcore.tree.Tree from the native searches
        return FlatTree(tree.tokens, tree.parents, tree.depths)
    return _check(tree.tokens, tree.parents, tree.depths)


def prune(tree: FlatTree, *, max_depth: int, max_nodes: int) -> FlatTree:
    """Keep nodes with ``depth <= max_depth``, then the first ``max_nodes``
    (depth order keeps every kept node's ancestors)."""
    if max_nodes < 1:
        raise ValueError("a tree keeps at least its root")
    keep = np.flatnonzero(tree.depths <= max_depth)[:max_nodes]
    if len(keep) == len(tree):
        return tree
    remap = np.full(len(tree), -1, dtype=np.int64)
    remap[keep] = np.arange(len(keep))
    parents = np.where(tree.parents[keep] >= 0, remap[np.maximum(tree.parents[keep], 0)], -1)
    return FlatTree(tree.tokens[keep].copy(), parents, tree.depths[keep].copy())


@dataclass
class Acceptance:
    path: list[int]  # node indices from the root (always path[0] == 0)
    bonus: int  # the target's own next token after the last path node

    @property
    def accepted(self) -> int:
        """Drafted tokens accepted (the root and the bonus not counted)."""
        return len(self.path) - 1


def accept(tree: FlatTree, logits: torch.Tensor, sampler: Sampler) -> Acceptance:
    """Walk the tree with the target's choices; ``logits`` is ``[n, V]``, row i
    = the target's next-token logits after node i.

    Builders emit distinct sibling tokens, but a tree may repeat one (e.g. two
    builders merged). Siblings with equal tokens stand for the same context, so
    the walk follows all of them at once (the target's choice is made once, on
    the first of them) and the longest continuation wins.
    """
    children: dict[int, dict[int, list[int]]] = {}
    for i, (p, t) in enumerate(zip(tree.parents[1:].tolist(), tree.tokens[1:].tolist()), start=1):
        children.setdefault(p, {}).setdefault(t, []).append(i)
    current = [0]
    while True:
        token = sampler.choose(logits[current[0]])
        nxt = [c for node in current for c in children.get(node, {}).get(token, ())]
        if not nxt:
            break
        current = nxt
    path = []
    node = current[0]
    while node >= 0:
        path.append(node)
        node = int(tree.parents[node])
    return Acceptance(path=path[::-1], bonus=token)
