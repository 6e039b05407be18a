"""Triton tree-attention kernel: cached prefix + tree block with 64-bit
ancestor words.

One program handles BLOCK_M query rows of one head of one sequence. It streams the prefix keys
(always visible, no mask loads) and then the block keys, whose visibility is
bit ``j % 64`` of word ``j // 64`` of the row's ancestor words, with an online
softmax in fp32. Versus the reference this never builds the dense
``[n, prefix + n]`` mask, and the prefix loop does no masking work at all.

Packed batches: one launch serves every sequence of a batched verify forward
(:class:`PackedAttention`). Each sequence has its own rows of the packed q/out, its own
prefix length, its own mask words and its own keys/values: views of one KV pool (same
storage, same strides), addressed by element offsets from one base pointer, so a batch of
B sequences costs one launch per layer instead of B. A single block is the one-sequence case
of the same kernel (:func:`tree_attention_triton`).

The PyTorch reference is ``dartcore.kernels.tree_attention.tree_attention_reference``;
tests compare the two under ``TRITON_INTERPRET=1`` on CPU and on CUDA (``gpu``
tests, ``tools/device_check.sh``). Float32 inputs use IEEE fp32 dots, not TF32.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["PackedAttention", "tree_attention_triton"]


@triton.jit
def _tree_attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bits_ptr,
    out_ptr,
    table_ptr,
    seg_ptr,
    group,
    scale,
    layer_k,
    layer_v,
    sq_h,
    sq_n,
    sk_h,
    sk_s,
    sv_h,
    sv_s,
    so_h,
    so_n,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # table[p] = (segment, first row of the block inside it); seg[s] = (first packed row,
    # rows n, prefix length, key offset, value offset, first mask word, words per row).
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    seg = tl.load(table_ptr + 2 * pid_m)
    m0 = tl.load(table_ptr + 2 * pid_m + 1)
    row0 = tl.load(seg_ptr + 7 * seg)
    n = tl.load(seg_ptr + 7 * seg + 1)
    prefix_len = tl.load(seg_ptr + 7 * seg + 2)
    k_base = k_ptr + tl.load(seg_ptr + 7 * seg + 3) + layer_k
    v_base = v_ptr + tl.load(seg_ptr + 7 * seg + 4) + layer_v
    bits_base = bits_ptr + tl.load(seg_ptr + 7 * seg + 5)
    words = tl.load(seg_ptr + 7 * seg + 6)
    kv_head = head // group
    rows = m0 + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < n
    dim_ok = dims < HEAD_DIM

    q = tl.load(
        q_ptr + head * sq_h + (row0 + rows)[:, None] * sq_n + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], -1.0e38, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    total = prefix_len + n

    # Prefix: every cached key is visible to every row.
    for start in range(0, prefix_len, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < prefix_len
        k = tl.load(
            k_base + kv_head * sk_h + keys[:, None] * sk_s + dims[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        v = tl.load(
            v_base + kv_head * sv_h + keys[:, None] * sv_s + dims[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(
            tl.float32
        )
        m_i = m_new

    # Tree block: key j (0-based inside the block) is visible to row i iff
    # bit j % 64 of bits[i, j // 64] is set.
    for start in range(prefix_len, total, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < total
        j = keys - prefix_len
        word = tl.load(
            bits_base + rows[:, None] * words + (j // 64)[None, :],
            mask=row_ok[:, None] & key_ok[None, :],
            other=0,
        )
        visible = ((word >> (j % 64).to(tl.int64)[None, :]) & 1) != 0
        k = tl.load(
            k_base + kv_head * sk_h + keys[:, None] * sk_s + dims[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        v = tl.load(
            v_base + kv_head * sv_h + keys[:, None] * sv_s + dims[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        s = tl.where(visible & key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(
            tl.float32
        )
        m_i = m_new

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows only; real rows see themselves
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + head * so_h + (row0 + rows)[:, None] * so_n + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def _tables(
    sizes, prefix_lens, key_offsets, value_offsets, word_offsets, words, block_m: int, device
):
    """The kernel's int64 program table and segment table (see the kernel)."""
    table, seg, row0 = [], [], 0
    for i, n in enumerate(sizes):
        table += [x for m0 in range(0, n, block_m) for x in (i, m0)]
        seg += [
            row0,
            n,
            prefix_lens[i],
            key_offsets[i],
            value_offsets[i],
            word_offsets[i],
            words[i],
        ]
        row0 += n
    as_t = functools.partial(torch.tensor, dtype=torch.int64, device=device)
    return as_t(table).view(-1, 2), as_t(seg)


