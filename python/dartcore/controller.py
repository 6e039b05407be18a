"""The budget controller: per step, how many tree nodes each sequence of a batch verifies.

A step verifies ``R = sum_i (1 + n_i)`` rows (each sequence's root plus its ``n_i`` drafted
nodes; ``n_i = 0`` is a plain autoregressive step for that sequence) and commits
``E = sum_i E_i(n_i)`` tokens in expectation. The controller picks the budgets that
maximise the batch's committed tokens per second, ``E / T``:

* ``E_i(n) = 1 + sum_{j <= n} p_{i,j}``: the accepted length is the number of accepted nodes,
  so its expectation is the sum of the nodes' chances of being accepted (on the path the
  target takes), over the ``n`` nodes the sequence verifies. A node's chance comes from what
  the search already knows about it: its depth and its path score (Eq. 10's cumulative
  score, which falls along every path), through :class:`NodeCalibration`, a table of the
  accepted share of the verified nodes of each (depth, score) cell, learned over every
  round of the batch and shrunk where it has seen little toward ``PRIOR_RATE ** depth``
  bounded by ``exp`` of the cell's score (:func:`cell_prior`). So a
  round where the drafter is sure of four tokens gets four nodes, and one where it guesses
  gets few, whatever the sequence did before; and a tree's siblings count what they add
  (a chain model of per-depth rates prices a budget's nodes as one chain, and undervalues
  the siblings of a tree).
* ``T = s(R) * verify(R) + [any n_i > 0] * (draft + search) + per_token * E + controller``:
  the target forward's time for R rows is the verify-cost curve of this machine
  (:class:`CostCurve`, measured once per model / device / dtype / thread count and cached on
  disk), scaled by ``s(R)``, the running ratio of the engine's measured verify times of R
  rows to the curve, shrunk toward the ratio over all steps where few steps had R rows (a
  shared machine's load changes after the curve was measured, and the forward inside the
  engine need not cost what it did alone), kept non-decreasing in R; the draft + search
  time, the acceptance time per committed token (on the CPU the walk computes the LM-head
  rows it visits: about one per committed token) and the controller's own time are running
  means of what the engine measured.

Two decisions a step. Before drafting (:meth:`BudgetController.choose`), which sequences
draft at all, from each sequence's expected marginals ``p_{i,j}`` of its recent trees
(:class:`Acceptance`: the calibrated chances of the j-th best node of its last trees,
exponentially averaged; a new sequence starts from the batch's prior, the same average over
every sequence). Those that draft get a tree of their budget plus :data:`DRAW_SLACK` nodes
(within their cap: room for a round where the drafter is surer than usual, without the
drafter rows of a whole cap -- two sequences of 8 rows each plus their new positions pass the
native draft's 16 rows, 9.8 ms a draft against 4.0 for 4 rows each); after the search
(:meth:`BudgetController.refine`), with each tree's own calibrated chances and the draft
now paid, the budgets are chosen again and each tree keeps its best ``n_i`` nodes
(:func:`best_nodes`: ancestor-closed, since a child's chance never exceeds its parent's).

A sequence given no nodes draws no tree, so an estimate that fell (a stretch of text the
drafter misses) would keep it at AR for good; instead every round it could have drafted and
did not, its expected marginals relax by :data:`RELAX` toward the prior's
``PRIOR_RATE ** j``, so it drafts again after a few rounds and follows what its trees show
then (the batch prior relaxes likewise in a round where no sequence drafted). RELAX is a
quarter of ALPHA: while every draft misses, a sequence probes about one round in five.

The rule (docs/architecture.md, "Budget controller"): add the node whose ΔE/E exceeds ΔT/T
by the most, while one does. T depends on the total row count only, so every candidate node
has the same ΔT and "by the most" is the node with the largest ΔE -- the next node of the sequence whose next
marginal is largest. Those marginals never grow along a sequence, so the first K nodes of
that order are the allocation with the largest E among all with K nodes; the controller walks
that order to the end of the caps and keeps the K with the best E / T, which is the exact
optimum of the model even where T is not convex (the CPU's native kernel takes 16 rows per
call: the curve has steps) -- stopping at the first node that does not pay would stop at
such a step. tests/test_controller.py checks it against brute force.
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
from dartcore.paths import cache_root

__all__ = ["Acceptance", "BudgetController", "CostCurve", "NodeCalibration", "best_nodes", "cost_cache_dir",
           "expected_tokens"]

# Exponential averaging weight of one round's outcome (a rate follows a change in ~1 / ALPHA
# rounds: a few sentences of new text).
ALPHA = 0.15
# A node's chance of acceptance before anything was observed: PRIOR_RATE ** depth (DART's SmolLM2
# drafter accepts ~0.5 of depth-1 nodes on the eval prompts, tau 1.77 at 4 nodes, README).
PRIOR_RATE = 0.5
# Per round without drafting, an idle sequence's marginals move this far toward the prior's.
RELAX = ALPHA / 4
# NodeCalibration's cells: depth 1, 2, 3 and deeper, by path score. Measured on SmolLM2 with the
# shipped drafter and the bench index (one greedy run, 8-node trees): depth-1 nodes scoring
# above -0.5 were accepted 93 % of the time, -1.5..-2 48 %, -2..-3 28 %, -4..-6 5 %, below -6 1 %.
SCORE_EDGES = (-0.25, -0.5, -1.0, -1.5, -2.0, -2.5, -3.0, -4.0, -5.0, -6.0, -8.0)
CALIBRATION_DEPTHS = 3
# The prior's weight in a cell, in verified nodes; and the decay of the counts per round (a cell
# follows the last ~1 / (1 - DECAY) rounds).
PRIOR_WEIGHT = 4.0
DECAY = 0.998
# The verify time of each row count as the engine measured it: per count, the decayed mean of
# the measured / curve ratios (a count follows its last ~1 / (1 - ROW_DECAY) steps), shrunk
# toward the ratio over all steps by ROW_PRIOR steps.
ROW_PRIOR = 4.0
ROW_DECAY = 0.995
# A sequence that drafts draws a tree of its chosen budget plus this many nodes (module docs).
DRAW_SLACK = 2


def expected_tokens(gains: np.ndarray, n: int) -> float:
    """``E(n) = 1 + sum_{j<=n} gains[j-1]``: the bonus token plus the chances of the ``n``
    verified nodes (see the module docs)."""
    return 1.0 + float(np.sum(gains[:n])) if n > 0 else 1.0


def prior_gains(n: int) -> np.ndarray:
    """The prior's marginals: the j-th best node of a chain, ``PRIOR_RATE ** j``."""
    return PRIOR_RATE ** np.arange(1, n + 1, dtype=np.float64)


