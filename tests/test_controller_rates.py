"""The budget controller's measured-rate judge: drafting steps against plain steps of the same
batch, by the tokens per second the engine measured, whatever the cost model predicts.

The fake machine charges a drafting step more than the model can see coming (a fixed cost per
drafting step, reported inside the acceptance time as the engine's stage clock would: tree
logits, tree walks), so the model keeps drafting where it loses; the judge must switch it off
within a bounded number of rounds and keep it off but for rare trials, follow the machine back
when drafting starts to pay, and leave a controller whose drafting wins alone."""

from __future__ import annotations

import numpy as np
import pytest

from dartcore.controller import (
    DRAW_SLACK,
    IDLE_STRIDE,
    JUDGE_WEIGHT,
    OFF_MAX,
    OFF_MIN,
    PROBE_MIN,
    REF_STEPS,
    TRIAL_ROUNDS,
    BudgetController,
    CostCurve,
)
from test_controller_recovery import FakeMachine, chain

# SmolLM2 on the CPU int8 path, roughly: a 4.6 ms plain step, 0.85 ms per extra verify row, a
# 1.2 ms draft; the drafter right about half the time.
INT8 = dict(v0=4.6, v1=0.85, d0=1.2, d1=0.02, per_token=0.1)
CURVE = [{"rows": 1, "ms": 4.6}, {"rows": 64, "ms": 60.0}]


def run(ctrl: BudgetController, machines, rounds: int, seed: int, cap: int = 6):
    """The engine's calls for one sequence against ``machines(t)`` (the machine of round t:
    a :class:`FakeMachine` and the hidden cost of a drafting step). Returns per round (drawn,
    verified, accepted, true ms)."""
    rng = np.random.default_rng(seed)
    acc = ctrl.new_sequence()
    pending = 1
    log = []
    for t in range(rounds):
        m, hidden = machines(t)
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
        draft = m.d0 + m.d1 * positions if n else None
        per_token = m.per_token + (hidden / (a + 1) if n else 0.0)
        ctrl.timed(rows=k + 1, verify_ms=m.verify(k + 1), draft_ms=draft, per_token_ms=per_token)
        ms = m.verify(k + 1) + (draft or 0.0) + per_token * (a + 1)
        log.append((n, k, a, ms))
    return np.array(log)


def rate(log: np.ndarray) -> float:
    """Committed tokens per ms over the rounds of ``log``."""
    return float((log[:, 2] + 1).sum() / log[:, 3].sum())


def controller(**kw) -> BudgetController:
    return BudgetController(CostCurve(CURVE), max_nodes=6, clock=lambda: 0.0, **kw)


@pytest.mark.parametrize("seed", range(3))
def test_drafting_that_loses_by_measurement_goes_to_budget_zero(seed):
    m = FakeMachine(q=0.5, **INT8)
    machine = lambda t: (m, 1.5)  # noqa: E731 - a drafting step costs 1.5 ms the model misses
    plain = 1.0 / (m.verify(1) + m.per_token)
    # the model alone keeps drafting and loses
    blind = run(controller(judge=False), machine, 1500, seed)
    assert np.mean(blind[:, 1] > 0) > 0.9 and rate(blind) < 0.975 * plain
    ctrl = controller()
    log = run(ctrl, machine, 1500, seed)
    drew = log[:, 0] > 0
    # the first verdict comes after the plain reference and JUDGE_WEIGHT's drafting steps
    first_off = int(np.flatnonzero(~drew[REF_STEPS + 1 :])[0]) + REF_STEPS + 1
    assert first_off <= 3 * JUDGE_WEIGHT + REF_STEPS + 2
    assert ctrl.mode in ("off", "trial") and ctrl.speedup is not None and ctrl.speedup < 1.0
    # off but for trials spaced ever wider
    assert np.mean(drew[500:]) < 0.04
    assert rate(log[200:]) > 0.985 * plain and rate(log) > 0.97 * plain


@pytest.mark.parametrize("seed", range(2))
def test_drafting_that_wins_keeps_speculating(seed):
    m = FakeMachine(q=0.8, **dict(INT8, v1=0.3, d0=0.5))
    machine = lambda t: (m, 0.3)  # noqa: E731
    assert max(range(1, 7), key=m.rate) > 0 and m.rate(4) > 1.5 * m.rate(0)
    blind = run(controller(judge=False), machine, 800, seed)
    ctrl = controller()
    log = run(ctrl, machine, 800, seed)
    assert ctrl.mode == "on" and ctrl.trials == 0 and ctrl.speedup > 1.3
    # a few plain steps measure the reference (and again every REF_AGE drafting steps)
    assert np.mean(log[20:, 1] > 0) > 0.95
    assert rate(log) > 0.97 * rate(blind)


