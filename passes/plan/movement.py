"""Parameter and gradient movement per step, counted by the planner without torch.

Every step each rank pulls the parameter slices it computes with from the ranks whose shards of the fixed
ZeRO-1 layout hold them, and pushes their gradients back (``runtime.redistribute``). Owns
:class:`ComputeLayout` (the flat vector's size, its regions, and, per (scheme, stage, TP rank), the sorted flat
ranges that place computes with: what ``runtime.stage_params`` holds) and :func:`movement_bytes`, which places
a strategy as the planner does (``placement.assign_ranks``) and intersects every rank's ranges with the
owners' ranges (an equal contiguous share of each region, ``runtime.fixed_layout.FixedLayout.owned``), as the
runtime does: per rank the bytes it receives and sends, parameters in the compute dtype and gradients in the
reduction dtype, messages to itself not counted.

Also owns the time of that movement: :func:`pair_elements` (what each owner sends each rank) and
:func:`movement_time`, which replays the runtime's rounds (round d: every rank sends to rank + d and receives
from rank - d, a message starting once both ends have reached the round, in chunks of ``chunk_numel``) over
the links of :class:`passes.plan.links.Links` (same node or not), and :class:`MovementCost`, what the
planner charges a strategy, cached per strategy, with a floor no strategy can beat. Two runtimes are modelled
(``MOVEMENT_MODES``):

- ``plain`` (``runtime.redistribute``): the pull before the compute and the push after it, both exposed;
- ``overlapped`` (``runtime.overlap``, ``TrainOptions(overlap_movement=True)``): the layout in ``windows`` windows,
  as many as the runtime cuts it into (:func:`window_cuts`, the one rule of both: 8, or one per large parameter at
  scale, 423 for a 32B LLaMA); a rank first does the memory work its set-up needs (on a CPU host: its zeroed gradient
  buffers and its own slices, exposed), then its pull travels while its stage waits for the pipeline to fill and
  computes the first micro-batch's forward window by window, its push while the last micro-batch's backward
  finishes the windows in reverse (:func:`overlapped_exposure`: per rank, the stall of the forward and the tail of
  the push after the rank's last backward, each window's transfer taking an equal share of the rank's pull or push
  as the rounds' replay times them); a replica's step is its compute, stretched by ``slowdown`` while its
  transfers run, plus its ranks' largest stall and tail (a replica that ends early hides its push behind the
  others).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np

from passes.plan.host_sharing import host_shared_ms
from passes.plan.ir import CostModel, ParallelScheme, PlanError, Strategy
from passes.plan.links import Links
from passes.plan.placement import assign_ranks

__all__ = ["region_shares", "owned_ranges", "compute_scheme", "ComputeLayout", "RankMovement", "movement_bytes",
           "merged", "places", "shared_transfer_ms", "llama_compute_layout", "pair_elements", "MovementTime",
           "movement_time", "MovementCost", "DEFAULT_CHUNK_NUMEL", "MOVEMENT_MODES", "OVERLAP_WINDOWS",
           "FORWARD_SHARE", "overlapped_exposure", "MAX_WINDOW_NUMEL", "window_cuts",
           "full_micro_batch_ms"]

DEFAULT_CHUNK_NUMEL = 1 << 24
"""Elements of the runtime's largest single message (``runtime.redistribute.DEFAULT_CHUNK_NUMEL``)."""

MOVEMENT_MODES = ("plain", "overlapped")
"""The runtimes :class:`MovementCost` models (module docstring)."""
OVERLAP_WINDOWS = 8
"""Windows the overlapped runtime cuts the layout into at least (``runtime.overlap.DEFAULT_WINDOWS``): more where
they would exceed ``MAX_WINDOW_NUMEL`` (:func:`window_cuts`)."""
MAX_WINDOW_NUMEL = 1 << 25
"""Elements of the overlapped runtime's largest window (one parameter larger than this is a window of its own)."""
FORWARD_SHARE = 1 / 3
"""The forward's share of a micro-batch's forward and backward time (the backward computes twice the FLOPs)."""

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


