"""The time of parameter and gradient movement as the planner charges it (``passes.plan.movement``,
``passes.plan.links``): the rounds replayed against a plain event-by-event reference, hand-computed cases,
the quick bound and the floor under the replay, and the planner's estimates and bounds with movement charged."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from importlib import resources

import numpy as np
import pytest

from passes.plan.cost_model import Profile, load_profile
from passes.plan.ir import CostModel, ParallelScheme, PlanError, SchemeCost, Strategy
from passes.plan.links import LINK_PRESETS, Links, link_preset
from passes.plan.movement import (
    ComputeLayout,
    MovementCost,
    _rounds_ms,
    _rounds_ready,
    llama_compute_layout,
    movement_bytes,
    movement_time,
    pair_elements,
    shared_transfer_ms,
)
from passes.plan.policies import POLICIES, Planner, homogeneous_strategies


def reference_rounds_ms(sends: list[list[int]], gpus_per_node: int, links: Links, elem_bytes: int,
                        chunk: int) -> float:
    """The last rank's finish of :func:`reference_rounds_ready`."""
    return max(reference_rounds_ready(sends, gpus_per_node, links, elem_bytes, chunk))


def reference_rounds_ready(sends: list[list[int]], gpus_per_node: int, links: Links, elem_bytes: int,
                           chunk: int) -> list[float]:
    """Round by round, rank by rank: in round d rank r sends sends[r][r+d] to r+d and receives from r-d; a
    message starts when both its ends have finished the round before; a rank's round ends with the later of
    its send and its receive."""
    world = len(sends)
    done = [0.0] * world
    for d in range(1, world):
        finished = list(done)
        for r in range(world):
            to = (r + d) % world
            n = sends[r][to]
            if n == 0:
                continue
            same = r // gpus_per_node == to // gpus_per_node
            took = links.message_ms(n * elem_bytes, same, messages=math.ceil(n / chunk))
            end = max(done[r], done[to]) + took
            finished[r] = max(finished[r], end)
            finished[to] = max(finished[to], end)
        done = finished
    return done


def test_the_rounds_are_the_event_by_event_reference():
    rng = random.Random(5)
    for world, gpn in ((2, 2), (4, 2), (6, 4), (8, 8), (5, 1), (37, 8), (130, 8)):
        links = Links(gpus_per_node=gpn, intra_gbps=rng.uniform(1, 10), inter_gbps=rng.uniform(0.1, 1),
                      latency_us=rng.uniform(0, 100))
        for _ in range(5):
            sends = [[0 if a == b or rng.random() < 0.3 else rng.randrange(1, 10**7) for b in range(world)]
                     for a in range(world)]
            node = np.arange(world) // gpn
            got = _rounds_ms(np.array(sends, dtype=np.int64), node, links, 2, 1 << 20)
            assert got == pytest.approx(reference_rounds_ms(sends, gpn, links, 2, 1 << 20), rel=1e-12)
            per_rank = _rounds_ready(np.array(sends, dtype=np.int64), node, links, 2, 1 << 20)
            assert per_rank.tolist() == pytest.approx(reference_rounds_ready(sends, gpn, links, 2, 1 << 20),
                                                      rel=1e-12, abs=1e-12)
            roomy = dataclasses.replace(links, host_gbps=1e9)  # a host link no round fills: the same rounds
            assert _rounds_ready(np.array(sends, dtype=np.int64), node, roomy, 2, 1 << 20).tolist() == \
                pytest.approx(per_rank.tolist(), rel=1e-9)


