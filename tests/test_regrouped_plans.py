"""Regrouped plans in the planner (``passes/plan/regrouped.py``): a schedule covers every sequence exactly once
within each group's memory cap, its CP groups are aligned blocks of one scheme's slots (so a rank keeps one
parameter slice), its makespan stays above the any-schedule bound, widening shortens a step the longest
sequence sets, and hydraulis with this freedom is never slower than ``dynamic-cp`` on the long-context data."""

import pytest

from passes.plan.bounds import bound_terms
from passes.plan.context_parallel import with_context_parallel
from passes.plan.cost_model import HCOMPILE_RUNTIME, build_cost_model, default_optimizer_layout, load_profile
from passes.plan.ir import ParallelScheme, PlanError, StepPlan, Strategy
from passes.plan.links import link_preset
from passes.plan.placement import assign_ranks
from passes.plan.policies import Planner
from passes.plan.regrouped import VARIANTS, regrouped_schedule, slot_layout
from runtime.topology import Cluster, check_placement

PROFILE = load_profile("llama-32b")
LINKS = link_preset("a800-80g")
GPUS = 128
LAYOUT = default_optimizer_layout(PROFILE, GPUS, 160_000, HCOMPILE_RUNTIME, longest_held=True)
MODEL = with_context_parallel(build_cost_model(PROFILE, LAYOUT, HCOMPILE_RUNTIME), PROFILE, LINKS, GPUS, 160_000,
                              LAYOUT, HCOMPILE_RUNTIME)
BATCH = [120_000, 90_000, 61_000, 40_000, 33_000, 20_000, 12_000, 9_000, 4_000, 3_000, 2_500, 900, 700, 300] * 2


def _plan(schedule) -> StepPlan:
    return StepPlan(strategy=schedule.layout, seq_lens=tuple(BATCH), replicas=schedule.replicas,
                    est_step_ms=schedule.makespan_ms, lower_bound_ms=0.0, policy="hydraulis", regrouped=True)


@pytest.mark.parametrize("layout", ["16x(tp8)", "8x(tp8)+16x(tp4)", "4x(tp16)+16x(tp4)"])
@pytest.mark.parametrize("widen,thrifty", VARIANTS)
def test_a_schedule_covers_every_sequence_once_in_aligned_groups_within_memory(layout, widen, thrifty):
    layout = Strategy.parse(layout)
    schedule = regrouped_schedule(MODEL, layout, BATCH, widen, thrifty=thrifty)
    members = sorted(i for r in schedule.replicas for mb in r.micro_batches for i in mb)
    assert members == list(range(len(BATCH)))
    slots = dict(zip(assign_ranks(layout, MODEL.gpus_per_node), layout.replicas()))
    for group in schedule.replicas:
        for mb in group.micro_batches:
            assert sum(BATCH[i] for i in mb) <= MODEL.max_tokens(group.scheme)
        tp, cp = group.scheme.tp, group.scheme.cp
        blocks = [group.ranks[c * tp:(c + 1) * tp] for c in range(cp)]
        assert all(slots.get(b) == ParallelScheme(tp=tp) for b in blocks), "a CP rank's TP group is one slot"
        same = [b for b in sorted(slots) if slots[b] == ParallelScheme(tp=tp)]
        assert same.index(blocks[0]) % cp == 0, "aligned within its scheme's slots"
    plan = _plan(schedule)
    assert plan.slot_problem() is None
    check_placement(plan.replicas, Cluster(world_size=GPUS, gpus_per_node=8), regrouped=True)
    bounds = bound_terms(MODEL, GPUS, tuple(BATCH))
    assert schedule.makespan_ms >= bounds.any_schedule * (1 - 1e-9)
    assert len(schedule.slot_ms) == len(layout.replicas()) == len(schedule.edges)


def test_a_slot_runs_its_cp_groups_before_its_own_micro_batches_in_plan_order():
    schedule = regrouped_schedule(MODEL, Strategy.parse("16x(tp8)"), BATCH)
    plan = _plan(schedule)
    for rank in range(GPUS):
        cps = [plan.replicas[p.replica].scheme.cp for p in plan.places_of(rank)]
        assert cps == sorted(cps, key=lambda c: c == 1), (rank, cps)  # CP groups first, then the slot alone


def test_widening_shortens_a_step_the_longest_sequence_sets():
    batch = [120_000] + [2_000] * 40
    layout = Strategy.parse("16x(tp8)")
    least, widened = (regrouped_schedule(MODEL, layout, batch, w) for w in (False, True))
    cp = {w: max(r.scheme.cp for r in s.replicas) for w, s in ((False, least), (True, widened))}
    assert cp[True] > cp[False]
    assert widened.makespan_ms < least.makespan_ms


