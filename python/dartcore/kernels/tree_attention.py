"""Tree attention: n new query rows attend to a cached prefix (all of it) and
to the new block through a boolean block mask (a tree's ancestor mask, or a
causal mask for prefill).

Two implementations behind one dispatcher:

* :func:`tree_attention_reference` -- PyTorch (matmul, masked softmax in fp32
  over prefix + block). Runs everywhere; the CPU path.
* ``dartcore.kernels.triton_tree.tree_attention_triton`` -- a Triton kernel
  that never materialises the dense mask: the prefix is visible by
  construction and the block mask travels as 64-bit ancestor words
  (:func:`pack_block_mask`). Used on CUDA when Triton is importable.

``_FORCE`` is the private override tests use to pick one path:
``with force_backend("reference"): ...``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F

__all__ = [
    "tree_attention",
    "tree_attention_reference",
    "pack_block_mask",
    "force_backend",
    "backend_for",
]

_FORCE: str | None = None  # None = automatic; "reference" | "triton"


@contextlib.contextmanager
def force_backend(name: str | None) -> Iterator[None]:
    """Force the dispatcher to one backend inside a ``with`` block (tests)."""
    global _FORCE
    if name not in (None, "reference", "triton"):
        raise ValueError(f"unknown tree-attention backend {name!r}")
    old, _FORCE = _FORCE, name
    try:
        yield
    finally:
        _FORCE = old


def _triton_usable(device: torch.device) -> bool:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def backend_for(device: torch.device) -> str:
    if _FORCE is not None:
        return _FORCE
    return "triton" if device.type == "cuda" and _triton_usable(device) else "reference"


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    block_mask: torch.Tensor | None,
    *,
    scale: float,
) -> torch.Tensor:
    """Attention of a block of new rows over prefix + block.

    q: ``[heads, n, D]``; k, v: ``[kv_heads, prefix_len + n, D]`` (the block's
    own keys already appended); ``heads`` a multiple of ``kv_heads`` (GQA).
    block_mask: bool ``[n, n]``, ``block_mask[i, j]`` = row i sees new key j
    (every row must see itself), or None for a causal block. Returns
    ``[heads, n, D]`` in q's dtype.
    """
    n = q.shape[1]
    if block_mask is None and prefix_len == 0 and n >= _SDPA_CAUSAL_MIN:
        # Long causal prefill: SDPA's fused causal kernel never builds the
        # [n, n] scores (an 8k-token prompt would need GBs for them).
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[0] != k.shape[0]
        )
    if block_mask is None:
        block_mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril_()
    if backend_for(q.device) == "triton":
        from dartcore.kernels.triton_tree import tree_attention_triton

        return tree_attention_triton(q, k, v, prefix_len, _packed(block_mask), scale=scale)
    return tree_attention_reference(q, k, v, prefix_len, block_mask, scale=scale)


# The last forward's packed masks by mask object: every layer of one forward passes the same
# masks (one per sequence of a packed batch), so each is packed once per forward.
_PACKED: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
_PACKED_KEEP = 64


def _packed(block_mask: torch.Tensor) -> torch.Tensor:
    """pack_block_mask, reused while the same mask object comes back."""
    hit = _PACKED.get(id(block_mask))
    if hit is None or hit[0] is not block_mask:
        if len(_PACKED) >= _PACKED_KEEP:
            _PACKED.clear()
        hit = _PACKED[id(block_mask)] = (block_mask, pack_block_mask(block_mask))
    return hit[1]


# Below this many rows the plain reference is faster on CPU than SDPA's dispatch.
_SDPA_CAUSAL_MIN = 256


def tree_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    block_mask: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    # Plain matmul / masked softmax (fp32) rather than F.scaled_dot_product_attention:
    # at batch 1 with a handful of rows SDPA's CPU kernel costs ~1 ms of dispatch
    # and thread start-up per call (0.03 ms for this on 4 heads x 40 keys, measured
    # on the 2-core dev box), which dominated a tiny model's decode step.
    heads, n, head_dim = q.shape
    kv_heads, total, _ = k.shape
    if total != prefix_len + n:
        raise ValueError(f"keys cover {total} slots, expected prefix {prefix_len} + block {n}")
    group = heads // kv_heads
    qg = q.reshape(kv_heads, group * n, head_dim)  # query heads sharing a KV head, stacked
    scores = torch.matmul(qg, k.transpose(1, 2)).float().mul_(scale)  # [kv_heads, group * n, total]
    scores = scores.view(kv_heads, group, n, total)
    hidden = ~block_mask.to(q.device)
    scores[..., prefix_len:].masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(kv_heads, group * n, total)
    return torch.matmul(probs, v).view(heads, n, head_dim)


def pack_block_mask(block_mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool ``[n, n]`` mask into int64 words ``[n, ceil(n / 64)]``:
    bit ``j % 64`` of word ``j // 64`` of row i is ``block_mask[i, j]``."""
    n = block_mask.shape[0]
    words = (n + 63) // 64
    padded = torch.zeros(n, words * 64, dtype=torch.int64, device=block_mask.device)
    padded[:, :n] = block_mask.to(torch.int64)
    weights = torch.ones(64, dtype=torch.int64, device=block_mask.device) << torch.arange(
        64, dtype=torch.int64, device=block_mask.device
    )
    # Distinct powers of two: the wrapping int64 sum is a bitwise OR (bit 63
    # makes the word negative, which is the right two's-complement pattern).
    return (padded.view(n, words, 64) * weights).sum(-1)
