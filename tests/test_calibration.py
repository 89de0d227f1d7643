"""runtime.calibration: per-scheme factors from measured steps (median of a window, unseen schemes at the
geometric mean), the scaled cost model, and PlanService.set_cost_model taking effect at the next submit."""

import math

import pytest

from passes.plan.ir import CostModel, ParallelScheme, PlanError, SchemeCost, Strategy
from passes.plan.policies import Planner
from runtime.calibration import OnlineCalibration, scaled_cost_model
from runtime.planning import PlanService

TP1, TP2, TP4 = ParallelScheme(tp=1), ParallelScheme(tp=2), ParallelScheme(tp=4)
MODEL = CostModel(name="toy", gpus_per_node=4, entries=(
    SchemeCost(scheme=TP1, a=1e-4, b=0.08, c=4.0, max_tokens=512),
    SchemeCost(scheme=TP2, a=4e-5, b=0.06, c=25.0, max_tokens=1024),
    SchemeCost(scheme=TP4, a=2e-5, b=0.04, c=40.0, max_tokens=2048)))
MIXED = Strategy.parse("1x(tp2)+2x(tp1)")
LENS = [900, 300, 200, 500, 120, 60, 400, 33]


def planner():
    return Planner(MODEL, 4, [MIXED, Strategy.parse("4x(tp1)")], Strategy.parse("2x(tp2)"))


def mixed_plan():
    return planner().plan(LENS, strategy=MIXED)


def busy_scaled(plan, factors, model=MODEL):
    """Per rank: the base model's compute time of its replica's micro-batches (one stage's) times the scheme's
    factor (what a machine whose schemes run ``factors`` times the profile would measure)."""
    busy = [0.0] * 4
    for r in plan.replicas:
        ms = sum(model.micro_batch_ms(r.scheme, [plan.seq_lens[i] for i in mb]) for mb in r.micro_batches)
        for rank in r.ranks:
            busy[rank] = ms * factors[r.scheme]
    return busy


def test_factors_are_measured_over_predicted_per_scheme():
    plan, cal = mixed_plan(), OnlineCalibration(MODEL)
    assert cal.factors == {TP1: 1.0, TP2: 1.0, TP4: 1.0}  # nothing measured yet: the base model
    cal.observe(plan, busy_scaled(plan, {TP1: 1.5, TP2: 1.2}))
    f = cal.factors
    assert f[TP1] == pytest.approx(1.5) and f[TP2] == pytest.approx(1.2)
    assert f[TP4] == pytest.approx(math.sqrt(1.5 * 1.2))  # not run: the geometric mean of the others
    scaled = cal.model()
    for lens in ([512], [100, 200, 3], [1]):
        assert scaled.micro_batch_ms(TP1, lens) == pytest.approx(1.5 * MODEL.micro_batch_ms(TP1, lens))
        assert scaled.micro_batch_ms(TP2, lens) == pytest.approx(1.2 * MODEL.micro_batch_ms(TP2, lens))
    assert [e.max_tokens for e in scaled.entries] == [e.max_tokens for e in MODEL.entries]
    assert scaled.name == "toy (calibrated)" and cal.model().name == "toy (calibrated)"


def test_a_spike_does_not_move_the_median_and_old_steps_leave_the_window():
    plan, cal = mixed_plan(), OnlineCalibration(MODEL, window=3)
    for factor in (1.1, 1.1, 3.0):  # one step hit by background load
        cal.observe(plan, busy_scaled(plan, {TP1: factor, TP2: 1.0}))
    assert cal.factors[TP1] == pytest.approx(1.1)
    for _ in range(2):  # the machine really slowed down: after a window's majority the factor follows
        cal.observe(plan, busy_scaled(plan, {TP1: 1.4, TP2: 1.0}))
    assert cal.factors[TP1] == pytest.approx(1.4)


def test_the_replica_is_timed_by_its_slowest_rank():
    plan, cal = mixed_plan(), OnlineCalibration(MODEL)
    busy = busy_scaled(plan, {TP1: 1.0, TP2: 1.0})
    tp2_ranks = next(r.ranks for r in plan.replicas if r.scheme == TP2)
    busy[tp2_ranks[0]] *= 2.0
    cal.observe(plan, busy)
    assert cal.factors[TP2] == pytest.approx(2.0) and cal.factors[TP1] == pytest.approx(1.0)


def test_pipeline_bubble_is_not_counted_as_busy():
    """A (tp1,pp2) stage rank is busy for its micro-batches only; the 1F1B bubble is idle time."""
    pp2 = ParallelScheme(tp=1, pp=2)
    model = CostModel(name="pp", gpus_per_node=4, entries=(MODEL.entries[0],
                                                            SchemeCost(scheme=pp2, a=5e-5, b=0.04, c=3.0,
                                                                       max_tokens=1024)))
    strategy = Strategy.parse("1x(tp1,pp2)+2x(tp1)")
    plan = Planner(model, 4, [strategy], Strategy.parse("4x(tp1)")).plan(LENS[1:], strategy=strategy)
    replica = next(r for r in plan.replicas if r.scheme == pp2)
    micro = [model.micro_batch_ms(pp2, [plan.seq_lens[i] for i in mb]) for mb in replica.micro_batches]
    assert len(micro) > 1 and model.replica_ms(pp2, micro) > sum(micro)  # the plan has a bubble
    cal = OnlineCalibration(model)
    cal.observe(plan, busy_scaled(plan, {TP1: 1.0, pp2: 1.3}, model))
    assert cal.factors[pp2] == pytest.approx(1.3)


def test_bad_input_is_named():
    with pytest.raises(PlanError, match="window must be a positive integer, got 0"):
        OnlineCalibration(MODEL, window=0)
    with pytest.raises(PlanError, match="busy times of 2 ranks"):
        OnlineCalibration(MODEL).observe(mixed_plan(), [1.0, 1.0])
    with pytest.raises(PlanError, match=r"factor of \(tp1,pp1\) must be a finite number > 0, got -1"):
        scaled_cost_model(MODEL, {TP1: -1.0})


def test_plan_service_takes_a_new_model_at_the_next_submit():
    pl = planner()
    service = PlanService(pl, rank=0)
    service.submit(LENS, MIXED)
    service.set_cost_model(scaled_cost_model(MODEL, {TP1: 2.0, TP2: 2.0, TP4: 2.0}))
    first = service.take().plan  # planned before the new model was set
    service.submit(LENS, MIXED)
    second = service.take().plan
    assert pl.cost_model.name == "toy (calibrated)"
    assert second.est_step_ms == pytest.approx(2.0 * first.est_step_ms)
    other = CostModel(name="other", gpus_per_node=4, entries=MODEL.entries[:2])
    with pytest.raises(PlanError, match="schemes and caps"):
        service.set_cost_model(other)


def test_a_slower_scheme_gets_less_work():
    """The point of calibrating: once tp1 is measured 1.6x its profile, the plan moves work off the tp1
    replicas (or off tp1 altogether)."""
    pl = planner()
    before = pl.plan(LENS, strategy=MIXED)
    cal = OnlineCalibration(MODEL)
    cal.observe(before, busy_scaled(before, {TP1: 1.6, TP2: 1.0}))
    pl.cost_model = cal.model()
    after = pl.plan(LENS, strategy=MIXED)

    def tp1_tokens(plan):
        return sum(plan.seq_lens[i] for r in plan.replicas if r.scheme == TP1 for mb in r.micro_batches for i in mb)

    assert tp1_tokens(after) < tp1_tokens(before)