def test_slot_layouts_and_a_sequence_no_group_holds():
    assert slot_layout(Strategy.parse("2x(tp8,cp4)+8x(tp4)")) == Strategy.parse("8x(tp8)+8x(tp4)")
    assert slot_layout(Strategy.parse("2x(tp4,pp2)")) is None
    with pytest.raises(PlanError, match="fits no CP group of the slots of 1x\\(tp8,pp1\\)\\+30x\\(tp4,pp1\\)"):
        regrouped_schedule(MODEL, Strategy.parse("1x(tp8)+30x(tp4)"), [120_000, 1_000])


@pytest.mark.parametrize("charged", [False, True])
def test_hydraulis_with_regrouping_is_never_slower_than_dynamic_cp(charged):
    """The long-context preset (1M tokens a step) on 128 A800s, compute only and with movement charged as the
    overlapped runtime runs it: hydraulis plans dynamic-cp's own layout among its regrouped candidates, charged
    the same way (every slot a replica, busy until it finishes, covering the first pull and the last push with
    its first and last micro-batch), so no step is slower; some steps regroup."""
    from hcompile.tools.simulate import PlanJob, prepare
    from passes.plan.dynamic_cp import dynamic_cp_schedule

    planner, _, batches = prepare(PlanJob(dataset="long-context", gpus=GPUS, global_tokens=1_000_000, steps=2,
                                          charge_movement=charged))
    regrouped = 0
    for batch in batches:
        ours, theirs = planner.plan(batch, "hydraulis"), planner.plan(batch, "dynamic-cp")
        assert ours.est_step_ms <= theirs.est_step_ms * (1 + 1e-9)
        if charged:
            schedule = dynamic_cp_schedule(planner.cost_model, GPUS, planner.cp_base, batch)
            assert theirs.est_step_ms == pytest.approx(planner.movement.step_ms(
                schedule.layout, list(schedule.slot_ms), list(schedule.edges)))
            assert theirs.est_move_ms == pytest.approx(theirs.est_step_ms - schedule.makespan_ms) and \
                theirs.est_move_ms > 0
        assert ours.est_step_ms >= planner.bounds(batch).any_schedule * (1 - 1e-9)
        assert ours.lower_bound_ms == pytest.approx(planner.bounds(batch).any_schedule + planner.movement_floor_ms)
        regrouped += ours.regrouped
    assert regrouped >= 1


def test_a_layout_with_a_scheme_that_holds_no_token_is_refused():
    with pytest.raises(PlanError, match="cannot run: \\(tp2,pp1\\)"):
        regrouped_schedule(MODEL, Strategy.parse("8x(tp8)+32x(tp2)"), BATCH)


def test_recomputation_is_chosen_group_by_group_on_plain_slots():
    """32B on 64 A800s with recomputing twins (documents of 160K tokens, which no plain CP group of 8 tp8 slots
    holds): on plain tp8 slots the 160K documents run in recomputing CP groups, each other sequence on a plain
    slot or group as it fits, every sequence once, each rank on one parameter slice; the step is shorter than on
    recomputing slots (which recompute the short documents too) and never under the any-schedule bound.
    Without twins in the cost model no group recomputes and the 160K document is refused by name."""
    gpus = 64
    twins = _twins(gpus)
    batch = [160_000, 160_000, 61_000, 40_000, 20_000, 9_000, 4_000, 2_500, 900, 300] * 2
    plain_slots, rc_slots = Strategy.parse("8x(tp8)"), Strategy.parse("8x(tp8,rc)")
    schedule = regrouped_schedule(twins, plain_slots, batch)
    members = sorted(i for r in schedule.replicas for mb in r.micro_batches for i in mb)
    assert members == list(range(len(batch)))
    for group in schedule.replicas:
        lens = [batch[i] for mb in group.micro_batches for i in mb]
        assert all(sum(batch[i] for i in mb) <= twins.max_tokens(group.scheme) for mb in group.micro_batches)
        if max(lens) == 160_000:
            assert group.scheme.rc and group.scheme.cp > 1, group.scheme  # only recomputing groups hold it
        if max(lens) <= twins.max_tokens(ParallelScheme(tp=8)):
            assert not group.scheme.rc, (group.scheme, lens)  # what a plain slot holds runs plain
    assert any(g.scheme.rc for g in schedule.replicas) and any(not g.scheme.rc for g in schedule.replicas)
    plan = StepPlan(strategy=plain_slots, seq_lens=tuple(batch), replicas=schedule.replicas,
                    est_step_ms=schedule.makespan_ms, lower_bound_ms=0.0, policy="hydraulis", regrouped=True)
    assert plan.slot_problem() is None
    check_placement(plan.replicas, Cluster(world_size=gpus, gpus_per_node=8), regrouped=True)
    assert schedule.makespan_ms < regrouped_schedule(twins, rc_slots, batch).makespan_ms
    assert schedule.makespan_ms >= bound_terms(twins, gpus, tuple(batch)).any_schedule * (1 - 1e-9)
    layout = default_optimizer_layout(PROFILE, gpus, 160_000, HCOMPILE_RUNTIME, longest_held=True, recompute=True)
    plain_model = with_context_parallel(build_cost_model(PROFILE, layout, HCOMPILE_RUNTIME), PROFILE, LINKS, gpus,
                                        153_600, layout, HCOMPILE_RUNTIME)
    with pytest.raises(PlanError, match="a sequence of 160000 tokens fits no CP group of the slots of 8x"):
        regrouped_schedule(plain_model, plain_slots, batch)


