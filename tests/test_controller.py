"""The budget controller against brute force: on synthetic verify-cost curves (flat then
linear, convex, with a step where the native kernel's 16 rows run out) and synthetic
marginals, its budgets reach the best E / T over every allocation of small budgets (the
reference enumerates them all); at batch 1 it picks the fixed budget that maximises
tau(n) / t(n); the calibration follows the verified nodes and keeps a tree's best nodes
ancestor-closed; marginals follow the trees; the engine's trees are cut to the refined
budgets; the cost curve is cached on disk and remeasured on request."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from conftest import tiny_model
from dartcore.controller import (
    PRIOR_RATE,
    Acceptance,
    BudgetController,
    CostCurve,
    NodeCalibration,
    best_nodes,
    expected_tokens,
)

CURVES = {
    # 1 / 4 / 8 / 16 rows ~ 24 / 34 / 39 / 57 ms: the dev box's two-thread curve (issue figures)
    "cpu": CostCurve(
        [
            {"rows": 1, "ms": 24},
            {"rows": 4, "ms": 34},
            {"rows": 8, "ms": 39},
            {"rows": 16, "ms": 57},
            {"rows": 32, "ms": 110},
            {"rows": 64, "ms": 215},
        ]
    ),
    "flat-gpu": CostCurve([{"rows": 1, "ms": 10}, {"rows": 64, "ms": 11}, {"rows": 128, "ms": 16}]),
    "convex": CostCurve([{"rows": r, "ms": 5 + 0.05 * r * r} for r in range(1, 70)]),
    "step": CostCurve(
        [
            {"rows": 1, "ms": 20},
            {"rows": 16, "ms": 30},
            {"rows": 17, "ms": 60},
            {"rows": 64, "ms": 90},
        ]
    ),
}


def choose(ctrl, accs, caps):
    """The first decision without its side effects (idle sequences relax)."""
    return ctrl.choose([a.copy() for a in accs], caps)


def brute_force(ctrl: BudgetController, accs, caps):
    best, arg = -1.0, None
    for budgets in itertools.product(*[range(min(c, ctrl.max_nodes) + 1) for c in caps]):
        e = sum(expected_tokens(a.gains, n) for a, n in zip(accs, budgets))
        t = ctrl.step_ms(len(accs) + sum(budgets), any(n > 0 for n in budgets), e)
        if e / t > best + 1e-12:
            best, arg = e / t, budgets
    return best, arg


def objective(ctrl, accs, budgets):
    e = sum(expected_tokens(a.gains, n) for a, n in zip(accs, budgets))
    return e / ctrl.step_ms(len(accs) + sum(budgets), any(n > 0 for n in budgets), e)


def random_gains(rng, n=5):
    return np.sort(rng.uniform(0.0, 0.95, n))[::-1].copy()


@pytest.mark.parametrize("curve", sorted(CURVES))
@pytest.mark.parametrize("seed", range(6))
def test_choice_equals_brute_force(curve, seed):
    rng = np.random.default_rng(seed)
    ctrl = BudgetController(
        CURVES[curve],
        max_nodes=5,
        draft_ms=float(rng.uniform(0, 8)),
        per_token_ms=float(rng.uniform(0, 3)),
        verify_scale=float(rng.uniform(0.5, 2)),
    )
    b = int(rng.integers(1, 5))
    accs = [Acceptance(random_gains(rng)) for _ in range(b)]
    caps = [int(rng.integers(0, 6)) for _ in range(b)]
    ctrl.controller_ms = 0.0  # the reference has no controller time to measure
    got = ctrl._allocate([a.gains[:c] for a, c in zip(accs, caps)], ctrl.draft_ms)
    best, arg = brute_force(ctrl, accs, caps)
    assert all(0 <= n <= c for n, c in zip(got, caps))
    assert objective(ctrl, accs, got) == pytest.approx(best, rel=1e-9), (got, arg)


@pytest.mark.parametrize("seed", range(4))
def test_refine_equals_brute_force_with_the_draft_paid(seed):
    rng = np.random.default_rng(100 + seed)
    ctrl = BudgetController(CURVES["step"], max_nodes=5, draft_ms=float(rng.uniform(1, 8)))
    ctrl.controller_ms = 0.0
    trees = [random_gains(rng, int(rng.integers(0, 6))) for _ in range(int(rng.integers(1, 5)))]
    got = ctrl.refine(trees)
    ctrl.controller_ms = 0.0
    ctrl.draft_ms = 0.0  # the reference: a model without the (sunk) draft
    best, _ = brute_force(ctrl, [Acceptance(t) for t in trees], [len(t) for t in trees])
    assert objective(ctrl, [Acceptance(t) for t in trees], got) == pytest.approx(best, rel=1e-9)


def test_batch_one_picks_the_best_fixed_budget():
    # tau(n) of the shipped drafter at 1..8 nodes, measured (one greedy run, bench index):
    # 1.31 / 1.47 / 1.56 / 1.62 / - / 1.69 / - / 1.73: marginals that reproduce it give the best
    # fixed n = argmax tau / t.
    gains = np.array([0.31, 0.16, 0.09, 0.06, 0.035, 0.035, 0.02, 0.02])
    for curve in CURVES.values():
        ctrl = BudgetController(curve, max_nodes=8, draft_ms=3.0)
        ctrl.controller_ms = 0.0
        (n,) = ctrl._allocate([gains], ctrl.draft_ms)
        fixed = max(
            range(9),
            key=lambda k: (
                expected_tokens(gains, k) / ctrl.step_ms(1 + k, k > 0, expected_tokens(gains, k))
            ),
        )
        assert n == fixed


def test_more_load_means_smaller_budgets():
    gains = 0.6 ** np.arange(1, 7)
    ctrl = BudgetController(CURVES["cpu"], max_nodes=6, draft_ms=3.0)
    per_seq = [
        np.mean(choose(ctrl, [Acceptance(gains.copy()) for _ in range(b)], [6] * b))
        for b in (1, 4, 16)
    ]
    assert per_seq[0] >= per_seq[1] >= per_seq[2]
    assert per_seq[2] < per_seq[0]
    # on a flat (GPU-like) curve extra rows are free: every sequence takes its cap
    flat = BudgetController(CURVES["flat-gpu"], max_nodes=6, draft_ms=1.0)
    assert choose(flat, [Acceptance(gains.copy()) for _ in range(8)], [6] * 8) == [6] * 8
    # a sequence that never gets tokens accepted gets no nodes
    assert choose(
        BudgetController(CURVES["cpu"], max_nodes=6), [Acceptance(np.full(6, 0.001))], [6]
    ) == [0]
    # a sure sequence gets the nodes a doubtful one would have had
    ctrl = BudgetController(CURVES["cpu"], max_nodes=6, draft_ms=3.0)
    sure, doubtful = Acceptance(np.full(6, 0.95)), Acceptance(np.full(6, 0.02))
    a, b = ctrl.refine([sure.gains, doubtful.gains])
    assert a == 6 and b == 0


def test_calibration_learns_the_accepted_share_of_each_cell_and_stays_monotone():
    cal = NodeCalibration()
    # before any observation: the prior PRIOR_RATE ** depth
    assert np.allclose(
        cal.probs([1, 2, 3, 7], [-1.0, -1.0, -1.0, -1.0]), PRIOR_RATE ** np.array([1, 2, 3, 3])
    )
    rng = np.random.default_rng(0)
    for _ in range(3000):  # depth 1: accepted 90 % above -0.5, 10 % below -5; depth 2: 40 % at -1
        cal.observe(
            [1, 1, 2],
            [-0.3, -5.5, -1.2],
            [rng.random() < 0.9, rng.random() < 0.1, rng.random() < 0.4],
        )
    p = cal.probs([1, 1, 2], [-0.3, -5.5, -1.2])
    assert p == pytest.approx([0.9, 0.1, 0.4], abs=0.06)
    t = cal.table()
    assert np.all(np.diff(t, axis=1) <= 0) and np.all(np.diff(t, axis=0) <= 0)  # monotone both ways
    # a cell that contradicts the order (a lower score accepted more often) is held to it
    for _ in range(500):
        cal.observe([1], [-7.0], [True])
    assert cal.probs([1], [-7.0])[0] <= cal.probs([1], [-5.5])[0]


def test_low_score_cells_start_below_the_flat_prior_and_do_not_lift_their_neighbours():
    cal = NodeCalibration()
    # unseen: PRIOR_RATE ** depth, bounded by exp of the cell's highest score
    assert cal.probs([1, 1, 2], [-0.1, -6.5, -9.0]) == pytest.approx(
        [PRIOR_RATE, np.exp(-6.0), np.exp(-8.0)]
    )
    # a small budget verifies many nodes scoring -4.5 (3 % accepted) and almost none below:
    # the seldom-seen cells under them must not pool it upward (with a flat prior the cell
    # below -8, two nodes seen, sat at ~0.4 and the pooled run at ~0.07)
    rng = np.random.default_rng(1)
    for _ in range(400):
        cal.observe([1], [-4.5], [rng.random() < 0.03])
    cal.observe([1, 1], [-9.0, -7.0], [False, False])
    assert cal.probs([1], [-4.5])[0] < 0.05
    assert cal.probs([1], [-9.0])[0] <= cal.probs([1], [-7.0])[0] <= cal.probs([1], [-4.5])[0]


def test_deeper_cells_start_from_what_depth_one_showed():
    # a drafter right 80 % of the time at depth 1: its unseen depth-3 cells start near 0.8 ** 3,
    # not at PRIOR_RATE ** 3 (a budget of two nodes would never verify a third to learn it)
    sure = NodeCalibration()
    rng = np.random.default_rng(2)
    for _ in range(500):
        sure.observe([1], [-0.1], [rng.random() < 0.8])
    assert sure.probs([3], [-0.1])[0] == pytest.approx(0.8**3, abs=0.05)
    assert sure.probs([3], [-3.5])[0] <= np.exp(-3.0)  # still bounded by the cell's score
    # one right 30 % of the time keeps the flat prior (acceptance runs in streaks)
    doubtful = NodeCalibration()
    for _ in range(500):
        doubtful.observe([1], [-0.1], [rng.random() < 0.3])
    assert doubtful.probs([2, 3], [-0.1, -0.1]) == pytest.approx(PRIOR_RATE ** np.array([2, 3]))


def test_best_nodes_of_a_tree_are_ancestor_closed():
    rng = np.random.default_rng(3)
    cal = NodeCalibration()
    for _ in range(200):
        d = rng.integers(1, 5, 20)
        s = -rng.uniform(0, 10, 20)
        cal.observe(d, s, rng.random(20) < np.exp(s / 2))
    for _ in range(50):  # random trees whose scores fall along every path
        n = int(rng.integers(2, 30))
        parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
        depths = np.zeros(n, dtype=np.int64)
        scores = np.zeros(n)
        for i in range(1, n):
            depths[i] = depths[parents[i]] + 1
            scores[i] = scores[parents[i]] - rng.exponential(1.0)
        order = best_nodes(cal.probs(depths[1:], scores[1:]), depths[1:])
        for k in range(1, n):
            kept = set(order[:k].tolist()) | {0}
            assert all(parents[j] in kept for j in kept if j), (k, order)


def test_marginals_follow_the_trees_and_new_sequences_start_from_the_batch():
    ctrl = BudgetController(CURVES["cpu"], max_nodes=4)
    acc = ctrl.new_sequence()
    for _ in range(200):
        ctrl.observe_tree(acc, np.array([0.9, 0.8, 0.7, 0.6]), cap=4)
    assert acc.gains == pytest.approx([0.9, 0.8, 0.7, 0.6], abs=1e-3)
    for _ in range(200):
        ctrl.observe_tree(acc, np.array([0.9]), cap=4)  # the search found one node: zeros past it
    assert acc.gains == pytest.approx([0.9, 0, 0, 0], abs=1e-3)
    fresh = ctrl.new_sequence()
    assert np.allclose(fresh.gains, ctrl.prior.gains) and fresh.gains is not ctrl.prior.gains
    ctrl.observe_tree(acc, np.array([0.1, 0.05]), cap=2)  # a tree cut at 2 by the room left
    assert acc.gains[2] < 1e-3 and np.all(np.diff(acc.gains) <= 0)


def test_a_sequence_at_ar_drafts_again_and_probes_rarely_while_it_keeps_missing():
    ctrl = BudgetController(CURVES["cpu"], max_nodes=4)
    acc = ctrl.new_sequence()
    acc.gains[:] = 0.002  # a stretch the drafter missed: AR is the choice
    ctrl.prior.gains[:] = 0.002
    rounds = 0
    while ctrl.choose([acc], [4]) == [0]:
        rounds += 1
        assert rounds < 60, "an idle sequence's marginals never came back"
    assert 1 <= rounds <= 40  # from a near-zero estimate: a few dozen rounds
    assert np.all(ctrl.prior.gains > 0.002)  # no sequence drafted: the prior relaxed too
    drafted = 0
    for _ in range(300):  # every tree is hopeless from now on
        if ctrl.choose([acc], [4])[0] > 0:
            drafted += 1
            ctrl.observe_tree(acc, np.full(4, 0.001), cap=4)
    assert 0 < drafted < 75  # it keeps probing, about one round in five
    for _ in range(300):  # the drafter is sure again: back to the full budget
        if ctrl.choose([acc], [4])[0]:
            ctrl.observe_tree(acc, np.full(4, 0.95), cap=4)
    assert ctrl.choose([acc], [4]) == [4]
    assert ctrl.choose([acc], [0]) == [0] and np.all(acc.gains > 0.9)  # no room: not "idle"


@pytest.mark.parametrize("curve", ["flat-gpu", "cpu"])
def test_the_engine_cuts_each_tree_to_its_refined_budget(curve, tmp_path, monkeypatch):
    from dartcore.engine import Engine, SamplingParams
    from test_engine import cached_oracle, run

    dec, prompts, refs = cached_oracle(tmp_path, monkeypatch, 3, 16, seed=3)
    engine = Engine(dec, max_batch=3, budget="adaptive", max_nodes=6)
    engine.controller.curve = CURVES[curve]
    # the model's times are the curve's alone (the tiny model's measured forwards would move them)
    monkeypatch.setattr(engine.controller, "timed", lambda **kw: None)
    cuts = []
    real = engine._refine

    def spy(running, trees):
        out = real(running, trees)
        for req, full, cut in zip(running, trees, out):
            assert len(cut) - 1 == req.seq.budget <= len(full) - 1
            kept = set(range(len(cut)))
            assert all(p in kept for p in cut.parents[1:])  # a tree: every parent kept
            cuts.append((len(full) - 1, len(cut) - 1))
        return out

    engine._refine = spy
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=16)) for p in prompts]
    seen = run(engine)
    got = [seen[i][-1].tokens for i in ids]
    assert got == refs  # greedy: cut trees or whole, the target's own tokens
    assert cuts and engine.controller.calibration.seen.sum() > 0
    if curve == "flat-gpu":  # rows are free: every tree is kept whole
        assert all(n == full for full, n in cuts)


def test_generate_batch_goes_on_with_its_controller(tmp_path, monkeypatch):
    """A decoder's adaptive generate_batch calls share one controller: the second starts from
    what the first learned and reads no cost curve; outputs stay the target's."""
    from dartcore.engine import Engine
    from test_engine import cached_oracle

    dec, prompts, refs = cached_oracle(tmp_path, monkeypatch, 3, 12, seed=4)
    reads = []
    real = CostCurve.for_target.__func__

    def counted(cls, *a, **kw):
        reads.append(kw.get("max_rows"))
        return real(cls, *a, **kw)

    monkeypatch.setattr(CostCurve, "for_target", classmethod(counted))
    first = dec.generate_batch(prompts[:1], max_new_tokens=12, budget="adaptive", max_batch=1)
    ctrl = dec._controller
    assert isinstance(ctrl, BudgetController) and len(reads) == 1
    seen = ctrl.calibration.seen.sum()
    again = dec.generate_batch(prompts[1:2], max_new_tokens=12, budget="adaptive", max_batch=1)
    assert dec._controller is ctrl and len(reads) == 1 and ctrl.calibration.seen.sum() > seen
    assert [first[0].tokens, again[0].tokens] == refs[:2]
    # a batch whose rows pass the controller's curve gets a new one (its curve read once more)
    both = dec.generate_batch(prompts, max_new_tokens=12, budget="adaptive")
    assert [r.tokens for r in both] == refs and len(reads) == 2 and dec._controller is not ctrl
    # a fixed budget keeps the controller for the next adaptive call
    kept = dec._controller
    dec.generate_batch(prompts[:1], max_new_tokens=4, budget=2)
    assert dec._controller is kept
    # an engine refuses a controller it cannot go on with
    with pytest.raises(ValueError, match="budget='adaptive'"):
        Engine(dec, max_batch=1, budget=2, controller=kept)
    with pytest.raises(ValueError, match="made for max_nodes=8, this engine.s is 3"):
        Engine(dec, max_batch=1, budget="adaptive", max_nodes=3, controller=kept)
    with pytest.raises(TypeError, match="BudgetController"):
        Engine(dec, max_batch=1, budget="adaptive", controller=object())


