"""Two-stage assignment: packing, estimates and dispatch against brute force on tiny instances."""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from passes.plan.assign import Kind, dispatch, estimate_replica_ms, pack_fewest_bins, pack_replica
from passes.plan.ir import ParallelScheme, PlanError

PP1 = Kind(ParallelScheme(tp=1), 1e-3, 1.0, 10.0, 100)
PP3 = Kind(ParallelScheme(tp=1, pp=3), 1e-3, 1.0, 10.0, 100)


def test_fewest_bins_first_fit_decreasing():
    assert pack_fewest_bins([60, 50, 40, 30, 20], [0, 1, 2, 3, 4], 100) == [[0, 2], [1, 3, 4]]


def test_pack_pp1_exact_time():
    bins, ms = pack_replica(PP1, [60, 50, 40], [0, 1, 2])
    work = sum(1e-3 * s * s + s for s in (60, 50, 40))
    assert len(bins) == 2 and ms == pytest.approx(work + 2 * 10.0)


def test_pack_charges_each_micro_batch_its_bucket_padding():
    bucketed = Kind(ParallelScheme(tp=1), 1e-3, 1.0, 10.0, 100, (32, 64, 100))
    bins, ms = pack_replica(bucketed, [60, 50, 40], [0, 1, 2])  # [60, 40] is full; [50] is padded by 14 to 64
    work = sum(1e-3 * s * s + s for s in (60, 50, 40))
    assert sorted(map(sorted, bins)) == [[0, 2], [1]]
    assert ms == pytest.approx(work + 2 * 10.0 + (1e-3 * 14 * 14 + 14))


def test_pack_pp_gt_1_uses_more_micro_batches_to_cut_the_bubble():
    seq_lens = [10] * 12
    bins, ms = pack_replica(PP3, seq_lens, list(range(12)))
    one_bin = 12 * (1e-3 * 100 + 10) + 10.0
    assert len(bins) > 1 and ms < one_bin * 3  # (pp-1)*max term shrinks with more micro-batches
    times = [sum(1e-3 * 100 + 10 for _ in b) + 10.0 for b in bins]
    assert ms == pytest.approx(sum(times) + 2 * max(times))


def test_pack_rejects_oversized():
    with pytest.raises(PlanError, match="longer than 100 tokens"):
        pack_replica(PP1, [101], [0])


def test_estimate_is_exact_for_pp1_when_bins_are_tight():
    assert estimate_replica_ms(PP1, 500.0, 250, 100.0, 5) == pytest.approx(500.0 + 3 * 10.0)
    assert estimate_replica_ms(PP1, 0.0, 0, 0.0, 0) == 0.0


def _brute_force(kinds, seq_lens):
    """Independent optimum for pp=1 replicas: every assignment, every partition into micro-batches."""
    def best_replica(kind, items):
        if not items:
            return 0.0
        best = math.inf
        for labels in itertools.product(range(len(items)), repeat=len(items)):
            groups = {}
            for item, label in zip(items, labels):
                groups.setdefault(label, []).append(item)
            if all(sum(seq_lens[i] for i in g) <= kind.max_tokens for g in groups.values()):
                best = min(best, sum(kind.seq_ms(seq_lens[i]) for i in items) + kind.c * len(groups))
        return best
    best = math.inf
    for choice in itertools.product(range(len(kinds)), repeat=len(seq_lens)):
        if any(seq_lens[i] > kinds[r].max_tokens for i, r in enumerate(choice)):
            continue
        worst = max(best_replica(k, [i for i, r in enumerate(choice) if r == q]) for q, k in enumerate(kinds))
        best = min(best, worst)
    return best


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=5))
def test_tiny_instances_are_solved_optimally(seq_lens):
    big = Kind(ParallelScheme(tp=2), 5e-4, 0.6, 8.0, 100)
    small = Kind(ParallelScheme(tp=1), 1e-3, 1.0, 10.0, 60)
    kinds = [big, small, small]
    result = dispatch(kinds, seq_lens)
    assert max(ms for _, ms in result) == pytest.approx(_brute_force(kinds, seq_lens))


def test_dispatch_sends_long_sequences_only_where_they_fit():
    big = Kind(ParallelScheme(tp=4), 1e-4, 0.3, 5.0, 1000)
    small = Kind(ParallelScheme(tp=1), 4e-4, 1.0, 5.0, 100)
    kinds = [big] + [small] * 4
    seq_lens = [900, 800] + [50] * 30
    result = dispatch(kinds, seq_lens)
    big_members = {i for b in result[0][0] for i in b}
    assert {0, 1} <= big_members
    for bins, _ in result[1:]:
        assert all(seq_lens[i] <= 100 for b in bins for i in b)
    with pytest.raises(PlanError, match="1001 tokens fits no replica"):
        dispatch(kinds, [1001])
