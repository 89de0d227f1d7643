"""The planner's model of the overlapped runtime (``passes.plan.movement``, ``mode="overlapped"``): the closed
form of a rank's stall and tail against an event-by-event replay of the runtime's schedule (windows arriving
one after another while the first forward consumes them, gradients leaving window by window as the last
backward finishes them); plans charged per replica, never above the plain runtime's charge, never under the
step's lower bound; bad settings refused by name."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_movement_time import _cost_model, _llama

from passes.plan.ir import PlanError, Strategy
from passes.plan.links import Links
from passes.plan.movement import FORWARD_SHARE, MovementCost, overlapped_exposure
from passes.plan.policies import POLICIES, Planner, homogeneous_strategies


def _replay(pull: float, push: float, stage: int, first: float, last: float, windows: int,
            ahead: float = 0.0) -> tuple[float, float]:
    """Event by event: the rank works ``ahead`` ms before anything travels or computes, then window g of the pull
    lands at ahead + (g + 1) pull / W; the stage's first forward starts once the pipeline has filled (``stage``
    forward slots) and computes window g once it has landed and window g - 1 is done; the last backward (ending
    at 0) finishes window W - 1 first, each window's gradients leave once it is finished and the previous
    window's have left. Stall: how much later the forward ends; tail: how long the push runs after the stage's
    last backward, less the ``stage`` backward slots later stages leave it."""
    fwd, bwd = FORWARD_SHARE * first, (1 - FORWARD_SHARE) * last
    start = end = stage * fwd
    for g in range(windows):
        landed = ahead + (g + 1) * pull / windows
        end = max(end, landed) + fwd / windows
    stall = end - (start + fwd)
    sent = -bwd
    for k in range(windows):
        finished = -bwd + (k + 1) * bwd / windows
        sent = max(sent, finished) + push / windows
    return stall, max(0.0, sent - stage * bwd)


def test_the_closed_form_is_the_event_replay():
    rng = random.Random(3)
    for _ in range(500):
        windows = rng.choice([1, 2, 3, 8, 16])
        case = [rng.choice([0.0, rng.uniform(0, 50)]) for _ in range(2)] + [rng.randrange(4)] + \
            [rng.uniform(0.1, 80) for _ in range(2)]
        ahead = rng.choice([0.0, rng.uniform(0, 60)])
        stall, tail = overlapped_exposure(*(np.array([x], dtype=float) for x in case), windows, np.array([ahead]))
        want = _replay(*case, windows, ahead)
        assert (float(stall[0]), float(tail[0])) == pytest.approx(want, abs=1e-9), (case, windows, ahead)
    # nothing covers one window on a first stage; a long enough forward and backward cover the rest
    stall, tail = overlapped_exposure(np.array([8.0]), np.array([16.0]), np.array([0.0]), np.array([300.0]),
                                      np.array([300.0]), 8)
    assert (float(stall[0]), float(tail[0])) == (1.0, 2.0)


def test_plans_are_charged_per_replica_under_the_plain_charge_and_over_the_bound():
    model = _cost_model()
    layout = _llama(list(model.schemes))
    links = Links(gpus_per_node=4, intra_gbps=0.5, inter_gbps=0.05, latency_us=10)
    plain = MovementCost(layout, links)
    overlapped = MovementCost(layout, links, mode="overlapped", slowdown=0.0)
    pool = homogeneous_strategies(model, 8) + [Strategy.parse("1x(tp4)+2x(tp2)")]
    fixed = Strategy.parse("2x(tp4)")
    batch = [700, 30, 64, 200, 90, 1000, 12, 300, 45, 500]
    blind = Planner(model, 8, pool, fixed)
    charged = Planner(model, 8, pool, fixed, movement=overlapped)
    assert 0 < charged.movement_floor_ms == pytest.approx(Planner(model, 8, pool, fixed, movement=plain)
                                                         .movement_floor_ms / overlapped.windows)
    assert overlapped.windows == layout.windows  # as the runtime cuts this layout (tests/test_movement.py)
    for policy in POLICIES:
        got = charged.plan(batch, policy)
        compute = max(r.est_ms for r in got.replicas)
        assert got.est_step_ms == pytest.approx(compute + got.est_move_ms)
        assert 0 <= got.est_move_ms <= plain.exposed_ms(got.strategy) + 1e-9, policy
        assert got.lower_bound_ms == pytest.approx(blind.plan(batch, policy).lower_bound_ms
                                                   + charged.movement_floor_ms)
        assert got.lower_bound_ms <= got.est_step_ms + 1e-9, policy
        # the charge is the slowest replica's compute plus its ranks' stall and tail, as step_ms computes it
        edges = [(r.est_ms, r.est_ms) for r in got.replicas]  # any cover: the charge stays within its bounds
        assert overlapped.step_ms(got.strategy, [r.est_ms for r in got.replicas], edges) >= compute


def test_slowdown_stretches_the_compute_beside_transfers():
    model = _cost_model()
    layout = _llama(list(model.schemes))
    links = Links(gpus_per_node=4, intra_gbps=0.5, inter_gbps=0.05, latency_us=10)
    strategy = Strategy.parse("1x(tp4)+2x(tp2)")
    still = MovementCost(layout, links, mode="overlapped")
    slowed = MovementCost(layout, links, mode="overlapped", slowdown=0.1)
    replica_ms, edges = [100.0, 90.0, 80.0], [(10.0, 10.0)] * 3
    busy = max(a + b for a, b in zip(still.time(strategy).pull_ranks, still.time(strategy).push_ranks))
    gained = slowed.step_ms(strategy, replica_ms, edges) - still.step_ms(strategy, replica_ms, edges)
    assert 0 < gained <= 0.1 * min(100.0, busy) + 1e-9


def test_a_later_stage_transfers_in_the_pipeline_fill_and_drain_without_slowing_its_compute():
    """Pipeline slots where a stage waits cover its transfers: with a first and last micro-batch long enough that
    the second stage's pull and push fit in its fill and drain, only the first stage's transfers stretch the
    replica's compute."""
    from passes.plan.ir import ParallelScheme

    layout = _llama([ParallelScheme(tp=2, pp=2)])
    links = Links(gpus_per_node=4, intra_gbps=0.5, inter_gbps=0.05, latency_us=10)
    strategy = Strategy.parse("1x(tp2,pp2)")
    still = MovementCost(layout, links, mode="overlapped")
    slowed = MovementCost(layout, links, mode="overlapped", slowdown=0.5)
    t = still.time(strategy)
    both = np.asarray(t.pull_ranks) + np.asarray(t.push_ranks)
    stage, _ = still._rank_places(strategy)
    long = 10 * float(both.max())  # every slot longer than any transfer
    gained = slowed.step_ms(strategy, [1e6], [(long, long)]) - still.step_ms(strategy, [1e6], [(long, long)])
    assert gained == pytest.approx(0.5 * float(both[stage == 0].max()))
    assert float(both[stage == 1].max()) > 0  # the second stage moves too, in its slack


