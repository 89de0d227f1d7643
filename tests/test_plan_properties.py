"""Property tests of every planner policy: exactly-once, memory caps, rank sets, determinism, estimates
that follow the cost-model formulas and never beat the lower bound."""

import dataclasses
import functools

from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from passes.plan.cost_model import build_cost_model, load_profile
from passes.plan.datasets import load_dataset
from passes.plan.ir import CostModel, ParallelScheme, SchemeCost, Strategy, bucket_padding
from passes.plan.policies import POLICIES, Planner, homogeneous_strategies
from passes.plan.pool import build_pool

TOY = CostModel(name="toy", gpus_per_node=4, entries=(
    SchemeCost(scheme=ParallelScheme(tp=1), a=4e-4, b=1.0, c=20.0, max_tokens=256),
    SchemeCost(scheme=ParallelScheme(tp=2), a=2.5e-4, b=0.55, c=15.0, max_tokens=640),
    SchemeCost(scheme=ParallelScheme(tp=1, pp=2), a=2e-4, b=0.5, c=12.0, max_tokens=512),
    SchemeCost(scheme=ParallelScheme(tp=4), a=1.5e-4, b=0.3, c=12.0, max_tokens=1536),
))
TOY_POOL = [Strategy.parse(s) for s in ["8x(tp1)", "1x(tp4)+4x(tp1)", "1x(tp2)+1x(tp1,pp2)+4x(tp1)", "2x(tp4)"]]
TOY_PLANNER = Planner(TOY, 8, TOY_POOL, fixed=Strategy.parse("2x(tp4)"))
BUCKETED = dataclasses.replace(TOY, buckets=(64, 96, 128, 192, 256, 384, 512, 640, 1024, 1536))
BUCKETED_PLANNER = Planner(BUCKETED, 8, TOY_POOL, fixed=Strategy.parse("2x(tp4)"))


@functools.lru_cache(maxsize=1)
def paper_planner() -> Planner:
    layout = Strategy.parse("4x(tp16)")
    cost_model = build_cost_model(load_profile("llama-32b"), layout)
    pool = build_pool(cost_model, 64, load_dataset("commoncrawl"), 200_000, layout, seed=0)
    return Planner(cost_model, 64, pool, layout)


def check_plan(planner: Planner, plan, seq_lens):
    cm = planner.cost_model
    seen = sorted(i for r in plan.replicas for mb in r.micro_batches for i in mb)
    assert seen == list(range(len(seq_lens))), "every sequence exactly once"
    ranks = sorted(rank for r in plan.replicas for rank in r.ranks)
    assert ranks == list(range(planner.gpus)), "rank sets are disjoint and cover the cluster"
    assert [r.scheme for r in plan.replicas] == list(plan.strategy.replicas())
    for r in plan.replicas:
        assert r.max_tokens == cm.max_tokens(r.scheme)
        for mb in r.micro_batches:
            assert mb, "no empty micro-batch"
            if plan.policy == "padding":
                assert len(mb) * max(seq_lens[i] for i in mb) <= r.max_tokens
            else:
                assert sum(seq_lens[i] for i in mb) <= r.max_tokens
        if plan.policy == "padding":
            e = cm.cost(r.scheme)
            longest = [max(seq_lens[i] for i in mb) for mb in r.micro_batches]
            times = [len(mb) * e.seq_ms(s) + e.c + e.seq_ms(bucket_padding(cm.buckets, len(mb) * s))
                     for mb, s in zip(r.micro_batches, longest)]
        else:
            times = [cm.micro_batch_ms(r.scheme, [seq_lens[i] for i in mb]) for mb in r.micro_batches]
        assert abs(r.est_ms - cm.replica_ms(r.scheme, times)) <= 1e-6 * max(1.0, r.est_ms)
    assert plan.est_step_ms == max(r.est_ms for r in plan.replicas)
    assert plan.est_step_ms >= plan.lower_bound_ms * (1 - 1e-9), "no plan beats the lower bound"