def test_a_trial_follows_the_machine_back_to_drafting():
    """Drafting loses for the first 600 rounds, then rows and drafts get cheap: a trial finds
    it out within the off stretch then running (at most OFF_MAX rounds) and drafting stays."""
    slow = FakeMachine(q=0.6, **INT8)
    fast = FakeMachine(q=0.6, **dict(INT8, v1=0.2, d0=0.3))
    switch = 600
    ctrl = controller()
    log = run(ctrl, lambda t: (slow, 1.0) if t < switch else (fast, 0.0), switch + 2 * OFF_MAX, 0)
    drew = log[:, 0] > 0
    assert ctrl.trials_lost >= 2 and np.mean(drew[300:switch]) < 0.1
    back = switch + int(np.flatnonzero(drew[switch:])[0])
    assert back - switch <= OFF_MAX + TRIAL_ROUNDS
    assert ctrl.mode == "on" and np.mean(drew[back + 50 :]) > 0.9


def test_off_stretches_double_up_to_the_cap():
    m = FakeMachine(q=0.3, **INT8)
    ctrl = controller()
    log = run(ctrl, lambda t: (m, 2.0), 6000, 1)
    drew = np.flatnonzero(log[:, 0] > 0)
    gaps = np.diff(drew)
    stretches = gaps[gaps > OFF_MIN]  # the off stretches (the model's own pauses are short)
    assert len(stretches) >= 6 and ctrl.trials >= 6
    assert list(stretches) == sorted(stretches) and stretches[0] < 2 * OFF_MIN
    assert OFF_MAX <= stretches.max() <= OFF_MAX + 1
    # what the trials cost: the drafting steps are a small share once stretches are long
    assert np.mean(log[2000:, 0] > 0) < 0.02


def test_the_idle_stride_consults_the_model_every_few_rounds():
    """At budget 0 for every sequence the engine's controller (``idle_stride``) runs the model
    one round in IDLE_STRIDE; the marginals relax as if it had run every round."""
    runs = {}
    for stride in (1, IDLE_STRIDE):
        ctrl = controller(idle_stride=stride, probe_interval=10**9)
        calls = []

        def counted(marginals, draft_ms, real=ctrl._allocate, calls=calls):
            calls.append(1)
            return real(marginals, draft_ms)

        ctrl._allocate = counted
        accs = [ctrl.new_sequence() for _ in range(3)]
        for acc in accs:
            acc.gains[:] = 0.0
        ctrl.prior.gains[:] = 0.0
        for _ in range(4 * IDLE_STRIDE):
            assert ctrl.choose(accs, [6, 6, 6]) == [0, 0, 0]
        runs[stride] = (len(calls), accs[0].gains.copy())
    assert runs[1][0] == 4 * IDLE_STRIDE and runs[IDLE_STRIDE][0] == 4
    # the strided controller has relaxed for the rounds up to its last choice
    rounds_relaxed = 3 * IDLE_STRIDE + 1
    one = controller(probe_interval=10**9)
    acc = one.new_sequence()
    acc.gains[:] = 0.0
    one.prior.gains[:] = 0.0
    for _ in range(rounds_relaxed):
        one.choose([acc], [6])
    np.testing.assert_allclose(runs[IDLE_STRIDE][1], acc.gains)


def test_a_probe_across_the_kernels_row_cliff_waits_for_its_share_first():
    """At batch 16 on the CPU a probe's 3 nodes cross the native kernel's 16 rows (~147 ms
    against 44): its first try waits until its predicted extra time is PROBE_SHARE of the
    plain steps since, not PROBE_MIN rounds; a batch below the cliff probes as before."""
    curve = CostCurve(
        [{"rows": 1, "ms": 30.0}, {"rows": 16, "ms": 44.0}, {"rows": 17, "ms": 146.0}]
        + [{"rows": 64, "ms": 200.0}]
    )

    def first_probe(batch: int) -> int:
        ctrl = BudgetController(curve, max_nodes=4, draft_ms=5.0, clock=lambda: 0.0)
        accs = [ctrl.new_sequence() for _ in range(batch)]
        for acc in accs:
            acc.gains[:] = 0.01
        ctrl.prior.gains[:] = 0.01
        for t in range(2000):
            if any(ctrl.choose(accs, [4] * batch)):
                return t
        return -1

    assert first_probe(8) == PROBE_MIN
    late = first_probe(16)
    assert late > 100  # (146 - 44 + 5) ms over 1 % of a ~44 ms step: ~240 rounds


