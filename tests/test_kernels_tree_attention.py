"""Tree attention: the PyTorch reference against brute-force softmax loops,
and the Triton kernel against the reference under TRITON_INTERPRET=1 (CPU).

The CUDA path of the Triton kernel is covered by the ``gpu`` tests, which
skip on CPU-only machines; ``tools/device_check.sh`` runs them on a GPU.
Tolerance: 1e-5 absolute on unit-scale random inputs (fp32).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dartcore.acceptance import ancestor_mask
from dartcore.kernels.tree_attention import (
    force_backend,
    pack_block_mask,
    tree_attention,
    tree_attention_reference,
)

REPO = Path(__file__).resolve().parents[1]


def random_parents(rng, n):
    return np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])


def brute_force(q, k, v, prefix_len, block_mask, scale):
    heads, n, d = q.shape
    group = heads // k.shape[0]
    out = torch.zeros(heads, n, d, dtype=torch.float64)
    for h in range(heads):
        kv = h // group
        for i in range(n):
            keys = [j for j in range(prefix_len)] + [
                prefix_len + j for j in range(n) if block_mask[i, j]
            ]
            s = [float(q[h, i].double() @ k[kv, j].double()) * scale for j in keys]
            m = max(s)
            w = [math.exp(x - m) for x in s]
            z = sum(w)
            for wj, j in zip(w, keys):
                out[h, i] += wj / z * v[kv, j].double()
    return out


@pytest.mark.parametrize(
    "heads,kv_heads,prefix,n", [(2, 2, 0, 1), (4, 2, 5, 7), (6, 3, 11, 13), (4, 1, 0, 9)]
)
def test_reference_equals_brute_force(heads, kv_heads, prefix, n):
    rng = np.random.default_rng(heads * 100 + n)
    g = torch.Generator().manual_seed(n)
    d = 8
    q = torch.randn(heads, n, d, generator=g)
    k = torch.randn(kv_heads, prefix + n, d, generator=g)
    v = torch.randn(kv_heads, prefix + n, d, generator=g)
    mask = torch.from_numpy(ancestor_mask(random_parents(rng, n)))
    got = tree_attention_reference(q, k, v, prefix, mask, scale=d**-0.5)
    want = brute_force(q, k, v, prefix, mask, d**-0.5)
    assert torch.allclose(got.double(), want, atol=1e-5)


def test_pack_block_mask_bits():
    rng = np.random.default_rng(0)
    for n in (1, 5, 63, 64, 65, 130):
        mask = torch.from_numpy(rng.random((n, n)) < 0.3)
        bits = pack_block_mask(mask).numpy()
        assert bits.shape == (n, (n + 63) // 64) and bits.dtype == np.int64
        for i in range(n):
            for j in range(n):
                word = int(bits[i, j // 64]) & ((1 << 64) - 1)
                assert bool((word >> (j % 64)) & 1) == bool(mask[i, j])


def test_dispatcher_override():
    q = torch.randn(2, 3, 8)
    k = torch.randn(2, 3, 8)
    mask = torch.ones(3, 3, dtype=torch.bool).tril()
    with force_backend("reference"):
        a = tree_attention(q, k, k, 0, mask, scale=0.3)
    assert torch.allclose(a, tree_attention_reference(q, k, k, 0, mask, scale=0.3))
    with pytest.raises(ValueError):
        with force_backend("cuda-magic"):
            pass


_INTERPRETER_SCRIPT = r"""
import numpy as np, torch
from dartcore.kernels.tree_attention import force_backend, tree_attention, tree_attention_reference
from dartcore.models.cache import KVCache
from dartcore.acceptance import ancestor_mask
rng = np.random.default_rng(0)
worst = 0.0
for heads, kv_heads, prefix, n, d in [(2, 2, 0, 1, 8), (4, 2, 37, 70, 16), (3, 1, 5, 129, 32), (4, 4, 64, 17, 64)]:
    g = torch.Generator().manual_seed(n)
    q = torch.randn(heads, n, d, generator=g)
    k = torch.randn(kv_heads, prefix + n, d, generator=g)
    v = torch.randn(kv_heads, prefix + n, d, generator=g)
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
    mask = torch.from_numpy(ancestor_mask(parents))
    with force_backend("triton"):
        a = tree_attention(q, k, v, prefix, mask, scale=d ** -0.5)
    b = tree_attention_reference(q, k, v, prefix, mask, scale=d ** -0.5)
    worst = max(worst, float((a - b).abs().max()))
