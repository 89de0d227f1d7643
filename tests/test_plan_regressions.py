"""Planner faults found against exhaustive optima of small instances (issue 23): each instance as it was found,
against an optimum written from the cost model's definition alone."""

import math

import numpy as np
import pytest
from partitions import partitions

from passes.plan.assign import Kind, dispatch, first_fit, pack_fewest_bins, pack_replica
from passes.plan.ir import CostModel, ParallelScheme, SchemeCost, Strategy
from passes.plan.pool import fluid_estimate


def best_packing_ms(kind: Kind, seq_lens: list[int]) -> float:
    """The least 1F1B time of one replica over every split of its sequences into micro-batches."""
    best = math.inf
    for groups in partitions(seq_lens):
        if all(sum(g) <= kind.max_tokens for g in groups):
            times = [sum(kind.seq_ms(s) for s in g) + kind.c for g in groups]
            best = min(best, sum(times) + (kind.pp - 1) * max(times))
    return best


def test_pipelined_replica_may_use_as_many_micro_batches_as_sequences():
    # sqrt((pp-1) W / c) = 11.2 micro-batches for 8 sequences: the counts near it were dropped, not clamped,
    # and the replica ran one micro-batch of 310.4 ms.
    kind = Kind(ParallelScheme(tp=2, pp=4), 4.176e-5, 0.1412, 1.804, 527)
    seq_lens = [17, 1, 156, 2, 129, 29, 156, 27]
    bins, ms = pack_replica(kind, seq_lens, list(range(len(seq_lens))))
    assert best_packing_ms(kind, seq_lens) == pytest.approx(157.56, abs=0.01)
    assert ms == pytest.approx(best_packing_ms(kind, seq_lens), rel=1e-9)
    assert sorted(i for b in bins for i in b) == list(range(len(seq_lens)))


def test_pipelined_replica_of_a_32b_model_runs_each_long_sequence_alone():
    # llama-32b's (tp8,pp4): three 13,952-token sequences, two of which fit one micro-batch; 5,644 ms packed
    # as two micro-batches, 3,830 ms as three.
    kind = Kind(ParallelScheme(tp=8, pp=4), 4.91076016e-07, 0.0370804063, 25.442409002069667, 27904)
    bins, ms = pack_replica(kind, [13_952] * 3, [0, 1, 2])
    assert len(bins) == 3
    assert ms == pytest.approx(best_packing_ms(kind, [13_952] * 3), rel=1e-9)
    assert ms == pytest.approx(3830, abs=1)


def test_fewest_bins_finds_the_perfect_packing_first_fit_decreasing_misses():
    # 498 tokens under a 249-token cap: 106+77+66 and 105+87+57; first-fit decreasing needs three.
    seq_lens = [106, 105, 87, 77, 66, 57]
    bins = pack_fewest_bins(seq_lens, list(range(6)), 249)
    assert len(bins) == 2
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum(seq_lens[i] for i in b) <= 249 for b in bins)
    kind = Kind(ParallelScheme(tp=1), 1e-4, 0.5, 10.0, 249)
    assert pack_replica(kind, seq_lens, list(range(6)))[1] == pytest.approx(best_packing_ms(kind, seq_lens))


def test_fewest_bins_of_many_sequences_is_first_fit_decreasing():
    # past the exact search's reach (24 sequences): first-fit decreasing, as before
    rng = np.random.default_rng(3)
    seq_lens = [int(x) for x in rng.integers(20, 140, 40)]
    longest_first = sorted(range(40), key=lambda j: (-seq_lens[j], j))
    assert pack_fewest_bins(seq_lens, list(range(40)), 249) == first_fit(seq_lens, longest_first, 249)


def test_dispatch_finds_the_best_assignment_of_a_small_batch():
    # three tp1 replicas, nine sequences: the local search stopped at 202.94 ms; every assignment with every
    # packing (tests/test_bounds.py, subset_optimum) gives 194.85 ms at best
    kind = Kind(ParallelScheme(tp=1), 0.00021235249026917337, 0.3947393394995252, 10.865216611615827, 217)
    seq_lens = [217, 25, 105, 217, 137, 137, 179, 13, 117]
    result = dispatch([kind] * 3, seq_lens)
    assert sorted(i for bins, _ in result for b in bins for i in b) == list(range(len(seq_lens)))
    assert max(ms for _, ms in result) == pytest.approx(194.8507, abs=1e-3)


def test_fluid_estimate_takes_a_strategy_of_four_schemes():
    model = CostModel(name="four", gpus_per_node=8, entries=(
        SchemeCost(scheme=ParallelScheme(tp=1), a=4e-4, b=1.0, c=20.0, max_tokens=256),
        SchemeCost(scheme=ParallelScheme(tp=2), a=2.5e-4, b=0.55, c=15.0, max_tokens=640),
        SchemeCost(scheme=ParallelScheme(tp=1, pp=2), a=2e-4, b=0.5, c=12.0, max_tokens=512),
        SchemeCost(scheme=ParallelScheme(tp=4), a=1.5e-4, b=0.3, c=12.0, max_tokens=1536),
    ))
    four = Strategy.parse("1x(tp4)+1x(tp2)+1x(tp1,pp2)+2x(tp1)")
    batch = [1000, 600, 300, 100, 20, 20]
    estimate = fluid_estimate(model, four, batch)
    assert math.isfinite(estimate)
    # the tp4 replica alone would take the 1000-token sequence and the rest: no better than the four schemes
    assert estimate <= fluid_estimate(model, Strategy.parse("1x(tp4)+1x(tp2)+1x(tp1,pp2)"), batch) + 1e-9
    assert fluid_estimate(model, four, [2000]) == math.inf


def test_fluid_estimate_of_a_pipelined_replica_runs_no_more_micro_batches_than_it_has_sequences():
    # llama-32b's (tp8,pp4) with three 13,952-token sequences: sqrt((pp-1) W / c) = 14.7 micro-batches were
    # charged (4,128 ms); three is all there are, and the longest sequence sets the largest anyway (3,830 ms)
    e = SchemeCost(scheme=ParallelScheme(tp=8, pp=4), a=4.91076016e-07, b=0.0370804063, c=25.442409002069667,
                   max_tokens=27904)
    model = CostModel(name="32b", entries=(e,), gpus_per_node=8)
    kind = Kind.of(model, e.scheme)
    _, packed = pack_replica(kind, [13_952] * 3, [0, 1, 2])
    assert fluid_estimate(model, Strategy.parse("1x(tp8,pp4)"), [13_952] * 3) == pytest.approx(packed, rel=1e-9)
