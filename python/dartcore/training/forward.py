"""The drafter's training forward: every anchor of packed clean sequences drafted at once
under the prefix-shared mask (:mod:`dartcore.training.mask`), with the same layer as
inference (:meth:`dartcore.DartDrafter.draft`), so one row's logits equal a draft's
(tests/test_drafter.py)."""

from __future__ import annotations

import torch

from dartcore.drafter import DartDrafter
from dartcore.training.mask import build_layout, prefix_shared_attention

__all__ = ["train_forward"]


def train_forward(
    drafter: DartDrafter,
    taps: torch.Tensor,
    next_tokens: torch.Tensor,
    anchors: torch.Tensor,
    *,
    doc_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Prefix-shared training forward over packed clean sequences.

    taps [B, N, 3H]; next_tokens [B, N] (x_{i+1} of clean row i); anchors [B, A] (clean
    row index t of each group, -1 = padding group); doc_ids [B, N] (packed documents never
    see each other; default one document); position_ids [B, N] (default 0..N-1).
    Returns logits [B, A, d, V_draft]: [:, a, 0] from the anchor's clean row, [:, a, j]
    from MASK j of its group (position t+j)."""
    B, N, _ = taps.shape
    A, D = anchors.shape[1], drafter.d
    dev = taps.device
    if position_ids is None:
        position_ids = torch.arange(N, device=dev).expand(B, N)
    if doc_ids is None:
        doc_ids = torch.zeros(B, N, dtype=torch.long, device=dev)
    layout = build_layout(anchors, doc_ids, position_ids, D)
    rows, g = drafter.real_rows(taps, next_tokens)  # [B, N, 2H], [B, N, H]
    m_rows, m_res = drafter.mask_rows()  # [D-1, 2H]
    all_rows = torch.cat(
        (
            rows,
            m_rows.unsqueeze(0).unsqueeze(0).expand(B, A, D - 1, -1).reshape(B, A * (D - 1), -1),
        ),
        1,
    )
    cos, sin = drafter.rope(layout.positions)  # [B, R, hd]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    k, v = drafter.layer.kv(all_rows, cos, sin)  # [B, nkv, R, hd]
    # Queries: only rows whose output is used (anchor rows + MASK rows); a single layer
    # means other clean rows contribute keys/values only.
    qidx = layout.query_rows  # [B, A*D] indices into the R rows, group-major
    q_rows = torch.gather(all_rows, 1, qidx[..., None].expand(-1, -1, all_rows.shape[-1]))
    qcos = torch.gather(cos.squeeze(1), 1, qidx[..., None].expand(-1, -1, cos.shape[-1])).unsqueeze(
        1
    )
    qsin = torch.gather(sin.squeeze(1), 1, qidx[..., None].expand(-1, -1, sin.shape[-1])).unsqueeze(
        1
    )
    q = drafter.layer.q(q_rows, qcos, qsin)  # [B, nh, A*D, hd]
    attn = prefix_shared_attention(drafter.layer, q, k, v, layout, backend=backend)
    # [B, A, H]
    anchor_res = torch.gather(g, 1, anchors.clamp(min=0)[..., None].expand(-1, -1, g.shape[-1]))
    resid = torch.cat((anchor_res.unsqueeze(2), m_res.expand(B, A, D - 1, -1)), 2).reshape(
        B, A * D, -1
    )
    h = drafter.layer.mlp_block(resid + attn)
    return drafter.head(h).view(B, A, D, -1)
