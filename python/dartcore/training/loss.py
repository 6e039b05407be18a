"""The DART training loss: position-weighted forward KL, sum_k gamma^k KL(q_k || p_k).

``q_k`` is the teacher (the target's distribution at clean position ``t+1+k``, restricted
to the draft vocabulary and renormalised there), ``p_k`` the drafter's distribution for
prediction ``k`` of anchor ``t``. The gradient with respect to the drafter's logits of
prediction ``k`` is ``gamma^k (p_k - q_k)`` (with ``reduction="sum"``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["teacher_logprobs", "gamma_kl_loss", "DEFAULT_GAMMA"]

DEFAULT_GAMMA = 0.6


def teacher_logprobs(
    target_logits: torch.Tensor, draft_to_target: torch.Tensor | None = None
) -> torch.Tensor:
    """log q over the draft vocabulary: the target's logits gathered at the draft ids and
    renormalised (the mass outside the draft vocabulary is dropped)."""
    if draft_to_target is not None:
        target_logits = target_logits.index_select(-1, draft_to_target.to(target_logits.device))
    return F.log_softmax(target_logits.float(), dim=-1)


def gamma_kl_loss(
    draft_logits: torch.Tensor,
    teacher_logq: torch.Tensor,
    valid: torch.Tensor,
    *,
    gamma: float = DEFAULT_GAMMA,
    reduction: str = "mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_logits, teacher_logq: [..., d, V]; valid: [..., d] bool (False = padding or no
    teacher there). Returns (loss, per-position mean KL [d]).

    reduction: "sum" (sum over groups and positions), or "mean" (divided by the number of
    groups with at least one valid prediction)."""
    logp = F.log_softmax(draft_logits.float(), dim=-1)
    q = teacher_logq.exp()
    kl = (q * (teacher_logq - logp)).sum(-1)  # [..., d]; teacher_logq is finite (a log_softmax)
    d = kl.shape[-1]
    w = gamma ** torch.arange(d, device=kl.device, dtype=kl.dtype)
    validf = valid.to(kl.dtype)
    kl = torch.where(valid, kl, torch.zeros_like(kl))  # invalid rows: no loss, no gradient
    total = (kl * w).sum()
    flat_valid = validf.reshape(-1, d)
    per_pos = kl.reshape(-1, d).sum(0) / flat_valid.sum(0).clamp(min=1)
    if reduction == "sum":
        return total, per_pos.detach()
    if reduction != "mean":
        raise ValueError(f"unknown reduction {reduction!r}")
    groups = (flat_valid.sum(-1) > 0).sum().clamp(min=1)
    return total / groups, per_pos.detach()