def test_measured_times_fold_into_the_model():
    ctrl = BudgetController(CURVES["cpu"], max_nodes=4, draft_ms=2.0)
    for _ in range(100):  # the machine is now twice as slow as when the curve was measured
        ctrl.timed(rows=8, verify_ms=2 * 39.0, draft_ms=5.0, per_token_ms=1.5)
    assert ctrl.verify_scale == pytest.approx(2.0, rel=1e-3)
    assert ctrl.draft_ms == pytest.approx(5.0, rel=1e-3) and ctrl.per_token_ms == pytest.approx(
        1.5, rel=1e-3
    )
    ctrl.timed(rows=8, verify_ms=78.0, draft_ms=None, per_token_ms=None)  # a step without a draft
    assert ctrl.draft_ms == pytest.approx(5.0, rel=1e-3)
    assert ctrl.step_ms(8, True, 4.0) == pytest.approx(
        2 * 39 + 5 + 1.5 * 4 + ctrl.controller_ms, rel=1e-3
    )


def test_the_verify_time_of_each_row_count_follows_the_engine():
    # The curve says 1-9 rows cost the same; in the engine each row adds 3 ms.
    flat = CostCurve([{"rows": 1, "ms": 40}, {"rows": 9, "ms": 40}, {"rows": 16, "ms": 60}])
    gains = np.array([0.31, 0.16, 0.09, 0.06, 0.035, 0.035, 0.02, 0.02])
    ctrl = BudgetController(flat, max_nodes=8, draft_ms=3.0)
    ctrl.controller_ms = 0.0
    assert ctrl._allocate([gains], ctrl.draft_ms) == [8]  # free rows: take them all
    rng = np.random.default_rng(0)
    for _ in range(400):
        rows = int(rng.integers(1, 10))
        ctrl.timed(rows=rows, verify_ms=40.0 + 3.0 * (rows - 1), draft_ms=3.0, per_token_ms=0.0)
    assert [ctrl.verify_ms(r) for r in (1, 5, 9)] == pytest.approx([40.0, 52.0, 64.0], rel=0.08)
    t = ctrl.verify_ms(np.arange(1, 40))
    assert np.all(np.diff(t) >= 0)  # never cheaper for more rows, seen or not
    ctrl.controller_ms = 0.0
    (n,) = ctrl._allocate([gains], ctrl.draft_ms)

    def rate(k):
        return expected_tokens(gains, k) / (40.0 + 3.0 * k + (3.0 if k else 0.0))

    true = max(range(9), key=rate)  # 2 and 3 nodes tie here: either is the optimum
    assert n < 8 and rate(n) == pytest.approx(rate(true), rel=1e-9)
    # a count never measured takes the overall ratio
    lone = BudgetController(flat, max_nodes=4, draft_ms=3.0)
    for _ in range(50):
        lone.timed(rows=2, verify_ms=80.0, draft_ms=None, per_token_ms=None)
    assert lone.verify_ms(1) == pytest.approx(80.0, rel=0.05) and lone.verify_ms(
        16
    ) == pytest.approx(120.0, rel=0.05)


