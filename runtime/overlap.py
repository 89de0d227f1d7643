"""Parameter and gradient movement overlapped with compute, window by window of the fixed layout.

Owns :func:`layout_windows` (the fixed layout cut at parameter boundaries into windows of about equal size, the
same on every rank, none across a boundary of the layout's regions, so that each owner holds at most one range
of a window), :class:`WindowedMovement` (one strategy's :class:`~runtime.redistribute.Redistribution`
per window: which segment of this rank's buffer each owner fills, which parts of this rank's shard each rank
computes with), :class:`PullInFlight` (every window's pull posted at the start of the step, waited window by
window: the executor waits for a window when the program's gate asks for a parameter in it, before a piece of
the stage reads it) and :class:`PushInFlight` (a window's gradients posted as soon as the step's last backward
has accumulated all of them, summed into the owners' shards at the end).

The pull of window w+1 travels while the forward computes with window w; the push of the last layers'
gradients travels while the backward computes the first layers'. Messages go on the movement group of their
own (``runtime.distributed.movement_group``), never between a pipeline's or a TP group's messages. Between
two ranks messages match in the order both post them: pulls are posted by every rank at the start of the step
in ascending windows; pushes in descending windows (a sender posts window w only once every higher window is
posted; owners post every receive at the end in the same order), so every pair agrees, under gloo and NCCL.
Windows hold at most ``MAX_WINDOW_NUMEL`` elements. No rank waits, inside its compute, for a message another
rank posts inside its compute: the pull is posted whole before the compute starts and the push is summed only
after the backward has ended. (Bounding the windows in flight by waiting for the oldest one before posting the
next deadlocks a pipeline: a stage would wait for a window its next stage posts only once that stage has
received the activation the first one has not sent yet; ``tests/test_runtime_executor.py`` runs that case.)
So a rank holds every window's movement buffers at once at the peaks: the pull's send buffers (each served
element in the compute dtype, once per rank that computes with it) and the push's (the compute copy's gradients
in the reduction dtype, and each served element once per sender); :func:`overlap_buffer_bytes` is what the
memory model charges for them.
"""

from __future__ import annotations

import time

import torch

from runtime import distributed as comm
from runtime.fixed_layout import FixedLayout
from runtime.redistribute import Ranges, Redistribution, Traffic, gather_ranges, intersect, pieces, total
from runtime.stage_params import StageParams

__all__ = ["layout_windows", "WindowedMovement", "PullInFlight", "PushInFlight", "DEFAULT_WINDOWS",
           "MAX_WINDOW_NUMEL", "overlap_buffer_bytes"]

DEFAULT_WINDOWS = 8
"""Windows the fixed layout is cut into for overlapped movement (more where they would exceed
``MAX_WINDOW_NUMEL``)."""
MAX_WINDOW_NUMEL = 1 << 25
"""Elements of the largest window (one parameter larger than this is a window of its own)."""


def overlap_buffer_bytes(shard_numel: int, compute_numel: int, replicas: int, param_bytes: int,
                         reduce_bytes: int) -> int:
    """Bytes of movement buffers a rank holds at most under overlapped movement: its shard served to up to
    ``replicas`` ranks in the compute dtype (the pull's sends) and received from as many in the reduction dtype
    (the push's receives), plus ``compute_numel`` gradients in the reduction dtype (the push's sends, kept until
    the step ends: its compute copy's when they are cast; 0 when the gradient buffer is already in the reduction
    dtype, fp32 both by default, and the sends are views of it). A bound: each replica computes with an element
    on one rank (an element a tensor-parallel group replicates, such as a norm's weight, is small)."""
    return shard_numel * replicas * (param_bytes + reduce_bytes) + compute_numel * reduce_bytes


