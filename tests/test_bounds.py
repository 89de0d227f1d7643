"""The step lower bounds: hand-computed values, and never above the exhaustive optimum of small instances
(every strategy of up to 8 GPUs, every assignment of sequences to replicas, every split into micro-batches),
for random cost models; and the planner within 1% of that optimum on nearly every such instance."""

import functools
import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from partitions import partitions

from passes.plan.bounds import bound_terms, lower_bound_ms
from passes.plan.ir import CostModel, ParallelScheme, SchemeCost, Strategy
from passes.plan.policies import Planner

TOY = CostModel(name="toy", gpus_per_node=4, entries=(
    SchemeCost(scheme=ParallelScheme(tp=1), a=4e-4, b=1.0, c=20.0, max_tokens=256),
    SchemeCost(scheme=ParallelScheme(tp=2), a=2.5e-4, b=0.55, c=15.0, max_tokens=640),
    SchemeCost(scheme=ParallelScheme(tp=1, pp=2), a=2e-4, b=0.5, c=12.0, max_tokens=512),
    SchemeCost(scheme=ParallelScheme(tp=4), a=1.5e-4, b=0.3, c=12.0, max_tokens=1536),
))
SCHEMES = [ParallelScheme(tp=1), ParallelScheme(tp=2), ParallelScheme(tp=4), ParallelScheme(tp=1, pp=2),
           ParallelScheme(tp=2, pp=2), ParallelScheme(tp=1, pp=4)]


def exhaustive_optimum(cost_model: CostModel, gpus: int, seq_lens: list[int]) -> float:
    """The least makespan over every plan, written from the cost model's definition alone: the sequences split
    into replicas, each of a scheme (at most ``gpus`` GPUs in all), each replica's sequences split into
    micro-batches of at most ``max_tokens`` tokens; a replica takes ``sum_j t_j + (pp - 1) max_j t_j`` with
    ``t_j = sum seq_ms(s) + c`` (``a s^2 + b s``, or ``b s + max(a s^2, exchange s)`` under CP). Node
    placement is ignored (a superset of the real plans)."""
    costs = {e.scheme: e for e in cost_model.entries if e.scheme.gpus <= gpus}

    @functools.lru_cache(maxsize=None)
    def replica_ms(scheme: ParallelScheme, lens: tuple[int, ...]) -> float:
        e = costs[scheme]
        if max(lens) > e.max_tokens:
            return math.inf
        best = math.inf
        for groups in partitions(list(lens)):
            if any(sum(g) > e.max_tokens for g in groups):
                continue
            times = [sum(e.seq_ms(s) for s in g) + e.c for g in groups]
            best = min(best, sum(times) + (scheme.pp - 1) * max(times))
        return best

    best = math.inf
    for replicas in partitions(list(range(len(seq_lens)))):
        blocks = [tuple(sorted(seq_lens[i] for i in r)) for r in replicas]
        for schemes in itertools.product(costs, repeat=len(blocks)):
            if sum(s.gpus for s in schemes) <= gpus:
                best = min(best, max(replica_ms(s, b) for s, b in zip(schemes, blocks)))
    return best


def _subset_sums(values: list[float]) -> np.ndarray:
    """Per subset of the items (a bit mask), the sum of its items' ``values``."""
    sums = np.zeros(1 << len(values))
    for i, v in enumerate(values):
        sums[1 << i: 2 << i] = sums[: 1 << i] + v
    return sums


@functools.lru_cache(maxsize=None)
def _set_and_block(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (set, block) of ``n`` items, the block a subset of the set that holds the set's lowest item (so
    each split of a set into blocks is met once), as bit masks ordered by the set's size then the set; and
    where each size's pairs start."""
    sets, blocks = [], []
    for whole in range(1, 1 << n):
        low = whole & -whole
        rest = sub = whole ^ low
        while True:
            sets.append(whole)
            blocks.append(sub | low)
            if sub == 0:
                break
            sub = (sub - 1) & rest
    set_masks, block_masks = np.array(sets), np.array(blocks)
    sizes = np.array([bin(m).count("1") for m in sets])
    order = np.lexsort((set_masks, sizes))
    return set_masks[order], block_masks[order], np.searchsorted(sizes[order], np.arange(1, n + 2))