@dataclass
class Acceptance:
    """One sequence's (or the batch prior's) expected marginals: ``gains[j]``, the calibrated
    chance of the (j+1)-th best node of its recent trees, exponentially averaged. Never
    increasing in j."""

    gains: np.ndarray

    @classmethod
    def prior(cls, depth: int) -> "Acceptance":
        return cls(prior_gains(depth))

    def copy(self) -> "Acceptance":
        return Acceptance(self.gains.copy())

    def relax(self, alpha: float = RELAX) -> None:
        """A round this sequence could have drafted and did not: the marginals move toward the
        prior's (see the module docs)."""
        self.gains += alpha * (prior_gains(len(self.gains)) - self.gains)

    def observe(self, marginals: np.ndarray, cap: int, alpha: float = ALPHA) -> None:
        """One tree of ``cap`` nodes (fewer when the search found fewer) had these ranked
        chances: the first ``cap`` marginals move toward them (zero past the tree's end)."""
        cap = min(int(cap), len(self.gains))
        if cap <= 0:
            return
        m = np.asarray(marginals, dtype=np.float64)[:cap]
        self.gains[:cap] += alpha * (np.pad(m, (0, cap - len(m))) - self.gains[:cap])
        np.minimum.accumulate(self.gains, out=self.gains)


def cell_prior() -> np.ndarray:
    """A calibration cell's chance before it saw a node: ``PRIOR_RATE ** depth``, but never
    more than ``exp`` of the cell's highest path score. The path score is a log-probability of
    the path, and the drafter is under- rather than over-confident (measured on SmolLM2 with
    8-node trees: depth-1 nodes scoring -2..-2.5 accepted 34 % against exp(-2) = 14 %, -4..-5
    7 % against 1.8 %), so the bound only lowers cells the flat prior overrates: the low-score
    cells a small budget seldom verifies. Without it those cells stayed near the flat prior
    and, pooled with their better-observed neighbours to keep the table monotone, valued the
    5th-8th nodes of a tree at ~0.07 where ~0.02 were accepted."""
    upper = np.concatenate(([0.0], SCORE_EDGES))  # each cell's highest score
    return np.minimum(prior_gains(CALIBRATION_DEPTHS)[:, None], np.exp(upper)[None, :])