def layout_windows(layout: FixedLayout, count: int = DEFAULT_WINDOWS) -> list[tuple[int, int]]:
    """The flat vector cut into windows [lo, hi) at parameter boundaries, each about ``numel / count`` elements
    and at most ``MAX_WINDOW_NUMEL`` where the parameters allow (a parameter larger than that is one window), plus
    one more where a window would cross into the layout's next region (``FixedLayout.regions``: none does)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"the number of movement windows must be a positive integer, got {count!r}")
    count = max(count, -(-layout.numel // MAX_WINDOW_NUMEL))
    target = layout.numel / count
    region_starts = {lo for lo, _ in layout.regions[1:]}
    cuts, sized = [0], 1
    for spec in layout.specs.values():
        if spec.offset <= cuts[-1]:
            continue
        if spec.offset in region_starts:
            cuts.append(spec.offset)
        elif (spec.offset - cuts[-1] >= target and sized < count) or \
                spec.offset + spec.numel - cuts[-1] > MAX_WINDOW_NUMEL:  # the window would grow past the bound
            cuts.append(spec.offset)
            sized += 1
    return [(lo, hi) for lo, hi in zip(cuts, [*cuts[1:], layout.numel]) if hi > lo]


class WindowedMovement:
    """The movement plan of one strategy on this rank, by window."""

    def __init__(self, move: Redistribution, layout: FixedLayout, windows: list[tuple[int, int]],
                 chunk_numel: int):
        self.move, self.windows, self.chunk = move, windows, chunk_numel
        self.rank, self.world_size = move.rank, move.world_size
        mine = move.ranges
        own = layout.owned(self.rank)

        def position(flat: int) -> int:
            """Where flat element ``flat`` (or the first needed one after it) sits in this rank's buffer."""
            return total(intersect(mine, 0, flat))

        self.spans: list[tuple[int, int]] = []
        """Per window: [start, end) of this rank's buffer that it covers."""
        self.fills: list[list[tuple[int, int, int]]] = []
        """Per window: (owner, start, count) of the segment of this rank's buffer each owner fills."""
        self.serves: list[list[tuple[int, Ranges]]] = []
        """Per window: (rank, ranges of this rank's shard in shard coordinates) that rank computes with."""
        for lo, hi in windows:
            self.spans.append((position(lo), position(hi)))
            fills = []
            for owner in range(self.world_size):
                held = intersect(layout.owner_ranges(owner), lo, hi)
                if len(held) > 1:
                    raise ValueError(f"window [{lo}, {hi}) crosses a region of the layout: owner {owner} holds "
                                     f"{held} of it (layout_windows never cuts so)")
                for a, b in held:
                    start, end = position(a), position(b)
                    if end > start:
                        fills.append((owner, start, end - start))
            self.fills.append(fills)
            mine_here = [(pos + a - flo, pos + b - flo) for flo, fhi, pos in own
                         for a, b in intersect([(flo, fhi)], lo, hi)]
            self.serves.append([(j, r) for j, need in enumerate(move.serves) for sa, sb in mine_here
                                for r in [intersect(need, sa, sb)] if r])

    def windows_of(self, params: StageParams) -> dict[str, int]:
        """The window of each of ``params``' parameters (by name)."""
        return {name: self.window_of(start) for name, start, numel in params.starts() if numel}

    def window_of(self, start: int) -> int:
        """The window holding buffer position ``start``."""
        for g, (a, b) in enumerate(self.spans):
            if a <= start < b:
                return g
        raise ValueError(f"buffer position {start} is outside this rank's {self.move.numel} elements")

    def chunks(self, count: int) -> list[tuple[int, int]]:
        """(first, length) of the messages a transfer of ``count`` elements is cut into."""
        return [(c, min(self.chunk, count - c)) for c in range(0, count, self.chunk)]

    def start_pull(self, layout: FixedLayout, flat: torch.Tensor) -> "PullInFlight":
        """Post every window's pull into ``flat`` (this rank's buffer); copy what this rank's own shard holds."""
        return PullInFlight(self, layout, flat)

    def start_push(self, params: StageParams, reduce_dtype: torch.dtype, layout: FixedLayout) -> "PushInFlight":
        """A push of ``params``' gradient buffer (zeroed for the step), posted window by window as
        :meth:`PushInFlight.accumulated` reports the step's last gradients."""
        return PushInFlight(self, params, reduce_dtype, layout)


class PullInFlight:
    """Every window's parameter slices on their way into this rank's buffer."""

    def __init__(self, plan: WindowedMovement, layout: FixedLayout, flat: torch.Tensor):
        if flat.numel() != plan.move.numel:
            raise ValueError(f"the buffer has {flat.numel()} elements, this rank computes with {plan.move.numel}")
        self.plan, self.waited, self.wait_s = plan, 0, 0.0
        shard, group, size = layout.shard.detach(), comm.movement_group(), flat.element_size()
        self._works: list[list[comm.Work]] = []
        self._keep: list[list[torch.Tensor]] = []
        sent = received = 0
        for g in range(len(plan.windows)):
            sends, recvs = [], []
            for j, ranges in plan.serves[g]:
                if j == plan.rank:
                    continue
                for c, n in plan.chunks(total(ranges)):
                    sends.append((gather_ranges(shard, ranges, c, n, flat.dtype), j))
                    sent += n * size
            with torch.no_grad():
                for owner, start, count in plan.fills[g]:
                    if owner == plan.rank:
                        local = next(r for j, r in plan.serves[g] if j == plan.rank)
                        for pos, off, n in pieces(local, 0, count):
                            flat[start + pos:start + pos + n].copy_(shard[off:off + n])
                        continue
                    for c, n in plan.chunks(count):
                        recvs.append((flat[start + c:start + c + n], owner))
                        received += n * size
            self._works.append(comm.post(sends, recvs, group))
            self._keep.append([t for t, _ in sends])
        self.traffic = Traffic(params_received=received, params_sent=sent)
        """Bytes this pull moves."""

    def wait(self, window: int) -> None:
        """Block until every window up to ``window`` is in place (under NCCL: the current stream waits)."""
        started = time.perf_counter()
        while self.waited <= window:
            for work in self._works[self.waited]:
                work.wait()
            self._keep[self.waited] = []
            self.waited += 1
        self.wait_s += time.perf_counter() - started

    def wait_all(self) -> None:
        """Block until the whole pull is done (this rank's sends included)."""
        self.wait(len(self._works) - 1)


