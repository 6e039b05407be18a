"""The verify-cost curve: target forward time for a tree of n nodes after a
cached prefix, on the machine at hand, and the tree budget it implies.

A tree of n nodes commits E[τ(n)] tokens per forward; the budget worth using is
the n that maximises τ(n) / t(n). τ(n) grows slowly (roughly logarithmically)
with n while t(n) is flat as long as the forward is memory-bound and linear once
it is compute-bound — on a GPU the knee is at tens of nodes, on a 2-core CPU it
is at a handful. ``choose_budget`` takes the measured curve and an acceptance
model (measured τ at a few budgets, interpolated in log n) and returns the best n.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["DEFAULT_SIZES", "measure_verify_cost", "choose_budget"]

DEFAULT_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def _random_tree_mask(n: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Depths and ancestor mask of a random depth-ordered tree of n nodes."""
    parents = np.full(n, -1)
    for i in range(1, n):
        parents[i] = rng.integers(0, i)
    depths = np.zeros(n, dtype=np.int64)
    mask = np.eye(n, dtype=bool)
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
        mask[i] |= mask[parents[i]]
    return torch.from_numpy(depths), torch.from_numpy(mask)


@torch.inference_mode()
def measure_verify_cost(target, *, prefix_len: int = 256, sizes: Sequence[int] = DEFAULT_SIZES,
                        repeats: int = 5, seed: int = 0, logits_rows=None) -> list[dict]:
    """Median wall time (ms) of one target forward over a random tree of each size
    after ``prefix_len`` cached tokens. ``target`` is a
    :class:`dartcore.models.transformer.TargetModel`; ``logits_rows`` as for its forward
    (default: logits of every row; lazy verification passes ``slice(0, 0)``).

    The repeats are interleaved: each round times every size once (in turn ascending and
    descending), so a burst of load on a shared machine lands on a few sizes' single samples,
    which each size's median drops, instead of on all the samples of the sizes it overlaps."""
    rng = np.random.default_rng(seed)
    vocab = target.vocab_size
    cache = target.new_cache(prefix_len + max(sizes) + 1)
    prompt = torch.from_numpy(rng.integers(0, vocab, prefix_len))
    target.forward(cache, prompt, torch.arange(prefix_len), logits_rows=slice(-1, None))
    cache.commit(prefix_len)
    trees = {}
    for n in sizes:
        depths, mask = _random_tree_mask(n, rng)
        trees[n] = (torch.from_numpy(rng.integers(0, vocab, n)), depths + prefix_len, mask)
        target.forward(cache, *trees[n], logits_rows=logits_rows)  # warm-up (allocations, kernels)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(repeats):
        for n in (sizes if rep % 2 == 0 else list(sizes)[::-1]):
            if target.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            target.forward(cache, *trees[n], logits_rows=logits_rows)
            if target.device.type == "cuda":
                torch.cuda.synchronize()
            times[n].append(time.perf_counter() - t0)
    return [{"nodes": int(n), "ms": 1e3 * statistics.median(times[n])} for n in sizes]


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
    scored = [{"nodes": r["nodes"], "ms": r["ms"], "tau": tau(r["nodes"]),
               "tok_per_s": 1e3 * tau(r["nodes"]) / r["ms"]} for r in curve]
    best = max(scored, key=lambda r: r["tok_per_s"])
    return {"budget": best["nodes"], "tau_model": model, "curve": scored}
