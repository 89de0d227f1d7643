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

__all__ = ["ComputeLayout", "RankMovement", "movement_bytes", "merged", "places", "llama_compute_layout"]

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


@dataclass(frozen=True, slots=True, kw_only=True)
class _Param:
    numel: int
    rows: int
    """Size of the split dim (stored outermost): output features of a column-parallel weight, input features of
    a row-parallel one; 0 when the parameter is never split."""
    kind: str
    """``column``, ``row``, ``kv`` (a column-parallel key/value weight) or ``whole``."""
    stage: str
    """``first``, ``last`` or ``layer``."""
    layer: int = -1


def _llama_params(layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int) -> list[_Param]:
    """The parameters of an ``hcompile.models.Llama`` in its order (bias-free; separate q, k, v projections)."""
    kv = hidden // heads * kv_heads
    out = [_Param(numel=vocab * hidden, rows=0, kind="whole", stage="first")]
    for i in range(layers):
        out += [_Param(numel=hidden, rows=0, kind="whole", stage="layer", layer=i),
                _Param(numel=hidden * hidden, rows=hidden, kind="column", stage="layer", layer=i),
                _Param(numel=kv * hidden, rows=kv, kind="kv", stage="layer", layer=i),
                _Param(numel=kv * hidden, rows=kv, kind="kv", stage="layer", layer=i),
                _Param(numel=hidden * hidden, rows=hidden, kind="row", stage="layer", layer=i),
                _Param(numel=hidden, rows=0, kind="whole", stage="layer", layer=i),
                _Param(numel=ffn * hidden, rows=ffn, kind="column", stage="layer", layer=i),
                _Param(numel=ffn * hidden, rows=ffn, kind="column", stage="layer", layer=i),
                _Param(numel=hidden * ffn, rows=ffn, kind="row", stage="layer", layer=i)]
    return out + [_Param(numel=hidden, rows=0, kind="whole", stage="last"),
                  _Param(numel=vocab * hidden, rows=0, kind="whole", stage="last")]


def _block(param: _Param, tp: int, tp_rank: int, heads: int, kv_heads: int) -> tuple[int, int]:
    """The part [start, stop) of the split dim TP rank ``tp_rank`` holds (the whole parameter when not split)."""
    if param.kind == "whole" or tp == 1:
        return 0, param.rows or param.numel
    if param.kind == "kv" and tp > kv_heads:  # fewer kv heads than ranks: each rank holds its q heads' kv head
        head = tp_rank * (heads // tp) // (heads // kv_heads)
        size = param.rows // kv_heads
        return head * size, (head + 1) * size
    size = param.rows // tp
    return tp_rank * size, (tp_rank + 1) * size


def llama_compute_layout(*, layers: int, hidden: int, ffn_hidden: int, heads: int, kv_heads: int, vocab: int,
                         schemes: list[ParallelScheme]) -> ComputeLayout:
    """The compute layout of a LLaMA (``hcompile.models.Llama``'s parameters and order, embeddings and head not
    split) for the planner at any scale: q, gate and up projections split by output rows, o and down by input
    features (stored transposed), k and v by rows or, with fewer kv heads than ranks, the rank's kv head whole;
    pipeline stages take ``layers / pp`` consecutive layers each (the earlier stages one more when it does not
    divide), the embedding with the first and the final norm and head with the last. The runtime cuts stages by
    cost, so under pp > 1 this is the even cut, an approximation of it."""
    for name, value in (("layers", layers), ("hidden", hidden), ("ffn_hidden", ffn_hidden), ("heads", heads),
                        ("kv_heads", kv_heads), ("vocab", vocab)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name} must be a positive integer, got {value!r}")
    if hidden % heads or heads % kv_heads:
        raise PlanError(f"hidden {hidden} must be a multiple of heads {heads}, and heads of kv_heads {kv_heads}")
    params = _llama_params(layers, hidden, ffn_hidden, heads, kv_heads, vocab)
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel
    ranges: dict[Place, Ranges] = {}
    for scheme in schemes:
        if heads % scheme.tp or (kv_heads % scheme.tp and scheme.tp % kv_heads) or scheme.pp > layers:
            raise PlanError(f"{scheme.describe()} does not fit a LLaMA of {heads} heads, {kv_heads} kv heads and "
                            f"{layers} layers")
        bounds = [sum(layers // scheme.pp + (i < layers % scheme.pp) for i in range(s)) for s in range(scheme.pp + 1)]
        for stage in range(scheme.pp):
            for tp_rank in range(scheme.tp):
                own = []
                for p, offset in zip(params, offsets):
                    held = ((p.stage == "first" and stage == 0) or (p.stage == "last" and stage == scheme.pp - 1)
                            or (p.stage == "layer" and bounds[stage] <= p.layer < bounds[stage + 1]))
                    if held:
                        a, b = _block(p, scheme.tp, tp_rank, heads, kv_heads)
                        inner = p.numel // (p.rows or p.numel)
                        own.append((offset + a * inner, offset + b * inner))
                ranges[(scheme, stage, tp_rank)] = merged(own)
    return ComputeLayout(numel=total, ranges=ranges)
