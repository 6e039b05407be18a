"""Triton tree-attention kernel: cached prefix + tree block with 64-bit
ancestor words.

One program handles BLOCK_M query rows of one head. It streams the prefix keys
(always visible, no mask loads) and then the block keys, whose visibility is
bit ``j % 64`` of word ``j // 64`` of the row's ancestor words, with an online
softmax in fp32. Versus the reference this never builds the dense
``[n, prefix + n]`` mask, and the prefix loop does no masking work at all.

The PyTorch reference is ``dartcore.kernels.tree_attention.tree_attention_reference``;
tests compare the two under ``TRITON_INTERPRET=1`` on CPU and on CUDA (``gpu``
tests, ``tools/device_check.sh``). Float32 inputs use IEEE fp32 dots, not TF32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["tree_attention_triton"]


@triton.jit
def _tree_attn_kernel(
    q_ptr, k_ptr, v_ptr, bits_ptr, out_ptr,
    n, prefix_len, words, group, scale,
    sq_h, sq_n, sk_h, sk_s, sv_h, sv_s, so_h, so_n,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < n
    dim_ok = dims < HEAD_DIM

    q = tl.load(q_ptr + head * sq_h + rows[:, None] * sq_n + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], -1.0e38, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    total = prefix_len + n

    # Prefix: every cached key is visible to every row.
    for start in range(0, prefix_len, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < prefix_len
        k = tl.load(k_ptr + kv_head * sk_h + keys[:, None] * sk_s + dims[None, :],
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        v = tl.load(v_ptr + kv_head * sv_h + keys[:, None] * sv_s + dims[None, :],
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        m_i = m_new

    # Tree block: key j (0-based inside the block) is visible to row i iff
    # bit j % 64 of bits[i, j // 64] is set.
    for start in range(prefix_len, total, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < total
        j = keys - prefix_len
        word = tl.load(bits_ptr + rows[:, None] * words + (j // 64)[None, :],
                       mask=row_ok[:, None] & key_ok[None, :], other=0)
        visible = ((word >> (j % 64).to(tl.int64)[None, :]) & 1) != 0
        k = tl.load(k_ptr + kv_head * sk_h + keys[:, None] * sk_s + dims[None, :],
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        v = tl.load(v_ptr + kv_head * sv_h + keys[:, None] * sv_s + dims[None, :],
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        s = tl.where(visible & key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        m_i = m_new

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows only; real rows see themselves
    out = acc / l_i[:, None]
    tl.store(out_ptr + head * so_h + rows[:, None] * so_n + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def tree_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                          bits: torch.Tensor, *, scale: float, block_m: int = 16,
                          block_n: int = 32) -> torch.Tensor:
    """q ``[heads, n, D]``, k/v ``[kv_heads, prefix_len + n, D]`` (last dim
    contiguous), bits int64 ``[n, ceil(n / 64)]``. Returns ``[heads, n, D]``."""
    heads, n, head_dim = q.shape
    kv_heads = k.shape[0]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    if k.shape[1] != prefix_len + n or v.shape[1] != prefix_len + n:
        raise ValueError("keys/values must cover the prefix plus the block")
    words = (n + 63) // 64
    if tuple(bits.shape) != (n, words) or bits.dtype != torch.int64:
        raise ValueError(f"bits must be int64 [{n}, {words}], got {tuple(bits.shape)} {bits.dtype}")
    q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    bits = bits.contiguous()
    out = torch.empty_like(q)
    block_d = max(16, triton.next_power_of_2(head_dim))
    grid = (triton.cdiv(n, block_m), heads)
    _tree_attn_kernel[grid](
        q, k, v, bits, out,
        n, prefix_len, words, heads // kv_heads, float(scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        # fp32 stays fp32 (Triton's default for a float32 dot is TF32, ~1e-3 relative
        # error, enough to flip a greedy argmax against the target's own fp32 forward).
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