def test_two_ranks_by_hand():
    layout = ComputeLayout(numel=2_000_000_000, ranges={(ParallelScheme(), 0, 0): ((0, 2_000_000_000),)})
    strategy = Strategy.parse("2x(tp1)")
    # each rank needs the other's 1e9 elements: 2 GB of bf16 parameters at 1 GB/s, 4 GB of fp32 gradients
    same = movement_time(layout, strategy, Links(gpus_per_node=2, intra_gbps=1, inter_gbps=0.5, latency_us=0),
                         chunk_numel=1 << 40)
    assert (same.pull_ms, same.push_ms) == pytest.approx((2000.0, 4000.0))
    apart = movement_time(layout, strategy, Links(gpus_per_node=1, intra_gbps=1, inter_gbps=0.5, latency_us=0),
                          chunk_numel=1 << 40)
    assert (apart.pull_ms, apart.push_ms) == pytest.approx((4000.0, 8000.0))
    chunked = movement_time(layout, strategy, Links(gpus_per_node=2, intra_gbps=1, inter_gbps=1, latency_us=1000),
                            chunk_numel=10**8)  # ten chunks of a millisecond's start-up each
    assert chunked.pull_ms == pytest.approx(2000.0 + 10.0)
    # new buffers written at 1 GB/s: the pull writes the 2e9-element compute copy and its gradient buffer in bf16
    # (8 GB) and one staging buffer for the 1e9 elements it casts to bf16 and sends (2 GB); the push the fp32
    # shard gradient (4 GB), one receive buffer for its 1e9 fp32 gradients in (4 GB) and one buffer for the 1e9
    # bf16 gradients it casts to fp32 and sends (4 GB)
    fresh = movement_time(layout, strategy, Links(gpus_per_node=2, intra_gbps=1, inter_gbps=1, latency_us=0,
                                                   fresh_gbps=1), chunk_numel=1 << 40)
    assert (fresh.pull_ms, fresh.push_ms) == pytest.approx((2000.0 + 8000.0 + 2000.0, 4000.0 + 8000.0 + 4000.0))
    # freed at 2 GB/s and written memory added at 4: the pull frees its staging buffer (2 GB) and casts 2 GB;
    # the push frees the gradient buffer (4 GB), the receive and the cast buffers (4 GB each), adds its own and
    # the received gradients into the shard's (8 GB) and casts 4 GB
    memory = movement_time(layout, strategy, Links(gpus_per_node=2, intra_gbps=1, inter_gbps=1, latency_us=0,
                                                    fresh_gbps=1, freed_gbps=2, warm_gbps=4), chunk_numel=1 << 40)
    assert memory.pull_ms == pytest.approx(fresh.pull_ms + 1000.0 + 500.0)
    assert memory.push_ms == pytest.approx(fresh.push_ms + 6000.0 + 2000.0 + 1000.0)


def test_only_messages_from_several_ranges_are_gathered():
    # fp32 parameters and gradients (nothing cast): owner 0 holds [0, 2e9) and serves [0, 1e9) and [1.5e9, 2e9),
    # two ranges, so it gathers its 1.5e9 elements for rank 1; owner 1 holds [2e9, 4e9) and serves [2e9, 3e9),
    # one range, sent as it lies
    layout = ComputeLayout(numel=4_000_000_000, ranges={(ParallelScheme(), 0, 0): (
        (0, 1_000_000_000), (1_500_000_000, 3_000_000_000))})
    fast = dict(gpus_per_node=2, intra_gbps=1000, inter_gbps=1000, latency_us=0)
    plain = movement_time(layout, Strategy.parse("2x(tp1)"), Links(**fast), param_bytes=4, chunk_numel=1 << 40)
    warm = movement_time(layout, Strategy.parse("2x(tp1)"), Links(**fast, warm_gbps=1), param_bytes=4,
                         chunk_numel=1 << 40)
    assert warm.pull_ms - plain.pull_ms == pytest.approx(6000.0)  # owner 0 copies 6 GB; owner 1 nothing
    # the push adds each owner's own and received gradients: owner 0 twice 1.5e9 fp32 elements, owner 1 twice 1e9
    assert warm.push_ms - plain.push_ms == pytest.approx(12000.0)


def test_transfers_sharing_a_host_by_hand():
    # 3 GB/s shared, each transfer at most 2 GB/s: 1, 2 and 4 MB start together; 1 GB/s each until the 1 MB one
    # ends (1 ms), then 1.5 GB/s each: the 2 MB one ends at 1 + 1/1.5 ms, then the 4 MB one alone at 2 GB/s
    got = shared_transfer_ms(np.array([1e6, 2e6, 0.0, 4e6]), np.array([2.0, 2.0, 2.0, 2.0]), 3.0)
    t2 = 1 + 1 / 1.5
    assert got.tolist() == pytest.approx([1.0, t2, 0.0, t2 + (4e6 - 1e6 - 1.5e6 / 1.5) / 2e6])
    # two ranks: a pair exchanging alone runs at the pair's speed, however much the host could carry
    layout = ComputeLayout(numel=2_000_000_000, ranges={(ParallelScheme(), 0, 0): ((0, 2_000_000_000),)})
    host = Links(gpus_per_node=2, intra_gbps=1, inter_gbps=1, latency_us=0, host_gbps=100)
    alone = movement_time(layout, Strategy.parse("2x(tp1)"), host, chunk_numel=1 << 40)
    assert (alone.pull_ms, alone.push_ms) == pytest.approx((2000.0, 4000.0))
    # four ranks all sending at once share it: 4 transfers of a 1 GB/s host take 4 times as long each
    four = ComputeLayout(numel=4_000_000, ranges={(ParallelScheme(), 0, 0): ((0, 4_000_000),)})
    own = Links(gpus_per_node=4, intra_gbps=1, inter_gbps=1, latency_us=0)
    shared = Links(gpus_per_node=4, intra_gbps=1, inter_gbps=1, latency_us=0, host_gbps=1)
    t_own = movement_time(four, Strategy.parse("4x(tp1)"), own, chunk_numel=1 << 40)
    t_shared = movement_time(four, Strategy.parse("4x(tp1)"), shared, chunk_numel=1 << 40)
    assert t_shared.pull_ms == pytest.approx(4 * t_own.pull_ms) and t_shared.push_ms == pytest.approx(4 * t_own.push_ms)
    with pytest.raises(PlanError, match="host_gbps"):
        Links(gpus_per_node=4, intra_gbps=1, inter_gbps=1, latency_us=0, host_gbps=0)


