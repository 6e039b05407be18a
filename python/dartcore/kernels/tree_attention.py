"""Tree attention: n new query rows attend to a cached prefix (all of it) and
to the new block through a boolean block mask (a tree's ancestor mask, or a
causal mask for prefill).

Two implementations behind one dispatcher:

* :func:`tree_attention_reference` -- PyTorch (SDPA with a dense boolean mask
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

__all__ = ["tree_attention", "tree_attention_reference", "pack_block_mask", "force_backend", "backend_for"]

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


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                   block_mask: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Attention of a block of new rows over prefix + block.

    q: ``[heads, n, D]``; k, v: ``[kv_heads, prefix_len + n, D]`` (the block's
    own keys already appended); ``heads`` a multiple of ``kv_heads`` (GQA).
    block_mask: bool ``[n, n]``, ``block_mask[i, j]`` = row i sees new key j;
    every row must see itself. Returns ``[heads, n, D]`` in q's dtype.
    """
    if backend_for(q.device) == "triton":
        from dartcore.kernels.triton_tree import tree_attention_triton

        return tree_attention_triton(q, k, v, prefix_len, pack_block_mask(block_mask), scale=scale)
    return tree_attention_reference(q, k, v, prefix_len, block_mask, scale=scale)


def tree_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                             block_mask: torch.Tensor, *, scale: float) -> torch.Tensor:
    n = q.shape[1]
    if k.shape[1] != prefix_len + n:
        raise ValueError(f"keys cover {k.shape[1]} slots, expected prefix {prefix_len} + block {n}")
    if prefix_len == 0 and n > 1 and _is_causal(block_mask):
        # Prefill: let SDPA pick its fused causal path instead of a dense mask.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=q.shape[0] != k.shape[0])
    mask = torch.ones(n, prefix_len + n, dtype=torch.bool, device=q.device)
    mask[:, prefix_len:] = block_mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[0] != k.shape[0])


def _is_causal(block_mask: torch.Tensor) -> bool:
    n = block_mask.shape[0]
    return bool(torch.equal(block_mask, torch.ones(n, n, dtype=torch.bool, device=block_mask.device).tril()))


def pack_block_mask(block_mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool ``[n, n]`` mask into int64 words ``[n, ceil(n / 64)]``:
    bit ``j % 64`` of word ``j // 64`` of row i is ``block_mask[i, j]``."""
    n = block_mask.shape[0]
    words = (n + 63) // 64
    padded = torch.zeros(n, words * 64, dtype=torch.int64, device=block_mask.device)
    padded[:, :n] = block_mask.to(torch.int64)
    weights = torch.ones(64, dtype=torch.int64, device=block_mask.device) << torch.arange(
        64, dtype=torch.int64, device=block_mask.device)
    # Distinct powers of two: the wrapping int64 sum is a bitwise OR (bit 63
    # makes the word negative, which is the right two's-complement pattern).
    return (padded.view(n, words, 64) * weights).sum(-1)
