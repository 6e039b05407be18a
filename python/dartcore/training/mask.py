"""The prefix-shared attention mask of DART training.

Rows of one packed training sequence (the layout): the ``N`` clean rows first, then for
every anchor ``a`` (clean row ``t_a``) a group of ``d - 1`` MASK rows (MASK ``j`` at
position ``pos(t_a) + j``). Attention (True = may attend):

* clean row q -> clean row k  iff  same document and k <= q            (clean causal)
* group row q of anchor t -> clean row k  iff  same document and k <= t  (prefix shared)
* group row q -> group row k  iff  same group and j(k) <= j(q)          (causal in group)

Groups never see each other and never see clean rows after their anchor. Only the rows
whose outputs are used are queried (each anchor's clean row, then its MASK rows; a single
drafter layer means other clean rows only contribute keys and values), so the mask is
``[A*d, R]`` with query ``a*d + j`` = row 0 (``j = 0``, the anchor's clean row) or MASK ``j``.

Backends: a dense boolean mask with SDPA, computed in query chunks to bound memory (CPU,
and any device), and a FlexAttention block mask (CUDA only; it skips the fully masked
blocks, which is most of them). Both are built from the same per-row description.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Layout", "build_layout", "dense_mask", "brute_force_mask", "prefix_shared_attention"]

# Query rows per dense chunk: bounds the boolean mask and the score matrix at
# chunk x R x heads floats (512 x ~1.5k x 9 x 4 B = 28 MB for SmolLM2 at ctx 512).
_DENSE_CHUNK = 512


@dataclass
class Layout:
    n_clean: int
    d: int
    positions: torch.Tensor  # [B, R] position id of every row (rope)
    query_rows: torch.Tensor  # [B, A*d] row index of each query (group-major)
    # per query row
    q_limit: torch.Tensor  # [B, A*d] last clean row it may see
    q_doc: torch.Tensor  # [B, A*d]
    q_group: torch.Tensor  # [B, A*d] anchor slot a
    q_j: torch.Tensor  # [B, A*d] 0 = anchor row, j = MASK j
    # per key row
    k_doc: torch.Tensor  # [B, R] (-1 for MASK rows)
    k_group: torch.Tensor  # [B, R] (-1 for clean rows)
    k_j: torch.Tensor  # [B, R] (0 for clean rows)


def build_layout(
    anchors: torch.Tensor, doc_ids: torch.Tensor, position_ids: torch.Tensor, d: int
) -> Layout:
    """anchors [B, A] (clean row index, -1 = padding group, treated as anchor 0 and to be
    excluded from the loss), doc_ids / position_ids [B, N]."""
    B, N = doc_ids.shape
    A = anchors.shape[1]
    dev = doc_ids.device
    t = anchors.clamp(min=0)  # [B, A]
    j = torch.arange(1, d, device=dev)  # MASK indices 1..d-1
    mpos = torch.gather(position_ids, 1, t)[..., None] + j  # [B, A, d-1]
    positions = torch.cat((position_ids, mpos.reshape(B, -1)), 1)
    mdoc = torch.gather(doc_ids, 1, t)  # [B, A]
    k_doc = torch.cat(
        (doc_ids, torch.full((B, A * (d - 1)), -1, device=dev, dtype=doc_ids.dtype)), 1
    )
    groups = torch.arange(A, device=dev)
    k_group = torch.cat(
        (
            torch.full((B, N), -1, device=dev, dtype=torch.long),
            groups.repeat_interleave(d - 1).expand(B, -1),
        ),
        1,
    )
    k_j = torch.cat((torch.zeros(B, N, device=dev, dtype=torch.long), j.repeat(A).expand(B, -1)), 1)
    mask_row = N + groups[:, None] * (d - 1) + (j - 1)  # [A, d-1]
    query_rows = torch.cat((t[..., None], mask_row.expand(B, A, d - 1)), 2).reshape(B, A * d)
    q_limit = t.repeat_interleave(d, dim=1)
    q_doc = mdoc.repeat_interleave(d, dim=1)
    q_group = groups.repeat_interleave(d).expand(B, -1)
    q_j = torch.arange(d, device=dev).repeat(A).expand(B, -1)
    return Layout(N, d, positions, query_rows, q_limit, q_doc, q_group, q_j, k_doc, k_group, k_j)


def dense_mask(layout: Layout, q_slice: slice = slice(None)) -> torch.Tensor:
    """Boolean mask [B, Q, R] (True = attend) for the query rows in ``q_slice``."""
    R = layout.positions.shape[1]
    kidx = torch.arange(R, device=layout.positions.device)
    lim, qdoc = layout.q_limit[:, q_slice, None], layout.q_doc[:, q_slice, None]
    qg, qj = layout.q_group[:, q_slice, None], layout.q_j[:, q_slice, None]
    kclean = (kidx < layout.n_clean)[None, None, :]
    clean = kclean & (kidx[None, None, :] <= lim) & (layout.k_doc[:, None, :] == qdoc)
    group = ~kclean & (qj > 0) & (layout.k_group[:, None, :] == qg) & (layout.k_j[:, None, :] <= qj)
    return clean | group


def brute_force_mask(anchors: list[int], doc_ids: list[int], d: int) -> torch.Tensor:
    """The full [R, R] mask over all rows, written from the definition with plain loops
    (reference for tests; rows: clean 0..N-1, then MASK j of anchor a at N + a*(d-1) + j-1)."""
    N = len(doc_ids)
    rows = [("clean", i, None, 0) for i in range(N)]
    for a, t in enumerate(anchors):
        rows += [("mask", t, a, j) for j in range(1, d)]
    R = len(rows)
    m = torch.zeros(R, R, dtype=torch.bool)
    for qi, (qk, qt, qa, qj) in enumerate(rows):
        for ki, (kk, kt, ka, kj) in enumerate(rows):
            if kk == "clean":
                m[qi, ki] = doc_ids[kt] == doc_ids[qt] and kt <= qt
            else:
                m[qi, ki] = qk == "mask" and qa == ka and kj <= qj
    return m


def _flex_block_mask(layout: Layout, n_heads: int):
    from torch.nn.attention.flex_attention import create_block_mask

    n_clean = layout.n_clean
    q_limit, q_doc, q_group, q_j = layout.q_limit, layout.q_doc, layout.q_group, layout.q_j
    k_doc, k_group, k_j = layout.k_doc, layout.k_group, layout.k_j

    def mask_mod(b, h, q, k):
        is_clean = k < n_clean
        clean = is_clean & (k <= q_limit[b, q]) & (k_doc[b, k] == q_doc[b, q])
        group = (
            ~is_clean
            & (q_j[b, q] > 0)
            & (k_group[b, k] == q_group[b, q])
            & (k_j[b, k] <= q_j[b, q])
        )
        return clean | group

    B, Q = q_limit.shape
    R = k_doc.shape[1]
    return create_block_mask(mask_mod, B, None, Q, R, device=q_limit.device)


def prefix_shared_attention(
    layer,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: Layout,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of the query rows under the prefix-shared mask. q [B, nh, Q, hd], k/v
    [B, nkv, R, hd] -> [B, Q, H] (after o_proj). backend: "auto" (flex on CUDA, dense
    otherwise), "flex", "dense"."""
    if backend == "auto":
        backend = "flex" if q.is_cuda else "dense"
    if backend == "flex":
        if not q.is_cuda:
            raise RuntimeError(
                "the FlexAttention path needs a CUDA device; use backend='dense' on CPU"
            )
        return layer.attend(q, k, v, None, flex_block_mask=_flex_block_mask(layout, q.shape[1]))
    if backend != "dense":
        raise ValueError(f"unknown attention backend {backend!r}")
    Q = q.shape[2]
    outs = []
    for s in range(0, Q, _DENSE_CHUNK):
        sl = slice(s, min(Q, s + _DENSE_CHUNK))
        outs.append(layer.attend(q[:, :, sl], k, v, dense_mask(layout, sl)))
    return torch.cat(outs, 1)