def test_choose_times_itself():
    ctrl = BudgetController(CURVES["cpu"], max_nodes=4)
    ctrl.choose([ctrl.new_sequence() for _ in range(8)], [4] * 8)
    assert ctrl.choose_s > 0 and ctrl.controller_ms > 0


def test_cost_curve_interpolates_and_extrapolates():
    c = CostCurve([{"rows": 1, "ms": 10}, {"rows": 5, "ms": 20}, {"rows": 9, "ms": 40}])
    assert c(3) == pytest.approx(15) and c(1) == 10 and c(13) == pytest.approx(60)
    assert np.allclose(c(np.array([1, 5, 9])), [10, 20, 40])
    # more rows never cost less: points that disagree are pooled (least-squares non-decreasing)
    noisy = CostCurve(
        [{"rows": 1, "ms": 30}, {"rows": 2, "ms": 12}, {"rows": 4, "ms": 50}, {"rows": 8, "ms": 20}]
    )
    assert np.allclose(noisy(np.array([1, 2, 4, 8])), [21, 21, 35, 35])
    # one low reading does not flatten the sizes before it (a lower envelope would: 39 for 1-5)
    dip = CostCurve(
        [
            {"rows": r, "ms": m}
            for r, m in [
                (1, 39.3),
                (2, 40.2),
                (3, 45.1),
                (4, 46.6),
                (5, 39.2),
                (6, 43.0),
                (8, 44.1),
            ]
        ]
    )
    assert dip(1) == pytest.approx(39.3) and dip(8) - dip(1) > 3.0