def fixed_rate(m: FakeMachine, hidden: float, n: int, rounds: int, seed: int) -> float:
    """The committed tokens per ms of drafting ``n`` nodes (a chain) every round on ``m``."""
    rng = np.random.default_rng(seed)
    toks = ms = 0.0
    for _ in range(rounds):
        a = 0
        while a < n and rng.random() < m.q:
            a += 1
        toks += a + 1
        ms += m.verify(n + 1) + m.d0 + m.d1 * (a + 1) + m.per_token * (a + 1) + hidden
    return toks / ms


@pytest.mark.parametrize("seed", range(2))
def test_the_fixed_arm_drafts_the_decoders_budget_while_it_pays(seed):
    """With the engine's fixed arm (the decoder's own budget on a CPU) the controller starts
    drafting exactly that budget -- no slack drawn, no node cut -- and keeps it where the
    measured rate says it beats plain steps by a few percent, which a ten-step verdict cannot
    tell from noise."""
    # SmolLM2 int8 at one sequence, roughly: budget 2 wins by ~10 %
    m = FakeMachine(q=0.6, **dict(INT8, v0=3.1, v1=0.4, d0=0.75))
    machine = lambda t: (m, 0.1)  # noqa: E731
    ctrl = controller(fixed_nodes=2)
    assert ctrl.mode == "fixed"
    acc = ctrl.new_sequence()
    assert ctrl.draws([acc], [6]) == [2] and ctrl.refine([np.array([0.9, 0.01])]) == [2]
    ctrl = controller(fixed_nodes=2)
    log = run(ctrl, machine, 1500, seed)
    plain = 1.0 / (m.verify(1) + m.per_token)
    best = fixed_rate(m, 0.1, 2, 4000, seed)
    assert best > 1.05 * plain
    assert ctrl.mode == "fixed" and ctrl.speedup is not None and ctrl.speedup > 1.0
    assert np.mean(log[50:, 1] == 2) > 0.95 and rate(log[50:]) > 0.97 * best


@pytest.mark.parametrize("seed", range(2))
def test_a_losing_fixed_arm_goes_to_budget_zero_and_trials_alternate_arms(seed):
    m = FakeMachine(q=0.5, **INT8)
    ctrl = controller(fixed_nodes=2)
    log = run(ctrl, lambda t: (m, 1.5), 3000, seed)
    plain = 1.0 / (m.verify(1) + m.per_token)
    drew = log[:, 0] > 0
    assert ctrl.trials >= 3 and ctrl.trials_lost >= 2
    assert np.mean(drew[1500:]) < 0.04
    assert rate(log[1000:]) > 0.985 * plain and rate(log) > 0.96 * plain


def test_a_batch_is_left_to_the_model():
    ctrl = controller(fixed_nodes=2)
    batch = 2
    accs = [ctrl.new_sequence() for _ in range(batch)]
    for acc in accs:
        acc.gains[:] = 0.9
    draws = ctrl.draws(accs, [6] * batch)
    assert ctrl.mode == "fixed" and not ctrl._fixed_now(batch)
    # the model's own choice, drawn with its slack, not the fixed budget
    assert any(d > 2 for d in draws) and all(d == 0 or d > DRAW_SLACK for d in draws)
    with pytest.raises(ValueError):
        controller(fixed_nodes=-1)


def test_after_the_model_loses_in_fixed_mode_a_batch_waits_out_an_off_stretch():
    """In fixed mode a batch's steps are the model's; once its drafting lost a verdict they are
    plain for an off stretch (doubling like the judge's), while a lone sequence keeps drafting
    the fixed budget."""
    ctrl = controller(fixed_nodes=2, probe_interval=10**9)
    accs = [ctrl.new_sequence() for _ in range(2)]
    for acc in accs:
        acc.gains[:] = 0.9
    ctrl._batch, ctrl._steady = 2, True
    ctrl._ar_ms[2], ctrl._ar_n[2] = 5.0, REF_STEPS
    for _ in range(int(JUDGE_WEIGHT) + 4):  # drafting steps at half the plain rate
        ctrl._batch, ctrl._step_fixed = 2, False
        ctrl._judge_step(rows=6, drafted=True, tokens=2, ms=10.0)
    assert ctrl.mode == "fixed" and ctrl.speedup < 1.0 and ctrl._model_off == OFF_MIN
    for _ in range(OFF_MIN):
        assert ctrl.choose(accs, [6, 6]) == [0, 0]
        assert ctrl.draws(accs[:1], [6]) == [2]
    assert any(ctrl.choose(accs, [6, 6]))  # the model again