def _least_per_set(sets: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    out = np.full(1 << n, math.inf)
    np.minimum.at(out, sets, values)
    return out


def _replica_optimum_per_subset(e: SchemeCost, seq_lens: list[int]) -> np.ndarray:
    """Per subset of the sequences, the least time of one replica of ``e.scheme`` that runs exactly them:
    over v micro-batches, ``work + v c + (pp - 1) (least largest micro-batch work of a split into v + c)``."""
    n = len(seq_lens)
    sets, blocks, _ = _set_and_block(n)
    tokens = _subset_sums([float(s) for s in seq_lens])
    work = _subset_sums([e.seq_ms(s) for s in seq_lens])
    fits = tokens[blocks] <= e.max_tokens
    sets, blocks = sets[fits], blocks[fits]
    largest = np.full(1 << n, math.inf)  # over the splits into v micro-batches
    largest[0] = 0.0
    extra = np.full(1 << n, math.inf)
    for v in range(1, n + 1):
        largest = _least_per_set(sets, np.maximum(work[blocks], largest[sets ^ blocks]), n)
        split = np.isfinite(largest)
        extra[split] = np.minimum(extra[split], v * e.c + (e.scheme.pp - 1) * (largest[split] + e.c))
    return work + extra


def subset_optimum(cost_model: CostModel, gpus: int, seq_lens: list[int]) -> float:
    """``exhaustive_optimum`` by dynamic programming over the subsets of the sequences (up to 10 or so): per
    subset, the best replica of each GPU count over every split into micro-batches; then per subset and GPU
    count g, the least makespan of a split into replicas of at most g GPUs in all."""
    n = len(seq_lens)
    entries = [e for e in cost_model.entries if e.scheme.gpus <= gpus and e.max_tokens > 0]
    by_gpus: dict[int, np.ndarray] = {}
    for e in entries:
        table = _replica_optimum_per_subset(e, seq_lens)
        by_gpus[e.scheme.gpus] = np.minimum(by_gpus.get(e.scheme.gpus, table), table)
    sets, blocks, starts = _set_and_block(n)
    best = np.full((gpus + 1, 1 << n), math.inf)  # per g: each subset's least makespan on at most g GPUs
    best[:, 0] = 0.0
    for size in range(n):
        s, b = sets[starts[size]:starts[size + 1]], blocks[starts[size]:starts[size + 1]]
        ms = np.full((gpus + 1, len(s)), math.inf)
        for g, table in by_gpus.items():
            ms[g:] = np.minimum(ms[g:], np.maximum(table[b][None, :], best[:gpus + 1 - g, s ^ b]))
        first = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
        best[:, s[first]] = np.minimum.reduceat(ms, first, axis=1)
    return float(best[gpus, -1])


def _draw_instance(draw, schemes: list[ParallelScheme], name: str):
    """4 GPUs, random coefficients for ``schemes`` (a CP scheme's exchange sometimes longer than its
    attention), up to 5 lengths any scheme holds."""
    entries = []
    for scheme in schemes:
        entries.append(SchemeCost(
            scheme=scheme, a=draw(st.floats(0, 2e-3)), b=draw(st.floats(0.05, 1.0)), c=draw(st.floats(0, 60)),
            max_tokens=draw(st.integers(16, 400)), exchange=draw(st.floats(0, 0.5)) if scheme.cp > 1 else 0.0))
    model = CostModel(name=name, entries=tuple(entries), gpus_per_node=4)
    longest = max(e.max_tokens for e in entries)
    lens = draw(st.lists(st.integers(1, longest), min_size=1, max_size=5))
    return model, 4, lens


def _check_bounds(model, gpus, lens) -> float:
    """The exhaustive optimum, after checking the subset search reaches it and no bound exceeds it."""
    optimum = exhaustive_optimum(model, gpus, lens)
    assert subset_optimum(model, gpus, lens) == pytest.approx(optimum, rel=1e-9)
    bounds = bound_terms(model, gpus, lens)
    for name in ("area", "latency", "pipeline", "long"):
        assert getattr(bounds, name) <= optimum * (1 + 1e-9), (name, bounds, optimum)
    assert bounds.best == max(bounds.area, bounds.latency, bounds.pipeline, bounds.long)
    return optimum


@st.composite
def instances(draw):
    return _draw_instance(draw, SCHEMES, "random")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
@example((TOY, 8, [1, 1, 224, 641, 641, 1]))  # two long ones fill the cluster, the short ones all absorbed
def test_no_plan_beats_any_bound(instance):
    _check_bounds(*instance)


CP_SCHEMES = [ParallelScheme(tp=1, cp=2), ParallelScheme(tp=2, cp=2), ParallelScheme(tp=1, cp=4)]


@st.composite
def cp_instances(draw):
    """4 GPUs, schemes with and without CP."""
    return _draw_instance(draw, [ParallelScheme(tp=1), ParallelScheme(tp=2), *CP_SCHEMES], "random-cp")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cp_instances())
