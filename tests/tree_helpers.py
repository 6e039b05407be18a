"""Test helpers for draft trees (not part of dartcore's API)."""

from __future__ import annotations

import numpy as np

from dartcore.errors import TreeError
from dartcore.tree import Tree


def random_tree(
    n: int,
    *,
    vocab_size: int = 1000,
    max_depth: int | None = None,
    root_token: int | None = None,
    rng: np.random.Generator | int | None = None,
) -> Tree:
    """A random valid tree of ``n`` nodes (root included), for tests: depth order, distinct
    sibling tokens, scores that decrease along every path, depth ≤ ``max_depth``."""
    if n < 1:
        raise TreeError(f"a tree has at least its root, got n={n}")
    g = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    if max_depth is not None and max_depth < 1 and n > 1:
        raise TreeError("max_depth must be >= 1 for a tree of more than one node")
    parents = [-1]
    depths = [0]
    for i in range(1, n):
        while True:
            p = int(g.integers(0, i))
            if max_depth is None or depths[p] < max_depth:
                break
        parents.append(p)
        depths.append(depths[p] + 1)
    par = np.asarray(parents)
    dep = np.asarray(depths)
    order = np.argsort(dep, kind="stable")
    remap = np.empty(n, dtype=np.int64)
    remap[order] = np.arange(n)
    new_par = np.where(par[order] >= 0, remap[np.maximum(par[order], 0)], -1)
    tokens = np.empty(n, dtype=np.int64)
    tokens[0] = int(g.integers(0, vocab_size)) if root_token is None else int(root_token)
    scores = np.zeros(n, dtype=np.float64)
    kids: dict[int, list[int]] = {}
    for i in range(1, n):
        kids.setdefault(int(new_par[i]), []).append(i)
    for p, ch in kids.items():
        if len(ch) > vocab_size:
            raise TreeError(
                f"node {p} has {len(ch)} children but the vocabulary has {vocab_size} tokens"
            )
        tokens[ch] = g.choice(vocab_size, size=len(ch), replace=False)
    for i in range(1, n):
        scores[i] = scores[new_par[i]] + float(np.log(g.uniform(0.05, 1.0)))
    return Tree(tokens=tokens, parents=new_par, depths=dep[order], scores=scores)