def _same(a, b):
    da, db = a.to_dict(), b.to_dict()
    da.pop("solve_ms"), db.pop("solve_ms")
    return da == db


toy_batches = st.lists(st.integers(min_value=1, max_value=1536), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(seq_lens=toy_batches, policy=st.sampled_from(POLICIES))
def test_toy_plans_hold_every_invariant(seq_lens, policy):
    plan = TOY_PLANNER.plan(seq_lens, policy)
    check_plan(TOY_PLANNER, plan, seq_lens)
    assert _same(plan, TOY_PLANNER.plan(seq_lens, policy)), "deterministic"


@settings(max_examples=40, deadline=None)
@given(seq_lens=toy_batches, policy=st.sampled_from(POLICIES))
def test_bucketed_plans_charge_the_padding_the_runtime_adds(seq_lens, policy):
    """With buckets every estimate is the formula of the micro-batches as executed (padded to their bucket),
    so never below the unpadded plan's own formula, and the unpadded lower bound still holds."""
    plan = BUCKETED_PLANNER.plan(seq_lens, policy)
    check_plan(BUCKETED_PLANNER, plan, seq_lens)
    unpadded = max(TOY.replica_ms(r.scheme, [TOY.micro_batch_ms(r.scheme, [seq_lens[i] for i in mb])
                                             for mb in r.micro_batches]) for r in plan.replicas)
    if policy != "padding":
        assert plan.est_step_ms >= unpadded - 1e-9


@settings(max_examples=40, deadline=None)
@given(seq_lens=st.lists(st.integers(min_value=1, max_value=256), min_size=1, max_size=30),
       strategy=st.sampled_from(TOY_POOL + homogeneous_strategies(TOY, 8)))
def test_selection_without_pruning_is_the_best_of_the_pool(seq_lens, strategy):
    exhaustive = Planner(TOY, 8, TOY_POOL, fixed=Strategy.parse("2x(tp4)"), prune_above=float("inf"))
    assignment = exhaustive._two_stage(strategy, seq_lens)
    plan = exhaustive.plan(seq_lens)
    if strategy in TOY_POOL:
        assert plan.est_step_ms <= assignment.est_ms + 1e-6


paper_batches = st.lists(
    st.one_of(st.integers(1, 2000), st.integers(2000, 8000), st.integers(8000, 43520)),
    min_size=1, max_size=300,
).filter(lambda b: sum(b) <= 400_000)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seq_lens=paper_batches, policy=st.sampled_from(POLICIES))
def test_paper_scale_plans_hold_every_invariant(seq_lens, policy):
    planner = paper_planner()
    plan = planner.plan(seq_lens, policy)
    check_plan(planner, plan, seq_lens)


@settings(max_examples=60, deadline=None)
@given(seq_lens=toy_batches, fixed=st.sampled_from(homogeneous_strategies(TOY, 8)))
@example(seq_lens=[39, 39, 8, 54, 362, 348, 354], fixed=Strategy.parse("4x(tp2)"))  # 259.6 ms before, 246.9 fixed
def test_hydraulis_never_plans_a_step_worse_than_the_fixed_strategy(seq_lens, fixed):
    """Whatever the ranking prunes (here: everything it may, one strategy planned in full besides those it
    must), the baselines' fixed strategy is planned in full with the two-stage assignment, so hydraulis is
    never slower than it."""
    assume(max(seq_lens) <= TOY.max_tokens(fixed.schemes[0]))
    pool = TOY_POOL if fixed in TOY_POOL else [*TOY_POOL, fixed]
    greedy = Planner(TOY, 8, pool, fixed=fixed, prune_above=1.0, full_at_least=1, full_at_most=1, refine=False)
    forced = greedy.plan(seq_lens, strategy=fixed)
    assert greedy.plan(seq_lens, "hydraulis").est_step_ms <= forced.est_step_ms + 1e-6