def test_no_plan_beats_any_bound_with_context_parallel_schemes(instance):
    model, gpus, lens = instance
    optimum = _check_bounds(model, gpus, lens)
    planner = Planner(model, gpus, every_strategy(list(model.schemes), gpus),
                      fixed=Strategy.homogeneous(ParallelScheme(tp=1), gpus), refine=False)
    assert planner.plan(lens).est_step_ms >= optimum * (1 - 1e-9)


# Beyond tp1 (always there, so any set of replicas can be topped up to fill the cluster), the schemes a
# cluster's cost models draw from: some sizes do not divide the cluster.
MENU = {
    3: [ParallelScheme(tp=2), ParallelScheme(tp=1, pp=2), ParallelScheme(tp=1, pp=3)],
    6: [ParallelScheme(tp=2), ParallelScheme(tp=1, pp=2), ParallelScheme(tp=1, pp=3), ParallelScheme(tp=4),
        ParallelScheme(tp=2, pp=2), ParallelScheme(tp=1, pp=4)],
    8: [ParallelScheme(tp=2), ParallelScheme(tp=1, pp=2), ParallelScheme(tp=1, pp=3), ParallelScheme(tp=4),
        ParallelScheme(tp=2, pp=2), ParallelScheme(tp=1, pp=4), ParallelScheme(tp=2, pp=3),
        ParallelScheme(tp=2, pp=4)],
}
WIDE_INSTANCES = 1200


def wide_instance(rng: np.random.Generator) -> tuple[CostModel, int, list[int]]:
    """3, 6 or 8 GPUs (one node: any replica places), tp1 and one to four schemes of the cluster's menu with
    random coefficients, 1 to 10 sequences, each exactly at one of the schemes' caps (the intermediate ones
    included) with probability 0.3."""
    gpus = int(rng.choice(list(MENU)))
    menu = MENU[gpus]
    picked = rng.choice(len(menu), int(rng.integers(1, min(4, len(menu)) + 1)), replace=False)
    schemes = [ParallelScheme(tp=1), *(menu[i] for i in sorted(picked))]
    entries = tuple(SchemeCost(scheme=s, a=float(rng.uniform(0, 2e-3)), b=float(rng.uniform(0.05, 1.0)),
                               c=float(rng.uniform(0, 60)), max_tokens=int(rng.integers(16, 401))) for s in schemes)
    caps = sorted({e.max_tokens for e in entries})
    lens = [int(rng.choice(caps)) if rng.random() < 0.3 else int(rng.integers(1, caps[-1] + 1))
            for _ in range(int(rng.integers(1, 11)))]
    return CostModel(name="random", entries=entries, gpus_per_node=8), gpus, lens


def every_strategy(schemes: list[ParallelScheme], gpus: int) -> list[Strategy]:
    """Every multiset of ``schemes`` that fills ``gpus`` exactly."""
    if not schemes:
        return []
    first, rest = schemes[0], schemes[1:]
    out = []
    for count in range(gpus // first.gpus, -1, -1):
        left = gpus - count * first.gpus
        head = [(first, count)] if count else []
        if left == 0:
            out.append(Strategy.of(head))
        else:
            out.extend(Strategy.of(head + list(s.parts)) for s in every_strategy(rest, left))
    return out


def test_subset_optimum_is_the_definition_on_wide_instances():
    rng = np.random.default_rng(1)
    checked = 0
    while checked < 12:
        model, gpus, lens = wide_instance(rng)
        if len(lens) <= 4:
            assert subset_optimum(model, gpus, lens) == pytest.approx(exhaustive_optimum(model, gpus, lens), rel=1e-9)
            checked += 1


def test_bound_holds_and_the_planner_is_near_the_optimum_on_wide_instances():
    rng = np.random.default_rng(0)
    ratios = []
    for _ in range(WIDE_INSTANCES):
        model, gpus, lens = wide_instance(rng)
        optimum = subset_optimum(model, gpus, lens)
        assert lower_bound_ms(model, gpus, lens) <= optimum * (1 + 1e-9), (model, gpus, lens)
        planner = Planner(model, gpus, every_strategy(list(model.schemes), gpus),
                          fixed=Strategy.homogeneous(ParallelScheme(tp=1), gpus), refine=False)
        plan = planner.plan(lens)
        assert plan.est_step_ms >= optimum * (1 - 1e-9), (model, gpus, lens)
        ratios.append(plan.est_step_ms / optimum)
    near = float(np.mean(np.asarray(ratios) <= 1.01))
    assert near >= 0.99, f"the planner within 1% of the optimum on {near:.2%} of {WIDE_INSTANCES} instances"


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
