"""The learning-rate schedule of both trainers (the drafter's and DARTree's correction head):
linear warm-up, then a cosine from 1 down to a floor."""

from __future__ import annotations

import math

__all__ = ["warmup_cosine"]


def warmup_cosine(
    step: int, *, warmup_steps: int, max_steps: int, min_ratio: float, progress: float | None = None
) -> float:
    """The learning-rate factor at ``step``: ``(step + 1) / warmup_steps`` during the
    warm-up, then ``min_ratio + (1 - min_ratio) · (1 + cos(π · p)) / 2`` with ``p`` the
    fraction of the post-warm-up steps done (or ``progress``, when larger: a time-budgeted run
    ends its cosine at the floor whatever the machine's speed), capped at 1."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    p = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    if progress is not None:
        p = max(p, progress)
    p = min(1.0, p)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p))
