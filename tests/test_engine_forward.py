"""The packed forwards against one-sequence references: ``TargetModel.forward_batch`` over
several sequences' blocks (different prefixes, tree masks, a causal block) equals one
``forward`` per sequence, through the torch path and through the native layer ops (which
run on any CPU; their products are torch's here unless AVX-512F is present); the batched
draft (``DartDrafter.draft_batch``, ``NativeDraft.draft_batch``) equals one ``draft`` per
sequence; the KV pool's slots are views that never move."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_model
from dartcore.acceptance import ancestor_mask
from dartcore.kernels.linear import native_linear_available
from dartcore.models.kv_pool import KVPool, PoolFullError
from dartcore.models.transformer import NativeLayerOps, TargetModel
from test_decoder import random_tree

torch.set_num_threads(1)


def _blocks(rng, n_seq):
    prefixes = [rng.integers(3, 64, size=int(k)).tolist() for k in rng.integers(1, 40, size=n_seq)]
    trees = [
        random_tree(rng, int(rng.integers(3, 64)), 64, int(rng.integers(1, 7)), 3)
        for _ in range(n_seq)
    ]
    return prefixes, trees


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("ops", ["torch", "native-ops"])
def test_forward_batch_equals_one_forward_per_sequence(family, ops):
    pytest.importorskip("dartcore._native")
    if ops == "native-ops" and not native_linear_available():
        pytest.skip(
            "the native layer stack needs the native products (AVX-512F or AVX2 + FMA + F16C)"
        )
    # native-ops: the whole layer stack in one native call; torch: column-major torch products
    target = TargetModel(tiny_model(family), native_linear=ops == "native-ops")
    assert isinstance(target._ops, NativeLayerOps) == (ops == "native-ops")
    rng = np.random.default_rng(0)
    prefixes, trees = _blocks(rng, 3)
    pool = KVPool.for_target(target, None, slots=3, capacity=64)
    caches = [pool.acquire()[1] for _ in range(3)]
    refs = [target.new_cache(64) for _ in range(3)]
    for p, c, r in zip(prefixes, caches, refs):
        for cache in (c, r):
            target.forward(cache, torch.tensor(p), torch.arange(len(p)))
            cache.commit(len(p))
    sizes = [len(t) for t in trees]
    masks = [torch.from_numpy(ancestor_mask(t.parents)) for t in trees]
    masks[1] = None  # a causal block among tree blocks
    tokens = torch.from_numpy(np.concatenate([t.tokens for t in trees]))
    positions = torch.from_numpy(
        np.concatenate([t.depths + len(p) for t, p in zip(trees, prefixes)])
    )
    positions[sizes[0] : sizes[0] + sizes[1]] = torch.arange(sizes[1]) + len(prefixes[1])
    taps = (1, target.num_layers)
    out = target.forward_batch(caches, sizes, tokens, positions, masks, taps=taps)
    a = 0
    target._ops = None  # the reference: the torch path, one sequence at a time
    for i, (t, p, r) in enumerate(zip(trees, prefixes, refs)):
        pos = positions[a : a + sizes[i]]
        ref = target.forward(r, torch.from_numpy(t.tokens), pos, masks[i], taps=taps)
        assert torch.allclose(out.logits[a : a + sizes[i]], ref.logits, atol=1e-4, rtol=1e-4)
        assert torch.allclose(out.taps[a : a + sizes[i]], ref.taps, atol=1e-4, rtol=1e-4)
        n = len(p) + sizes[i]
        assert torch.allclose(caches[i].k[:, :, :n], r.k[:, :, :n], atol=1e-4, rtol=1e-4), float(
            (caches[i].k[:, :, :n] - r.k[:, :, :n]).abs().max()
        )
        a += sizes[i]


def _drafter(target_hf, d=4):
    from dartcore.drafter import DartDrafter

    torch.manual_seed(0)
    dr = DartDrafter.from_target(target_hf, d=d)
    with torch.no_grad():
        for p in dr.parameters():
            p.mul_(3.0)
    return dr.eval()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("path", ["torch", "native-ops"])
def test_draft_batch_equals_one_draft_per_sequence(family, path):
    from dartcore.kernels.native_draft import NativeDraft

    hf = tiny_model(family, layers=6)
    dr = _drafter(hf)
    rng = np.random.default_rng(1)
    n_new = [3, 1, 5]
    rows = [4, 1, 2]
    H = hf.config.hidden_size
    starts = [7, 0, 20]
    taps = [torch.randn(n, 3 * H) for n in n_new]
    nexts = [torch.from_numpy(rng.integers(0, 64, size=n)) for n in n_new]
    pre_taps = [torch.randn(s, 3 * H) for s in starts]
    pre_next = [torch.from_numpy(rng.integers(0, 64, size=s)) for s in starts]
    if path == "native-ops":
        pytest.importorskip("dartcore._native")
        batched = NativeDraft(
            dr, threads=1, product=lambda w, b: lambda x: torch.nn.functional.linear(x, w, b)
        )
    else:
        batched = dr
    pool = KVPool(
        slots=3,
        capacity=64,
        layers=1,
        kv_heads=1,
        head_dim=1,
        dtype=torch.float32,
        device="cpu",
        drafter_shape=(dr.config.num_key_value_heads, dr.config.head_dim, torch.float32),
    )
    states = [pool.acquire()[2] for _ in range(3)]
    refs = [dr.new_state(64) for _ in range(3)]
    for s, r, t, x in zip(states, refs, pre_taps, pre_next):
        if t.shape[0]:
            dr.draft(s, t, x, rows=1)
            dr.draft(r, t, x, rows=1)
    got = batched.draft_batch(states, taps, nexts, rows, return_hidden=True)
    for (logits, hidden), r, t, x, k in zip(got, refs, taps, nexts, rows):
        ref_logits, ref_hidden = dr.draft(r, t, x, rows=k, return_hidden=True)
        assert logits.shape == ref_logits.shape == (k, dr.lm_head.out_features)
        assert torch.allclose(logits, ref_logits, atol=1e-4, rtol=1e-4)
        assert torch.allclose(hidden, ref_hidden, atol=1e-4, rtol=1e-4)
    for s, r in zip(states, refs):
        assert s.length == r.length
        assert torch.allclose(s.k[:, : s.length], r.k[:, : r.length], atol=1e-5)


def test_pool_slots_are_fixed_views():
    pool = KVPool(
        slots=2, capacity=8, layers=2, kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu"
    )
    assert pool.nbytes == 2 * 2 * 2 * 1 * 8 * 4 * 4
    s0, c0, d0 = pool.acquire()
    s1, c1, _ = pool.acquire()
    assert (s0, s1) == (0, 1) and d0 is None
    c1.write(0, torch.ones(1, 3, 4), torch.ones(1, 3, 4))
    assert pool.k[1, 0, 0, :3].eq(1).all() and pool.k[0].eq(0).all()
    with pytest.raises(PoolFullError, match="all 2 KV slots"):
        pool.acquire()
    pool.release(0)
    with pytest.raises(Exception, match="not in use"):
        pool.release(0)
    assert pool.acquire()[0] == 0
    with pytest.raises(ValueError):
        KVPool(
            slots=0, capacity=8, layers=1, kv_heads=1, head_dim=1, dtype=torch.float32, device="cpu"
        )
