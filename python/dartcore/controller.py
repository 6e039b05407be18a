"""The budget controller: per step, how many tree nodes each sequence of a batch verifies.

A step verifies ``R = sum_i (1 + n_i)`` rows (each sequence's root plus its ``n_i`` drafted
nodes; ``n_i = 0`` is a plain autoregressive step for that sequence) and commits
``E = sum_i E_i(n_i)`` tokens in expectation. The controller picks the budgets that
maximise the batch's committed tokens per second, ``E / T``:

* ``E_i(n) = 1 + sum_{j <= n} prod_{k <= j} r_{i,k}``: node j's chance of being accepted is
  the chance that depths 1..j all are, with ``r_{i,k}`` sequence i's acceptance rate at depth
  k given depth k-1 was accepted, exponentially averaged over its recent rounds
  (:class:`Acceptance`). A new sequence starts from the batch's prior: the same average
  over every sequence's rounds.
* ``T = s * verify(R) + [any n_i > 0] * (draft + search) + per_token * E + controller``: the
  target forward's time for R rows is the verify-cost curve of this machine
  (:class:`CostCurve`, measured once per model / device / dtype / thread count and cached on
  disk), scaled by ``s``, the running ratio of the engine's measured verify times to the
  curve (a shared machine's load changes after the curve was measured); the draft + search
  time, the acceptance time per committed token (on the CPU the walk computes the LM-head
  rows it visits: about one per committed token) and the controller's own time are running
  means of what the engine measured.

A sequence given no nodes is not observed that round, so an estimate that fell (a stretch of
text the drafter misses) would keep it at AR for good; instead every round it could have
drafted and did not, its rates relax by :data:`RELAX` toward :data:`PRIOR_RATE`, so it drafts
again after a few rounds and its rates follow what it measures then (the batch prior relaxes
likewise in a round where no sequence drafted). RELAX is a quarter of ALPHA: while every draft
misses, a sequence probes about one round in five.

The rule (seed note Eq. 13): add the node whose ΔE/E exceeds ΔT/T by the most, while one
does. T depends on the total row count only, so every candidate node has the same ΔT and
"by the most" is the node with the largest ΔE -- the next node of the sequence whose next
marginal ``prod r`` is largest. Those marginals never grow along a sequence, so the first
K nodes of that order are the allocation with the largest E among all with K nodes; the
controller walks that order to the end of the caps and keeps the K with the best E / T,
which is the exact optimum of the model even where T is not convex (the CPU's native kernel
takes 16 rows per call: the curve has steps) -- stopping at the first node that does not pay
would stop at such a step. tests/test_controller.py checks it against brute force.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dartcore.errors import DartError

__all__ = ["Acceptance", "BudgetController", "CostCurve", "cost_cache_dir", "expected_tokens"]

# Exponential averaging weight of one round's outcome (a rate follows a change in ~1 / ALPHA
# rounds: a few sentences of new text).
ALPHA = 0.15
# Prior acceptance rate per depth before anything was observed: DART's SmolLM2 drafter accepts
# ~0.5 of depth-1 nodes on the eval prompts (tau 1.77 at 4 nodes, README).
PRIOR_RATE = 0.5
# Per round without drafting, an idle sequence's rates move this far toward PRIOR_RATE.
RELAX = ALPHA / 4


def expected_tokens(rates: np.ndarray, n: int) -> float:
    """``E(n) = 1 + sum_{j<=n} prod_{k<=j} rates[k-1]`` (the chain model, see the module docs)."""
    return 1.0 + float(np.cumprod(rates[:n]).sum()) if n > 0 else 1.0


@dataclass
class Acceptance:
    """Per-depth acceptance rates of one sequence (or of the batch: the prior)."""

    rates: np.ndarray

    @classmethod
    def prior(cls, depth: int) -> "Acceptance":
        return cls(np.full(depth, PRIOR_RATE))

    def copy(self) -> "Acceptance":
        return Acceptance(self.rates.copy())

    def relax(self, alpha: float = RELAX, toward: float = PRIOR_RATE) -> None:
        """A round this sequence could have drafted and did not: the rates move toward the
        prior (see the module docs)."""
        self.rates += alpha * (toward - self.rates)

    def observe(self, tree_depth: int, accepted: int, alpha: float = ALPHA) -> None:
        """One round: a tree reaching ``tree_depth`` accepted ``accepted`` drafted tokens.
        Depth k is observed when depth k - 1 was accepted and the tree had depth k."""
        for k in range(1, min(tree_depth, accepted + 1, len(self.rates)) + 1):
            self.rates[k - 1] += alpha * (float(accepted >= k) - self.rates[k - 1])


class CostCurve:
    """Verify time (ms) against total rows, from measured points, linear in between and
    extrapolated linearly past the last one."""

    def __init__(self, points: list[dict]):
        pts = sorted((int(p["rows"]), float(p["ms"])) for p in points)
        if not pts or pts[0][0] < 1:
            raise DartError("a verify-cost curve needs measured points with rows >= 1")
        self.points = pts
        self.rows = np.array([p[0] for p in pts], dtype=np.float64)
        # A forward of more rows never costs less, and another job's noise on a shared machine
        # only adds time (seen: 128 ms for 1 row, 105 ms for 2; 331 ms for 10 rows, 165 for 12):
        # the curve is the lower envelope, each point the least time measured at its size or more.
        self.ms = np.minimum.accumulate(np.array([p[1] for p in pts], dtype=np.float64)[::-1])[::-1].copy()

    def __call__(self, rows) -> np.ndarray | float:
        r = np.asarray(rows, dtype=np.float64)
        out = np.interp(r, self.rows, self.ms)
        if len(self.rows) >= 2:
            slope = (self.ms[-1] - self.ms[-2]) / max(self.rows[-1] - self.rows[-2], 1.0)
            out = np.where(r > self.rows[-1], self.ms[-1] + slope * (r - self.rows[-1]), out)
        return float(out) if out.ndim == 0 else out

    def as_list(self) -> list[dict]:
        return [{"rows": r, "ms": m} for r, m in self.points]

    # -- measured once per machine, cached --------------------------------------------------

    @classmethod
    def for_target(cls, target, backend, *, max_rows: int, remeasure: bool = False,
                   cache_dir: Path | None = None) -> "CostCurve":
        """The curve of ``target`` on this machine up to ``max_rows`` rows: read from the
        cache (:func:`cost_cache_dir`, one file per model / device / dtype / threads / path),
        else measured with :func:`dartcore.benchmark.verify_cost.measure_verify_cost` under the
        backend's round scope (what a decoding step runs under) and written by rename.
        ``remeasure`` (or ``DARTCORE_REMEASURE_COST=1``) measures again."""
        key = _curve_key(target)
        path = (cache_dir or cost_cache_dir()) / f"{key['digest']}.json"
        remeasure = remeasure or os.environ.get("DARTCORE_REMEASURE_COST") == "1"
        if not remeasure and path.is_file():
            try:
                data = json.loads(path.read_text())
                if data.get("key") == key and max(p["rows"] for p in data["points"]) >= max_rows:
                    return cls(data["points"])
            except (OSError, ValueError, KeyError, TypeError):
                pass  # unreadable: measure again
        from dartcore.benchmark.verify_cost import measure_verify_cost

        sizes = sorted({r for r in (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 17, 20, 24, 32, 40, 48, 64, 80, 96, 128,
                                    160, 192, 256) if r <= max_rows} | {max_rows})
        with backend.round_scope():  # the forward as the engine's verify runs it
            passes = [measure_verify_cost(target, prefix_len=128, sizes=sizes, repeats=3, seed=seed,
                                          logits_rows=backend.verify_logits_rows()) for seed in (0, 1)]
        # two passes over the sizes, the smaller median of each: a burst of load in one pass
        points = [{"rows": a["nodes"], "ms": min(a["ms"], b["ms"])} for a, b in zip(*passes)]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "points": points, "measured_at": time.time()}, indent=1))
        os.replace(tmp, path)
        return cls(points)


def cost_cache_dir() -> Path:
    """Where measured verify-cost curves live: ``$DARTCORE_CACHE_DIR/verify_cost``, default
    ``~/.cache/dartcore/verify_cost``."""
    base = os.environ.get("DARTCORE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "dartcore")
    return Path(base) / "verify_cost"


def _curve_key(target) -> dict:
    import torch

    cfg = target.config
    fields = {
        "model": str(getattr(cfg, "_name_or_path", "") or ""),
        "family": target.family, "layers": target.num_layers, "hidden": target.hidden_size,
        "heads": target.num_heads, "kv_heads": target.num_kv_heads, "vocab": target.vocab_size,
        "intermediate": int(getattr(cfg, "intermediate_size", 0) or 0),
        "device": str(target.device), "dtype": str(target.dtype), "threads": int(target.threads),
        "torch_threads": int(torch.get_num_threads()), "native": bool(target.native_linear),
        # GGML block weights cost differently from float32 ones at every row count
        "blocks": bool(getattr(target, "blocks", False)),
    }
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    return {**fields, "digest": digest}


@dataclass
class BudgetController:
    """Chooses each step's budgets (see the module docs). ``curve``: the verify-cost curve;
    ``max_nodes``: the largest budget per sequence (and the depth of the rates kept)."""

    curve: CostCurve
    max_nodes: int
    alpha: float = ALPHA
    draft_ms: float | None = None  # running means of the engine's measured stage times:
    per_token_ms: float = 0.0  # acceptance (LM-head rows on the CPU) per committed token
    controller_ms: float = 0.0
    verify_scale: float = 1.0  # measured verify time / curve
    prior: Acceptance = field(init=False)
    choose_s: float = 0.0  # total time spent choosing

    def __post_init__(self):
        if self.max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {self.max_nodes}")
        self.prior = Acceptance.prior(max(self.max_nodes, 1))
        if self.draft_ms is None:
            # Until a draft was timed: about a quarter of a one-row verify (SmolLM2's drafter
            # is one layer and a head over 8k tokens against 30 layers and a 49k head).
            self.draft_ms = 0.25 * float(self.curve(1))

    def new_sequence(self) -> Acceptance:
        """A new sequence's rates: the batch's prior."""
        return self.prior.copy()

    def observe(self, acc: Acceptance, tree_depth: int, accepted: int) -> None:
        acc.observe(tree_depth, accepted, self.alpha)
        self.prior.observe(tree_depth, accepted, self.alpha)

    def timed(self, *, rows: int, verify_ms: float, draft_ms: float | None, per_token_ms: float | None) -> None:
        """Fold one step's measured times into the running means: its verify forward of
        ``rows`` rows, its draft + search (None when nothing was drafted) and its acceptance
        time per committed token."""
        a = 0.2
        predicted = float(self.curve(rows))
        if predicted > 0 and verify_ms > 0:
            self.verify_scale += a * (verify_ms / predicted - self.verify_scale)
        if draft_ms is not None:
            self.draft_ms += a * (draft_ms - self.draft_ms)
        if per_token_ms is not None:
            self.per_token_ms += a * (per_token_ms - self.per_token_ms)

    def step_ms(self, rows: int, drafting: bool, expected: float) -> float:
        """The model's time of one step verifying ``rows`` rows and committing ``expected``
        tokens."""
        return (self.verify_scale * float(self.curve(rows)) + (self.draft_ms if drafting else 0.0)
                + self.per_token_ms * expected + self.controller_ms)

    def choose(self, accs: list[Acceptance], caps: list[int]) -> list[int]:
        """Budgets ``n_i <= caps[i]`` maximising ``E / T`` (see the module docs)."""
        t0 = time.perf_counter()
        budgets = self._choose(accs, caps)
        idle = [acc for acc, cap, n in zip(accs, caps, budgets) if n == 0 and min(int(cap), self.max_nodes) > 0]
        for acc in idle:
            acc.relax(self.alpha / 4)
        if idle and not any(budgets):
            self.prior.relax(self.alpha / 4)
        dt = time.perf_counter() - t0
        self.choose_s += dt
        self.controller_ms += 0.2 * (1e3 * dt - self.controller_ms)
        return budgets

    def _choose(self, accs: list[Acceptance], caps: list[int]) -> list[int]:
        b = len(accs)
        owners, gains = [], []
        for i, (acc, cap) in enumerate(zip(accs, caps)):
            cap = min(int(cap), self.max_nodes, len(acc.rates))
            if cap > 0:
                gains.append(np.cumprod(acc.rates[:cap]))
                owners.append(np.full(cap, i))
        budgets = [0] * b
        if not gains:
            return budgets
        gain = np.concatenate(gains)
        owner = np.concatenate(owners)
        # Largest marginal first; ties keep each sequence's nodes in depth order (stable sort).
        order = np.argsort(-gain, kind="stable")
        e = b + np.concatenate(([0.0], np.cumsum(gain[order])))
        k = np.arange(len(e))
        t = (self.verify_scale * self.curve(b + k) + np.where(k > 0, self.draft_ms, 0.0) + self.per_token_ms * e
             + self.controller_ms)
        best = int(np.argmax(e / t))
        for i in owner[order[:best]]:
            budgets[int(i)] += 1
        return budgets
