"""Triton kernels for a Gated DeltaNet layer over a draft tree: every node's states from its
parent's.

A tree node i (rows in topological order: ``parents[i] < i``, -1 = the committed state) has

* a convolution window: its parent's window shifted by one column, its own input last
  (Hugging Face's ``causal_conv1d_update`` on the parent's ``[C, K]`` state), and the conv
  output ``act(sum_t w[c, t] * window[c, t] + bias[c])`` (:func:`tree_conv_triton`);
* a recurrent state: the gated delta rule on its parent's,
  ``S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T``, with ``k`` and ``q`` l2-normed and ``q``
  scaled by ``key_dim ** -0.5``, and the output ``S^T q`` (Hugging Face's
  ``torch_recurrent_gated_delta_rule`` one node at a time; :func:`tree_delta_rule_triton`).

Each program walks all nodes in order for one slice (a block of channels; one value head's
block of value columns). A node whose parent is the node just before it (a chain, a tree's
first child) keeps the state in registers; any other reloads its parent's from the per-node
state buffer, which the kernel writes for every node anyway (acceptance commits one of them).
So a chain costs one state write per node and no reload; a tree adds one reload per branch.

Chains longer than one step (a prompt) are the chunked kernels' work (``flash-linear-attention``
where installed, else Hugging Face's torch form); these kernels serve the draft trees. The torch
reference is the Hugging Face functions node by node (``HybridTarget(tree_form="recurrent")`` off
CUDA); tests compare them under ``TRITON_INTERPRET=1`` on CPU and on CUDA (``gpu`` tests,
``tools/device_check.sh``).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from dartcore.errors import DartError, TreeError

__all__ = ["tree_conv_triton", "tree_delta_rule_triton"]


@triton.jit
def _tree_conv_kernel(
    x_ptr,
    parent_ptr,
    c0_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    st_ptr,
    m,
    C,
    sx_n,
    so_n,
    K: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    ch = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    t = tl.arange(0, BLOCK_K)
    c_ok = ch < C
    tile_ok = c_ok[:, None] & (t < K)[None, :]
    # the parent's column t + 1 becomes the node's column t; the last column is the node's input
    shift_ok = c_ok[:, None] & (t + 1 < K)[None, :]
    tile = ch[:, None] * K + t[None, :]
    w = tl.load(w_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + ch, mask=c_ok, other=0.0).to(tl.float32)
    last = (t == K - 1)[None, :]
    for i in range(m):
        p = tl.load(parent_ptr + i)
        if p < 0:
            win = tl.load(c0_ptr + tile + 1, mask=shift_ok, other=0.0)
        else:
            win = tl.load(st_ptr + p * C * K + tile + 1, mask=shift_ok, other=0.0)
        x = tl.load(x_ptr + i * sx_n + ch, mask=c_ok, other=0.0)
        win = tl.where(last, x[:, None].to(win.dtype), win)
        y = tl.sum(win.to(tl.float32) * w, axis=1)
        if HAS_BIAS:
            y = y + bias
        if SILU:
            y = y * tl.sigmoid(y)
        tl.store(out_ptr + i * so_n + ch, y.to(out_ptr.dtype.element_ty), mask=c_ok)
        tl.store(st_ptr + i * C * K + tile, win, mask=tile_ok)
        tl.debug_barrier()  # node i's window is visible to its children's loads


@triton.jit
def _tree_delta_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    parent_ptr,
    s0_ptr,
    out_ptr,
    st_ptr,
    m,
    heads,
    group,
    scale,
    eps,
    sq_n,
    sk_n,
    sv_n,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr,
):
    head = tl.program_id(0)
    kh = head // group
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = dk < DK
    v_ok = dv < DV
    s_ok = k_ok[:, None] & v_ok[None, :]
    s_tile = head * DK * DV + dk[:, None] * DV + dv[None, :]
    node = heads * DK * DV
    S = tl.load(s0_ptr + s_tile, mask=s_ok, other=0.0).to(tl.float32)
    for i in range(m):
        p = tl.load(parent_ptr + i)
        # S holds node i - 1's state (the committed one before node 0): others are reloaded
        if p != i - 1:
            if p < 0:
                S = tl.load(s0_ptr + s_tile, mask=s_ok, other=0.0).to(tl.float32)
            else:
                S = tl.load(st_ptr + p * node + s_tile, mask=s_ok, other=0.0)
        kk = tl.load(k_ptr + i * sk_n + kh * DK + dk, mask=k_ok, other=0.0).to(tl.float32)
        qq = tl.load(q_ptr + i * sq_n + kh * DK + dk, mask=k_ok, other=0.0).to(tl.float32)
        if L2NORM:
            kk = kk * tl.rsqrt(tl.sum(kk * kk, axis=0) + eps)
            qq = qq * tl.rsqrt(tl.sum(qq * qq, axis=0) + eps)
        qq = qq * scale
        vv = tl.load(v_ptr + i * sv_n + head * DV + dv, mask=v_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + i * heads + head).to(tl.float32)
        beta = tl.load(beta_ptr + i * heads + head).to(tl.float32)
        S = S * tl.exp(g)
        delta = (vv - tl.sum(S * kk[:, None], axis=0)) * beta
        S = S + kk[:, None] * delta[None, :]
        o = tl.sum(S * qq[:, None], axis=0)
        tl.store(out_ptr + i * heads * DV + head * DV + dv, o, mask=v_ok)
        tl.store(st_ptr + i * node + s_tile, S, mask=s_ok)
        tl.debug_barrier()  # node i's state is visible to its children's loads


def _parents(parents, m: int, device) -> torch.Tensor:
    p = np.asarray(parents, dtype=np.int64).reshape(-1)
    if p.shape[0] != m:
        raise TreeError(f"{p.shape[0]} parents for {m} nodes")
    if m and ((p >= np.arange(m)) | (p < -1)).any():
        raise TreeError("tree nodes must come after their parents (parents[i] < i, -1 = root)")
    return torch.from_numpy(p.astype(np.int32)).to(device)


def tree_conv_triton(
    x: torch.Tensor,
    parents,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    *,
    block_c: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal depthwise convolution over a tree: ``x [m, C]`` the nodes' inputs,
    ``conv_state [C, K]`` the committed window (the last K inputs), ``weight [C, K]``,
    ``activation`` ``"silu"`` or None. Returns the outputs ``[m, C]`` (``x``'s dtype) and
    every node's window ``[m, C, K]`` (``conv_state``'s dtype)."""
    if activation not in (None, "silu", "swish"):
        raise DartError(f"tree conv kernel: activation {activation!r} is not supported")
    m, C = x.shape
    K = conv_state.shape[-1]
    if conv_state.shape != (C, K) or weight.shape != (C, K):
        raise DartError(
            f"tree conv kernel: x {tuple(x.shape)}, state {tuple(conv_state.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    x = x.contiguous()
    out = torch.empty(m, C, dtype=x.dtype, device=x.device)
    states = torch.empty(m, C, K, dtype=conv_state.dtype, device=x.device)
    if m == 0:
        return out, states
    has_bias = bias is not None
    block_c = min(block_c, triton.next_power_of_2(C))
    _tree_conv_kernel[(triton.cdiv(C, block_c),)](
        x,
        _parents(parents, m, x.device),
        conv_state.contiguous(),
        weight.contiguous(),
        bias.contiguous() if has_bias else weight,
        out,
        states,
        m,
        C,
        x.stride(0),
        out.stride(0),
        K=K,
        BLOCK_C=block_c,
        BLOCK_K=triton.next_power_of_2(K),
        HAS_BIAS=has_bias,
        SILU=activation is not None,
    )
    return out, states


def tree_delta_rule_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents,
    initial_state: torch.Tensor,
    *,
    use_qk_l2norm: bool = True,
    block_v: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a tree: ``q, k [m, Hk, Dk]``, ``v [m, Hv, Dv]`` (``Hv`` a
    multiple of ``Hk``: value head h reads key head ``h // (Hv // Hk)``), ``g, beta [m, Hv]``,
    ``initial_state [Hv, Dk, Dv]`` (the committed state). Returns the outputs ``[m, Hv, Dv]``
    (``v``'s dtype) and every node's state ``[m, Hv, Dk, Dv]`` float32."""
    m, hk, dk = k.shape
    hv, dv = v.shape[1:]
    if q.shape != k.shape or v.shape[0] != m or hv % max(hk, 1):
        raise DartError(
            f"tree delta rule: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if g.shape != (m, hv) or beta.shape != (m, hv) or initial_state.shape != (hv, dk, dv):
        raise DartError(
            f"tree delta rule: g {tuple(g.shape)}, beta {tuple(beta.shape)}, "
            f"state {tuple(initial_state.shape)} for {m} nodes of {hv} heads"
        )
    dev = v.device
    out = torch.empty(m, hv, dv, dtype=torch.float32, device=dev)
    states = torch.empty(m, hv, dk, dv, dtype=torch.float32, device=dev)
    if m == 0:
        return out.to(v.dtype), states
    block_v = min(block_v, triton.next_power_of_2(dv))
    q, k, v = (t.reshape(m, -1).contiguous() for t in (q, k, v))
    _tree_delta_kernel[(hv, triton.cdiv(dv, block_v))](
        q,
        k,
        v,
        g.float().contiguous(),
        beta.float().contiguous(),
        _parents(parents, m, dev),
        initial_state.float().contiguous(),
        out,
        states,
        m,
        hv,
        hv // hk,
        dk**-0.5,
        1e-6,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        DK=dk,
        DV=dv,
        BLOCK_K=triton.next_power_of_2(dk),
        BLOCK_V=block_v,
        L2NORM=use_qk_l2norm,
    )
    return out.to(v.dtype), states
