"""Context parallelism in the planner (``passes/plan/context_parallel.py``): the IR's text forms with cp, the
CP schemes' costs and memory, which CP schemes are considered, and movement places of CP replicas."""

import dataclasses

import pytest

from passes.plan.context_parallel import (
    KV_SPLITS,
    ceil_pow2,
    cp_cost,
    cp_schemes,
    kv_splits,
    needs_cp,
    with_context_parallel,
)
from passes.plan.cost_model import HCOMPILE_RUNTIME, build_cost_model, default_optimizer_layout, load_profile
from passes.plan.ir import ParallelScheme, PlanError, SchemeCost, Strategy
from passes.plan.links import link_preset
from passes.plan.movement import places

PROFILE = load_profile("llama-32b")
LINKS = link_preset("a800-80g")
LAYOUT = default_optimizer_layout(PROFILE, 64, 4096, HCOMPILE_RUNTIME)
BASE = build_cost_model(PROFILE, LAYOUT, HCOMPILE_RUNTIME)


@pytest.mark.parametrize("text, expected", [
    ("1x(cp4)", "1x(tp1,pp1,cp4)"),
    ("1x(cp2,tp2)+2x(tp1)", "1x(tp2,pp1,cp2)+2x(tp1,pp1)"),
    ("1x(cp2,pp2)", "1x(tp1,pp2,cp2)"),
    ("(pp2,cp2,tp4)", "1x(tp4,pp2,cp2)"),
    ("cp2,tp4", "1x(tp4,pp1,cp2)"),
    ("2x(tp4,cp1)", "2x(tp4,pp1)"),
])
def test_degrees_parse_in_any_order_and_cp1_prints_as_before(text, expected):
    strategy = Strategy.parse(text)
    assert strategy.describe() == expected
    assert Strategy.parse(strategy.describe()) == strategy


def test_a_repeated_degree_is_refused():
    with pytest.raises(PlanError, match="cp2,cp4"):
        ParallelScheme.parse("(cp2,cp4)")


def test_cp_replica_gpus_and_tokens():
    scheme = ParallelScheme.parse("(cp2,tp4)")
    assert scheme.gpus == 8
    model = with_context_parallel(BASE, PROFILE, LINKS, 64, 140_000, LAYOUT, HCOMPILE_RUNTIME)
    one, two = model.max_tokens(ParallelScheme(tp=4)), model.max_tokens(scheme)
    assert 2 * one - 128 <= two <= 2 * one + 128  # the activations per token halve, the states do not change


def _gather_ms_per_token(tp: int, cp: int, gbps: float) -> float:
    """The runtime's K/V exchange per token of a micro-batch, worked out by hand for llama-32b: per layer the
    rank receives the other cp-1 shares' K and V of its kv heads in the forward (all-gather) and sends their
    gradients in the backward (reduce-scatter), bf16; as many kv heads as heads (llama-32b's profile gives no
    kv heads)."""
    assert PROFILE.kv_heads is None
    kv_width = PROFILE.hidden
    bytes_per_token = PROFILE.layers * 2 * (cp - 1) / cp * 2 * kv_width / tp * 2
    return bytes_per_token / (gbps * 1e9) * 1e3


