"""The budget controller with a wrong verify-cost curve: a cached curve is a prior, not the truth.

A curve measured while the machine was busy (69 ms for one SmolLM2 row and 35 ms more per
node, where the engine's forwards take 30 ms and 1.5 more) is planted; the engine's rounds run
against a fake machine -- injected verify / draft times and a seeded acceptance process, the
controller's own clock stopped -- so every run is the same. The controller must draft within
a bounded number of rounds once drafting pays, reach the rate of the best fixed budget under
the true costs (brute force over the budgets), and still go to budget 0, probing ever more
rarely, where verify rows are so expensive that drafting loses. A planted file in the cache
directory is checked at load (spot check) and marked stale by a controller that finds the
engine faster than it says."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import tiny_model
from dartcore.controller import PROBE_MAX, PROBE_MIN, PROBE_NODES, BudgetController
from dartcore.cost import CostCurve, cost_cache_dir, curve_key
from dartcore.tree import Tree

# A curve measured while the machine was busy: SmolLM2 fp32, 2 threads, on a loaded 2-vCPU VM.
BUSY = [
    (1, 66.7),
    (2, 104.0),
    (3, 114.2),
    (4, 128.2),
    (5, 144.4),
    (6, 156.1),
    (8, 205.9),
    (9, 240.7),
]


def busy_points(max_rows: int = 64) -> list[dict]:
    slope = (BUSY[-1][1] - BUSY[-2][1]) / (BUSY[-1][0] - BUSY[-2][0])
    return [{"rows": r, "ms": m} for r, m in BUSY] + [
        {"rows": max_rows, "ms": BUSY[-1][1] + slope * (max_rows - BUSY[-1][0])}
    ]


def chain(n: int, step: float = -0.2) -> Tree:
    """A chain of ``n`` nodes after the root, path scores falling by ``step`` per node."""
    return Tree(np.arange(n + 1), np.arange(-1, n), np.arange(n + 1), step * np.arange(n + 1))


class FakeMachine:
    """True costs: verify ``v0 + v1 * (rows - 1)`` ms, draft ``d0 + d1 * positions`` ms (the
    drafter runs over every position committed since the sequence last drafted); each node of
    a chain is accepted with chance ``q`` given its parent."""

    def __init__(self, v0, v1, q, d0=4.0, d1=0.3, per_token=0.2):
        self.v0, self.v1, self.q, self.d0, self.d1, self.per_token = v0, v1, q, d0, d1, per_token

    def verify(self, rows: int) -> float:
        return self.v0 + self.v1 * (rows - 1)

    def expected(self, n: int) -> float:
        return 1.0 + sum(self.q**j for j in range(1, n + 1))

    def rate(self, n: int) -> float:
        """Expected committed tokens per ms of a fixed budget ``n``, drafting every round (the
        drafter then sees E(n) positions a round)."""
        e = self.expected(n)
        t = self.verify(1 + n) + (self.d0 + self.d1 * e if n else 0.0) + self.per_token * e
        return e / t


def run(ctrl: BudgetController, m: FakeMachine, rounds: int, seed: int, cap: int = 6):
    """The engine's calls for one sequence (draws, ranked, observe_tree, refine,
    observe_verified, timed), against ``m``. Returns per round (drawn, verified, accepted)."""
    rng = np.random.default_rng(seed)
    acc = ctrl.new_sequence()
    pending = 1
    log = []
    for _ in range(rounds):
        (n,) = ctrl.draws([acc], [cap])
        if n:
            _, marginals = ctrl.ranked(chain(n))
            ctrl.observe_tree(acc, marginals, n)
            (k,) = ctrl.refine([marginals])
            positions, pending = pending, 0
        else:
            (k,) = ctrl.refine([np.zeros(0)])
        a = 0
        while a < k and rng.random() < m.q:
            a += 1
        ctrl.observe_verified(chain(k), list(range(a + 1)))
        pending += a + 1
        ctrl.timed(
            rows=k + 1,
            verify_ms=m.verify(k + 1),
            draft_ms=m.d0 + m.d1 * positions if n else None,
            per_token_ms=m.per_token,
        )
        log.append((n, k, a))
    return np.array(log)


def achieved(m: FakeMachine, kept: np.ndarray) -> float:
    """Expected tokens per ms of the budgets the controller verified, under the true costs."""
    e = np.array([m.expected(int(k)) for k in kept])
    t = np.array(
        [
            m.verify(1 + int(k))
            + (m.d0 + m.d1 * m.expected(int(k)) if k else 0.0)
            + m.per_token * x
            for k, x in zip(kept, e)
        ]
    )
    return float(e.sum() / t.sum())


@pytest.mark.parametrize("seed", range(3))
def test_a_busy_curve_is_overridden_within_a_few_rounds(seed):
    m = FakeMachine(v0=30.0, v1=1.5, q=0.8)
    best = max(range(7), key=m.rate)
    assert best > 0 and m.rate(best) > 1.3 * m.rate(0)  # drafting pays, by a wide margin
    ctrl = BudgetController(CostCurve(busy_points()), max_nodes=6, clock=lambda: 0.0)
    # the curve alone says: do not draft (a node costs more than a third of a round)
    assert ctrl.choose([ctrl.new_sequence()], [6]) == [0]
    ctrl = BudgetController(CostCurve(busy_points()), max_nodes=6, clock=lambda: 0.0)
    log = run(ctrl, m, 400, seed)
    kept = log[:, 1]
    first = int(np.flatnonzero(kept)[0])
    assert first <= PROBE_MIN + 2  # the first probe, and it wins
    assert ctrl.probe_wins >= 1 and ctrl.probe_interval == PROBE_MIN
    assert np.mean(kept[first + 10 :] > 0) > 0.95
    assert achieved(m, kept[50:]) > 0.93 * m.rate(best)


def test_without_probes_the_busy_curve_would_decide_for_good():
    """The reference for the test above: the same run with probing switched off stays at 0."""
    ctrl = BudgetController(
        CostCurve(busy_points()), max_nodes=6, clock=lambda: 0.0, probe_interval=10**9
    )
    log = run(ctrl, FakeMachine(v0=30.0, v1=1.5, q=0.8), 200, 0)
    assert not log[:, 1].any()


@pytest.mark.parametrize("curve", ["busy", "flat"])
def test_drafting_that_truly_loses_goes_to_zero_and_probes_back_off(curve):
    # each verified node costs 15 ms on a 20 ms round: even the best budget loses
    m = FakeMachine(v0=20.0, v1=15.0, q=0.8)
    assert max(range(7), key=m.rate) == 0
    points = (
        busy_points() if curve == "busy" else [{"rows": 1, "ms": 10.0}, {"rows": 64, "ms": 11.0}]
    )
    ctrl = BudgetController(CostCurve(points), max_nodes=6, clock=lambda: 0.0)
    log = run(ctrl, m, 700, 0)
    drawn, kept = log[:, 0], log[:, 1]
    # a flat (optimistic) curve is found out within PROBE_MAX + a few rounds of one row count
    settled = 2 * PROBE_MAX
    assert np.mean(kept[settled:] == 0) > 0.97
    # the probes back off: at most one per PROBE_MAX rounds once they keep losing
    assert (drawn[settled:] > 0).sum() <= (700 - settled) // PROBE_MAX + 2
    assert ctrl.probe_interval == PROBE_MAX
    # what the losing probes cost (3 nodes, 45 ms + a draft, once per 64 rounds of 20 ms)
    assert achieved(m, kept[settled:]) > 0.96 * m.rate(0)


def test_probe_interval_doubles_while_probes_lose_and_resets_when_one_wins():
    # a node costs as much as a round: even the prior's marginals (relaxed to) do not pay
    curve = CostCurve([{"rows": 1, "ms": 20.0}, {"rows": 16, "ms": 320.0}])
    ctrl = BudgetController(curve, max_nodes=4, draft_ms=3.0, clock=lambda: 0.0)
    acc = ctrl.new_sequence()
    acc.gains[:] = 0.0
    ctrl.prior.gains[:] = 0.0
    probes, intervals = [], []
    for t in range(400):
        (n,) = ctrl.choose([acc], [4])
        if n:
            assert n == PROBE_NODES
            probes.append(t)
            intervals.append(ctrl.probe_interval)
            ctrl.observe_tree(acc, np.zeros(4), cap=n)  # the probe's tree is worth nothing
    gaps = np.diff(probes)
    assert gaps[0] == 2 * PROBE_MIN + 1 and list(gaps[:4]) == sorted(gaps[:4])  # backing off
    assert ctrl.probe_interval == PROBE_MAX and gaps[-1] == PROBE_MAX + 1
    # rows got cheap (the engine measures 20.5 ms for 4 rows) and the drafter is sure: the
    # next probe wins and the interval resets
    for _ in range(20):
        ctrl.timed(rows=1, verify_ms=20.0, draft_ms=None, per_token_ms=None)
    while ctrl.choose([acc], [4]) == [0]:
        pass
    ctrl.observe_tree(acc, np.full(4, 0.95), cap=PROBE_NODES)
    ctrl.timed(rows=1 + PROBE_NODES, verify_ms=20.5, draft_ms=3.0, per_token_ms=None)
    ctrl.choose([acc], [4])
    assert ctrl.probe_interval == PROBE_MIN and ctrl.probe_wins == 1


def test_refine_keeps_the_probe_and_catch_up_drafts_do_not_raise_the_draft_cost():
    ctrl = BudgetController(CostCurve(busy_points()), max_nodes=6, clock=lambda: 0.0)
    acc = ctrl.new_sequence()
    for _ in range(PROBE_MIN):
        assert ctrl.draws([acc], [6]) == [0]
        ctrl.refine([np.zeros(0)])
        ctrl.timed(rows=1, verify_ms=30.0, draft_ms=None, per_token_ms=0.0)
    (n,) = ctrl.draws([acc], [6])
    assert n > 0 and acc.idle == 0
    # the model would cut this tree to nothing (a node at 0.05 is not worth a busy-curve row)
    assert ctrl._allocate([np.full(n, 0.05)], 0.0) == [0]
    assert ctrl.refine([np.full(n, 0.05)]) == [PROBE_NODES]
    prior = ctrl.draft_cost()
    # this draft caught up on the idle rounds' positions: 40 ms, far more than a steady one
    ctrl.timed(rows=1 + PROBE_NODES, verify_ms=34.0, draft_ms=40.0, per_token_ms=0.0)
    assert ctrl.draft_cost() == pytest.approx(prior)
    ctrl.choose([acc], [6])
    ctrl._catchup = False  # a step whose drafters all drafted the step before: steady
    ctrl.timed(rows=4, verify_ms=34.0, draft_ms=5.0, per_token_ms=0.0)
    assert ctrl.draft_cost() == pytest.approx(5.0)
    ctrl._catchup = True
    ctrl.timed(rows=4, verify_ms=34.0, draft_ms=40.0, per_token_ms=0.0)
    assert ctrl.draft_cost() == pytest.approx(5.0)


def _plant(target, cache_dir, points, **extra) -> Path:  # noqa: F821
    key = curve_key(target)
    path = cache_dir / "verify_cost" / f"{key['digest']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "points": points, **extra}))
    return path


def test_a_planted_busy_curve_is_measured_again_at_load(tmp_path, monkeypatch):
    from dartcore import DartDecoder
    from test_decoder import CharTokenizer

    monkeypatch.setenv("DARTCORE_CACHE", str(tmp_path))
    torch.set_num_threads(1)
    dec = DartDecoder(tiny_model("llama"), CharTokenizer(), tree="ar")
    assert cost_cache_dir() == tmp_path / "verify_cost"
    # 69 ms a row where the tiny model takes ~1: measured on a busy machine
    path = _plant(dec.target, tmp_path, busy_points(16))
    curve = CostCurve.for_target(dec.target, dec.backend, max_rows=16)
    assert curve(1) < 66.7 / 1.5
    data = json.loads(path.read_text())
    assert (
        data["points"] != busy_points(16) and data["conditions"]["replaced"]["one_row_ms"] == 66.7
    )
    assert {"loadavg_1m", "cpus", "time"} <= set(data["conditions"]) and data["key"]["cpu"]
    # a cached curve faster than now is kept (now is the busy moment); scaled by the controller
    fast = [{"rows": 1, "ms": 1e-4}, {"rows": 16, "ms": 2e-4}]
    _plant(dec.target, tmp_path, fast)
    assert CostCurve.for_target(dec.target, dec.backend, max_rows=16).points == [
        (1, 1e-4),
        (16, 2e-4),
    ]
    # a stale one is measured again
    _plant(dec.target, tmp_path, fast, stale={"rows": 1})
    assert CostCurve.for_target(dec.target, dec.backend, max_rows=16)(1) > 1e-3


def test_the_controller_marks_a_curve_stale_when_the_engine_is_much_faster(tmp_path):
    path = tmp_path / "curve.json"
    path.write_text(json.dumps({"key": {}, "points": busy_points()}))
    ctrl = BudgetController(CostCurve(busy_points(), path=path), max_nodes=4, clock=lambda: 0.0)
    for _ in range(30):
        ctrl.timed(rows=1, verify_ms=30.0, draft_ms=None, per_token_ms=None)
    assert ctrl.stale is not None and ctrl.stale["rows"] == 1
    assert json.loads(path.read_text())["stale"]["engine_ms"] == pytest.approx(30.0)
    # a curve the engine agrees with (here: slower than the curve by a load burst) is kept
    path.write_text(json.dumps({"key": {}, "points": busy_points()}))
    ctrl = BudgetController(CostCurve(busy_points(), path=path), max_nodes=4, clock=lambda: 0.0)
    for _ in range(30):
        ctrl.timed(rows=1, verify_ms=90.0, draft_ms=None, per_token_ms=None)
    assert ctrl.stale is None and "stale" not in json.loads(path.read_text())


def test_the_engine_recovers_from_a_planted_busy_curve(tmp_path, monkeypatch):
    """The engine on a tiny model, the busy curve planted in the cache directory and kept at
    load (its spot check fell into a burst of load), the step times those of the fake machine:
    the engine's controller drafts within a few steps, and its outputs stay the target's own."""
    from dartcore import cost
    from dartcore.engine import Engine, SamplingParams
    from test_engine import cached_oracle

    dec, prompts, refs = cached_oracle(tmp_path, monkeypatch, 1, 60, seed=3)
    path = _plant(dec.target, tmp_path, busy_points(64))
    monkeypatch.setattr(cost, "spot_verify_ms", lambda target, backend, **kw: 66.7)
    engine = Engine(dec, max_batch=1, budget="adaptive", max_nodes=6)
    ctrl = engine.controller
    assert ctrl.curve.points[0] == (1, 66.7) and ctrl.curve.path == path
    ctrl.clock = lambda: 0.0
    m = FakeMachine(v0=30.0, v1=1.5, q=0.8)
    real = ctrl.timed
    monkeypatch.setattr(
        ctrl,
        "timed",
        lambda *, rows, verify_ms, draft_ms, per_token_ms: real(
            rows=rows,
            verify_ms=m.verify(rows),
            draft_ms=None if draft_ms is None else 4.0,
            per_token_ms=0.2,
        ),
    )
    rid = engine.add_request(prompts[0], SamplingParams(max_new_tokens=60))
    steps = []
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            out = o
        steps.append(engine.stats.steps[-1].budgets if engine.stats.steps else [])
    assert out.request_id == rid and out.tokens == refs[0]
    budgets = [b[0] for b in steps if b]
    first = next(i for i, b in enumerate(budgets) if b > 0)
    assert first <= PROBE_MIN + 2
    assert np.mean(np.array(budgets[first:]) > 0) > 0.8
    assert ctrl.stale is None or json.loads(path.read_text()).get("stale")


def test_expensive_losing_probes_cost_at_most_a_small_share_of_the_time():
    """At batch 16 on the CPU a probe's 3 nodes take the forward past the native kernel's 16
    rows (19 rows: ~147 ms against 44 for the AR step): losing probes are spaced by their
    measured cost, not every PROBE_MAX rounds."""
    curve = CostCurve(
        [{"rows": 1, "ms": 30.0}, {"rows": 16, "ms": 44.0}, {"rows": 17, "ms": 140.0}]
    )
    ctrl = BudgetController(curve, max_nodes=4, draft_ms=20.0, clock=lambda: 0.0)

    def verify(rows):
        return 44.0 if rows <= 16 else 147.0

    accs = [ctrl.new_sequence() for _ in range(16)]
    spent, probe_ms = 0.0, 0.0
    for _ in range(3000):
        budgets = ctrl.draws(accs, [4] * 16)
        marginals = []
        for acc, n in zip(accs, budgets):
            m = np.full(n, 0.01)  # the drafter is never right: every probe loses
            if n:
                ctrl.observe_tree(acc, m, n)
            marginals.append(m)
        kept = ctrl.refine(marginals)
        rows = 16 + sum(kept)
        t = verify(rows) + (20.0 if any(budgets) else 0.0)
        spent += t
        probe_ms += t - 44.0
        ctrl.timed(
            rows=rows,
            verify_ms=verify(rows),
            draft_ms=20.0 if any(budgets) else None,
            per_token_ms=0.0,
        )
    assert ctrl.probes >= 2  # it still probes ...
    assert probe_ms / spent < 0.02  # ... at under 2 % of the time (every PROBE_MAX rounds: ~5 %)


def test_a_curve_is_not_reused_across_numerics_kernels_or_native_builds(monkeypatch):
    """An int8 forward's extra rows cost a fraction of the exact path's, and a rebuilt kernel
    can change every point: each names a different cached file."""
    from dartcore import cost
    from dartcore.models.transformer import TargetModel

    target = TargetModel(tiny_model("llama"))
    base = curve_key(target)
    assert base["numerics"] == target.numerics
    assert base["native_build"] == cost.native_build() and len(base["native_build"]) == 16
    monkeypatch.setattr(target, "numerics", "exact", raising=False)
    exact = curve_key(target)
    monkeypatch.setattr(target, "numerics", "int8", raising=False)
    int8 = curve_key(target)
    assert exact["digest"] != int8["digest"]
    monkeypatch.setattr(cost, "int8_kernel", lambda: "avx2")
    assert curve_key(target)["digest"] != int8["digest"]
    monkeypatch.setattr(cost, "native_build", lambda: "0" * 16)
    assert curve_key(target)["digest"] not in {base["digest"], int8["digest"]}
