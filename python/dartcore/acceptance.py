"""Tree verification: flatten a tree for one target forward, then walk it.

Flattening (docs/architecture.md, "Verification"): node 0 is the root (the bonus
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
from dartcore.tree import (  # re-exported: the decoder's mask comes from the native bits
    Tree,
    ancestor_mask,
)

__all__ = ["flatten", "ancestor_mask", "accept", "Acceptance", "prune"]


def flatten(tree) -> Tree:
    """The :class:`~dartcore.tree.Tree` of ``tree`` (anything with ``tokens``, ``parents``,
    ``depths`` in depth order; checked by the Tree constructor). A Tree is returned as is."""
    if isinstance(tree, Tree):
        return tree
    return Tree(tree.tokens, tree.parents, tree.depths, getattr(tree, "scores", None))


def prune(tree: Tree, *, max_depth: int, max_nodes: int) -> Tree:
    """Keep nodes with ``depth <= max_depth``, then the first ``max_nodes`` (root included;
    depth order keeps every kept node's ancestors). The decoder enforces its round's budget
    with it on trees from builders that overshoot it (the built-in ones never do)."""
    if max_nodes < 1:
        raise TreeError("a tree keeps at least its root (max_nodes >= 1)")
    if len(tree) <= max_nodes and tree.depths[-1] <= max_depth:  # depth order: the deepest last
        return tree
    return keep_nodes(tree, np.flatnonzero(tree.depths <= max_depth)[:max_nodes])


def keep_nodes(tree: Tree, keep: np.ndarray) -> Tree:
    """The tree of nodes ``keep`` (ascending indices, the root and every kept node's parent
    among them), in their order."""
    keep = np.asarray(keep, dtype=np.int64)
    if len(keep) == len(tree):
        return tree
    remap = np.full(len(tree), -1, dtype=np.int64)
    remap[keep] = np.arange(len(keep))
    parents = np.where(tree.parents[keep] >= 0, remap[np.maximum(tree.parents[keep], 0)], -1)
    return Tree(
        tree.tokens[keep].copy(), parents, tree.depths[keep].copy(), tree.scores[keep].copy()
    )


@dataclass
class Acceptance:
    path: list[int]  # node indices from the root (always path[0] == 0)
    bonus: int  # the target's own next token after the last path node

    @property
    def accepted(self) -> int:
        """Drafted tokens accepted (the root and the bonus not counted)."""
        return len(self.path) - 1


def accept(tree: Tree, logits: torch.Tensor, sampler: Sampler) -> Acceptance:
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