def test_cp_cost_splits_compute_and_charges_the_first_head_group_of_the_exchange():
    """llama-32b is MHA (64 kv heads): a tp8 rank has 8, so the runtime pipelines its exchange over 4 groups of 2
    and the first group's quarter is exposed; the other three quarters run beside the attention (``exchange``),
    slowing it by the links' overlap slowdown."""
    base = BASE.cost(ParallelScheme(tp=8))
    costs = {cp: cp_cost(PROFILE, base, cp, LINKS, LAYOUT, HCOMPILE_RUNTIME) for cp in (2, 4, 8)}
    assert kv_splits(PROFILE.heads // 8) == KV_SPLITS == 4
    for cp, e in costs.items():
        gbps = LINKS.intra_gbps if 8 * cp <= LINKS.gpus_per_node else LINKS.inter_gbps
        gather = _gather_ms_per_token(8, cp, gbps)
        assert e.a == pytest.approx(base.a / cp)
        assert e.b == pytest.approx(base.b / cp + gather / 4 + LINKS.overlap_slowdown * gather * 3 / 4)
        assert e.c == pytest.approx(base.c + PROFILE.layers * 2 * (cp - 1) * LINKS.latency_us * 1e-3)
        assert e.exchange == pytest.approx(gather * 3 / 4)
        long = 120_000  # the attention of a long sequence hides the rest
        assert e.seq_ms(long) == pytest.approx(e.b * long + e.a * long ** 2)
    long = 120_000  # more CP ranks take less time each on a long sequence
    assert base.seq_ms(long) > costs[2].seq_ms(long) > costs[4].seq_ms(long) > costs[8].seq_ms(long)
    # a group across nodes (tp4 x cp4) pays the network, one inside a node (tp4 x cp2) NVLink
    tp4 = BASE.cost(ParallelScheme(tp=4))
    inside, across = (cp_cost(PROFILE, tp4, cp, LINKS, LAYOUT, HCOMPILE_RUNTIME) for cp in (2, 4))
    assert inside.exchange * 4 / 3 == pytest.approx(_gather_ms_per_token(4, 2, LINKS.intra_gbps))
    assert across.exchange * 4 / 3 == pytest.approx(_gather_ms_per_token(4, 4, LINKS.inter_gbps))


def test_a_rank_with_one_kv_head_pays_the_exchange_in_full():
    gqa = dataclasses.replace(PROFILE, kv_heads=8)  # 8 kv heads: one per tp8 rank, nothing to pipeline
    base = BASE.cost(ParallelScheme(tp=8))
    e = cp_cost(gqa, base, 2, LINKS, LAYOUT, HCOMPILE_RUNTIME)
    gather = _gather_ms_per_token(8, 2, LINKS.inter_gbps) * 8 / 64  # 16 GPUs: across nodes
    assert e.exchange == 0
    assert e.b == pytest.approx(base.b / 2 + gather)
    two = cp_cost(gqa, BASE.cost(ParallelScheme(tp=4)), 2, LINKS, LAYOUT, HCOMPILE_RUNTIME)  # 2 kv heads: halves
    assert two.exchange == pytest.approx(_gather_ms_per_token(4, 2, LINKS.intra_gbps) * 8 / 64 / 2)
    assert [kv_splits(n) for n in (1, 2, 3, 6, 8, 64)] == [1, 2, 3, 3, 4, 4]


def test_exchange_counts_only_what_attention_cannot_hide():
    e = SchemeCost(scheme=ParallelScheme(tp=1, cp=2), a=1e-4, b=0.5, c=1.0, max_tokens=1000, exchange=0.02)
    assert e.seq_ms(100) == pytest.approx(0.5 * 100 + 0.02 * 100)  # 1 ms attention, 2 ms exchange
    assert e.seq_ms(400) == pytest.approx(0.5 * 400 + 1e-4 * 400 * 400)  # 16 ms attention hides 8 ms
    with pytest.raises(PlanError, match="exchange"):
        SchemeCost(scheme=ParallelScheme(tp=1, cp=2), a=0, b=0, c=0, max_tokens=1, exchange=-1.0)


def test_cp_schemes_considered():
    assert ceil_pow2(1) == 1 and ceil_pow2(3) == 4 and ceil_pow2(8) == 8 and ceil_pow2(8.5) == 16
    found = cp_schemes(BASE, 64, 140_000)
    assert all(base.pp == 1 and base.cp == 1 for base, _ in found)
    assert {(b.tp, cp) for b, cp in found} >= {(8, 8), (16, 4), (4, 16)}
    assert all(b.tp * cp <= 64 for b, cp in found)
    assert needs_cp(BASE, 64, 140_000) and not needs_cp(BASE, 64, 30_000)


def test_auto_adds_cp_only_for_data_too_long_without_it():
    assert with_context_parallel(BASE, PROFILE, LINKS, 64, 30_000, LAYOUT, HCOMPILE_RUNTIME) is BASE
    assert with_context_parallel(BASE, PROFILE, LINKS, 64, 140_000, LAYOUT, HCOMPILE_RUNTIME, mode="off") is BASE
    on = with_context_parallel(BASE, PROFILE, LINKS, 64, 30_000, LAYOUT, HCOMPILE_RUNTIME, mode="on")
    assert any(s.cp > 1 for s in on.schemes)
    auto = with_context_parallel(BASE, PROFILE, LINKS, 64, 140_000, LAYOUT, HCOMPILE_RUNTIME)
    assert auto.longest_supported() >= 140_000
    with pytest.raises(PlanError, match="'sometimes'"):
        with_context_parallel(BASE, PROFILE, LINKS, 64, 1, LAYOUT, HCOMPILE_RUNTIME, mode="sometimes")


def test_cp_ranks_compute_with_the_slices_of_their_tp_rank():
    where = places(Strategy.parse("1x(tp2,cp2)+4x(tp1)"), 4)
    tp2 = ParallelScheme(tp=2)
    assert where[:4] == [(tp2, 0, 0), (tp2, 0, 1), (tp2, 0, 0), (tp2, 0, 1)]


@pytest.fixture(scope="module")
def long_context_job():
    """One `hcompile plan` job on the long-context preset, which no scheme without CP can hold (its 160K-token
    sequences need 128 A800s: on 64, tp16 x cp4 holds 146816 tokens beside fp32 gradient
    buffers, a piece's gradients and the NCCL buffers)."""
    from hcompile.tools.simulate import PlanJob, run_plan_job

    job = PlanJob(dataset="long-context", gpus=128, global_tokens=400_000, steps=2)
    return run_plan_job(job)


def test_the_long_context_data_is_planned_every_sequence_once_within_memory(long_context_job):
    report, plans = long_context_job
    assert set(report.results) == {"padding", "fixed-packing", "homogeneous-token", "homogeneous-per-step",
                                   "hydraulis", "dynamic-cp", "homogeneous-cp"}
    model = report.cost_model
    assert max(max(p.seq_lens) for p in plans) > max(model.max_tokens(s) for s in model.schemes if s.cp == 1)
    for plan in plans:
        members = sorted(i for r in plan.replicas for mb in r.micro_batches for i in mb)
        assert members == list(range(len(plan.seq_lens))), plan.policy
        for r in plan.replicas:
            for mb in r.micro_batches:
                assert sum(plan.seq_lens[i] for i in mb) <= model.max_tokens(r.scheme)
        if plan.policy != "hydraulis":  # hydraulis may regroup too (test_regrouped_plans.py)
            assert plan.regrouped == (plan.policy == "dynamic-cp")
        assert plan.est_step_ms > 0
    hydraulis = [p for p in plans if p.policy == "hydraulis"]
    assert all(p.est_step_ms >= p.lower_bound_ms * (1 - 1e-9) for p in hydraulis)
    assert any(r.scheme.cp > 1 for p in hydraulis for r in p.replicas)
    cp_fixed = report.cp_fixed
    assert cp_fixed is not None and cp_fixed.is_homogeneous and cp_fixed.schemes[0].cp > 1
    assert all(p.strategy == cp_fixed for p in plans if p.policy == "homogeneous-cp")


def test_dynamic_cp_gives_each_sequence_its_cp_size(long_context_job):
    from passes.plan.dynamic_cp import cp_size

    report, plans = long_context_job
    base = report.cp_base
    for plan in (p for p in plans if p.policy == "dynamic-cp"):
        assert plan.strategy == Strategy.homogeneous(base, 128)
        for r in plan.replicas:
            assert r.scheme.tp == base.tp and r.scheme.pp == 1
            for i in (i for mb in r.micro_batches for i in mb):
                assert r.scheme.cp == cp_size(report.cost_model, base, plan.seq_lens[i])
        with pytest.raises(PlanError, match="regroups its ranks"):
            plan.position_of(0)


def test_every_plan_regrouped_or_not_is_above_the_any_schedule_bound(long_context_job):
    """The area and latency bounds hold for dynamic-cp's regrouped plans too; the one-strategy bound may not."""
    report, plans = long_context_job
    steps = len(report.bounds)
    per_step = [[p for p in plans[k * len(report.results):(k + 1) * len(report.results)]] for k in range(steps)]
    for bounds, step_plans in zip(report.bounds, per_step):
        floor = report.movement_floor_ms
        assert bounds.any_schedule <= bounds.best
        for plan in step_plans:
            assert plan.est_step_ms >= (bounds.any_schedule + floor) * (1 - 1e-9), plan.policy
    out = report.to_json()
    assert out["any_schedule_bound_ms_mean"] == pytest.approx(report.any_schedule_bound_ms, abs=1e-3)
    assert out["any_schedule_bound_ms_mean"] <= out["lower_bound_ms_mean"]


def test_plan_json_carries_the_cp_baselines(long_context_job):
    report, _ = long_context_job
    out = report.to_json()
    assert {"dynamic-cp", "homogeneous-cp", "hydraulis"} <= set(out["policies"])
    assert out["cp_fixed_strategy"] == report.cp_fixed.describe() and out["cp_base"] == report.cp_base.describe()


def test_dynamic_cp_plans_are_runnable_and_a_given_cost_model_with_cp_is_refused(long_context_job):
    """dynamic-cp's regrouped plans have the shape the runtime runs: every rank in a group (an idle slot in an
    empty one), each rank computing with one slot's parameter slice in all of its groups."""
    from hcompile.cost import refuse_context_parallel_model
    from runtime.topology import Cluster, check_placement

    report, plans = long_context_job
    assert any(p.regrouped for p in plans) and any(not p.regrouped for p in plans)
    gpus = report.job.gpus
    cluster = Cluster(world_size=gpus, gpus_per_node=report.cost_model.gpus_per_node)
    for plan in plans:
        check_placement(plan.replicas, cluster, plan.regrouped)
        assert plan.slot_problem() is None
        if plan.regrouped:
            assert max(len(plan.places_of(r)) for r in range(gpus)) > 1
            assert {s.cp for s in (r.scheme for r in plan.replicas)} != {1}
    with pytest.raises(ValueError, match=r"context-parallel schemes .*\(tp4,pp1,cp2\).*derives its CP schemes itself"):
        refuse_context_parallel_model(report.cost_model)
    refuse_context_parallel_model(BASE)


def test_existing_data_plans_without_cp_under_auto():
    """Under ``auto`` a dataset that fits plans with the cost model unchanged (``with_context_parallel`` returns
    it as it is, tested above): no CP scheme, no CP baseline, the policies of before."""
    from hcompile.tools.simulate import PlanJob, run_plan_job
    from passes.plan.policies import POLICIES

    report, plans = run_plan_job(PlanJob(dataset="github", gpus=64, global_tokens=20_000, steps=1))
    assert tuple(report.results) == POLICIES and report.cp_base is None and report.cp_fixed is None
    assert all(s.cp == 1 for s in report.cost_model.schemes)
    assert "cp_fixed_strategy" not in report.to_json() and all(not p.regrouped for p in plans)