class NodeCalibration:
    """P(a tree node is accepted | its depth, its path score), from the verified nodes of every
    round: per cell (depth 1, 2, 3+ x :data:`SCORE_EDGES`) the decayed counts of accepted and
    verified nodes, shrunk toward :func:`cell_prior` by :data:`PRIOR_WEIGHT` nodes. The
    table is made monotone -- never larger for a lower score, never larger for a deeper
    node at the same score -- so a child's chance never exceeds its parent's (the path score
    only falls along a path) and the best nodes of a tree are ancestor-closed."""

    def __init__(self):
        shape = (CALIBRATION_DEPTHS, len(SCORE_EDGES) + 1)
        self.hits = np.zeros(shape)
        self.seen = np.zeros(shape)
        self._edges = -np.asarray(SCORE_EDGES)  # ascending, for searchsorted on -score
        self._prior = cell_prior()
        self._table: np.ndarray | None = None

    def _cells(self, depths: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        d = np.clip(np.asarray(depths, dtype=np.int64), 1, CALIBRATION_DEPTHS) - 1
        return d, np.searchsorted(self._edges, -np.asarray(scores, dtype=np.float64), side="left")

    def table(self) -> np.ndarray:
        if self._table is None:
            w = self.seen + PRIOR_WEIGHT
            t = (self.hits + PRIOR_WEIGHT * self._prior) / w
            # lower score: never more likely (each depth's cells pooled where they disagree,
            # weighted by what they saw); deeper: never more likely
            t = np.array([_decreasing(row, wr) for row, wr in zip(t, w)])
            self._table = np.minimum.accumulate(t, axis=0)
        return self._table

    def probs(self, depths, scores) -> np.ndarray:
        """The chance of each node (depth >= 1) given its depth and path score."""
        d, b = self._cells(depths, scores)
        return self.table()[d, b]

    def observe(self, depths, scores, accepted) -> None:
        """One round's verified nodes (depth >= 1) and whether each was on the accepted path."""
        self.hits *= DECAY
        self.seen *= DECAY
        d, b = self._cells(depths, scores)
        np.add.at(self.seen, (d, b), 1.0)
        np.add.at(self.hits, (d, b), np.asarray(accepted, dtype=np.float64))
        self._table = None


def _decreasing(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The weighted least-squares non-increasing fit of ``values`` (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights):
        blocks.append([float(v), float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks[-1]
            blocks[-1] = [(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2]
    return np.concatenate([np.full(c, m) for m, _, c in blocks])


def _increasing(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The weighted least-squares non-decreasing fit of ``values``."""
    return -_decreasing(-np.asarray(values, dtype=np.float64), weights)


def best_nodes(probs: np.ndarray, depths: np.ndarray) -> np.ndarray:
    """Indices of a tree's non-root nodes (1-based), best first: by chance, ties shallower then
    earlier. With chances that never grow from parent to child, every prefix is
    ancestor-closed."""
    probs = np.asarray(probs, dtype=np.float64)
    idx = np.arange(1, len(probs) + 1)
    return idx[np.lexsort((idx, np.asarray(depths), -probs))]


class CostCurve:
    """Verify time (ms) against total rows, from measured points, linear in between and
    extrapolated linearly past the last one."""

    def __init__(self, points: list[dict]):
        pts = sorted((int(p["rows"]), float(p["ms"])) for p in points)
        if not pts or pts[0][0] < 1:
            raise DartError("a verify-cost curve needs measured points with rows >= 1")
        self.points = pts
        self.rows = np.array([p[0] for p in pts], dtype=np.float64)
        # A forward of more rows never costs less: the curve is the least-squares non-decreasing
        # fit of the measured medians (pool adjacent violators). Not their lower envelope: one
        # low reading (5 rows at 39 ms after 1-4 rows at 39-47) would make every smaller size
        # as cheap, and the slope the controller weighs nodes by would vanish.
        ms = np.array([p[1] for p in pts], dtype=np.float64)
        self.ms = _increasing(ms, np.ones_like(ms))

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
            measured = measure_verify_cost(target, prefix_len=128, sizes=sizes, repeats=5,
                                           logits_rows=backend.verify_logits_rows())
        points = [{"rows": a["nodes"], "ms": a["ms"]} for a in measured]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "points": points, "measured_at": time.time()}, indent=1))
        os.replace(tmp, path)
        return cls(points)


def cost_cache_dir() -> Path:
    """Where measured verify-cost curves live: ``$DARTCORE_CACHE/verify_cost``, default
    ``~/.cache/dartcore/verify_cost``."""
    return cache_root() / "verify_cost"


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
    ``max_nodes``: the largest budget per sequence (and the length of the marginals kept)."""

    curve: CostCurve
    max_nodes: int
    alpha: float = ALPHA
    draft_ms: float | None = None  # running means of the engine's measured stage times:
    per_token_ms: float = 0.0  # acceptance (LM-head rows on the CPU) per committed token
    controller_ms: float = 0.0
    verify_scale: float = 1.0  # measured verify time / curve, over all steps
    prior: Acceptance = field(init=False)
    calibration: NodeCalibration = field(init=False)
    choose_s: float = 0.0  # total time spent choosing

    def __post_init__(self):
        if self.max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {self.max_nodes}")
        self.prior = Acceptance.prior(max(self.max_nodes, 1))
        self.calibration = NodeCalibration()
        # per row count r (index r): decayed sums of measured / curve ratios, and their weights
        self._ratio_sum = np.zeros(2)
        self._ratio_n = np.zeros(2)
        self._verify_table: np.ndarray | None = None  # verify_ms per row count; None after timed()
        if self.draft_ms is None:
            # Until a draft was timed: about a quarter of a one-row verify (SmolLM2's drafter
            # is one layer and a head over 8k tokens against 30 layers and a 49k head).
            self.draft_ms = 0.25 * float(self.curve(1))

    def new_sequence(self) -> Acceptance:
        """A new sequence's expected marginals: the batch's prior."""
        return self.prior.copy()

    # -- what a tree's nodes are worth ------------------------------------------------------

    def node_probs(self, tree) -> np.ndarray:
        """The calibrated chance of each non-root node of ``tree`` (node order)."""
        return self.calibration.probs(tree.depths[1:], tree.scores[1:])

    def ranked(self, tree) -> tuple[np.ndarray, np.ndarray]:
        """``tree``'s non-root nodes best first (:func:`best_nodes`) and their chances."""
        p = self.node_probs(tree)
        order = best_nodes(p, tree.depths[1:])
        return order, p[order - 1]

    def observe_tree(self, acc: Acceptance, marginals: np.ndarray, cap: int) -> None:
        """A sequence drew a tree of (up to) ``cap`` nodes with these ranked chances."""
        acc.observe(marginals, cap, self.alpha)
        self.prior.observe(marginals, cap, self.alpha)

    def observe_verified(self, tree, path) -> None:
        """The verified ``tree`` and its accepted ``path`` (node indices from the root):
        every non-root node is one observation of its calibration cell."""
        if len(tree) < 2:
            return
        accepted = np.zeros(len(tree) - 1)
        accepted[np.asarray(path[1:], dtype=np.int64) - 1] = 1.0
        self.calibration.observe(tree.depths[1:], tree.scores[1:], accepted)

    # -- times --------------------------------------------------------------------------------

    def timed(self, *, rows: int, verify_ms: float, draft_ms: float | None, per_token_ms: float | None) -> None:
        """Fold one step's measured times into the running means: its verify forward of
        ``rows`` rows, its draft + search (None when nothing was drafted) and its acceptance
        time per committed token."""
        a = 0.2
        predicted = float(self.curve(rows))
        if predicted > 0 and verify_ms > 0 and rows >= 1:
            ratio = verify_ms / predicted
            self.verify_scale += a * (ratio - self.verify_scale)
            if rows >= len(self._ratio_n):
                grow = int(rows) + 1 - len(self._ratio_n)
                self._ratio_sum = np.concatenate((self._ratio_sum, np.zeros(grow)))
                self._ratio_n = np.concatenate((self._ratio_n, np.zeros(grow)))
            self._ratio_sum *= ROW_DECAY
            self._ratio_n *= ROW_DECAY
            self._ratio_sum[rows] += ratio
            self._ratio_n[rows] += 1.0
        self._verify_table = None
        if draft_ms is not None:
            self.draft_ms += a * (draft_ms - self.draft_ms)
        if per_token_ms is not None:
            self.per_token_ms += a * (per_token_ms - self.per_token_ms)

    def verify_ms(self, rows) -> np.ndarray | float:
        """The model's verify time of ``rows`` rows: the curve, scaled at each row count by the
        ratio the engine measured there (shrunk toward the ratio over all steps where few steps
        had that count; the count of a fixed budget is measured often, its neighbours seldom),
        made non-decreasing in rows. The curve's slope is the price of a node, and a curve
        measured outside the engine (another prefix, a quiet moment, no drafter between
        forwards) can get it wrong: on a 2-vCPU AVX2 VM, 1-6 rows measured flat at ~48 ms
        while the engine's steps took 41 ms for 1 row and 50 for 5."""
        if self._verify_table is None:
            count = np.arange(len(self._ratio_n))
            scale = (self._ratio_sum + ROW_PRIOR * self.verify_scale) / (self._ratio_n + ROW_PRIOR)
            t = scale * self.curve(np.maximum(count, 1))
            t[1:] = _increasing(t[1:], self._ratio_n[1:] + ROW_PRIOR)
            t[0] = 0.0
            self._verify_table = t
        table = self._verify_table
        r = np.asarray(rows, dtype=np.int64)
        last = len(table) - 1
        # past the counts seen: the curve with the overall ratio, never below the last count's
        out = np.where(r <= last, table[np.minimum(r, last)],
                       np.maximum(self.verify_scale * self.curve(np.maximum(r, 1)), table[last]))
        return float(out) if out.ndim == 0 else out

    def step_ms(self, rows: int, drafting: bool, expected: float) -> float:
        """The model's time of one step verifying ``rows`` rows and committing ``expected``
        tokens."""
        return (float(self.verify_ms(rows)) + (self.draft_ms if drafting else 0.0)
                + self.per_token_ms * expected + self.controller_ms)

    # -- the two decisions --------------------------------------------------------------------

    def choose(self, accs: list[Acceptance], caps: list[int]) -> list[int]:
        """Before drafting: budgets ``n_i <= caps[i]`` maximising ``E / T`` from each
        sequence's expected marginals (see the module docs); a sequence with ``n_i > 0``
        draws a tree."""
        t0 = time.perf_counter()
        caps = [min(int(c), self.max_nodes, len(a.gains)) for a, c in zip(accs, caps)]
        budgets = self._allocate([a.gains[:c] for a, c in zip(accs, caps)], self.draft_ms)
        idle = [acc for acc, cap, n in zip(accs, caps, budgets) if n == 0 and cap > 0]
        for acc in idle:
            acc.relax(self.alpha / 4)
        if idle and not any(budgets):
            self.prior.relax(self.alpha / 4)
        self._timed_choice(t0)
        return budgets

    def draws(self, accs: list[Acceptance], caps: list[int]) -> list[int]:
        """:meth:`choose`, as the tree size each sequence draws: its budget plus
        :data:`DRAW_SLACK` nodes within its cap, 0 for a sequence that does not draft."""
        return [min(int(cap), n + DRAW_SLACK) if n > 0 else 0 for n, cap in zip(self.choose(accs, caps), caps)]

    def refine(self, marginals: list[np.ndarray]) -> list[int]:
        """After the search: budgets from each tree's own ranked chances (``marginals[i]``,
        empty for a sequence without a tree), the draft already paid."""
        t0 = time.perf_counter()
        budgets = self._allocate(marginals, 0.0)
        self._timed_choice(t0)
        return budgets

    def _timed_choice(self, t0: float) -> None:
        dt = time.perf_counter() - t0
        self.choose_s += dt
        self.controller_ms += 0.2 * (1e3 * dt - self.controller_ms)

    def _allocate(self, marginals: list[np.ndarray], draft_ms: float) -> list[int]:
        """The exact optimum of ``E / T`` over budgets ``n_i <= len(marginals[i])`` for
        marginals that never grow along a sequence (see the module docs)."""
        b = len(marginals)
        owners, gains = [], []
        for i, m in enumerate(marginals):
            if len(m):
                gains.append(np.asarray(m, dtype=np.float64))
                owners.append(np.full(len(m), i))
        budgets = [0] * b
        if not gains:
            return budgets
        gain = np.concatenate(gains)
        owner = np.concatenate(owners)
        # Largest marginal first; ties keep each sequence's nodes in order (stable sort).
        order = np.argsort(-gain, kind="stable")
        e = b + np.concatenate(([0.0], np.cumsum(gain[order])))
        k = np.arange(len(e))
        t = (self.verify_ms(b + k) + np.where(k > 0, draft_ms, 0.0) + self.per_token_ms * e
             + self.controller_ms)
        best = int(np.argmax(e / t))
        for i in owner[order[:best]]:
            budgets[int(i)] += 1
        return budgets
