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
  round of the batch and shrunk where it has seen little toward ``rho ** depth`` (``rho``:
  the accepted share of the depth-1 nodes, never below ``PRIOR_RATE``) bounded by ``exp``
  of the cell's score (:func:`cell_prior`, :meth:`NodeCalibration._prior_now`). So a
  round where the drafter is sure of four tokens gets four nodes, and one where it guesses
  gets few, whatever the sequence did before; and a tree's siblings count what they add
  (a chain model of per-depth rates prices a budget's nodes as one chain, and undervalues
  the siblings of a tree).
* ``T = verify(R) + [any n_i > 0] * draft + per_token * E + controller``: the target
  forward's time for R rows is what the engine measured for R rows (decayed mean over its
  steps), shrunk by :data:`ROW_PRIOR` steps toward the verify-cost curve of this machine
  (:class:`~dartcore.cost.CostCurve`, measured once and cached on disk) *mapped onto the
  engine's measurements* -- ``a + b * curve(R)`` fitted by least squares over the row
  counts the engine measured -- and kept non-decreasing in R. The curve is a prior for
  its shape only: a shared machine's load changes after it was measured, and the forward
  inside the engine need not cost what it did alone. The draft + search time, the acceptance
  time per committed token (on the CPU the walk computes the LM-head rows it visits: about
  one per committed token) and the controller's own time are running means of what the
  engine measured.

