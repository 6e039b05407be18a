"""Tree flattening and the acceptance walk against brute force."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dartcore import TreeError
from dartcore.acceptance import accept, ancestor_mask, flatten, prune
from dartcore.sampling import Sampler, SamplingParams
from dartcore.tree import Tree


def random_tree(rng, n, vocab=6):
    parents = [-1]
    depths = [0]
    for i in range(1, n):
        # pick a parent among nodes of the deepest or previous level to keep depth order
        p = int(rng.integers(0, i))
        while depths[p] + 1 < depths[-1]:
            p = int(rng.integers(0, i))
        parents.append(p)
        depths.append(depths[p] + 1)
    tokens = rng.integers(0, vocab, size=n)
    return Tree(
        tokens.astype(np.int64), np.array(parents, dtype=np.int64), np.array(depths, dtype=np.int64)
    )


def test_ancestor_mask_brute_force():
    rng = np.random.default_rng(0)
    for n in (1, 2, 9, 40):
        t = random_tree(rng, n)
        mask = ancestor_mask(t.parents)
        for i in range(n):
            anc = set()
            j = i
            while j >= 0:
                anc.add(j)
                j = int(t.parents[j])
            assert set(np.flatnonzero(mask[i])) == anc


def test_flatten_validates():
    from types import SimpleNamespace

    with pytest.raises(TreeError, match="parent"):  # any object with the three arrays is checked
        flatten(
            SimpleNamespace(
                tokens=np.array([1, 2, 3]), parents=np.array([-1, 2, 0]), depths=np.array([0, 1, 1])
            )
        )
    ok = flatten(SimpleNamespace(tokens=[5, 6], parents=[-1, 0], depths=[0, 1]))
    assert isinstance(ok, Tree) and ok.scores.tolist() == [0.0, 0.0]
    assert flatten(ok) is ok
    with pytest.raises(TreeError):
        flatten(Tree(np.array([1, 2]), np.array([0, -1]), np.array([0, 1])))
    with pytest.raises(TreeError):
        flatten(Tree(np.array([1, 2, 3]), np.array([-1, 0, 0]), np.array([0, 1, 2])))
    with pytest.raises(TreeError):
        flatten(Tree(np.array([1, 2, 3]), np.array([-1, 2, 0]), np.array([0, 1, 1])))
    with pytest.raises(TreeError):
        flatten(
            Tree(
                np.array([], dtype=np.int64),
                np.array([], dtype=np.int64),
                np.array([], dtype=np.int64),
            )
        )


def test_prune_keeps_ancestors_and_budgets():
    rng = np.random.default_rng(1)
    for _ in range(50):
        t = random_tree(rng, int(rng.integers(1, 30)))
        max_depth = int(rng.integers(0, 6))
        max_nodes = int(rng.integers(1, 30))
        p = flatten(prune(t, max_depth=max_depth, max_nodes=max_nodes))
        assert len(p) <= max_nodes and p.depths.max() <= max_depth
        keep = [i for i in range(len(t)) if t.depths[i] <= max_depth][:max_nodes]
        assert p.tokens.tolist() == t.tokens[keep].tolist()
        # parent of a kept node maps to its original parent
        for new, old in enumerate(keep):
            if new:
                assert keep[p.parents[new]] == t.parents[old]


def test_greedy_accept_is_longest_argmax_path():
    rng = np.random.default_rng(2)
    sampler = Sampler(SamplingParams())
    for _ in range(200):
        t = random_tree(rng, int(rng.integers(1, 25)), vocab=4)
        # Like a real model, a node's logits depend only on its context (the
        # tokens on its root path), so repeated sibling tokens agree.
        table: dict[tuple, torch.Tensor] = {}
        rows = []
        for node in range(len(t)):
            key = []
            j = node
            while j > 0:
                key.append(int(t.tokens[j]))
                j = int(t.parents[j])
            key = tuple(key[::-1])
            if key not in table:
                table[key] = torch.from_numpy(rng.normal(size=4)).float()
            rows.append(table[key])
        logits = torch.stack(rows)
        acc = accept(t, logits, sampler)
        # brute force: all root paths whose every token = argmax of its parent's logits
        best = [0]
        for node in range(len(t)):
            path = []
            j = node
            while j >= 0:
                path.append(j)
                j = int(t.parents[j])
            path = path[::-1]
            ok = all(int(t.tokens[c]) == int(logits[p].argmax()) for p, c in zip(path, path[1:]))
            if ok and len(path) > len(best):
                best = path
        assert len(acc.path) == len(best)
        # (duplicate sibling tokens: the walk takes the first; lengths agree either way)
        assert acc.bonus == int(logits[acc.path[-1]].argmax())
        assert acc.accepted == len(acc.path) - 1
