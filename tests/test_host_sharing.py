"""Replicas sharing a host's cores (``passes.plan.host_sharing``): the processor-sharing finish times against a
tick-by-tick replay of ranks sharing the cores; the work found from compute times gives those times back; with
a slot per rank nothing changes; a replica whose movement keeps its ranks busy longer delays a longer replica
that had the cores to itself; ``MovementCost.step_ms`` applies it per node only where ``Links.compute_slots``
says the ranks share cores; bad slots refused by name."""

from __future__ import annotations

import random

import pytest
from test_movement_time import _cost_model, _llama

from passes.plan.host_sharing import host_shared_ms, shared_finish, shared_work
from passes.plan.ir import PlanError, Strategy
from passes.plan.links import Links
from passes.plan.movement import MovementCost


def _ticks(work: list[float], ranks: list[int], slots: float, dt: float = 1e-3) -> list[float]:
    """Tick by tick: every busy rank does ``dt * min(1, slots / busy ranks)`` of its work per tick; a replica
    ends at the tick its work is done."""
    left, end, now = list(work), [0.0] * len(work), 0.0
    while any(x > 0 for x in left):
        busy = sum(r for x, r in zip(left, ranks) if x > 0)
        step = dt * min(1.0, slots / busy)
        now += dt
        for i, x in enumerate(left):
            if x > 0:
                left[i] = x - step
                if left[i] <= 1e-12:
                    end[i] = now
    return end


def test_finish_times_are_the_tick_replay():
    rng = random.Random(5)
    for _ in range(40):
        n = rng.randrange(1, 5)
        work = [rng.uniform(0.1, 3.0) for _ in range(n)]
        ranks = [rng.choice([1, 2, 4]) for _ in range(n)]
        slots = rng.choice([1, 2, 3.5, 8])
        assert shared_finish(work, ranks, slots) == pytest.approx(_ticks(work, ranks, slots), abs=2e-3)


def test_the_work_of_compute_times_gives_them_back():
    rng = random.Random(6)
    for _ in range(200):
        n = rng.randrange(1, 6)
        ms = [rng.choice([0.0, rng.uniform(1, 900)]) for _ in range(n)]
        ranks = [rng.choice([1, 2, 4]) for _ in range(n)]
        slots = rng.choice([1, 2, 3, 16])
        got = shared_finish(shared_work(ms, ranks, slots), ranks, slots)
        assert got == pytest.approx(ms, rel=1e-9, abs=1e-9), (ms, ranks, slots)


def test_with_a_slot_per_rank_every_replica_ends_as_its_own_model_says():
    compute, alone, ranks = [400.0, 650.0, 0.0], [700.0, 1100.0, 30.0], [2, 2, 1]
    assert host_shared_ms(compute, alone, ranks, slots=5) == pytest.approx(alone)
    assert host_shared_ms(compute, alone, ranks, slots=64) == pytest.approx(alone)


def test_an_early_replica_kept_busy_slows_the_long_one():
    """Two replicas of 2 ranks on 2 cores: computing alone, the short one (400 ms) leaves the long one (650 ms)
    the cores for its last 250 ms. When the movement adds 300 ms to each, the short one holds its cores until
    well into the long one's compute, which ends later than 650 + 300."""
    compute, alone, ranks = [400.0, 650.0], [700.0, 950.0], [2, 2]
    short, long = host_shared_ms(compute, alone, ranks, slots=2)
    assert short == pytest.approx(700.0)  # it ran beside the other all along, as when it computed
    # the long one's work: 200 shared + 250 alone = 450; plus 300 ms at its mean rate 450 / 650
    work = 450.0 + 300.0 * 450.0 / 650.0
    assert long == pytest.approx(700.0 + (work - 350.0))  # 350 done beside the short one, the rest alone
    assert long > 950.0
    # the same extra time on the long replica only changes nothing for the short one
    assert host_shared_ms(compute, [400.0, 950.0], ranks, slots=2)[0] == pytest.approx(400.0)


def test_step_ms_shares_a_node_only_where_the_links_say_so(monkeypatch):
    import passes.plan.movement as movement

    model = _cost_model()
    layout = _llama(list(model.schemes))
    base = dict(gpus_per_node=4, intra_gbps=0.5, inter_gbps=0.05, latency_us=10)
    strategy = Strategy.parse("2x(tp2)")
    replica_ms, edges = [300.0, 600.0], [(30.0, 30.0), (60.0, 60.0)]
    own = MovementCost(layout, Links(**base), mode="overlapped", slowdown=0.5)
    wide = MovementCost(layout, Links(**base, compute_slots=4), mode="overlapped", slowdown=0.5)
    shared = MovementCost(layout, Links(**base, compute_slots=2), mode="overlapped", slowdown=0.5)
    alone = own.step_ms(strategy, replica_ms, edges)
    assert wide.step_ms(strategy, replica_ms, edges) == pytest.approx(alone)
    calls = []

    def spy(compute, ends, ranks, slots):
        calls.append((list(compute), list(ends), list(ranks), slots))
        return host_shared_ms(compute, ends, ranks, slots)

    monkeypatch.setattr(movement, "host_shared_ms", spy)
    got = shared.step_ms(strategy, replica_ms, edges)
    # one node: the replicas' compute, their per-replica ends (the slowest is the unshared charge), 2 ranks each
    [(compute, ends, ranks, slots)] = calls
    assert compute == replica_ms and ranks == [2, 2] and slots == 2 and max(ends) == pytest.approx(alone)
    assert got == pytest.approx(max(host_shared_ms(compute, ends, ranks, slots))) and got > alone
    # two nodes of two ranks, a replica on each: nothing shared between them
    two = dict(base, gpus_per_node=2)
    calls.clear()
    assert MovementCost(layout, Links(**two, compute_slots=2), mode="overlapped", slowdown=0.5).step_ms(
        strategy, replica_ms, edges) == pytest.approx(
        MovementCost(layout, Links(**two), mode="overlapped", slowdown=0.5).step_ms(strategy, replica_ms, edges))
    assert [c[2] for c in calls] == [[2, 0], [0, 2]]


@pytest.mark.parametrize("slots", [0, -1.0, float("nan"), float("inf"), True, "2"])
def test_bad_slots_are_refused_by_name(slots):
    with pytest.raises(PlanError, match="compute_slots"):
        Links(gpus_per_node=4, intra_gbps=1.0, inter_gbps=1.0, latency_us=1.0, compute_slots=slots)
    if not isinstance(slots, (bool, str)):
        with pytest.raises(ValueError, match="slots"):
            shared_finish([1.0], [1], slots)