def _launch(
    q,
    k,
    v,
    bits,
    table,
    seg,
    out,
    *,
    group: int,
    scale: float,
    layer_k: int = 0,
    layer_v: int = 0,
    sk=None,
    sv=None,
    block_m: int,
    block_n: int,
) -> torch.Tensor:
    heads, _, head_dim = q.shape
    sk = sk or (k.stride(-3), k.stride(-2))
    sv = sv or (v.stride(-3), v.stride(-2))
    block_d = max(16, triton.next_power_of_2(head_dim))
    _tree_attn_kernel[(table.shape[0], heads)](
        q,
        k,
        v,
        bits,
        out,
        table,
        seg,
        group,
        float(scale),
        layer_k,
        layer_v,
        q.stride(0),
        q.stride(1),
        sk[0],
        sk[1],
        sv[0],
        sv[1],
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        # fp32 stays fp32 (Triton's default for a float32 dot is TF32, ~1e-3 relative
        # error, enough to flip a greedy argmax against the target's own fp32 forward).
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out


def tree_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    bits: torch.Tensor,
    *,
    scale: float,
    block_m: int = 16,
    block_n: int = 32,
) -> torch.Tensor:
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
    table, seg = _tables([n], [prefix_len], [0], [0], [0], [words], block_m, q.device)
    return _launch(
        q,
        k,
        v,
        bits,
        table,
        seg,
        torch.empty_like(q),
        group=heads // kv_heads,
        scale=scale,
        block_m=block_m,
        block_n=block_n,
    )


class PackedAttention:
    """One kernel launch per layer for a packed batch of sequences (see the module docs).

    ``caches``: the sequences' :class:`~dartcore.models.cache.KVCache` (views of one pool:
    :meth:`supports` says whether they are), ``sizes``: their block rows in packing order,
    ``bits``: their packed masks (:func:`dartcore.kernels.tree_attention.pack_block_mask`).
    Built once per forward (the tables go to the device once); :meth:`__call__` per layer,
    after the layer's keys/values were written to the caches."""

    def __init__(self, caches, sizes, bits, *, block_m: int = 16, block_n: int = 32):
        if not self.supports(caches):
            raise ValueError(
                "packed attention needs caches that are views of one pool (same storage and strides)"
            )
        self.k0, self.v0 = caches[0].k, caches[0].v
        es = self.k0.element_size()
        koff = [(c.k.data_ptr() - self.k0.data_ptr()) // es for c in caches]
        voff = [(c.v.data_ptr() - self.v0.data_ptr()) // es for c in caches]
        words = [int(b.shape[1]) for b in bits]
        word_off = [0]
        for b in bits[:-1]:
            word_off.append(word_off[-1] + b.numel())
        self.bits = torch.cat([b.reshape(-1) for b in bits]).contiguous()
        self.table, self.seg = _tables(
            [int(s) for s in sizes],
            [int(c.length) for c in caches],
            koff,
            voff,
            word_off,
            words,
            block_m,
            self.k0.device,
        )
        self.block_m, self.block_n = block_m, block_n

    @staticmethod
    def supports(caches) -> bool:
        """Whether every cache's keys/values share the first's storage and strides (a pool's
        slots do; separately allocated caches do not)."""
        k0, v0 = caches[0].k, caches[0].v
        if k0.stride(-1) != 1 or v0.stride(-1) != 1:
            return False
        ks, vs = k0.untyped_storage().data_ptr(), v0.untyped_storage().data_ptr()
        return all(
            c.k.untyped_storage().data_ptr() == ks
            and c.v.untyped_storage().data_ptr() == vs
            and c.k.stride() == k0.stride()
            and c.v.stride() == v0.stride()
            for c in caches
        )

    def __call__(self, q: torch.Tensor, layer: int, *, scale: float) -> torch.Tensor:
        """q ``[heads, N, D]`` (every sequence's rows, packed) -> ``[heads, N, D]``."""
        heads = q.shape[0]
        kv_heads = self.k0.shape[1]
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
        q = q.contiguous()
        return _launch(
            q,
            self.k0,
            self.v0,
            self.bits,
            self.table,
            self.seg,
            torch.empty_like(q),
            group=heads // kv_heads,
            scale=scale,
            layer_k=layer * self.k0.stride(0),
            layer_v=layer * self.v0.stride(0),
            sk=(self.k0.stride(1), self.k0.stride(2)),
            sv=(self.v0.stride(1), self.v0.stride(2)),
            block_m=self.block_m,
            block_n=self.block_n,
        )