def _twins(gpus: int):
    """32B on ``gpus`` A800s with recomputing twins of every scheme, CP up to documents of 160K tokens."""
    layout = default_optimizer_layout(PROFILE, gpus, 160_000, HCOMPILE_RUNTIME, longest_held=True, recompute=True)
    return with_context_parallel(build_cost_model(PROFILE, layout, HCOMPILE_RUNTIME, recompute=True), PROFILE,
                                 LINKS, gpus, 160_000, layout, HCOMPILE_RUNTIME)


def _gpu_ms(schedule) -> float:
    return sum(g.est_ms * g.scheme.gpus for g in schedule.replicas)


def test_the_thrifty_schedule_gives_each_long_sequence_its_least_gpu_time():
    """A long-context step of the 64-GPU preset (1M tokens) on 8 plain tp8 slots: the thrifty variant gives every
    long sequence the group of least GPU time among all that hold it (each CP size of (tp8) and of its
    recomputing twin, checked here by brute force), spends no more GPU time in all and ends the step sooner,
    above the any-schedule bound; hydraulis' planner takes it. (Under the caps before the memory model charged
    a piece's gradients and the movement's NCCL buffers, the earliest finish also took recomputing groups of 4
    for the 117K and 113K documents, a quarter more GPU time.)"""
    gpus, model = 64, _twins(64)
    batch = [159_232, 116_736, 113_088, 97_280, 89_024, 73_344, 48_960, 42_816, 38_912, 25_408, 22_464, 21_568,
             21_120, 20_608] + [13_000, 9_000, 6_000, 4_000, 2_500, 1_500, 900, 300] * 3
    layout = Strategy.parse("8x(tp8)")
    eager, thrifty = (regrouped_schedule(model, layout, batch, thrifty=t) for t in (False, True))
    cap = model.max_tokens(ParallelScheme(tp=8))
    every = [s for s in model.schemes if s.tp == 8 and s.pp == 1 and s.gpus <= gpus]
    for group in thrifty.replicas:
        if group.scheme.cp > 1 or group.scheme.rc:
            (i,), = group.micro_batches
            assert batch[i] > cap
            least = min(model.micro_batch_ms(s, [batch[i]]) * s.gpus for s in every
                        if model.max_tokens(s) >= batch[i])
            assert group.est_ms * group.scheme.gpus == pytest.approx(least), (batch[i], group.scheme)
    # the thrifty variant spends no more GPU time and ends the step sooner
    assert _gpu_ms(thrifty) <= _gpu_ms(eager)
    assert thrifty.makespan_ms < 0.97 * eager.makespan_ms
    assert thrifty.makespan_ms >= bound_terms(model, gpus, tuple(batch)).any_schedule * (1 - 1e-9)
    members = sorted(i for r in thrifty.replicas for mb in r.micro_batches for i in mb)
    assert members == list(range(len(batch)))
    plan = StepPlan(strategy=layout, seq_lens=tuple(batch), replicas=thrifty.replicas,
                    est_step_ms=thrifty.makespan_ms, lower_bound_ms=0.0, policy="hydraulis", regrouped=True)
    assert plan.slot_problem() is None
    check_placement(plan.replicas, Cluster(world_size=gpus, gpus_per_node=8), regrouped=True)
    planner = Planner(model, gpus, [layout], layout, regroup=True)
    ours = planner.plan(batch, "hydraulis")
    assert ours.regrouped and ours.est_step_ms <= thrifty.makespan_ms * (1 + 1e-9)