class PushInFlight:
    """This rank's gradient slices on their way to their owners and the other ranks' gradients of its shard on
    their way to it, window by window. A window is posted as one group of this rank's sends and receives for it
    once this rank's last backward has accumulated every gradient of it, and only after every higher window:
    every rank posts the same windows in the same order, each pair's sends matching its receives, so under NCCL
    (where a send waits on the stream until its receive is posted) no rank's stream waits on a window another
    rank posts after one it is itself waiting for. Nothing is waited for before the backward has ended
    (:meth:`finish`): a wait inside it could stand on a window that a rank further down the pipeline posts only
    after this one has sent it a gradient."""

    def __init__(self, plan: WindowedMovement, params: StageParams, reduce_dtype: torch.dtype, layout: FixedLayout):
        self.plan, self.params, self.reduce_dtype = plan, params, reduce_dtype
        self.size = torch.empty((), dtype=reduce_dtype).element_size()
        self.device = layout.shard.device
        windows = len(plan.windows)
        self.waiting: list[set[str]] = [set() for _ in range(windows)]
        """Per window: the parameters whose last gradient has not been accumulated yet."""
        self.window_of_param = plan.windows_of(params)
        for name, g in self.window_of_param.items():
            self.waiting[g].add(name)
        self.ready = [not w for w in self.waiting]
        self.next = windows - 1
        """The highest window not posted yet (posting goes down)."""
        self.sent = self.received = 0
        self._works: list[comm.Work] = []
        self._keep: list[torch.Tensor] = []
        self._adds: list[tuple[torch.Tensor, Ranges, int]] = []
        """(receive buffer, ranges of the shard it holds, its first element in their concatenation)."""
        self.group = comm.movement_group()
        self._post_ready()  # the windows this rank computes nothing in, above its first one

    def accumulated(self, name: str) -> None:
        """The step's last gradient of parameter ``name`` is in the buffer: post its window once all are."""
        g = self.window_of_param.get(name)
        if g is None or self.ready[g]:
            return
        self.waiting[g].discard(name)
        if not self.waiting[g]:
            self.ready[g] = True
            self._post_ready()

    def _post_ready(self) -> None:
        while self.next >= 0 and self.ready[self.next]:
            self._post(self.next)
            self.next -= 1

    def _post(self, g: int) -> None:
        plan, grads = self.plan, self.params.grad_flat
        if grads is None:
            raise RuntimeError("no gradients: zero_grads() was not called this step")
        self.params.weigh_grads(*plan.spans[g])
        sends, recvs = [], []
        for owner, start, count in plan.fills[g]:
            if owner == plan.rank:
                continue
            for c, n in plan.chunks(count):
                sends.append((grads[start + c:start + c + n].to(self.reduce_dtype), owner))
                self.sent += n * self.size
        for j, ranges in plan.serves[g]:
            if j == plan.rank:
                continue
            for c, n in plan.chunks(total(ranges)):
                buf = torch.empty(n, dtype=self.reduce_dtype, device=self.device)
                recvs.append((buf, j))
                self._adds.append((buf, ranges, c))
                self.received += n * self.size
        self._works += comm.post(sends, recvs, self.group)
        self._keep += [t for t, _ in sends]

    def finish(self, layout: FixedLayout) -> Traffic:
        """Post what is left (the backward is over), wait for every window and sum this rank's own gradients
        and the received ones into ``layout.shard.grad`` (fp32)."""
        self.ready = [True] * len(self.ready)
        self._post_ready()
        plan, grads = self.plan, self.params.grad_flat
        shard_grad = torch.zeros(layout.shard_numel, dtype=torch.float32, device=layout.shard.device)
        for g in range(len(plan.windows)):
            for owner, start, count in plan.fills[g]:
                if owner == plan.rank:
                    local = next(r for j, r in plan.serves[g] if j == plan.rank)
                    for pos, off, n in pieces(local, 0, count):
                        shard_grad[off:off + n].add_(grads[start + pos:start + pos + n])
        for work in self._works:
            work.wait()
        for buf, ranges, c in self._adds:
            for pos, off, n in pieces(ranges, c, buf.numel()):
                shard_grad[off:off + n].add_(buf[pos - c:pos - c + n])
        self._works, self._keep, self._adds = [], [], []
        layout.shard.grad = shard_grad
        return Traffic(grads_sent=self.sent, grads_received=self.received)