A wrong curve must not decide for good. A curve measured on a busy 2-vCPU VM (SmolLM2 fp32:
69 ms for one row, 104 for two, where the engine's steps took ~30 and ~32) prices a node at
more than a third of a round, so the model chose budget 0 in 334 of 335 rounds and never
measured a step with more rows that would have shown it wrong. Four things undo that:

* **probes**: a round in which no sequence would draft, more than ``probe_interval`` rounds
  after the batch last drafted, the sequence with the best first marginal draws a tree and
  verifies at least :data:`PROBE_NODES` (3) of its nodes whatever the model says. Its step
  measures a second row count, and one such step re-fits ``a + b * curve`` through it (the
  planted-curve test recovers at the first probe, round 5). At the next choice the probe is
  judged: it *wins* when its tree, with the times now known and the draft priced as a
  steady one, would have been worth drafting; a win sets the interval back to
  :data:`PROBE_MIN` (4 rounds), a loss doubles it up to :data:`PROBE_MAX` (64)
  and spaces the next probe by the probe's measured extra time, so that losing probes take
  at most :data:`PROBE_SHARE` (1 %) of the time. Where drafting truly loses, a probe costs
  3 verify rows and a draft that catches up on the rounds since: tens of ms on the dev VM
  at batch 1, but at batch 16 its rows take the CPU forward past the native kernel's 16
  rows (146-149 ms against 44 for the batch's AR step), which once per 64 rounds was ~5 %;
  so a probe whose rows cross such a cliff (one row dearer than :data:`CLIFF` plain steps
  and than the probe's other rows) waits its predicted share before its first try too.
* **the draft as a steady cost**: a sequence that has not drafted for k rounds (a new one:
  its whole prompt) makes its next draft first read the positions since (at most
  :data:`~dartcore.rounds.CATCHUP_SINK` + :data:`~dartcore.rounds.CATCHUP_WINDOW`) through
  the drafter's input projections (:func:`dartcore.rounds.draft`) -- ~6 ms of CPU for 150
  positions, where the steady draft of a batch of 8 takes ~22 (2-vCPU Xeon, SmolLM2
  drafter). Only a step whose drafting sequences all drafted the step before updates the
  draft time; a catch-up draft can only lower it (it bounds the steady cost from above).
  Before any draft was timed it is :data:`DRAFT_SHARE` of the measured one-row verify time.
* **one row count for long**: after :data:`PROBE_MAX` steps of the same row count (batch 1
  at a fixed choice), the next tree is halved once, so the fit has two counts to go on (a
  curve flat where the forward is not is found out too).
* **stale curves**: :meth:`CostCurve.for_target <dartcore.cost.CostCurve.for_target>`
  measures a cached curve again when its one-row time is more than
  :data:`~dartcore.cost.DISAGREE` (1.5) times a spot measurement at load; and a running
  controller that sees the engine's forwards that much faster than the curve marks the
  cache file stale, so the next process measures it again.

Measured rates. The model can be wrong where its parts are right: costs it does not price (the
tree's logits and walk on a drafting step, the search's Python side, a machine whose small
forwards grow with rows differently from the curve's) can make every budget it picks commit
fewer tokens per second than plain steps -- on the CPU int8 path the model drafted 2-3 node
trees at 0.91-0.95x of budget 0. So a judge compares what the engine measured: per batch size,
the plain step's time (a decayed mean over at least :data:`REF_STEPS` plain steps, measured
first where drafting steps have none to compare with, and again every :data:`REF_AGE`
drafting steps), and the recent drafting steps' committed tokens at that plain rate against
their measured time (decayed, the last ~10 steps; a step whose drafter caught up on a long
idle stretch or a whole prompt does not count). When drafting commits more slowly, drafting is
switched off (every step plain, the model not consulted) for :data:`OFF_MIN` rounds, then a
trial lets the model draft again and the judge measures it: a losing trial doubles the next
off stretch up to :data:`OFF_MAX` rounds, a winning one leaves drafting on. The model still
chooses the budgets while drafting wins, and its probes still find drafting where the model
alone would not -- but after a losing verdict they wait as long as the next off stretch, so
that probes the model judges won cannot restart drafting the judge measured losing sooner
than a trial would. At budget 0 by the model's own choice the engine consults it one round in
:data:`IDLE_STRIDE` (``idle_stride``): its choice there moves only as the marginals relax.

The fixed arm. Where drafting gains little -- SmolLM2 on the CPU int8 path at one sequence: a
fixed 2-node tree runs ~1.08x plain steps in the engine -- the model's E / T sits at break-even
and its choices flip between drafting and not, each draft after a plain stretch catching up and
each tree cut by its calibrated chances; measured, its drafting then lost (0.87-0.97x plain) and
the judge switched it off, though the fixed budget would have won. So on the CPU the engine
names the decoder's own budget (``fixed_nodes``, measured best per weights kind:
:data:`dartcore.trees.CPU_BLOCKS_MAX_NODES`, :data:`~dartcore.trees.CPU_MAX_NODES`) and the
controller starts there: a step of one sequence draws exactly that many nodes (no slack, no
cut; a batch is the model's: its rows cost more than the budget was measured for), while the judge
measures it over a longer window (:data:`FIXED_DECAY`, :data:`FIXED_WEIGHT`: ~50 drafting
steps, since ten steps' committed tokens vary as much as the gain) and switches it off below
:data:`FIXED_LOSS` of the plain rate. A model whose drafting loses hands over to the fixed arm
before drafting goes off, and a batch's steps (still the model's) stay plain for an off stretch;
the trials after an off stretch alternate between the two arms.

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
``PRIOR_RATE ** j``, so it drafts again after a few rounds where the cost model lets the
prior's marginals pay, and follows what its trees show then (the batch prior relaxes
likewise in a round where no sequence drafted). RELAX is a quarter of ALPHA: while every
draft misses, a sequence probes about one round in five. Where even the prior's marginals
do not pay -- the cost model's fault as often as the drafter's -- the forced probes above
take over.

The rule (docs/architecture.md, "Budget controller"): add the node whose ΔE/E exceeds ΔT/T by the most, while one
does. T depends on the total row count only, so every candidate node has the same ΔT and
"by the most" is the node with the largest ΔE -- the next node of the sequence whose next
marginal is largest. Those marginals never grow along a sequence, so the first K nodes of
that order are the allocation with the largest E among all with K nodes; the controller walks
that order to the end of the caps and keeps the K with the best E / T, which is the exact
optimum of the model even where T is not convex (the CPU's native kernel takes 16 rows per
call: the curve has steps) -- stopping at the first node that does not pay would stop at
such a step. tests/test_controller.py checks it against brute force.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dartcore.cost import DISAGREE, CostCurve, cost_cache_dir, decreasing, increasing

__all__ = [
    "Acceptance",
    "BudgetController",
    "CostCurve",
    "NodeCalibration",
    "best_nodes",
    "cost_cache_dir",
    "expected_tokens",
]

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
# the measured times (a count follows its last ~1 / (1 - ROW_DECAY) steps), shrunk by ROW_PRIOR
# steps toward the curve mapped onto the engine's measurements (module docs). A count takes part
# in that map while its decayed weight is at least FIT_WEIGHT steps.
ROW_PRIOR = 4.0
ROW_DECAY = 0.995
FIT_WEIGHT = 0.5
# The table is built again after this many steps, or at once when a step measured a row count
# that had no weight in the map (a probe's count re-prices the nodes at the next choice).
# Building it (the map's fit and the pooling) takes ~0.3 ms on the 2-vCPU dev VM, more than a
# tenth of an int8 plain step there; a count's mean moves by ~1/200 a step (ROW_DECAY), so a
# table 32 steps old differs from a fresh one by what one fresh measurement would change.
REFIT_STEPS = 32
# Row counts the verify table holds (larger ones are computed when asked for).
TABLE_ROWS = 257
# Until a draft was timed, it is priced at this share of a one-row verify (SmolLM2's drafter is
# one layer and a head over 8k tokens against 30 layers and a 49k head).
DRAFT_SHARE = 0.25
# Probing at budget 0 (module docs): a probe verifies at least PROBE_NODES nodes; the first comes
# PROBE_MIN rounds after the batch stopped drafting, the interval doubles per losing probe up to
# PROBE_MAX rounds and returns to PROBE_MIN after a winning one.
PROBE_NODES = 3
PROBE_MIN = 4
PROBE_MAX = 64
# A losing probe also spaces the next one so that probes that keep losing cost at most this
# share of the time: the interval is at least the probe's measured extra time over
# PROBE_SHARE times a step's. A probe's rows can cost far more than a node's average: at
# batch 16 on the CPU its 3 nodes take the forward past the native kernel's 16 rows (19 rows:
# 146-149 ms against 44 for the batch's AR step), and a probe every 64 steps cost ~5 %.
PROBE_SHARE = 0.01
# A probe whose rows cross a cliff of the verify cost (one row costing more than CLIFF times a
# plain step) waits its PROBE_SHARE spacing before its first try, not only after it lost.
CLIFF = 0.75
# A cached curve is marked stale once the smallest row count the engine measured this many
# (decayed) times ran more than DISAGREE (dartcore.cost) times faster than the curve says.
STALE_STEPS = 16.0
# ... checked once every this many steps timed
STALE_CHECK_STEPS = 8
# A sequence that drafts draws a tree of its chosen budget plus this many nodes (module docs).
DRAW_SLACK = 2
# The measured-rate judge (module docs, "Measured rates"). Drafting steps are compared with the
# plain steps of the same batch size: a verdict needs JUDGE_WEIGHT of the drafting steps' decayed
# weight (JUDGE_DECAY per step: the last ~10 count), against a plain step time measured over at
# least REF_STEPS plain steps (each moves it by REF_ALPHA), measured again after REF_AGE drafting
# steps. A losing verdict switches drafting off for OFF_MIN rounds, doubling per losing trial up
# to OFF_MAX; a trial whose model drafts in too few steps for a verdict ends after TRIAL_ROUNDS.
# A drafting step whose drafter caught up on more than CATCHUP_IDLE rounds (or a whole prompt)
# is not judged: a sequence that drafts round after round never pays that.
# The fixed arm (module docs, "Measured rates"): where the engine names the decoder's own node
# budget (``fixed_nodes``, measured for one sequence), a step of one sequence drafts that budget;
# a losing model hands drafting to it before switching it off.
# Its verdicts weigh the last ~50 drafting steps (the model's ~10): per step 1-3 tokens commit,
# so ten steps' mean varies by about a tenth, as much as the gain to be told apart.
FIXED_LOSS = 0.97
FIXED_DECAY = 0.98
FIXED_WEIGHT = 30.0
JUDGE_WEIGHT = 6.0
JUDGE_DECAY = 0.9
REF_STEPS = 3
REF_ALPHA = 0.3
REF_AGE = 128
OFF_MIN = 32
OFF_MAX = 1024
TRIAL_ROUNDS = 32
CATCHUP_IDLE = 8
# The engine's idle stride: after the model gives every sequence budget 0, the next
# IDLE_STRIDE - 1 rounds are plain without consulting it (its choice moves slowly there: the
# marginals relax by RELAX a round), so a batch at budget 0 pays for the model one step in four.
IDLE_STRIDE = 4


def expected_tokens(gains: np.ndarray, n: int) -> float:
    """``E(n) = 1 + sum_{j<=n} gains[j-1]``: the bonus token plus the chances of the ``n``
    verified nodes (see the module docs)."""
    return 1.0 + float(np.sum(gains[:n])) if n > 0 else 1.0


def prior_gains(n: int) -> np.ndarray:
    """The prior's marginals: the j-th best node of a chain, ``PRIOR_RATE ** j``."""
    return PRIOR_RATE ** np.arange(1, n + 1, dtype=np.float64)


_PRIOR_GAINS: dict[int, np.ndarray] = {}


def _prior_gains_shared(n: int) -> np.ndarray:
    """:func:`prior_gains`, one read-only array per length (relaxing reads it every round)."""
    g = _PRIOR_GAINS.get(n)
    if g is None:
        g = _PRIOR_GAINS[n] = prior_gains(n)
        g.flags.writeable = False
    return g


@dataclass
class Acceptance:
    """One sequence's (or the batch prior's) expected marginals: ``gains[j]``, the calibrated
    chance of the (j+1)-th best node of its recent trees, exponentially averaged. Never
    increasing in j. ``idle``: the rounds since the sequence last drew a tree."""

    gains: np.ndarray
    idle: int = 0  # rounds since it last drew a tree: positions its drafter has to catch up on
    drafts: int = 0  # trees it drew (its first draft reads the whole prompt)

    @classmethod
    def prior(cls, depth: int) -> Acceptance:
        return cls(prior_gains(depth))

    def copy(self) -> Acceptance:
        return Acceptance(self.gains.copy(), self.idle)

    def relax(self, alpha: float = RELAX) -> None:
        """A round this sequence could have drafted and did not: the marginals move toward the
        prior's (see the module docs)."""
        self.gains += alpha * (_prior_gains_shared(len(self.gains)) - self.gains)

    def observe(self, marginals: np.ndarray, cap: int, alpha: float = ALPHA) -> None:
        """One tree of ``cap`` nodes (fewer when the search found fewer) had these ranked
        chances: the first ``cap`` marginals move toward them (zero past the tree's end)."""
        cap = min(int(cap), len(self.gains))
        if cap <= 0:
            return
        m = np.zeros(cap)
        seen = np.asarray(marginals, dtype=np.float64)[:cap]
        m[: len(seen)] = seen
        self.gains[:cap] += alpha * (m - self.gains[:cap])
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
            t = (self.hits + PRIOR_WEIGHT * self._prior_now()) / w
            # lower score: never more likely (each depth's cells pooled where they disagree,
            # weighted by what they saw); deeper: never more likely
            t = np.array([decreasing(row, wr) for row, wr in zip(t, w)])
            self._table = np.minimum.accumulate(t, axis=0)
        return self._table

    def _prior_now(self) -> np.ndarray:
        """The cells' prior with what depth 1 showed: a depth-d cell (d >= 2) starts from
        ``rho ** d`` (bounded by ``exp`` of its score, as in :func:`cell_prior`), ``rho`` the
        accepted share of every depth-1 node seen, shrunk toward :data:`PRIOR_RATE` and never
        below it. Deeper cells are verified only once a budget reaches them, so their prior
        decides whether it does: with a flat ``PRIOR_RATE ** d`` a drafter right 80 % of the
        time could stay at two nodes for good (the third's cell never seen, priced at 0.125
        where 0.51 are accepted). Never below the flat prior: acceptance runs in streaks (a
        node's chance given its parent was accepted is above the depth-1 share), and a prior
        below the flat one kept small budgets from verifying the cells that would show it."""
        rho = (self.hits[0].sum() + PRIOR_WEIGHT * PRIOR_RATE) / (self.seen[0].sum() + PRIOR_WEIGHT)
        rho = max(float(rho), PRIOR_RATE)
        if rho == PRIOR_RATE:
            return self._prior
        upper = np.exp(np.concatenate(([0.0], SCORE_EDGES)))
        prior = self._prior.copy()
        depth = np.arange(2, CALIBRATION_DEPTHS + 1, dtype=np.float64)
        prior[1:] = np.minimum(rho ** depth[:, None], upper[None, :])
        return prior

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


def best_nodes(probs: np.ndarray, depths: np.ndarray) -> np.ndarray:
    """Indices of a tree's non-root nodes (1-based), best first: by chance, ties shallower then
    earlier. With chances that never grow from parent to child, every prefix is
    ancestor-closed."""
    probs = np.asarray(probs, dtype=np.float64)
    idx = np.arange(1, len(probs) + 1)
    return idx[np.lexsort((idx, np.asarray(depths), -probs))]


@dataclass
class BudgetController:
    """Chooses each step's budgets (see the module docs). ``curve``: the verify-cost curve (a
    prior: the engine's measured times override it); ``max_nodes``: the largest budget per
    sequence (and the length of the marginals kept); ``clock``: the clock the controller times
    its own work with (tests inject one)."""

    curve: CostCurve
    max_nodes: int
    alpha: float = ALPHA
    draft_ms: float | None = None  # running means of the engine's measured stage times:
    per_token_ms: float = 0.0  # acceptance (LM-head rows on the CPU) per committed token
    controller_ms: float = 0.0
    verify_scale: float = 1.0  # measured verify time / curve, over all steps
    clock: Callable[[], float] = time.perf_counter
    prior: Acceptance = field(init=False)
    calibration: NodeCalibration = field(init=False)
    choose_s: float = 0.0  # total time spent choosing
    probes: int = 0  # forced probes drawn, and how many of them won
    probe_wins: int = 0
    probe_interval: int = PROBE_MIN
    stale: dict | None = None  # why the curve was marked stale, once it was
    judge: bool = True  # the measured-rate judge (module docs, "Measured rates")
    # after a choice of budget 0 for every sequence, the next idle_stride - 1 rounds are plain
    # without consulting the model (module docs, "Measured rates"); 1: every round decides
    idle_stride: int = 1
    # the judge's fixed arm: every sequence's budget where the model's drafting lost (0: none)
    fixed_nodes: int = 0
    mode: str = "on"  # the judge's: "on" (the model decides), "off" (budget 0), "trial"
    speedup: float | None = None  # the judge's last measured drafting / plain rate
    trials: int = 0  # trials the judge ran after switching drafting off, and how many lost
    trials_lost: int = 0

    def __post_init__(self):
        if self.max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {self.max_nodes}")
        if self.fixed_nodes < 0:
            raise ValueError(f"fixed_nodes must be >= 0, got {self.fixed_nodes}")
        if self.fixed_nodes and self.mode == "on":
            self.mode = "fixed"  # the measured default first; the judge watches it
        self.prior = Acceptance.prior(max(self.max_nodes, 1))
        self.calibration = NodeCalibration()
        # per row count r (index r): decayed sums of the measured verify ms, and their weights
        self._ms_sum = np.zeros(2)
        self._ms_n = np.zeros(2)
        self._verify_table: np.ndarray | None = None  # verify_ms per row count; None: build again
        self._since_fit = 0  # steps timed since the table was built
        # the curve mapped onto the measurements (_fit_map)
        self._map = (0.0, self.verify_scale, 0.0)
        # The draft: measured in a step whose drafting sequences all drafted the step before
        # (steady), or bounded from above by a step that also caught up on idle positions.
        self._draft_steady = self.draft_ms is not None
        self._draft_bound = float("inf")
        self._catchup = False
        # probing
        self._rounds_idle = 0  # consecutive choices in which no sequence drew a tree
        self._probe_index: int | None = None  # this step's probe (index into the batch)
        self._probe_acc: Acceptance | None = None
        self._probe_marginals: np.ndarray | None = None
        self._judge = False  # a probe was drawn: judge it at the next choice
        self._probe_batch = 0  # the batch size at the probe
        self._probe_extra: float | None = None  # its step's measured time over an AR step's
        self._probe_spacing = 0.0  # rounds between probes their cost allows (PROBE_SHARE)
        # the row count of the last step timed, and how many steps in a row had it
        self._last_rows = 0
        self._same_rows = 0
        if self.draft_ms is None:
            self.draft_ms = DRAFT_SHARE * float(self.curve(1))
        # the judge: per batch size the plain step's measured ms, its plain steps since it was
        # last refreshed and the drafting steps since; the drafting steps' decayed AR-equivalent
        # time, measured time and weight; the rounds left off, the next off stretch, a trial's
        # rounds; this step's batch, committed tokens, controller ms and whether it is judged
        self._ar_ms: dict[int, float] = {}
        self._ar_n: dict[int, int] = {}
        self._ar_age: dict[int, int] = {}
        self._curve_ms: dict[int, float] = {}  # the curve at the row counts asked so far
        self._need_ref: set[int] = set()  # batch sizes whose plain time a drafting step awaits
        self._gain = self._spend = self._weight = 0.0
        self._fgain = self._fspend = self._fweight = 0.0  # the same for the fixed arm's steps
        self._step_fixed = False  # this step runs the fixed arm
        self._model_off = 0  # in fixed mode: batch steps left plain after the model lost
        self._off_left, self._off_len, self._trial_rounds = 0, OFF_MIN, 0
        self._next_trial = "model"  # the arm the next trial runs (alternating with "fixed")
        self._fixed_trial = self.mode == "fixed"  # the fixed arm runs without a won verdict yet
        self._skip = self._skipped = 0  # the idle stride's rounds left, and skipped since
        self._batch, self._tokens, self._ctrl_ms, self._steady = 0, 0, 0.0, False

    def new_sequence(self) -> Acceptance:
        """A new sequence's expected marginals: the batch's prior. Its first draft catches up
        on the prompt (the drafter has read none of it; see the module docs, "the draft as a
        steady cost"), so it counts as idle."""
        acc = self.prior.copy()
        acc.idle = 1
        return acc

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
        if acc is self._probe_acc:
            self._probe_marginals = np.asarray(marginals, dtype=np.float64)[
                : max(int(cap), 0)
            ].copy()

    def observe_plain(self, sequences: int) -> None:
        """A plain step: each of ``sequences`` committed one token (no node to observe)."""
        self._tokens += int(sequences)

    def observe_verified(self, tree, path, *, calibrate: bool = True) -> None:
        """The verified ``tree`` and its accepted ``path`` (node indices from the root):
        every non-root node is one observation of its calibration cell (``calibrate=False``:
        a tree without drafter scores, a builder's plan). The path's tokens (accepted nodes +
        the bonus) count in the step's committed tokens for the judge."""
        self._tokens += len(path)
        if len(tree) < 2 or not calibrate:
            return
        accepted = np.zeros(len(tree) - 1)
        accepted[np.asarray(path[1:], dtype=np.int64) - 1] = 1.0
        self.calibration.observe(tree.depths[1:], tree.scores[1:], accepted)

    # -- times --------------------------------------------------------------------------------

    def timed(
        self, *, rows: int, verify_ms: float, draft_ms: float | None, per_token_ms: float | None
    ) -> None:
        """Fold one step's measured times into the model: its verify forward of ``rows`` rows,
        its draft + search (None when nothing was drafted) and its acceptance time per
        committed token. The step's time -- these plus the controller's own -- and its
        committed tokens (:meth:`observe_verified`) go to the judge."""
        tokens, self._tokens = self._tokens, 0
        self._judge_step(
            rows,
            draft_ms is not None,
            tokens,
            verify_ms + (draft_ms or 0.0) + (per_token_ms or 0.0) * tokens + self._ctrl_ms,
        )
        self._ctrl_ms = 0.0
        a = 0.2
        if self._probe_index is not None and self._probe_batch:
            # the probe's step against the AR step the batch would have taken
            self._probe_extra = max(verify_ms - float(self.verify_ms(self._probe_batch)), 0.0) + (
                draft_ms or 0.0
            )
        predicted = self._curve_at(int(rows))
        if predicted > 0 and verify_ms > 0 and rows >= 1:
            self.verify_scale += a * (verify_ms / predicted - self.verify_scale)
            if rows >= len(self._ms_n):
                grow = int(rows) + 1 - len(self._ms_n)
                self._ms_sum = np.concatenate((self._ms_sum, np.zeros(grow)))
                self._ms_n = np.concatenate((self._ms_n, np.zeros(grow)))
            new_count = self._ms_n[rows] * ROW_DECAY < FIT_WEIGHT
            self._ms_sum *= ROW_DECAY
            self._ms_n *= ROW_DECAY
            self._ms_sum[rows] += verify_ms
            self._ms_n[rows] += 1.0
            self._same_rows = self._same_rows + 1 if rows == self._last_rows else 0
            self._last_rows = int(rows)
            self._since_fit += 1
            if new_count or self._since_fit >= REFIT_STEPS:
                self._verify_table = None
            if self.stale is None and self._since_fit % STALE_CHECK_STEPS == 0:
                self._check_curve()
        if draft_ms is not None:
            if not self._catchup:  # steady: the cost of drafting round after round
                if self._draft_steady:
                    self.draft_ms += a * (draft_ms - self.draft_ms)
                else:
                    self.draft_ms, self._draft_steady = float(draft_ms), True
            elif self._draft_steady:  # a catch-up costs more than a steady draft: an upper bound
                self.draft_ms = min(self.draft_ms, self.draft_ms + a * (draft_ms - self.draft_ms))
            else:
                self._draft_bound = min(self._draft_bound, float(draft_ms))
        if per_token_ms is not None:
            self.per_token_ms += a * (per_token_ms - self.per_token_ms)

    def _curve_at(self, rows: int) -> float:
        """The curve at one row count (remembered: the engine asks for the same few every step)."""
        ms = self._curve_ms.get(rows)
        if ms is None:
            ms = self._curve_ms[rows] = float(self.curve(rows))
        return ms

    def draft_cost(self) -> float:
        """The draft + search time of a step that drafts, as a steady cost (module docs):
        measured, else :data:`DRAFT_SHARE` of the one-row verify time bounded by the
        catch-up drafts measured so far."""
        if not self._draft_steady:
            self.draft_ms = min(DRAFT_SHARE * float(self.verify_ms(1)), self._draft_bound)
        return self.draft_ms

    def _check_curve(self) -> None:
        """Mark a cached curve stale when the engine's forwards run more than DISAGREE times
        faster than it says (it was measured on a busier machine; module docs)."""
        seen = np.flatnonzero(self._ms_n >= STALE_STEPS)
        if not len(seen):
            return
        r = int(seen[0])
        live = self._ms_sum[r] / self._ms_n[r]
        cached = self._curve_at(r)
        if cached > DISAGREE * live:
            self.stale = {"rows": r, "curve_ms": cached, "engine_ms": float(live)}
            self.curve.mark_stale(self.stale)

    def _fit_map(self) -> tuple[float, float, float]:
        """``(a, b, c)``: the mapped curve ``a + b * curve(r) + c * r``, the weighted
        least-squares fit of the engine's mean verify times over the row counts it measured
        (weights: the decayed counts). ``a + b * curve(r)`` (``b >= 0``) where the counts
        measured differ on the curve; a plain ratio (``b`` alone) where one count was
        measured, or where the curve is flat across the counts and so are the times; a line
        in rows (``a + c * r``, ``c >= 0``) where the curve is flat across the counts and the
        times are not (the curve's shape is wrong there); the overall ratio before any."""
        idx = np.flatnonzero(self._ms_n >= FIT_WEIGHT)
        idx = idx[idx >= 1]
        if not len(idx):
            return 0.0, max(self.verify_scale, 0.0), 0.0
        w = self._ms_n[idx]
        r = idx.astype(np.float64)
        x = self.curve(r)
        y = self._ms_sum[idx] / w
        xm, ym, rm = np.average(x, weights=w), np.average(y, weights=w), np.average(r, weights=w)
        vx = np.average((x - xm) ** 2, weights=w)
        if vx > (0.01 * xm) ** 2:
            b = max(float(np.average((x - xm) * (y - ym), weights=w) / vx), 0.0)
            return float(ym - b * xm), b, 0.0
        vy = np.average((y - ym) ** 2, weights=w)
        if len(idx) < 2 or vy <= (0.01 * ym) ** 2:
            return 0.0, float(ym / xm), 0.0
        c = max(
            float(
                np.average((r - rm) * (y - ym), weights=w) / np.average((r - rm) ** 2, weights=w)
            ),
            0.0,
        )
        return float(ym - c * rm), 0.0, c

    def _mapped(self, rows) -> np.ndarray:
        a, b, c = self._map
        r = np.maximum(np.asarray(rows, dtype=np.float64), 1.0)
        return np.maximum(a + b * self.curve(r) + c * r, 1e-3)

    def verify_ms(self, rows) -> np.ndarray | float:
        """The model's verify time of ``rows`` rows (module docs): at each row count the
        engine's measured mean there, shrunk by :data:`ROW_PRIOR` steps toward the curve
        mapped onto the engine's measurements (:meth:`_fit_map`), made
        non-decreasing in rows; past the counts measured, the mapped curve, never below the
        last count's, nor below the largest measured count's time grown as the curve grows
        from there (:meth:`_beyond`). The curve's slope is the price of a node, and a curve
        measured outside the engine (another prefix, a quiet or a busy moment, no drafter
        between forwards) can get it wrong: on a 2-vCPU AVX2 VM, 1-6 rows measured flat at
        ~48 ms while the engine's steps took 41 ms for 1 row and 50 for 5; a curve measured
        under load said 69 ms for 1 row and 104 for 2."""
        if self._verify_table is None:
            self._map = self._fit_map()
            self._since_fit = 0
            prior = self._mapped(np.arange(len(self._ms_n)))
            t = (self._ms_sum + ROW_PRIOR * prior) / (self._ms_n + ROW_PRIOR)
            t[1:] = increasing(t[1:], self._ms_n[1:] + ROW_PRIOR)
            t[0] = 0.0
            self._verify_table = t
            self._verify_table = self._beyond(np.arange(max(len(t), TABLE_ROWS)))
        table = self._verify_table
        r = np.asarray(rows, dtype=np.int64)
        if r.size and int(r.max()) >= len(table):
            out = self._beyond(r)
        else:
            out = table[r]
        return float(out) if out.ndim == 0 else out

    def _beyond(self, r: np.ndarray) -> np.ndarray:
        """The table at row counts ``r``, extended past the counts measured: the mapped
        curve, never below the last count's time nor below the largest well-measured
        count's time times the curve's growth from that count. The map is fitted over the
        counts the engine measured; a batch of 8 measures 8-11 rows, where the noise of a
        shared machine can make the fitted ``b`` ~0 -- and a flat map prices 64 more rows
        at nothing: every sequence of the batch drafted a full tree at once (69 rows, 350 ms
        against 60-110 for the batch's AR steps). Growing as the curve grows keeps the
        curve's shape where nothing was measured."""
        table = self._verify_table
        last = len(table) - 1
        rr = np.asarray(r, dtype=np.int64)
        out = np.where(
            rr <= last,
            table[np.clip(rr, 0, last)],
            np.maximum(self._mapped(rr), table[last]),
        )
        seen = np.flatnonzero(self._ms_n[: last + 1] >= FIT_WEIGHT)
        seen = seen[seen >= 1]
        if len(seen):
            top = int(seen[-1])
            grown = table[top] * self.curve(rr) / max(float(self.curve(top)), 1e-9)
            out = np.where(rr > top, np.maximum(out, grown), out)
        return out

    def step_ms(self, rows: int, drafting: bool, expected: float) -> float:
        """The model's time of one step verifying ``rows`` rows and committing ``expected``
        tokens."""
        return (
            float(self.verify_ms(rows))
            + (self.draft_cost() if drafting else 0.0)
            + self.per_token_ms * expected
            + self.controller_ms
        )

    # -- the measured-rate judge ------------------------------------------------------------

    def _forced_plain(self, batch: int) -> bool:
        """Whether the judge makes this step a plain one for every sequence: drafting is off
        (until its trial), or a drafting step awaits the plain step time of this batch size
        (module docs, "Measured rates")."""
        if not self.judge:
            return False
        if self.mode == "off":
            if self._off_left > 0:
                self._off_left -= 1
                return True
            self._trial_rounds = 0
            self._reset_verdicts()
            self.trials += 1
            if self.fixed_nodes and self._next_trial == "fixed":
                self.mode, self._fixed_trial, self._next_trial = "fixed", True, "model"
            else:
                self.mode, self._next_trial = "trial", "fixed"
        if self.mode == "fixed" and batch > 1 and self._model_off > 0:
            self._model_off -= 1  # the model lost at a batch: its off stretch
            return True
        if self.mode == "trial":
            self._trial_rounds += 1
            if self._trial_rounds > TRIAL_ROUNDS:  # the model hardly drafts: it decides
                self.mode = "on"
        return batch in self._need_ref

    def _fixed_now(self, batch: int) -> bool:
        """Whether this step of ``batch`` sequences runs the fixed arm: the judge handed
        drafting to it, and the step has one sequence (the budget was measured for one; a
        batch's rows cost more, and the model prices them)."""
        return self.mode == "fixed" and batch == 1

    def lap_ms(self, ms: float) -> None:
        """This step's controller time as the engine measured it (choosing, ranking the trees,
        cutting them): the judge counts it instead of the controller's own timing of
        :meth:`choose` and :meth:`refine`. Call before :meth:`timed`."""
        self._ctrl_ms = float(ms)

    def _judge_step(self, rows: int, drafted: bool, tokens: int, ms: float) -> None:
        """One step's measured time and committed tokens (module docs, "Measured rates"): a
        plain step updates its batch size's plain time; a steady drafting step counts, at the
        plain rate of its batch size, as the time plain steps would have taken to commit its
        tokens, and once enough did, drafting that commits more slowly than plain steps is
        switched off."""
        b = self._batch
        self._batch = 0
        if not self.judge or b <= 0 or tokens <= 0 or ms <= 0:
            return
        if not drafted:
            if rows == b:
                old = self._ar_ms.get(b)
                self._ar_ms[b] = ms if old is None else old + REF_ALPHA * (ms - old)
                self._ar_n[b] = self._ar_n.get(b, 0) + 1
                self._ar_age[b] = 0
                if self._ar_n[b] >= REF_STEPS:
                    self._need_ref.discard(b)
            return
        if not self._steady:
            return
        if self._ar_n.get(b, 0) < REF_STEPS:  # the next steps measure the plain time first
            self._need_ref.add(b)
            return
        self._ar_age[b] = self._ar_age.get(b, 0) + 1
        if self._ar_age[b] >= REF_AGE:  # measure the plain time again
            self._ar_n[b] = 0
        if self._step_fixed:
            self._judge_fixed(tokens / b * self._ar_ms[b], ms)
            return
        self._gain = JUDGE_DECAY * self._gain + tokens / b * self._ar_ms[b]
        self._spend = JUDGE_DECAY * self._spend + ms
        self._weight = JUDGE_DECAY * self._weight + 1.0
        if self._weight < JUDGE_WEIGHT:
            return
        self.speedup = self._gain / self._spend
        if self.speedup < 1.0:
            if self.mode == "trial":
                self.trials_lost += 1
            if self.fixed_nodes and self.mode in ("on", "fixed"):
                # the model's drafting lost: one sequence's steps are the fixed budget's (its
                # turn before switching off), a batch's are plain for an off stretch
                if self.mode == "on":
                    self.mode, self._fixed_trial = "fixed", True
                    self.trials += 1
                    self._fgain = self._fspend = self._fweight = 0.0
                self._model_off = self._off_len
                self._off_len = min(2 * self._off_len, OFF_MAX)
                self._gain = self._spend = self._weight = 0.0
            else:
                self._switch_off()
        elif self.mode == "trial":  # a won trial halves the next off stretch (noise can win one)
            self.mode, self._off_len = "on", max(self._off_len // 2, OFF_MIN)

    def _judge_fixed(self, gain: float, ms: float) -> None:
        """One steady step of the fixed arm: its own verdicts over a longer window
        (:data:`FIXED_DECAY`, :data:`FIXED_WEIGHT`: its small gains are as large as ten steps'
        noise) against :data:`FIXED_LOSS` -- the decoder's measured default yields to plain
        steps only where it measures clearly below them."""
        self._fgain = FIXED_DECAY * self._fgain + gain
        self._fspend = FIXED_DECAY * self._fspend + ms
        self._fweight = FIXED_DECAY * self._fweight + 1.0
        if self._fweight < FIXED_WEIGHT:
            return
        self.speedup = self._fgain / self._fspend
        if self.speedup < FIXED_LOSS:
            if self._fixed_trial:
                self.trials_lost += 1
            self._switch_off()
        elif self._fixed_trial:  # a won trial halves the next off stretch
            self._fixed_trial, self._off_len = False, max(self._off_len // 2, OFF_MIN)

    def _switch_off(self) -> None:
        """Drafting off for the next off stretch, which doubles up to :data:`OFF_MAX`."""
        self.mode, self._off_left = "off", self._off_len
        self._off_len = min(2 * self._off_len, OFF_MAX)
        self._reset_verdicts()

    def _reset_verdicts(self) -> None:
        self._gain = self._spend = self._weight = 0.0
        self._fgain = self._fspend = self._fweight = 0.0

    # -- the two decisions --------------------------------------------------------------------

    def choose(self, accs: list[Acceptance], caps: list[int]) -> list[int]:
        """Before drafting: budgets ``n_i <= caps[i]`` maximising ``E / T`` from each
        sequence's expected marginals (see the module docs); a sequence with ``n_i > 0``
        draws a tree. A round in which none would, :data:`PROBE_MIN` to :data:`PROBE_MAX`
        rounds after the batch stopped drafting, one sequence probes."""
        t0 = self.clock()
        self._batch, self._tokens = len(accs), 0
        skip = self._skip > 0
        if skip or self._forced_plain(len(accs)):
            # a plain step without the model: the judge's, or one of the idle stride's (whose
            # rounds the next choice relaxes for); no relaxing while the judge keeps it off
            if skip:
                self._skip -= 1
                self._skipped += 1
            for acc in accs:
                acc.idle += 1
            self._probe_index = self._probe_acc = None
            self._rounds_idle += 1
            self._steady = self._step_fixed = False
            self._ctrl_ms += 1e3 * (self.clock() - t0)
            return [0] * len(accs)
        caps = [min(int(c), self.max_nodes, len(a.gains)) for a, c in zip(accs, caps)]
        # relax for this round and the stride's rounds skipped since the last choice
        relax = 1.0 - (1.0 - self.alpha / 4) ** (1 + self._skipped)
        self._skipped = 0
        if self._judge:
            self._judge_probe(len(accs))
        fixed = self._step_fixed = self._fixed_now(len(accs))
        if fixed:
            budgets = [min(c, self.fixed_nodes) for c in caps]
        else:
            budgets = self._allocate([a.gains[:c] for a, c in zip(accs, caps)], self.draft_cost())
        self._probe_index = self._probe_acc = None
        if not any(budgets) and not fixed:
            self._rounds_idle += 1
            open_ = [i for i, c in enumerate(caps) if c > 0]
            # where the judge last measured drafting losing, probes wait as long as its trials
            judged = self._off_len if self.speedup is not None and self.speedup < 1.0 else 0
            wait = max(self.probe_interval, self._probe_spacing, judged)
            i = max(open_, key=lambda j: (accs[j].gains[0], -j)) if open_ else -1
            if open_ and self._rounds_idle > wait:
                wait = self._cliff_spacing(len(accs), min(caps[i], PROBE_NODES))
            if open_ and self._rounds_idle > wait:
                budgets[i] = min(caps[i], PROBE_NODES)
                self._probe_index, self._probe_acc, self._probe_marginals = i, accs[i], None
                self._probe_batch = len(accs)
                self._judge = True
                self.probes += 1
        if any(budgets):
            self._rounds_idle = 0
        drafting = [acc for acc, n in zip(accs, budgets) if n > 0]
        self._catchup = any(acc.idle > 0 for acc in drafting)
        self._steady = all(acc.drafts > 0 and acc.idle <= CATCHUP_IDLE for acc in drafting)
        for acc, cap, n in zip(accs, caps, budgets):
            if n > 0:
                acc.idle = 0
                acc.drafts += 1
            else:
                acc.idle += 1
                if cap > 0:
                    acc.relax(relax)
        if not any(budgets) and any(c > 0 for c in caps):
            self.prior.relax(relax)
            self._skip = self.idle_stride - 1
        self._timed_choice(t0)
        return budgets

    def _cliff_spacing(self, batch: int, nodes: int) -> float:
        """Rounds a probe of ``nodes`` nodes at ``batch`` sequences waits before its first try
        where its rows cross a cliff of the verify cost (one row costing more than
        :data:`CLIFF` plain steps and 4 times the probe's median row: past the CPU kernel's 16
        rows, 44 ms for 16 and ~147 for 19):
        its predicted extra time over :data:`PROBE_SHARE` of a plain step's. 0 elsewhere."""
        v = np.asarray(self.verify_ms(np.arange(batch, batch + nodes + 1)), dtype=np.float64)
        d = np.diff(v)
        # a cliff: one row far dearer than a plain step and than the probe's other rows (a
        # curve whose every row is dear is no cliff: its probes are priced as before)
        if len(d) < 2 or not float(d.max()) > max(CLIFF * v[0], 4.0 * float(np.median(d))):
            return 0.0
        base = float(v[0]) + self.per_token_ms * batch
        return (float(v[-1] - v[0]) + self.draft_cost()) / (PROBE_SHARE * max(base, 1e-3))

    def _judge_probe(self, batch: int) -> None:
        """Last round's probe, with what it showed (its tree's chances, the times of its
        step): it wins when, the draft priced as a steady one, its tree would have been worth
        drafting. A win brings the probe interval back to PROBE_MIN, a loss doubles it."""
        self._judge = False
        m = self._probe_marginals
        won = False
        if m is not None and len(m):
            won = any(self._allocate([m] + [np.zeros(0)] * max(batch - 1, 0), self.draft_cost()))
        if won:
            self.probe_wins += 1
            self.probe_interval = PROBE_MIN
            self._probe_spacing = 0.0
        else:
            self.probe_interval = min(2 * self.probe_interval, PROBE_MAX)
            if self._probe_extra is not None:
                base = float(self.verify_ms(batch)) + self.per_token_ms * batch
                self._probe_spacing = self._probe_extra / (PROBE_SHARE * max(base, 1e-3))
                if self._probe_spacing >= PROBE_MAX:  # an expensive loss backs off at once
                    self.probe_interval = PROBE_MAX
        self._probe_extra = None

    def draws(self, accs: list[Acceptance], caps: list[int]) -> list[int]:
        """:meth:`choose`, as the tree size each sequence draws: its budget plus
        :data:`DRAW_SLACK` nodes within its cap, 0 for a sequence that does not draft."""
        budgets = self.choose(accs, caps)
        slack = 0 if self._fixed_now(len(accs)) else DRAW_SLACK
        return [min(int(cap), n + slack) if n > 0 else 0 for n, cap in zip(budgets, caps)]

    def refine(self, marginals: list[np.ndarray]) -> list[int]:
        """After the search: budgets from each tree's own ranked chances (``marginals[i]``,
        empty for a sequence without a tree), the draft already paid; a probe keeps at least
        :data:`PROBE_NODES` of its tree's nodes, and after :data:`PROBE_MAX` steps of one row
        count the largest budget is halved once."""
        t0 = self.clock()
        if self._fixed_now(len(marginals)):  # the trees as drawn: the fixed budget, uncut
            self._timed_choice(t0)
            return [len(m) for m in marginals]
        budgets = self._allocate(marginals, 0.0)
        i = self._probe_index
        if i is not None and i < len(budgets):
            budgets[i] = max(budgets[i], min(PROBE_NODES, len(marginals[i])))
        elif self._same_rows >= PROBE_MAX and any(budgets):
            # every step of the last PROBE_MAX verified the same rows: the price of a node
            # rests on the curve's shape alone; verify fewer this once (module docs)
            j = int(np.argmax(budgets))
            budgets[j] //= 2
            self._same_rows = 0
        self._timed_choice(t0)
        return budgets

    def _timed_choice(self, t0: float) -> None:
        dt = self.clock() - t0
        self._ctrl_ms += 1e3 * dt
        self.choose_s += dt
        self.controller_ms += 0.2 * (1e3 * dt - self.controller_ms)

    def _allocate(self, marginals: list[np.ndarray], draft_ms: float) -> list[int]:
        """The exact optimum of ``E / T`` over budgets ``n_i <= len(marginals[i])`` for
        marginals that never grow along a sequence (see the module docs)."""
        b = len(marginals)
        sizes = [len(m) for m in marginals]
        budgets = [0] * b
        if not any(sizes):
            return budgets
        gain = np.concatenate(marginals, dtype=np.float64)
        owner = np.repeat(np.arange(b), sizes)
        # Largest marginal first; ties keep each sequence's nodes in order (stable sort).
        order = np.argsort(-gain, kind="stable")
        e = b + np.concatenate(([0.0], np.cumsum(gain[order])))
        k = np.arange(len(e))
        t = (
            self.verify_ms(b + k)
            + np.where(k > 0, draft_ms, 0.0)
            + self.per_token_ms * e
            + self.controller_ms
        )
        best = int(np.argmax(e / t))
        for i in owner[order[:best]]:
            budgets[int(i)] += 1
        return budgets