def _llama(schemes):
    return llama_compute_layout(layers=8, hidden=256, ffn_hidden=512, heads=8, kv_heads=4, vocab=4096,
                                schemes=schemes)


def test_pair_elements_are_the_byte_count():
    schemes = [ParallelScheme(tp=t, pp=p) for t in (1, 2, 4) for p in (1, 2)]
    layout = _llama(schemes)
    for text in ("8x(tp1)", "2x(tp2,pp2)", "1x(tp4)+2x(tp2)", "1x(tp4,pp2)"):
        strategy = Strategy.parse(text)
        e = pair_elements(layout, strategy, 4)
        off = e - np.diag(np.diag(e))
        counted = movement_bytes(layout, strategy, 4, param_bytes=1, reduce_bytes=1)
        assert [m.params_received for m in counted] == off.sum(axis=0).tolist()
        assert [m.params_sent for m in counted] == off.sum(axis=1).tolist()


def test_quick_bound_and_floor_lie_under_the_replay():
    schemes = [ParallelScheme(tp=t, pp=p) for t in (1, 2, 4) for p in (1, 2, 4)]
    layout = _llama(schemes)
    links = Links(gpus_per_node=4, intra_gbps=20, inter_gbps=2, latency_us=30)
    cost = MovementCost(layout, links)
    rng = random.Random(1)
    floor = cost.floor_ms(schemes, 16)
    assert floor == 0.0  # a (tp4,pp4) rank computes with about the 16th of the model its shard may hold
    assert cost.floor_ms([ParallelScheme(tp=2)], 16) > 0
    for _ in range(25):
        parts: dict[ParallelScheme, int] = {}
        left = 16
        while left:
            s = rng.choice([s for s in schemes if s.gpus <= left and left % s.gpus == 0])
            parts[s] = parts.get(s, 0) + 1
            left -= s.gpus
        strategy = Strategy.of(parts)
        try:
            exact = cost.exposed_ms(strategy)
        except PlanError:
            continue  # a TP group across nodes: not placeable
        assert floor <= cost.quick_ms(strategy) * (1 + 1e-9) <= exact * (1 + 1e-9), strategy.describe()
        assert cost.ranking_ms(strategy) == exact  # 16 ranks: ranked by the replay itself


def test_links_validated_and_presets_match_the_hardware_presets():
    with pytest.raises(PlanError, match="inter_gbps"):
        Links(gpus_per_node=8, intra_gbps=100, inter_gbps=0, latency_us=1)
    with pytest.raises(PlanError, match="gpus_per_node"):
        Links(gpus_per_node=0, intra_gbps=100, inter_gbps=1, latency_us=1)
    with pytest.raises(PlanError, match="no link preset for hardware 'tpu'"):
        link_preset("tpu")
    from passes.graph.hardware import GPU_PRESETS

    assert set(GPU_PRESETS) == set(LINK_PRESETS)
    for name, hw in GPU_PRESETS.items():
        links = LINK_PRESETS[name]
        assert (hw.link_gbps, hw.network_gbps, hw.latency_us, hw.gpus_per_node) == \
            (links.intra_gbps, links.inter_gbps, links.latency_us, links.gpus_per_node)


def _cost_model(gpus_per_node=4):
    entries = tuple(SchemeCost(scheme=ParallelScheme(tp=t), a=1e-4 / t, b=0.05 * (1 + 0.5 * (t - 1)) / t, c=2.0,
                               max_tokens=512 * t) for t in (1, 2, 4))  # tensor parallelism's efficiency < 1
    return CostModel(name="toy", entries=entries, gpus_per_node=gpus_per_node)


