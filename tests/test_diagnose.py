"""Step diagnostics: the gap to the area bound split into strategy, dispatch and packing (hand-computed
cases), the parts adding up for every policy, and per-replica slack."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from passes.plan.diagnose import diagnose
from passes.plan.ir import CostModel, ParallelScheme, SchemeCost, Strategy
from passes.plan.policies import POLICIES, Planner
from tests.test_plan_properties import TOY, TOY_PLANNER

# tp1: 1 ms a token; tp2: 0.75 ms a token on 2 GPUs, i.e. 1.5 GPU-ms a token.
TWO = CostModel(name="two", gpus_per_node=2, entries=(
    SchemeCost(scheme=ParallelScheme(tp=1), a=0.0, b=1.0, c=5.0, max_tokens=100),
    SchemeCost(scheme=ParallelScheme(tp=2), a=0.0, b=0.75, c=0.0, max_tokens=100)))
TP1x2, TP2x1 = Strategy.parse("2x(tp1)"), Strategy.parse("1x(tp2)")


def test_a_strategy_without_the_cheapest_scheme_is_a_strategy_gap():
    plan = Planner(TWO, 2, [TP2x1], fixed=TP2x1).plan([10, 10], strategy=TP2x1)
    d = diagnose(TWO, 2, plan)
    # area bound: each sequence's cheapest GPU-ms is tp1's 10 + 5 * 10/100 = 10.5, over 2 GPUs: 10.5 ms;
    # on tp2 each costs 1.5 * 10 = 15 GPU-ms: (15 - 10.5) * 2 / 2 = 4.5 ms of strategy; one micro-batch, 15 ms.
    assert d.est_step_ms == pytest.approx(15.0)
    assert d.bounds.area == pytest.approx(10.5)
    assert (d.strategy_ms, d.dispatch_ms, d.packing_ms) == pytest.approx((4.5, 0.0, 0.0))
    assert d.costliest == "strategy"


def test_micro_batch_costs_beyond_their_share_are_a_packing_gap():
    plan = Planner(TWO, 2, [TP1x2], fixed=TP1x2).plan([10, 10], strategy=TP1x2)
    d = diagnose(TWO, 2, plan)
    # one sequence per replica: 10 + 5 = 15 ms each, of which 10.5 is the sequence's share
    assert d.est_step_ms == pytest.approx(15.0)
    assert (d.strategy_ms, d.dispatch_ms, d.packing_ms) == pytest.approx((0.0, 0.0, 4.5))
    assert [r.slack_ms for r in d.replicas] == [0.0, 0.0]
    assert d.costliest == "packing"


def test_an_idle_replica_is_a_dispatch_gap():
    plan = Planner(TWO, 2, [TP1x2], fixed=TP1x2).plan([10], strategy=TP1x2)
    d = diagnose(TWO, 2, plan)
    # one replica works 15 ms, the other idles for all of it: 1 GPU * 15 ms / 2 GPUs
    assert d.bounds.area == pytest.approx(10.5 / 2)
    assert d.dispatch_ms == pytest.approx(7.5) and d.packing_ms == pytest.approx(4.5 / 2)
    assert sorted(r.slack_ms for r in d.replicas) == [0.0, 15.0]


@settings(max_examples=40, deadline=None)
@given(seq_lens=st.lists(st.integers(1, 1536), min_size=1, max_size=40), policy=st.sampled_from(POLICIES))
def test_parts_add_up_to_the_gap_for_every_policy(seq_lens, policy):
    plan = TOY_PLANNER.plan(seq_lens, policy)
    d = diagnose(TOY, 8, plan)
    total = d.bounds.area + d.strategy_ms + d.dispatch_ms + d.packing_ms
    assert total == pytest.approx(plan.est_step_ms, rel=1e-9)
    assert min(d.strategy_ms, d.dispatch_ms) >= -1e-9 and d.bounds.best == pytest.approx(plan.lower_bound_ms)
    assert d.vs_bound >= 1 - 1e-9
    assert [r.est_ms for r in plan.replicas] == [r.est_ms for r in d.replicas]
    assert sum(d.avoidable().values()) == pytest.approx(plan.est_step_ms - d.bounds.best, rel=1e-6, abs=1e-6)
    assert min(r.slack_ms for r in d.replicas) == 0.0


def test_what_the_bound_proves_unavoidable_is_not_counted_against_the_plan():
    # one sequence on two tp1 replicas (15 ms): the latency bound binds, 7.5 ms on tp2, 2.25 ms above the area
    # bound (5.25); that much of the idle replica's 7.5 ms dispatch gap no plan avoids.
    plan = Planner(TWO, 2, [TP1x2], fixed=TP1x2).plan([10], strategy=TP1x2)
    d = diagnose(TWO, 2, plan)
    assert d.bounds.binding == "latency" and d.unavoidable_ms == pytest.approx(7.5 - 5.25)
    assert d.avoidable() == pytest.approx({"strategy": 0.0, "dispatch": 7.5 - 2.25, "packing": 2.25,
                                                "movement": 0.0})
    assert d.costliest == "dispatch"
