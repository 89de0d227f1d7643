"""The step lower bounds: hand-computed values, and never above the exhaustive optimum of small instances
(every strategy of up to 4 GPUs, every assignment of sequences to replicas, every split into micro-batches),
for random cost models."""

import functools
import itertools
import math

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from passes.plan.bounds import bound_terms, lower_bound_ms
from passes.plan.ir import CostModel, ParallelScheme, SchemeCost

TOY = CostModel(name="toy", gpus_per_node=4, entries=(
    SchemeCost(scheme=ParallelScheme(tp=1), a=4e-4, b=1.0, c=20.0, max_tokens=256),
    SchemeCost(scheme=ParallelScheme(tp=2), a=2.5e-4, b=0.55, c=15.0, max_tokens=640),
    SchemeCost(scheme=ParallelScheme(tp=1, pp=2), a=2e-4, b=0.5, c=12.0, max_tokens=512),
    SchemeCost(scheme=ParallelScheme(tp=4), a=1.5e-4, b=0.3, c=12.0, max_tokens=1536),
))
SCHEMES = [ParallelScheme(tp=1), ParallelScheme(tp=2), ParallelScheme(tp=4), ParallelScheme(tp=1, pp=2),
           ParallelScheme(tp=2, pp=2), ParallelScheme(tp=1, pp=4)]


def _partitions(items: list[int]):
    """Every split of ``items`` into non-empty groups."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for groups in _partitions(rest):
        yield [[first], *groups]
        for k in range(len(groups)):
            yield [*groups[:k], [first, *groups[k]], *groups[k + 1:]]


def exhaustive_optimum(cost_model: CostModel, gpus: int, seq_lens: list[int]) -> float:
    """The least makespan over every plan, written from the cost model's definition alone: the sequences split
    into replicas, each of a scheme (at most ``gpus`` GPUs in all), each replica's sequences split into
    micro-batches of at most ``max_tokens`` tokens; a replica takes ``sum_j t_j + (pp - 1) max_j t_j`` with
    ``t_j = sum (a s^2 + b s) + c``. Node placement is ignored (a superset of the real plans)."""
    costs = {e.scheme: e for e in cost_model.entries if e.scheme.gpus <= gpus}

    @functools.lru_cache(maxsize=None)
    def replica_ms(scheme: ParallelScheme, lens: tuple[int, ...]) -> float:
        e = costs[scheme]
        if max(lens) > e.max_tokens:
            return math.inf
        best = math.inf
        for groups in _partitions(list(lens)):
            if any(sum(g) > e.max_tokens for g in groups):
                continue
            times = [sum(e.a * s * s + e.b * s for s in g) + e.c for g in groups]
            best = min(best, sum(times) + (scheme.pp - 1) * max(times))
        return best

    best = math.inf
    for replicas in _partitions(list(range(len(seq_lens)))):
        blocks = [tuple(sorted(seq_lens[i] for i in r)) for r in replicas]
        for schemes in itertools.product(costs, repeat=len(blocks)):
            if sum(s.gpus for s in schemes) <= gpus:
                best = min(best, max(replica_ms(s, b) for s, b in zip(schemes, blocks)))
    return best


@st.composite
def instances(draw):
    entries = []
    for scheme in SCHEMES:
        entries.append(SchemeCost(
            scheme=scheme, a=draw(st.floats(0, 2e-3)), b=draw(st.floats(0.05, 1.0)), c=draw(st.floats(0, 60)),
            max_tokens=draw(st.integers(16, 400))))
    model = CostModel(name="random", entries=tuple(entries), gpus_per_node=4)
    longest = max(e.max_tokens for e in entries)
    lens = draw(st.lists(st.integers(1, longest), min_size=1, max_size=5))
    return model, 4, lens


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
@example((TOY, 8, [1, 1, 224, 641, 641, 1]))  # two long ones fill the cluster, the short ones all absorbed
def test_no_plan_beats_any_bound(instance):
    model, gpus, lens = instance
    optimum = exhaustive_optimum(model, gpus, lens)
    bounds = bound_terms(model, gpus, lens)
    for name in ("area", "latency", "pipeline", "long"):
        assert getattr(bounds, name) <= optimum * (1 + 1e-9), (name, bounds, optimum)
    assert bounds.best == max(bounds.area, bounds.latency, bounds.pipeline, bounds.long)


def _one_scheme(scheme: ParallelScheme, a: float, b: float, c: float, max_tokens: int) -> CostModel:
    return CostModel(name="one", entries=(SchemeCost(scheme=scheme, a=a, b=b, c=c, max_tokens=max_tokens),))


def test_pipeline_bound_is_the_best_real_micro_batch_count():
    # One (tp1,pp2) replica, c = 4, 100 one-token sequences of 1 ms: W = 100, bound W + c + 2 sqrt(c W) = 144,
    # which 5 micro-batches of 20 reach exactly: 100 + 5 * 4 + (20 + 4).
    model = _one_scheme(ParallelScheme(tp=1, pp=2), a=0.0, b=1.0, c=4.0, max_tokens=1000)
    bounds = bound_terms(model, 2, [1] * 100)
    assert bounds.pipeline == pytest.approx(144.0, rel=1e-9)
    assert bounds.area == pytest.approx(2 * (100 + 4 * 100 / 1000) / 2)
    assert exhaustive_optimum_by_counts(100, c=4.0) == pytest.approx(144.0)
    assert bounds.binding == "pipeline"


def exhaustive_optimum_by_counts(n: int, c: float) -> float:
    """n unit sequences on one pp2 replica: the best over micro-batch counts (balanced is best)."""
    return min(n + v * c + (math.ceil(n / v) + c) for v in range(1, n + 1))


def test_long_bound_counts_the_replicas_long_sequences_need():
    # 8 GPUs; tp1 holds 100 tokens at 1 ms/token, tp8 holds 1000 at 0.25 ms/token (2 GPU-ms a token).
    # Two 900-token sequences need tp8, i.e. all 8 GPUs, so they run one after the other: 450 ms at least;
    # the area bound (spread over 8 GPUs) is only 225 ms and each alone takes 225 ms.
    model = CostModel(name="two", gpus_per_node=8, entries=(
        SchemeCost(scheme=ParallelScheme(tp=1), a=0.0, b=1.0, c=0.0, max_tokens=100),
        SchemeCost(scheme=ParallelScheme(tp=8), a=0.0, b=0.25, c=0.0, max_tokens=1000)))
    bounds = bound_terms(model, 8, [900, 900])
    assert bounds.area == pytest.approx(2 * 900 * 2 / 8)
    assert bounds.latency == pytest.approx(225.0)
    assert bounds.long == pytest.approx(450.0, rel=1e-9)
    assert lower_bound_ms(model, 8, [900, 900]) == pytest.approx(450.0, rel=1e-9)


def test_restricted_bound_is_area_and_latency_over_those_schemes():
    model = _one_scheme(ParallelScheme(tp=2), a=0.0, b=1.0, c=10.0, max_tokens=100)
    assert lower_bound_ms(model, 4, [50, 50, 50, 50], [ParallelScheme(tp=2)]) == pytest.approx(
        max(2 * (200 + 10 * 200 / 100) / 4, 60.0))
