"""Parameter and gradient movement per step, counted by the planner without torch.

Every step each rank pulls the parameter slices it computes with from the ranks whose shards of the fixed
ZeRO-1 layout hold them, and pushes their gradients back (``runtime.redistribute``). Owns
:class:`ComputeLayout` (the flat vector's size and, per (scheme, stage, TP rank), the sorted flat ranges that
place computes with: what ``runtime.stage_params`` holds) and :func:`movement_bytes`, which places a strategy
as the planner does (``placement.assign_ranks``) and intersects every rank's ranges with the owners' equal
contiguous shards, as the runtime does: per rank the bytes it receives and sends, parameters in the compute
dtype and gradients in the reduction dtype, messages to itself not counted.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Mapping

from passes.plan.ir import ParallelScheme, PlanError, Strategy
from passes.plan.placement import assign_ranks

__all__ = ["ComputeLayout", "RankMovement", "movement_bytes", "merged", "places"]

Ranges = tuple[tuple[int, int], ...]
Place = tuple[ParallelScheme, int, int]
"""(scheme, pipeline stage, TP rank)."""


def merged(ranges: list[tuple[int, int]] | Ranges) -> Ranges:
    """Sorted ranges with touching neighbours joined; overlapping ones are a PlanError."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if hi <= lo:
            continue
        if out and lo < out[-1][1]:
            raise PlanError(f"overlapping ranges {out[-1]} and {(lo, hi)}")
        if out and lo == out[-1][1]:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class _Prefix:
    """Sorted disjoint ranges with prefix sums: elements inside [lo, hi) in O(log n)."""

    starts: tuple[int, ...]
    ends: tuple[int, ...]
    before: tuple[int, ...]
    """Elements of the ranges before range i."""

    @classmethod
    def of(cls, ranges: Ranges) -> "_Prefix":
        before, total = [], 0
        for lo, hi in ranges:
            before.append(total)
            total += hi - lo
        return cls(tuple(lo for lo, _ in ranges), tuple(hi for _, hi in ranges), (*before, total))

    def upto(self, x: int) -> int:
        """Elements of the ranges below ``x``."""
        i = bisect.bisect_right(self.starts, x) - 1
        if i < 0:
            return 0
        return self.before[i] + min(x, self.ends[i]) - self.starts[i]

    def inside(self, lo: int, hi: int) -> int:
        """Elements of the ranges inside [lo, hi)."""
        return self.upto(hi) - self.upto(lo)

    @property
    def total(self) -> int:
        return self.before[-1]


@dataclass(frozen=True, slots=True, kw_only=True)
class ComputeLayout:
    """The fixed layout's size and where each place computes in it."""

    numel: int
    """Elements of the flat parameter vector (sharded in equal contiguous ranges over the job's ranks)."""
    ranges: Mapping[Place, Ranges]
    """Per (scheme, stage, TP rank): the sorted, disjoint flat ranges of the parameter slices it computes with."""
    _prefix: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.numel, bool) or not isinstance(self.numel, int) or self.numel < 1:
            raise PlanError(f"numel must be a positive integer, got {self.numel!r}")
        for place, ranges in self.ranges.items():
            if merged(ranges) != tuple(ranges) or (ranges and (ranges[0][0] < 0 or ranges[-1][1] > self.numel)):
                raise PlanError(f"the ranges of {_describe(place)} must be sorted, disjoint, joined and inside "
                                f"[0, {self.numel}), got {ranges[:3]}...")

    def needs(self, place: Place) -> _Prefix:
        """The ranges of ``place``, ready for counting (a place the layout lacks is a PlanError)."""
        if place not in self._prefix:
            if place not in self.ranges:
                raise PlanError(f"the compute layout has no ranges for {_describe(place)}")
            self._prefix[place] = _Prefix.of(self.ranges[place])
        return self._prefix[place]


def _describe(place: Place) -> str:
    scheme, stage, tp_rank = place
    return f"{scheme.describe()} stage {stage} TP rank {tp_rank}"


@dataclass(frozen=True, slots=True, kw_only=True)
class RankMovement:
    """Bytes one rank moves in one step, as ``runtime.redistribute.Traffic`` counts them."""

    params_received: int
    """Its parameter slices that other ranks' shards hold (compute dtype)."""
    params_sent: int
    """Parts of its shard other ranks compute with (compute dtype)."""
    grads_sent: int
    """Gradients of its slices that other ranks own (reduction dtype)."""
    grads_received: int
    """Gradients of its shard other ranks computed (reduction dtype)."""

    @property
    def total(self) -> int:
        """Every byte it sends or receives."""
        return self.params_received + self.params_sent + self.grads_sent + self.grads_received


def places(strategy: Strategy, gpus_per_node: int) -> list[Place]:
    """Per rank of the job, its (scheme, stage, TP rank) where the planner places ``strategy``."""
    out: dict[int, Place] = {}
    for scheme, ranks in zip(strategy.replicas(), assign_ranks(strategy, gpus_per_node)):
        width = scheme.tp * scheme.cp
        for i, rank in enumerate(ranks):
            out[rank] = (scheme, i // width, i % width)
    return [out[r] for r in range(strategy.gpus)]


def movement_bytes(layout: ComputeLayout, strategy: Strategy, gpus_per_node: int, *, param_bytes: int = 2,
                   reduce_bytes: int = 4) -> tuple[RankMovement, ...]:
    """Per rank of ``strategy`` (placed as the planner places it), the bytes it moves in one step."""
    where = places(strategy, gpus_per_node)
    world = len(where)
    shard = max(1, -(-layout.numel // world))
    counts: dict[Place, int] = {}
    for place in where:
        counts[place] = counts.get(place, 0) + 1
    out = []
    for rank, place in enumerate(where):
        lo, hi = rank * shard, (rank + 1) * shard
        mine = layout.needs(place)
        local = mine.inside(lo, hi)
        served = sum(n * layout.needs(p).inside(lo, hi) for p, n in counts.items()) - local
        received = mine.total - local
        out.append(RankMovement(params_received=received * param_bytes, params_sent=served * param_bytes,
                                grads_sent=received * reduce_bytes, grads_received=served * reduce_bytes))
    return tuple(out)