# the whole target forward (cache slices as k/v, GQA, tree mask) through the kernel
from transformers import LlamaConfig, AutoModelForCausalLM
from dartcore.models.transformer import TargetModel
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
target = TargetModel(AutoModelForCausalLM.from_config(cfg).eval())
parents = np.array([-1, 0, 0, 1, 1, 2, 4])
depths = np.array([0, 1, 1, 2, 2, 2, 3])
outs = []
for backend in ("triton", "reference"):
    cache = target.new_cache(40)
    with force_backend(backend):
        target.forward(cache, torch.arange(3, 23), torch.arange(20))
        cache.commit(20)
        outs.append(target.forward(cache, torch.arange(30, 37), torch.from_numpy(depths + 20),
                                   torch.from_numpy(ancestor_mask(parents))).logits)
worst = max(worst, float((outs[0] - outs[1]).abs().max()) / float(outs[1].abs().max()))
# a packed batch in one launch: sequences in slots of one KV pool, each with its own prefix
# length (0 included), block size, mask (None = causal) and position in the packing
from dartcore.kernels.tree_attention import pack_block_mask
from dartcore.kernels.triton_tree import PackedAttention
from dartcore.models.kv_pool import KVPool
pool = KVPool(slots=4, capacity=200, layers=3, kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu")
seqs = [(0, 5), (37, 1), (120, 70), (3, 9)]  # (prefix, block rows)
caches, masks, bits = [], [], []
for prefix, n in seqs:
    _, cache, _ = pool.acquire()
    cache.k[:, :, :prefix + n] = torch.randn(3, 2, prefix + n, 16)
    cache.v[:, :, :prefix + n] = torch.randn(3, 2, prefix + n, 16)
    cache.commit(prefix)
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
    m = None if n == 9 else torch.from_numpy(ancestor_mask(parents))
    caches.append(cache)
    masks.append(m)
    bits.append(pack_block_mask(m if m is not None else torch.ones(n, n, dtype=torch.bool).tril()))
assert PackedAttention.supports(caches) and not PackedAttention.supports([caches[0], KVCache(3, 2, 16, 50, dtype=torch.float32, device="cpu")])
plan = PackedAttention(caches, [n for _, n in seqs], bits)
total = sum(n for _, n in seqs)
for layer in range(3):
    q = torch.randn(4, total, 16)
    got = plan(q, layer, scale=0.25)
    a = 0
    for cache, (prefix, n), m in zip(caches, seqs, masks):
        keys, values = cache.view(layer, n)
        ref = tree_attention_reference(q[:, a:a + n], keys, values, prefix,
                                       m if m is not None else torch.ones(n, n, dtype=torch.bool).tril(), scale=0.25)
        worst = max(worst, float((got[:, a:a + n] - ref).abs().max()))
        a += n
print("MAXDIFF", worst)
"""


def test_triton_kernel_matches_reference_in_interpreter():
    pytest.importorskip("triton")
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=str(REPO / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if (
        proc.returncode != 0
        and "interpret" in proc.stderr.lower()
        and "not supported" in proc.stderr.lower()
    ):
        pytest.skip(f"Triton interpreter cannot run this kernel here: {proc.stderr[-500:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    worst = float(proc.stdout.split("MAXDIFF")[1])
    assert worst < 1e-5


@pytest.mark.gpu
def test_triton_kernel_matches_reference_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    rng = np.random.default_rng(1)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):  # fp32: IEEE dots, not TF32
        for heads, kv_heads, prefix, n, d in [
            (9, 3, 300, 60, 64),
            (16, 8, 1000, 128, 128),
            (4, 2, 0, 1, 64),
        ]:
            q = torch.randn(heads, n, d, device="cuda", dtype=dtype)
            k = torch.randn(kv_heads, prefix + n, d, device="cuda", dtype=dtype)
            v = torch.randn(kv_heads, prefix + n, d, device="cuda", dtype=dtype)
            parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
            mask = torch.from_numpy(ancestor_mask(parents)).cuda()
            with force_backend("triton"):
                a = tree_attention(q, k, v, prefix, mask, scale=d**-0.5)
            b = tree_attention_reference(q, k, v, prefix, mask, scale=d**-0.5)
            assert (a.float() - b.float()).abs().max() < tol