def test_cost_curve_is_cached_and_remeasured(tmp_path, monkeypatch):
    from dartcore import DartDecoder
    from test_decoder import CharTokenizer

    torch.set_num_threads(1)
    dec = DartDecoder(tiny_model("llama"), CharTokenizer(), tree="ar")
    calls = []
    import dartcore.cost as vc

    real = vc.measure_verify_cost

    def counting(*a, **kw):
        calls.append(kw["sizes"])
        return real(*a, **kw)

    monkeypatch.setattr(vc, "measure_verify_cost", counting)
    first = CostCurve.for_target(dec.target, dec.backend, max_rows=10, cache_dir=tmp_path)
    assert len(calls) == 1 and max(calls[0]) == 10
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert data["key"]["dtype"] == "torch.float32" and data["key"]["layers"] == 4
    again = CostCurve.for_target(dec.target, dec.backend, max_rows=10, cache_dir=tmp_path)
    assert len(calls) == 1 and again.points == first.points  # read from the cache
    CostCurve.for_target(dec.target, dec.backend, max_rows=10, cache_dir=tmp_path, remeasure=True)
    assert len(calls) == 2
    # the cache is too short
    CostCurve.for_target(dec.target, dec.backend, max_rows=20, cache_dir=tmp_path)
    assert len(calls) == 3
    assert all(p["ms"] > 0 for p in first.as_list())