def test_the_planner_charges_movement_in_every_policy_and_its_bound():
    model = _cost_model()
    layout = _llama(list(model.schemes))
    movement = MovementCost(layout, Links(gpus_per_node=4, intra_gbps=0.5, inter_gbps=0.05, latency_us=10))
    pool = homogeneous_strategies(model, 8) + [Strategy.parse("1x(tp4)+2x(tp2)")]
    fixed = Strategy.parse("2x(tp4)")
    charged = Planner(model, 8, pool, fixed, movement=movement)
    blind = Planner(model, 8, pool, fixed)
    batch = [700, 30, 64, 200, 90, 1000, 12, 300, 45, 500]
    assert charged.movement_floor_ms > 0
    for policy in POLICIES:
        with_move, without = charged.plan(batch, policy), blind.plan(batch, policy)
        assert with_move.est_move_ms == pytest.approx(movement.exposed_ms(with_move.strategy))
        compute = max(r.est_ms for r in with_move.replicas)
        assert with_move.est_step_ms == pytest.approx(compute + with_move.est_move_ms)
        assert with_move.lower_bound_ms == pytest.approx(without.lower_bound_ms + charged.movement_floor_ms)
        assert with_move.lower_bound_ms <= with_move.est_step_ms
        assert without.est_move_ms == 0.0
    # the chosen strategy is at least as good, compute plus movement, as every pool strategy planned alone
    best = charged.plan(batch, "hydraulis")
    for strategy in (s for s in pool if max(model.max_tokens(t) for t in s.schemes) >= max(batch)):
        assert best.est_step_ms <= charged.plan(batch, strategy=strategy).est_step_ms + 1e-6


def test_movement_changes_the_choice_when_it_dominates():
    """With slow links a strategy whose ranks compute with less of the model wins."""
    model = _cost_model()
    layout = _llama(list(model.schemes))
    slow = MovementCost(layout, Links(gpus_per_node=4, intra_gbps=0.01, inter_gbps=0.001, latency_us=10))
    pool = homogeneous_strategies(model, 8)
    batch = [100] * 40
    blind = Planner(model, 8, pool, pool[0]).plan(batch, "homogeneous-per-step")
    charged = Planner(model, 8, pool, pool[0], movement=slow).plan(batch, "homogeneous-per-step")
    assert blind.strategy == Strategy.parse("8x(tp1)")  # compute alone: the least communication inside
    assert charged.strategy == Strategy.parse("2x(tp4)")  # a tp4 rank pulls a quarter of the layers


def test_profile_links_parsed_and_checked():
    profile = load_profile("llama-32b")
    assert profile.links is None  # the presets' profiles take the hardware preset's links
    data = json.loads(resources.files("passes.plan").joinpath("data/profiles/a800-llama-32b.json").read_text())
    data["hardware"].update(intra_gbps=3.5, inter_gbps=3.5, latency_us=80.0)
    parsed = Profile.from_dict(data, name="measured")
    assert parsed.links == Links(gpus_per_node=profile.gpus_per_node, intra_gbps=3.5, inter_gbps=3.5,
                                 latency_us=80.0)
    data["hardware"].update(host_gbps=6.0)
    assert Profile.from_dict(data, name="cpu").links.host_gbps == 6.0  # ranks sharing one host's cores
    del data["hardware"]["latency_us"]
    with pytest.raises(PlanError, match="without latency_us"):
        Profile.from_dict(data, name="half")


def test_the_pool_is_chosen_with_the_movement_it_is_charged():
    from passes.plan.datasets import LengthDataset
    from passes.plan.pool import build_pool

    model = _cost_model()
    layout = _llama(list(model.schemes))
    slow = MovementCost(layout, Links(gpus_per_node=4, intra_gbps=0.01, inter_gbps=0.001, latency_us=10))
    data = LengthDataset.from_lengths("toy", [100, 200, 300, 900, 50, 80, 1500] * 20, source="test")
    fixed = Strategy.parse("2x(tp4)")
    blind = build_pool(model, 8, data, 4000, fixed, seed=0)
    charged = build_pool(model, 8, data, 4000, fixed, seed=0, extra=slow.exposed_ms)
    assert blind[0] == Strategy.parse("8x(tp1)")  # compute alone: tp1 is the most efficient
    assert slow.exposed_ms(charged[0]) < slow.exposed_ms(blind[0])
    assert charged[0] == Strategy.parse("2x(tp4)")  # a tp4 rank pulls a quarter of the layers