def _ahead_by_hand(layout, strategy: Strategy, links: Links, param_bytes: int) -> tuple[list, list]:
    """Per rank, the overlapped runtime's set-up memory counted from the layout's own ranges: the zeroed
    gradient buffer (every element the rank computes with), its own slices (those inside its shard) and the
    zeroed fp32 shard gradient, at the fresh-memory rate."""
    from passes.plan.movement import compute_scheme
    from passes.plan.placement import assign_ranks

    world, rate = strategy.gpus, links.fresh_gbps * 1e6
    pull, push = [0.0] * world, [0.0] * world
    for scheme, ranks in zip(strategy.replicas(), assign_ranks(strategy, links.gpus_per_node)):
        for i, rank in enumerate(ranks):
            place = (compute_scheme(scheme), i // scheme.tp, i % scheme.tp)
            needs = layout.needs(place)
            own = sum(needs.inside(a, b) for a, b in layout.owner_ranges(rank, world))
            pull[rank] = (needs.total + own) * param_bytes / rate
            push[rank] = 4 * layout.shard_numel(world) / rate
    return pull, push


def test_the_set_up_memory_is_exposed_before_the_windows_travel():
    """On a host whose fresh memory is counted (``Links.fresh_gbps``), the overlapped runtime first zeroes the
    gradient buffers and copies the rank's own slices, nothing travelling or computing meanwhile: part of the
    pull's and push's memory (``MovementTime.pull_ahead_ranks``, ``push_ahead_ranks``, counted here from the
    layout's ranges), exposed whole on a first stage (with a cover long enough, its charge is that work plus the
    first window's pull and the last window's push) and hidden by the fill on a later stage; without fresh
    memory counted there is none, and the charge is as before."""
    from passes.plan.ir import ParallelScheme

    schemes = [ParallelScheme(tp=t, pp=p) for t in (1, 2) for p in (1, 2)]
    layout = _llama(schemes)
    bare = Links(gpus_per_node=4, intra_gbps=0.5, inter_gbps=0.05, latency_us=10)
    host = Links(gpus_per_node=4, intra_gbps=0.5, inter_gbps=0.05, latency_us=10, fresh_gbps=0.2, freed_gbps=2.0,
                 warm_gbps=1.0)
    for text in ("4x(tp1)", "1x(tp2,pp2)", "1x(tp2)+2x(tp1)"):
        strategy = Strategy.parse(text)
        for param_bytes in (2, 4):
            cost = MovementCost(layout, host, param_bytes=param_bytes, mode="overlapped")
            t = cost.time(strategy)
            pull, push = _ahead_by_hand(layout, strategy, host, param_bytes)
            assert t.pull_ahead_ranks == pytest.approx(pull) and t.push_ahead_ranks == pytest.approx(push), text
            plain = MovementCost(layout, bare, param_bytes=param_bytes).time(strategy)  # transfers alone
            memory = np.subtract(t.pull_ranks, plain.pull_ranks), np.subtract(t.push_ranks, plain.push_ranks)
            assert (np.array(pull) > 0).all() and (np.array(pull) <= memory[0] + 1e-9).all(), text
            assert (np.array(push) <= memory[1] + 1e-9).all(), text
        assert MovementCost(layout, bare, mode="overlapped").time(strategy).pull_ahead_ranks == (0.0,) * 4
    strategy = Strategy.parse("1x(tp2,pp2)")
    cost = MovementCost(layout, host, param_bytes=4, mode="overlapped")
    t = cost.time(strategy)
    stage, _ = cost._rank_places(strategy)
    ahead = np.add(t.pull_ahead_ranks, t.push_ahead_ranks)
    beside = np.subtract(t.pull_ranks, t.pull_ahead_ranks) + np.subtract(t.push_ranks, t.push_ahead_ranks)
    long = 10 * float((ahead + beside).max())  # every pipeline slot longer than anything a rank moves
    want = float((ahead + beside / cost.windows)[stage == 0].max())
    assert cost.step_ms(strategy, [1e6], [(long, long)]) - 1e6 == pytest.approx(want)
    assert float(ahead[stage == 1].min()) > 0  # the second stage works ahead too, in the pipeline's fill


def test_bad_settings_are_refused_by_name():
    layout = _llama(list(_cost_model().schemes))
    links = Links(gpus_per_node=4, intra_gbps=0.5, inter_gbps=0.05, latency_us=10)
    with pytest.raises(PlanError, match="movement mode must be one of .* got 'async'"):
        MovementCost(layout, links, mode="async")
    with pytest.raises(PlanError, match="windows must be a positive integer, got 0"):
        MovementCost(layout, links, mode="overlapped", windows=0)
    with pytest.raises(PlanError, match="slowdown must be a finite number >= 0, got -0.1"):
        MovementCost(layout, links, mode="overlapped", slowdown=-0.1)
    with pytest.raises(PlanError, match="overlap_slowdown must be a finite number >= 0, got nan"):
        Links(gpus_per_node=4, intra_gbps=1, inter_gbps=1, latency_us=1, overlap_slowdown=float("nan"))


def test_the_ranking_counts_on_the_longest_micro_batch_to_cover_the_first_pull_and_last_push():
    """With ``edge_ms`` (the longest micro-batch each scheme runs), the estimate a strategy is ranked and pooled by
    is the worst rank's stall and tail with that micro-batch first and last, computed here from the ranks' phases
    by ``overlapped_exposure``; it falls as the cover grows, to the first and last window's share when the cover
    is unbounded; above ``exact_up_to`` ranks it is the same estimate on per-rank phases that are bounds under
    the replay's, so never above it; and the pool scores a mix above ``exact_up_to`` by its schemes'
    homogeneous strategies."""
    from passes.plan.movement import full_micro_batch_ms

    model = _cost_model()
    layout = _llama(list(model.schemes))
    links = Links(gpus_per_node=4, intra_gbps=0.5, inter_gbps=0.05, latency_us=10)
    edges = full_micro_batch_ms(model)
    assert edges == {s: model.micro_batch_ms(s, [model.max_tokens(s)]) for s in model.schemes}
    for text in ("8x(tp1)", "1x(tp4)+2x(tp2)", "2x(tp4)"):
        strategy = Strategy.parse(text)
        blind = MovementCost(layout, links, mode="overlapped")
        t = blind.time(strategy)
        pull, push = np.asarray(t.pull_ranks), np.asarray(t.push_ranks)
        estimates = []
        for scale in (0.0, 0.1, 1.0, 10.0, 1e9):
            scaled = {s: ms * scale for s, ms in edges.items()}
            cost = MovementCost(layout, links, mode="overlapped", edge_ms=scaled)
            cover = np.array([scaled[s] for s, ranks in zip(strategy.replicas(), cost._rank_places(strategy)[1])
                              for _ in ranks])
            stall, tail = overlapped_exposure(pull, push, np.zeros(len(pull)), cover, cover, cost.windows)
            assert cost.exposed_ms(strategy) == pytest.approx(float((stall + tail).max())), (text, scale)
            estimates.append(cost.exposed_ms(strategy))
            quick = MovementCost(layout, links, mode="overlapped", edge_ms=scaled, exact_up_to=0)
            assert 0 < quick.ranking_ms(strategy) <= cost.exposed_ms(strategy) + 1e-9, (text, scale)
        assert estimates == sorted(estimates, reverse=True) and estimates[0] > estimates[-1], text
        assert estimates[-1] == pytest.approx(blind.exposed_ms(strategy)), text  # nothing but the edge windows
    quick = MovementCost(layout, links, mode="overlapped", edge_ms=edges, exact_up_to=0)
    mix = Strategy.parse("1x(tp4)+2x(tp2)")
    assert quick.pool_ms(mix) == max(quick.ranking_ms(Strategy.parse("2x(tp4)")),
                                     quick.ranking_ms(Strategy.parse("4x(tp2)")))
    exact = MovementCost(layout, links, mode="overlapped", edge_ms=edges)
    assert exact.pool_ms(mix) == exact.exposed_ms(mix)
