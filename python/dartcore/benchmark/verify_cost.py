"""The verify-cost curve: target forward time for a tree of n nodes after a
cached prefix, on the machine at hand, and the tree budget it implies.

A tree of n nodes commits E[τ(n)] tokens per forward; the budget worth using is
the n that maximises τ(n) / t(n). τ(n) grows slowly (roughly logarithmically)
with n while t(n) is flat as long as the forward is memory-bound and linear once
it is compute-bound — on a GPU the knee is at tens of nodes, on a 2-core CPU it
is at a handful. ``choose_budget`` takes the measured curve and an acceptance
model (measured τ at a few budgets, interpolated in log n) and returns the best n.

The measurement itself (:func:`measure_verify_cost`, :data:`DEFAULT_SIZES`) is the runtime's
(:mod:`dartcore.cost`, which the budget controller reads): re-exported here.
"""

from __future__ import annotations

import math

import numpy as np

from dartcore.cost import DEFAULT_SIZES, measure_verify_cost

__all__ = ["DEFAULT_SIZES", "choose_budget", "measure_verify_cost"]


def choose_budget(curve: list[dict], tau_at: dict[int, float] | None = None) -> dict:
    """The budget n maximising committed tokens per second, τ(n) / t(n).

    ``tau_at`` maps a few budgets to a measured τ; τ is interpolated linearly in
    log n between them (and held flat outside). Without measurements a
    conservative model τ(n) = 1 + 0.6·log2(n) is used and said so.
    """
    if tau_at:
        known = sorted(tau_at.items())
        xs = [math.log(max(n, 1)) for n, _ in known]
        ys = [t for _, t in known]

        def tau(n: int) -> float:
            return float(np.interp(math.log(max(n, 1)), xs, ys))

        model = "measured"
    else:

        def tau(n: int) -> float:
            return 1.0 + 0.6 * math.log2(max(n, 1))

        model = "1 + 0.6 log2(n) (assumed)"
    scored = [
        {
            "nodes": r["nodes"],
            "ms": r["ms"],
            "tau": tau(r["nodes"]),
            "tok_per_s": 1e3 * tau(r["nodes"]) / r["ms"],
        }
        for r in curve
    ]
    best = max(scored, key=lambda r: r["tok_per_s"])
    return {"budget": best["nodes"], "tau_model": model, "curve": scored}