def region_shares(regions: Ranges, world: int) -> list[int]:
    """Per region [lo, hi): the elements of every rank's share of it among ``world``, ``ceil((hi - lo) / world)``
    (the last ranks' shares are short or empty)."""
    return [-(-(hi - lo) // world) for lo, hi in regions]


def owned_ranges(regions: Ranges, owner: int, world: int) -> list[tuple[int, int, int]]:
    """(flat lo, flat hi, position in the owner's shard) of each flat range rank ``owner`` of ``world`` holds:
    its equal contiguous share of each region, in flat order; its shard is the shares one after the other,
    each padded to the region's share. The one ownership rule of the runtime's fixed layout
    (``runtime.fixed_layout.FixedLayout.owned``) and of the planner's count."""
    out, pos = [], 0
    for (lo, hi), share in zip(regions, region_shares(regions, world)):
        a, b = min(hi, lo + owner * share), min(hi, lo + (owner + 1) * share)
        if b > a:
            out.append((a, b, pos))
        pos += share
    return out


def window_cuts(extents: Iterable[tuple[int, int]], numel: int, region_starts: Iterable[int] = (),
                count: int = OVERLAP_WINDOWS, max_numel: int | None = None) -> list[tuple[int, int]]:
    """The overlapped runtime's windows of a flat vector of ``numel`` elements, [lo, hi) each: cut at parameter
    starts (``extents``: (offset, elements) of every parameter, in flat order) into about ``numel / count``
    elements each, at most ``max_numel`` (None: ``MAX_WINDOW_NUMEL``) where the parameters allow (a parameter
    larger than that is a window of its own: so a large model gets more than ``count``), and at every start of
    a region (``region_starts``) besides. The one rule of ``runtime.overlap.layout_windows`` and of the
    planner's window count (:attr:`ComputeLayout.windows`)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise PlanError(f"the number of movement windows must be a positive integer, got {count!r}")
    max_numel = MAX_WINDOW_NUMEL if max_numel is None else max_numel
    count = max(count, -(-numel // max_numel))
    target = numel / count
    starts = set(region_starts)
    cuts, sized = [0], 1
    for offset, size in extents:
        if offset <= cuts[-1]:
            continue
        if offset in starts:
            cuts.append(offset)
        elif (offset - cuts[-1] >= target and sized < count) or offset + size - cuts[-1] > max_numel:
            cuts.append(offset)  # the window is due, or would grow past the bound
            sized += 1
    return [(lo, hi) for lo, hi in zip(cuts, [*cuts[1:], numel]) if hi > lo]


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
    """Elements of the flat parameter vector."""
    ranges: Mapping[Place, Ranges]
    """Per (scheme, stage, TP rank): the sorted, disjoint flat ranges of the parameter slices it computes with."""
    regions: Ranges = ()
    """The flat ranges every rank owns an equal contiguous share of (the runtime's: the parameters TP never
    splits, then the others); empty: one region, the whole vector."""
    windows: int = OVERLAP_WINDOWS
    """The windows the overlapped runtime cuts this layout into (:func:`window_cuts` of its parameters; a
    layout built without them: ``OVERLAP_WINDOWS``)."""
    pushes: Mapping[Place, Ranges] = field(default_factory=dict)
    """Per place whose gradient push is not all of its ranges: the ranges it pushes (the runtime's
    ``StageParams.push_ranges``: a TP rank other than 0 pushes no replicated parameter); the others push
    their ``ranges``."""
    _prefix: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.numel, bool) or not isinstance(self.numel, int) or self.numel < 1:
            raise PlanError(f"numel must be a positive integer, got {self.numel!r}")
        regions = tuple(self.regions) or ((0, self.numel),)
        if regions[0][0] != 0 or regions[-1][1] != self.numel or any(
                a[1] != b[0] for a, b in zip(regions, regions[1:])) or any(hi <= lo for lo, hi in regions):
            raise PlanError(f"regions must cut [0, {self.numel}) into consecutive non-empty ranges, got {regions}")
        if isinstance(self.windows, bool) or not isinstance(self.windows, int) or self.windows < 1:
            raise PlanError(f"windows must be a positive integer, got {self.windows!r}")
        object.__setattr__(self, "regions", regions)
        for place, ranges in self.ranges.items():
            if merged(ranges) != tuple(ranges) or (ranges and (ranges[0][0] < 0 or ranges[-1][1] > self.numel)):
                raise PlanError(f"the ranges of {_describe(place)} must be sorted, disjoint, joined and inside "
                                f"[0, {self.numel}), got {ranges[:3]}...")

    def owner_ranges(self, owner: int, world: int) -> Ranges:
        """The flat ranges rank ``owner`` of ``world`` holds: its share of each region, in flat order."""
        return tuple((a, b) for a, b, _ in owned_ranges(self.regions, owner, world))

    def shard_numel(self, world: int) -> int:
        """Elements of every rank's shard among ``world``: its shares, each padded to the region's."""
        return sum(region_shares(self.regions, world))

    def needs(self, place: Place) -> _Prefix:
        """The ranges of ``place``, ready for counting (a place the layout lacks is a PlanError)."""
        if place not in self._prefix:
            if place not in self.ranges:
                raise PlanError(f"the compute layout has no ranges for {_describe(place)}")
            self._prefix[place] = _Prefix.of(self.ranges[place])
        return self._prefix[place]

    def pushed(self, place: Place) -> _Prefix:
        """The ranges whose gradients ``place`` pushes (:attr:`pushes`, else its ranges), ready for counting."""
        if place not in self.pushes:
            return self.needs(place)
        key = ("pushes", place)
        if key not in self._prefix:
            self._prefix[key] = _Prefix.of(self.pushes[place])
        return self._prefix[key]


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


def compute_scheme(scheme: ParallelScheme) -> ParallelScheme:
    """The scheme whose parameter slices ``scheme``'s ranks compute with: a CP rank holds the same TP slice
    of its stage as the replica without CP, so ``(tp, pp, cp)`` computes as ``(tp, pp)``; recomputation changes
    nothing of it either."""
    return scheme if scheme.cp == 1 and not scheme.rc else ParallelScheme(tp=scheme.tp, pp=scheme.pp)


def places(strategy: Strategy, gpus_per_node: int) -> list[Place]:
    """Per rank of the job, its (scheme, stage, TP rank) where the planner places ``strategy``; a CP replica's
    stage group is ``cp`` TP groups one after another (rank ``i`` of the group: TP rank ``i % tp``), each
    placed as its scheme without CP (:func:`compute_scheme`)."""
    out: dict[int, Place] = {}
    for scheme, ranks in zip(strategy.replicas(), assign_ranks(strategy, gpus_per_node)):
        width = scheme.tp * scheme.cp
        base = compute_scheme(scheme)
        for i, rank in enumerate(ranks):
            out[rank] = (base, i // width, (i % width) % scheme.tp)
    return [out[r] for r in range(strategy.gpus)]


def movement_bytes(layout: ComputeLayout, strategy: Strategy, gpus_per_node: int, *, param_bytes: int = 2,
                   reduce_bytes: int = 4) -> tuple[RankMovement, ...]:
    """Per rank of ``strategy`` (placed as the planner places it), the bytes it moves in one step."""
    where = places(strategy, gpus_per_node)
    world = len(where)
    counts: dict[Place, int] = {}
    for place in where:
        counts[place] = counts.get(place, 0) + 1
    out = []
    for rank, place in enumerate(where):
        owned = layout.owner_ranges(rank, world)
        mine = layout.needs(place)
        local = sum(mine.inside(lo, hi) for lo, hi in owned)
        served = sum(n * layout.needs(p).inside(lo, hi) for p, n in counts.items() for lo, hi in owned) - local
        received = mine.total - local
        push = layout.pushed(place)
        push_local = sum(push.inside(lo, hi) for lo, hi in owned)
        pushed_in = sum(n * layout.pushed(p).inside(lo, hi) for p, n in counts.items() for lo, hi in owned) - push_local
        out.append(RankMovement(params_received=received * param_bytes, params_sent=served * param_bytes,
                                grads_sent=(push.total - push_local) * reduce_bytes,
                                grads_received=pushed_in * reduce_bytes))
    return tuple(out)


def _per_owner(layout: ComputeLayout, place: Place, world: int) -> np.ndarray:
    """Per owner k of ``world``: elements of its ranges that ``place`` computes with."""
    return _owner_parts(layout, place, world)[0].sum(axis=1)


def _owner_parts(layout: ComputeLayout, place: Place, world: int) -> tuple[np.ndarray, np.ndarray]:
    """Per owner k of ``world`` and region g: the elements of k's share of g that ``place`` computes with, and
    in how many separate ranges of the shard they lie (more than one: the runtime gathers the message)."""
    prefix = layout.needs(place)
    starts, ends = np.asarray(prefix.starts, dtype=np.int64), np.asarray(prefix.ends, dtype=np.int64)
    elements, ranges = [], []
    for (lo, hi), share in zip(layout.regions, region_shares(layout.regions, world)):
        cuts = np.minimum(hi, lo + share * np.arange(world + 1))  # owner k's share: [cuts[k], cuts[k + 1])
        upto = np.array([prefix.upto(int(c)) for c in cuts], dtype=np.int64)
        elements.append(upto[1:] - upto[:-1])
        ranges.append(np.searchsorted(starts, cuts[1:], side="left") - np.searchsorted(ends, cuts[:-1], side="right"))
    return np.stack(elements, axis=1), np.stack(ranges, axis=1)


def pair_elements(layout: ComputeLayout, strategy: Strategy, gpus_per_node: int,
                  columns: dict[tuple[Place, int], np.ndarray] | None = None) -> np.ndarray:
    """``E[k, r]``: elements of owner k's shard that rank r computes with, for ``strategy`` placed as the
    planner places it (the diagonal is what a rank holds itself). ``columns`` caches each place's per-owner
    counts across strategies."""
    where = places(strategy, gpus_per_node)
    columns = {} if columns is None else columns
    for place in dict.fromkeys(where):
        if (place, len(where)) not in columns:
            columns[(place, len(where))] = _per_owner(layout, place, len(where))
    return np.stack([columns[(p, len(where))] for p in where], axis=1)


@dataclass(frozen=True, slots=True, kw_only=True)
class MovementTime:
    """The wall time of one step's movement phases, as the runtime runs them."""

    pull_ms: float
    """Parameters from the owners, until the last rank has its slices."""
    push_ms: float
    """Gradients to the owners, from a common start until the last rank is done."""
    pull_ranks: tuple[float, ...] = ()
    """Per rank (placement order), when it has its slices."""
    push_ranks: tuple[float, ...] = ()
    """Per rank, when its gradients are sent and its shard's received."""
    pull_ahead_ranks: tuple[float, ...] = ()
    """Per rank, the part of its pull (``pull_ranks``) the overlapped runtime does before its compute and its
    transfers start: memory work (:func:`_ahead_ms`; empty: none counted)."""
    push_ahead_ranks: tuple[float, ...] = ()
    """Per rank, the part of its push (``push_ranks``) the overlapped runtime does then too."""

    @property
    def total_ms(self) -> float:
        return self.pull_ms + self.push_ms


def overlapped_exposure(pull_ms: np.ndarray, push_ms: np.ndarray, stage: np.ndarray, first_ms: np.ndarray,
                        last_ms: np.ndarray, windows: int,
                        ahead_ms: np.ndarray | float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, the overlapped runtime's (stall, tail) in ms: how much later its forward ends than with its
    parameters in place, and how long its push runs after its last backward, less what the stages after it
    leave it (a later stage ends its last backward ``stage`` backward slots before the first stage).

    The rank first spends ``ahead_ms`` on work before its compute and its transfers (memory:
    :attr:`MovementTime.pull_ahead_ranks` and ``push_ahead_ranks``, not in ``pull_ms`` or ``push_ms``); then its
    pull (``pull_ms``) arrives in ``windows`` equal shares, window g at ahead + (g + 1) pull / W; its stage
    (``stage``) starts the first forward after ``stage`` forward slots of the pipeline filling and computes
    window g after window g - 1 for first_fwd / W, where first_fwd is ``FORWARD_SHARE`` of ``first_ms`` (the
    first micro-batch's time on one stage). Its push (``push_ms``) leaves window by window, each share once
    the last backward (last_bwd = the rest of ``last_ms``) has finished it, in reverse order, one after
    another. Both are linear in g, so their worst window is the first or the last:
    stall = max(0, ahead + pull / W - s fwd, ahead + pull - s fwd - (W - 1) fwd / W);
    tail = max(0, max(push / W, push - (W - 1) bwd / W) - s bwd)."""
    w = float(windows)
    fwd, bwd = FORWARD_SHARE * first_ms, (1 - FORWARD_SHARE) * last_ms
    waited = stage * fwd - ahead_ms
    stall = np.maximum(0.0, np.maximum(pull_ms / w - waited, pull_ms - waited - (w - 1) * fwd / w))
    tail = np.maximum(0.0, np.maximum(push_ms / w, push_ms - (w - 1) * bwd / w) - stage * bwd)
    return stall, tail


def _rounds_ms(sends: np.ndarray, node: np.ndarray, links: Links, elem_bytes: int, chunk_numel: int) -> float:
    """When the last rank finishes the rounds (see :func:`_rounds_ready`)."""
    return float(_rounds_ready(sends, node, links, elem_bytes, chunk_numel).max())


def _rounds_ready(sends: np.ndarray, node: np.ndarray, links: Links, elem_bytes: int,
                  chunk_numel: int) -> np.ndarray:
    """The runtime's rounds of pairs with ``sends[a, b]`` elements from a to b: round d pairs r -> r + d, a
    message starts when both ends have finished round d - 1 (an empty one is not sent) and takes a latency
    per chunk plus its bytes over its link; a rank finishes a round with its send and its receive. Per rank,
    when it finishes the last round (ms). The runtime sends a pair's two regions as messages of their own: up
    to one latency more per pair and round than counted here.

    Round by round on vectors of the ranks, each held twice over so that "rank r + d" and "rank r - d" are
    views; the messages' costs a block of rounds at a time, each round's read from ``sends`` as two strided
    slices: no array of ranks squared is made (at 1024 ranks those temporaries cost more than the rounds)."""
    world = sends.shape[0]
    if world < 2:
        return np.zeros(world)
    flat = np.ascontiguousarray(sends, dtype=np.float64).ravel()  # sends[r, r + d] is flat[r (world + 1) + d]
    node = np.asarray(node)
    node2 = np.concatenate([node, node])
    per_element = (elem_bytes / (links.intra_gbps * 1e6), elem_bytes / (links.inter_gbps * 1e6))
    ready2, end2 = np.zeros(2 * world), np.empty(2 * world)
    ready, end = ready2[:world], end2[:world]
    both = np.empty(world)
    block = min(world - 1, _ROUNDS_PER_BLOCK)
    n = np.empty((block, world))
    for first in range(1, world, block):
        rounds = range(first, min(world, first + block))
        k = len(rounds)
        for j, d in enumerate(rounds):
            n[j, :world - d] = flat[d:(world - d) * (world + 1):world + 1]  # r + d < world
            n[j, world - d:] = flat[(world - d) * (world + 1) + d - world::world + 1]  # r + d wraps around
        same = np.lib.stride_tricks.as_strided(node2[first:], shape=(k, world),
                                               strides=(node2.strides[0],) * 2) == node  # r and r + d on a node
        if links.host_gbps is None:
            transfer = n[:k] * np.where(same, *per_element)
        else:
            gbps = np.where(same, links.intra_gbps, links.inter_gbps)
            transfer = np.stack([shared_transfer_ms(n[j] * elem_bytes, gbps[j], links.host_gbps) for j in range(k)])
        cost = links.latency_us * 1e-3 * np.ceil(n[:k] / chunk_numel) + transfer
        cost[n[:k] == 0] = -np.inf  # no message: the round waits for nothing on that side
        for j, d in enumerate(rounds):
            np.maximum(ready, ready2[d:d + world], out=end)  # a message starts when its two ends are ready
            end += cost[j]
            end2[world:] = end
            np.maximum(end, end2[world - d:2 * world - d], out=both)  # its send, and its receive from r - d
            np.maximum(ready, both, out=ready)
            ready2[world:] = ready
    return ready.copy()


_ROUNDS_PER_BLOCK = 64
"""Rounds whose messages :func:`_rounds_ready` costs at once (a block of 64 x 1024 ranks is half a MB)."""


def shared_transfer_ms(nbytes: np.ndarray, gbps: np.ndarray, host_gbps: float) -> np.ndarray:
    """Milliseconds each of a round's transfers takes (``nbytes`` each, 0: none) when they start together and
    share ``host_gbps``: while k of them run, each moves at ``min(its link's gbps, host_gbps / k)``."""
    left = np.asarray(nbytes, dtype=np.float64).copy()
    done = np.zeros_like(left)
    active = left > 0
    now = 0.0
    while active.any():
        rate = np.minimum(gbps[active], host_gbps / active.sum()) * 1e6  # bytes per ms
        step = float((left[active] / rate).min())
        now += step
        left[active] -= rate * step
        finished = active.copy()
        finished[active] = left[active] <= 1e-9 * np.maximum(1.0, nbytes[active])
        done[finished] = now
        active &= ~finished
    return done


SHARD_BYTES = 4
"""Bytes of one element of the owners' shards (fp32 master weights and their gradients)."""


def _owner_elements(layout: ComputeLayout, strategy: Strategy, gpus_per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """Per (owner k, rank r, region g) of ``strategy`` placed on nodes of ``gpus_per_node``: the elements of
    owner k's shard rank r computes with in region g, and the ranges they lie in."""
    where = places(strategy, gpus_per_node)
    parts = {p: _owner_parts(layout, p, len(where)) for p in dict.fromkeys(where)}
    return (np.stack([parts[p][0] for p in where], axis=1), np.stack([parts[p][1] for p in where], axis=1))


def _buffer_ms(layout: ComputeLayout, owners: tuple[np.ndarray, np.ndarray], links: Links, param_bytes: int,
               reduce_bytes: int, chunk_numel: int) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, the ms its pull and its push spend on memory besides the transfers, as the runtime spends it
    (``runtime.redistribute`` and the executor): new buffers written at ``links.fresh_gbps`` and freed at
    ``links.freed_gbps``, copies and sums between written ones at ``links.warm_gbps``. Pull: the compute copy
    and its zeroed gradient buffer, one staging buffer (written and freed) for the messages it gathers from
    several ranges of its shard or casts (the largest of them) and the gathering itself. Push: the zeroed
    fp32 shard gradient, one receive buffer (its largest message) and, where the gradients' dtype is not the
    reduction's, one cast buffer and the cast itself, both freed with the gradient buffer at the end; and the
    sums into the shard gradient of its own and every received gradient (``owners``: :func:`_owner_elements`)."""
    elements, ranges = owners
    elements = elements.copy()  # [owner k, rank r, region g]
    world = elements.shape[1]
    gathered = ranges > 1
    local = elements[np.arange(world), np.arange(world)].sum(axis=1)
    elements[np.arange(world), np.arange(world)] = 0
    needs = elements.sum(axis=(0, 2)) + local
    served = elements.sum(axis=(1, 2))
    message = np.minimum(elements, chunk_numel)
    if param_bytes != SHARD_BYTES:
        gathered = elements > 0  # every message is cast
    staged = np.where(gathered, message, 0).max(axis=(1, 2), initial=0)
    gathers = np.where(gathered, elements, 0).sum(axis=(1, 2))
    pull = (links.fresh_ms(1) * (2 * needs + staged) + links.freed_ms(1) * staged
            + links.warm_ms(1) * gathers) * param_bytes
    inbox = message.max(axis=(1, 2), initial=0) * reduce_bytes
    push = (links.fresh_ms(1) * (SHARD_BYTES * layout.shard_numel(world) + inbox)
            + links.freed_ms(1) * (needs * param_bytes + inbox) + links.warm_ms(1) * (local + served) * SHARD_BYTES)
    if param_bytes != reduce_bytes:
        cast = message.max(axis=(0, 2), initial=0) * reduce_bytes
        push += (links.fresh_ms(1) + links.freed_ms(1)) * cast + links.warm_ms(1) * (needs - local) * reduce_bytes
    return pull, push


def _ahead_ms(layout: ComputeLayout, elements: np.ndarray, links: Links,
              param_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, the ms of the memory work the overlapped runtime does before its compute and its transfers
    start (the executor's pull phase: ``StageParams.zero_grads`` and ``runtime.overlap.MovementInFlight``'s
    set-up), of what :func:`_buffer_ms` counts: of the pull, the zeroed gradient buffer and its own slices
    copied into the compute copy; of the push, the zeroed fp32 shard gradient. The rest of both travels beside
    the compute (the other slices land in the compute copy as their windows arrive). ``elements``: per (owner,
    rank, region), as :func:`_owner_elements` counts them."""
    world = elements.shape[1]
    local = elements[np.arange(world), np.arange(world)].sum(axis=1)
    needs = elements.sum(axis=(0, 2))
    pull = links.fresh_ms(1) * (needs + local) * param_bytes
    push = np.full(world, links.fresh_ms(1) * SHARD_BYTES * layout.shard_numel(world))
    return pull, push


def movement_time(layout: ComputeLayout, strategy: Strategy, links: Links, *, param_bytes: int = 2,
                  reduce_bytes: int = 4, chunk_numel: int = DEFAULT_CHUNK_NUMEL,
                  columns: dict[tuple[Place, int], np.ndarray] | None = None) -> MovementTime:
    """The pull and push of ``strategy`` on ``links`` (ranks ``n * gpus_per_node ..`` on node n). With
    ``links.host_gbps`` a round's transfers share it (:func:`shared_transfer_ms`). With ``links.fresh_gbps``
    or ``links.warm_gbps``, each rank also spends the time its phases' own memory work takes
    (:func:`_buffer_ms`)."""
    if chunk_numel < 1:
        raise PlanError(f"chunk_numel must be positive, got {chunk_numel!r}")
    elements = pair_elements(layout, strategy, links.gpus_per_node, columns)
    np.fill_diagonal(elements, 0)
    node = np.arange(elements.shape[0]) // links.gpus_per_node
    pull = _rounds_ready(elements, node, links, param_bytes, chunk_numel)
    push = _rounds_ready(elements.T, node, links, reduce_bytes, chunk_numel)
    pull_ahead = push_ahead = np.zeros(len(node))
    if links.fresh_gbps is not None or links.warm_gbps is not None:
        owners = _owner_elements(layout, strategy, links.gpus_per_node)
        pull_memory, push_memory = _buffer_ms(layout, owners, links, param_bytes, reduce_bytes, chunk_numel)
        pull, push = pull + pull_memory, push + push_memory
        pull_ahead, push_ahead = _ahead_ms(layout, owners[0], links, param_bytes)
    return MovementTime(pull_ms=float(pull.max(initial=0.0)), push_ms=float(push.max(initial=0.0)),
                        pull_ranks=tuple(float(x) for x in pull), push_ranks=tuple(float(x) for x in push),
                        pull_ahead_ranks=tuple(float(x) for x in pull_ahead),
                        push_ahead_ranks=tuple(float(x) for x in push_ahead))


def _beside_and_ahead(t: MovementTime) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per rank, of ``t``: the pull and the push the overlapped runtime runs beside the compute, and the work it
    does before both (zeros where none is counted)."""
    pull, push = np.asarray(t.pull_ranks, dtype=np.float64), np.asarray(t.push_ranks, dtype=np.float64)
    pull_ahead = np.asarray(t.pull_ahead_ranks or np.zeros(len(pull)), dtype=np.float64)
    push_ahead = np.asarray(t.push_ahead_ranks or np.zeros(len(push)), dtype=np.float64)
    return pull - pull_ahead, push - push_ahead, pull_ahead + push_ahead


class MovementCost:
    """What the planner charges a strategy for its movement, under the ``plain`` or the ``overlapped`` runtime
    (module docstring), cached per strategy. :meth:`exposed_ms` replays the rounds (O(ranks^2), cached);
    :meth:`quick_ms` is a bound under it in O(ranks x places); :meth:`ranking_ms`, what a planner ranks many
    candidates by, is the first up to ``exact_up_to`` ranks and the same estimate on the second's per-rank phases
    above; :meth:`pool_ms` what the strategy pool scores mixes by. Overlapped, a plan's charge depends on its
    micro-batches (:meth:`step_ms`); the estimates count on each scheme's longest micro-batch to cover what it
    can (``edge_ms``)."""

    def __init__(self, layout: ComputeLayout, links: Links, *, param_bytes: int = 2, reduce_bytes: int = 4,
                 chunk_numel: int = DEFAULT_CHUNK_NUMEL, exact_up_to: int = 256, mode: str = "plain",
                 windows: int | None = None, slowdown: float = 0.0,
                 edge_ms: Mapping[ParallelScheme, float] | None = None):
        """``mode``: ``plain`` or ``overlapped``; ``windows``: the overlapped runtime's windows (None: the
        layout's, :attr:`ComputeLayout.windows`); ``slowdown``: how much slower compute runs while transfers run
        beside it (0.05: 5%), a property of the hardware; ``edge_ms``: per scheme, the longest micro-batch its
        replicas run on one stage (:func:`full_micro_batch_ms`), what :meth:`exposed_ms` counts on to cover the
        first pull and the last push (None: nothing covers more than a window)."""
        if mode not in MOVEMENT_MODES:
            raise PlanError(f"movement mode must be one of {MOVEMENT_MODES}, got {mode!r}")
        windows = layout.windows if windows is None else windows
        if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
            raise PlanError(f"windows must be a positive integer, got {windows!r}")
        if not (isinstance(slowdown, (int, float)) and 0 <= slowdown < float("inf")):
            raise PlanError(f"slowdown must be a finite number >= 0, got {slowdown!r}")
        self.layout, self.links, self.exact_up_to = layout, links, exact_up_to
        self.param_bytes, self.reduce_bytes, self.chunk_numel = param_bytes, reduce_bytes, chunk_numel
        self.mode, self.windows, self.slowdown = mode, windows, float(slowdown)
        self.edge_ms = None if edge_ms is None else dict(edge_ms)
        self._times: dict[Strategy, MovementTime] = {}
        self._quick: dict[Strategy, tuple[np.ndarray, np.ndarray]] = {}
        self._per_scheme: dict[tuple[ParallelScheme, int], float] = {}
        self._columns: dict[tuple[Place, int], np.ndarray] = {}
        self._ranks: dict[Strategy, tuple[np.ndarray, list[np.ndarray]]] = {}

    def ranking_ms(self, strategy: Strategy) -> float:
        """:meth:`exposed_ms` on up to ``exact_up_to`` ranks (a few ms at 64); above, the same estimate on the
        per-rank phases of :meth:`quick_ms` instead of the rounds' replay (which costs about 0.1 s per strategy
        at 1024 ranks, and a step ranks hundreds)."""
        if strategy.gpus <= self.exact_up_to:
            return self.exposed_ms(strategy)
        if self.mode == "plain":
            return self._plain_quick_ms(strategy)
        return self._overlapped_estimate(strategy, *self._quick_ranks(strategy))

    def pool_ms(self, strategy: Strategy) -> float:
        """What the strategy pool scores a mix's movement by (it scores thousands: 50K at 1024 GPUs): up to
        ``exact_up_to`` ranks :meth:`exposed_ms`; above, the largest :meth:`ranking_ms` of the homogeneous
        strategies of its schemes, as many replicas as the GPUs take (a rank's movement is mostly set by its own
        scheme's slice), each computed once."""
        if strategy.gpus <= self.exact_up_to:
            return self.exposed_ms(strategy)
        out = 0.0
        for scheme in strategy.schemes:
            key = (scheme, strategy.gpus)
            if key not in self._per_scheme:  # as many replicas of it as the GPUs take
                self._per_scheme[key] = self.ranking_ms(Strategy.of({scheme: strategy.gpus // scheme.gpus}))
            out = max(out, self._per_scheme[key])
        return out

    def quick_ms(self, strategy: Strategy) -> float:
        """A bound under what any plan of ``strategy`` is charged: plain, per phase, the busiest rank's sends or
        receives one after another at their links' speed, a latency per message, no waiting for the other ends;
        overlapped, 0 (a replica that ends early hides its movement)."""
        return 0.0 if self.mode == "overlapped" else self._plain_quick_ms(strategy)

    def _plain_quick_ms(self, strategy: Strategy) -> float:
        pull, push = self._quick_ranks(strategy)
        return float(pull.max(initial=0.0)) + float(push.max(initial=0.0))

    def _quick_ranks(self, strategy: Strategy) -> tuple[np.ndarray, np.ndarray]:
        """Per rank, a bound under its pull and its push: its sends or its receives one after another at their
        links' speed, a latency per message, no waiting for the other ends (cached)."""
        if strategy not in self._quick:
            self._quick[strategy] = self._quick_phases(strategy)
        return self._quick[strategy]

    def _quick_phases(self, strategy: Strategy) -> tuple[np.ndarray, np.ndarray]:
        where = places(strategy, self.links.gpus_per_node)
        world, gpn = len(where), self.links.gpus_per_node
        if world < 2:
            return np.zeros(world), np.zeros(world)
        node = np.arange(world) // gpn
        nodes = int(node[-1]) + 1
        intra, inter = 1 / (self.links.intra_gbps * 1e6), 1 / (self.links.inter_gbps * 1e6)
        recv = np.zeros(world)  # ms per byte, received
        send = np.zeros(world)
        recv_msgs = np.zeros(world)
        send_msgs = np.zeros(world)
        ranks_of: dict[Place, list[int]] = {}
        for rank, place in enumerate(where):
            ranks_of.setdefault(place, []).append(rank)
        for place, ranks in ranks_of.items():
            key = (place, world)
            if key not in self._columns:
                self._columns[key] = _per_owner(self.layout, place, world)
            column = self._columns[key]  # elements of owner k's shard the place needs
            on_node = np.bincount(node, weights=column, minlength=nodes)
            holds = column > 0
            r = np.asarray(ranks)
            recv[r] += (on_node[node[r]] - column[r]) * intra + (column.sum() - on_node[node[r]]) * inter
            recv_msgs[r] += holds.sum() - holds[r]
            here = np.bincount(node[r], minlength=nodes)  # ranks of this place per node
            is_place = np.isin(np.arange(world), r)  # owner k is itself a rank of this place
            same = here[node] - is_place  # other ranks of this place on owner k's node
            send += column * (same * intra + (len(ranks) - here[node]) * inter)
            send_msgs += holds * (len(ranks) - is_place)
        latency = self.links.latency_us * 1e-3
        pull, push = (np.maximum(recv * b + recv_msgs * latency, send * b + send_msgs * latency)
                      for b in (self.param_bytes, self.reduce_bytes))
        return pull, push

    def time(self, strategy: Strategy) -> MovementTime:
        """The movement phases of ``strategy``."""
        if strategy not in self._times:
            self._times[strategy] = movement_time(self.layout, strategy, self.links, param_bytes=self.param_bytes,
                                                  reduce_bytes=self.reduce_bytes, chunk_numel=self.chunk_numel,
                                                  columns=self._columns)
        return self._times[strategy]

    def exposed_ms(self, strategy: Strategy) -> float:
        """Step time the movement of ``strategy`` adds: plain, all of it; overlapped, an estimate of the least a
        plan of it exposes: every rank's stall and tail (:func:`overlapped_exposure`) with the longest micro-batch
        its scheme runs first and last (``edge_ms``; without them nothing covers more than the first window's
        pull and the last window's push), the worst rank's, plus ``slowdown`` times the transfers of the replica
        that moves least (what its compute pays beside them): what the pool and the ranking score it by (a plan
        is charged :meth:`step_ms`). Not a bound: a replica that ends early hides its own."""
        t = self.time(strategy)
        if self.mode == "plain":
            return t.total_ms
        return self._overlapped_estimate(strategy, *_beside_and_ahead(t))

    def _overlapped_estimate(self, strategy: Strategy, pull: np.ndarray, push: np.ndarray,
                             ahead: np.ndarray | float = 0.0) -> float:
        """:meth:`exposed_ms` under the overlapped runtime, from each rank's pull and push beside the compute and
        its work before them (``ahead``)."""
        if strategy.gpus < 2:
            return 0.0
        both = pull + push
        stage, members = self._rank_places(strategy)
        if self.edge_ms is None:
            exposed = float((both / self.windows + ahead).max(initial=0.0))
        else:  # each rank's first forward and last backward those of the longest micro-batch its scheme runs
            edge = np.zeros(len(both))
            for ranks, scheme in zip(members, strategy.replicas()):
                edge[ranks] = self.edge_ms.get(scheme, 0.0)
            stall, tail = overlapped_exposure(pull, push, stage, edge, edge, self.windows, ahead)
            exposed = float((stall + tail).max(initial=0.0))
        if not self.slowdown:
            return exposed
        # and the slowdown every replica's compute pays beside its transfers, at least that of the one moving least
        # (a replica computes at least as long as its transfers run at the scales planned)
        least = min((float(both[r].max(initial=0.0)) for r in members), default=0.0)
        return exposed + self.slowdown * least

    def step_ms(self, strategy: Strategy, replica_ms: list[float], edges: list[tuple[float, float]]) -> float:
        """The step of a plan of ``strategy`` with movement: plain, its slowest replica (``replica_ms``, in
        ``strategy.replicas()`` order) plus :meth:`exposed_ms`; overlapped, per replica its compute, stretched by
        ``slowdown`` while its transfers run beside it (not while a stage waits in the pipeline's fill or
        drain), plus its ranks' largest stall and tail
        (:func:`overlapped_exposure`, with ``edges``: per replica the time of its first and last micro-batch on
        one stage), the slowest of them. Where a node's ranks share its cores (``Links.compute_slots``), the
        replicas of the node slow each other (:func:`passes.plan.host_sharing.host_shared_ms`, ``replica_ms``
        being each replica's compute as it runs beside the others): a replica whose movement keeps its ranks
        busy longer holds the cores the others had once it ended."""
        if self.mode == "plain" or strategy.gpus < 2:
            return max(replica_ms, default=0.0) + self.exposed_ms(strategy)
        stage, members = self._rank_places(strategy)
        pull, push, ahead = _beside_and_ahead(self.time(strategy))
        first, last = np.zeros(len(pull)), np.zeros(len(pull))
        for ranks, (f, b) in zip(members, edges):
            first[ranks], last[ranks] = f, b
        stall, tail = overlapped_exposure(pull, push, stage, first, last, self.windows, ahead)
        # transfers slow the compute only where they overlap it: not while a later stage waits for the pipeline
        # to fill (its pull, from when its work ahead is done) or an earlier one finishes the last backwards
        beside = (np.maximum(0.0, pull - np.maximum(0.0, stage * FORWARD_SHARE * first - ahead))
                  + np.maximum(0.0, push - stage * (1 - FORWARD_SHARE) * last))
        ends = []
        for ranks, ms in zip(members, replica_ms):
            busy = float(beside[ranks].max(initial=0.0))
            ends.append(ms + self.slowdown * min(ms, busy) + float(stall[ranks].max(initial=0.0))
                        + float(tail[ranks].max(initial=0.0)))
        slots = self.links.compute_slots
        if slots is not None and len(members) > 1:  # replicas sharing a node's cores slow each other
            per_node = self.links.gpus_per_node
            shared = [0.0] * len(ends)
            for node in sorted({int(r) // per_node for ranks in members for r in ranks}):
                here = [int(np.count_nonzero(ranks // per_node == node)) for ranks in members]
                shared = [max(a, b) for a, b in zip(shared, host_shared_ms(replica_ms, ends, here, slots))]
            ends = shared
        return max(ends, default=0.0)

    def _rank_places(self, strategy: Strategy) -> tuple[np.ndarray, list[np.ndarray]]:
        """Per rank its pipeline stage, and per replica (``strategy.replicas()`` order) its ranks."""
        if strategy not in self._ranks:
            where = places(strategy, self.links.gpus_per_node)
            self._ranks[strategy] = (np.array([stage for _, stage, _ in where], dtype=np.float64),
                                     [np.asarray(r, dtype=np.int64)
                                      for r in assign_ranks(strategy, self.links.gpus_per_node)])
        return self._ranks[strategy]

    def floor_ms(self, schemes: list[ParallelScheme], gpus: int) -> float:
        """A floor under the movement any plan of a strategy of ``schemes`` on ``gpus`` GPUs adds to the step's
        compute: a rank computes with at least the fewest elements any place of those schemes needs, its own
        shard holds at most a shard of them, and the rest comes in and its gradient goes out at the fastest
        link; overlapped, over the windows (the slowest replica's first stage covers neither its first window's
        pull nor its last window's push)."""
        if gpus < 2 or not schemes:
            return 0.0
        if self.mode == "overlapped":  # a first stage's rank of the slowest replica: first and last window
            return self._plain_floor_ms(schemes, gpus) / self.windows
        return self._plain_floor_ms(schemes, gpus)

    def _plain_floor_ms(self, schemes: list[ParallelScheme], gpus: int) -> float:
        fewest = min(self.layout.needs((compute_scheme(s), stage, t)).total for s in schemes for stage in range(s.pp)
                     for t in range(s.tp))
        missing = max(0, fewest - self.layout.shard_numel(gpus))
        fastest = max(self.links.intra_gbps, self.links.inter_gbps) * 1e6
        return missing * (self.param_bytes + self.reduce_bytes) / fastest


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


def full_micro_batch_ms(cost_model: CostModel) -> dict[ParallelScheme, float]:
    """Per scheme of ``cost_model``, its longest micro-batch on one stage: one sequence of its ``max_tokens``
    (what covers the most of a replica's first pull and last push: :attr:`MovementCost.edge_ms`)."""
    return {s: cost_model.micro_batch_ms(s, [cost_model.max_tokens(s)]) for s in cost_model.schemes}


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
    """The compute layout of a LLaMA (``hcompile.models.Llama``'s parameters, embeddings and head not split, in
    the runtime's flat order: the parameters TP never splits first, each group in the model's order, the two
    groups the layout's regions) for the planner at any scale: q, gate and up projections split by output
    rows, o and down by input features (stored transposed), k and v by rows or, with fewer kv heads than
    ranks, the rank's kv head whole; pipeline stages take ``layers / pp`` consecutive layers each (the earlier
    stages one more when it does not divide), the embedding with the first and the final norm and head with the
    last. The runtime cuts stages by cost, so under pp > 1 this is the even cut, an approximation of it."""
    for name, value in (("layers", layers), ("hidden", hidden), ("ffn_hidden", ffn_hidden), ("heads", heads),
                        ("kv_heads", kv_heads), ("vocab", vocab)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name} must be a positive integer, got {value!r}")
    if hidden % heads or heads % kv_heads:
        raise PlanError(f"hidden {hidden} must be a multiple of heads {heads}, and heads of kv_heads {kv_heads}")
    params = _llama_params(layers, hidden, ffn_hidden, heads, kv_heads, vocab)
    params = [p for p in params if p.kind == "whole"] + [p for p in params if p.kind != "whole"]  # the runtime's order
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel
    whole = sum(p.numel for p in params if p.kind == "whole")
    ranges: dict[Place, Ranges] = {}
    for scheme in dict.fromkeys(compute_scheme(s) for s in schemes):  # a CP scheme computes as its base
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
    return ComputeLayout(numel=total, ranges=ranges, regions=((0, whole), (whole, total)),
                         windows=len(window_cuts(zip(offsets, (p.numel for p in params)), total, (whole,))))
