"""Parameter and gradient movement overlapped with compute, window by window of the fixed layout, with a bounded
number of bytes in flight.

Owns :func:`layout_windows` (the fixed layout cut at parameter boundaries into windows of about equal size, the
same on every rank, none across a boundary of the layout's regions, so that each owner holds at most one range
of a window), :class:`WindowedMovement` (one strategy's :class:`~runtime.redistribute.Redistribution` per window:
which segment of this rank's buffer each owner fills, which parts of this rank's shard each rank computes with,
and this rank's messages of a step in their global order) and :class:`MovementInFlight` (one step's pull and
push, driven by a progress thread of their own).

The pull of window w+1 travels while the forward computes with window w; the push of the last layers'
gradients travels while the backward computes the first layers'. Messages go on the movement group of their
own (``runtime.distributed.movement_group``), never between a pipeline's or a TP group's messages.

Order and bound. A rank's messages with one peer in one window of one phase form a unit, never split (the peer's
unit with it holds the same messages, the other way). Every rank posts its units in one order: the pull's windows
ascending, then the push's descending, and in a window the peers ascending, so that the units of every pair
follow one global order ((phase, window, lower rank, higher rank)). Its progress thread posts consecutive units
of one window as one batch (``runtime.distributed.post``: one NCCL group) and completes the batches oldest first,
with at most ``inflight_bytes`` of buffers (the pull's cast sends, the push's cast sends and its receives) in
flight, one unit alone when it is larger (:func:`largest_unit_numel`); a push window waits, before it is posted,
for the backward to have accumulated every parameter of it. No order of events can deadlock: a batch waits only
for its peers' batches holding the same units; the current batch of every rank ends at a unit of the global
order, and the rank whose current batch ends lowest has every peer's matching unit in a current or earlier
batch, so it completes (a push batch once its backward has reached it, and the backward never waits for
movement). Batches pair up between every two ranks (a unit lies in one batch on each side). The compute waits
only for pull windows, in the first forward, and only on the thread, never inside a collective another rank
posts inside its compute. (The earlier design posted everything up front so that the compute thread never
waited; bounding it by waiting for the oldest window inside the compute deadlocked a pipeline, whose next stage
posts only once it has the activation; ``tests/test_runtime_executor.py`` runs that case with the bound at 0,
one unit at a time.) :func:`overlap_buffer_bytes` is what the memory model charges for the buffers.

On GPUs the thread works on the movement stream (:func:`movement_stream`: one per executor, made once, from the
high-priority pool that ProcessGroupNCCL's internal streams do not come from, so it never aliases a
communicator's stream and the buffers the allocator caches on it are reused step after step): it starts after
the compute stream's work so far (the optimiser's update of the shard), a push send after the event the backward
recorded when its window was complete, and it synchronises its stream when it completes a message, so the
buffers it frees are free and a pull window it reports is in place.
"""

from __future__ import annotations

import _thread
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from passes.plan.movement import OVERLAP_WINDOWS, window_cuts
from runtime import distributed as comm
from runtime.fixed_layout import FixedLayout
from runtime.redistribute import (
    Ranges,
    Redistribution,
    Traffic,
    gather_ranges,
    intersect,
    pieces,
    total,
    zip_spans,
)
from runtime.stage_params import StageParams

__all__ = ["layout_windows", "WindowedMovement", "Message", "Unit", "MovementInFlight", "MovementError",
           "DEFAULT_WINDOWS", "DEFAULT_INFLIGHT_BYTES", "THREAD_START_TIMEOUT_S", "overlap_buffer_bytes",
           "largest_unit_numel", "check_inflight_bytes", "movement_stream", "MOVEMENT_STREAM_PRIORITY"]

DEFAULT_WINDOWS = OVERLAP_WINDOWS
"""Windows the fixed layout is cut into for overlapped movement (more where they would exceed the planner's
``passes.plan.movement.MAX_WINDOW_NUMEL``, the one bound of both)."""
DEFAULT_INFLIGHT_BYTES = 1 << 28
"""Bytes of movement buffers a rank's progress thread keeps in flight at most (256 MiB)."""
THREAD_START_TIMEOUT_S = 60.0
"""The longest a rank waits for its progress thread to run once started (at most half the movement group's
timeout): a thread starts in microseconds, and one that has not run by then died starting (out of memory)."""


MOVEMENT_STREAM_PRIORITY = -1
"""Priority of the movement stream: the high-priority pool (``torch.cuda.Stream(priority=-1)``), which
ProcessGroupNCCL takes its internal streams from only under ``TORCH_NCCL_HIGH_PRIORITY``; a plain
``torch.cuda.Stream()`` hands out the low-priority pool's 32 streams round-robin, the pool NCCL's streams come
from, so a stream made per step would sooner or later be a communicator's own."""


def movement_stream(device: torch.device | str,
                    factory: Callable[..., "torch.cuda.Stream"] | None = None) -> "torch.cuda.Stream | None":
    """The stream a rank's movement works on, made once and kept by its owner (the executor) for every step:
    None on a device without streams (the CPU); on a CUDA device ``factory(device, priority=-1)``
    (``torch.cuda.Stream`` unless given, :data:`MOVEMENT_STREAM_PRIORITY`). Any other device type is a
    ValueError naming it."""
    device = torch.device(device)
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        raise ValueError(f"movement runs on a CUDA device or the CPU, got {device}")
    return (factory or torch.cuda.Stream)(device, priority=MOVEMENT_STREAM_PRIORITY)


def check_inflight_bytes(value: object, name: str = "inflight_bytes") -> int:
    """``value`` as a bound on the bytes in flight: an integer >= 0, else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def overlap_buffer_bytes(inflight_bytes: int, unit_numel: int, param_bytes: int, reduce_bytes: int) -> int:
    """Bytes of movement buffers a rank holds at most under overlapped movement: ``inflight_bytes``, or one unit
    (``unit_numel`` elements, :func:`largest_unit_numel`, each way in the wider of the compute and reduction
    dtypes) when that is more. The pull receives into the compute copy and a push send that is already in the
    reduction dtype is a view of the gradient buffer: neither holds a buffer of its own."""
    return max(int(inflight_bytes), 2 * int(unit_numel) * max(param_bytes, reduce_bytes))


def layout_windows(layout: FixedLayout, count: int = DEFAULT_WINDOWS) -> list[tuple[int, int]]:
    """The flat vector cut into windows [lo, hi) at parameter boundaries, each about ``numel / count`` elements
    and at most ``passes.plan.movement.MAX_WINDOW_NUMEL`` where the parameters allow (a parameter larger than that
    is one window), plus one more where a window would cross into the layout's next region
    (``FixedLayout.regions``: none does): the planner's rule (``passes.plan.movement.window_cuts``), so that it
    counts the windows this runtime cuts."""
    specs = sorted(layout.specs.values(), key=lambda spec: spec.offset)
    return window_cuts(((spec.offset, spec.numel) for spec in specs), layout.numel,
                       (lo for lo, _ in layout.regions[1:]), count)


@dataclass(frozen=True, slots=True, eq=False)
class Message:
    """One message of a step's movement on this rank."""

    key: tuple
    """Its place in the step's order, the same on both of its ranks (module docstring)."""
    phase: str
    """``pull`` or ``push``."""
    send: bool
    """Whether this rank sends it (else receives it)."""
    peer: int
    """The other rank."""
    window: int
    """The layout window it belongs to."""
    at: int
    """Pull send, push send and receive: its first element in the concatenation of ``ranges``; pull receive:
    its first position in this rank's buffer."""
    count: int
    """Elements."""
    ranges: Ranges | None = None
    """Pull send, push receive: the ranges of this rank's shard (shard coordinates) it covers part of; push
    send: the ranges of this rank's buffer (its gradient buffer) it covers part of."""


@dataclass(frozen=True, slots=True, eq=False)
class Unit:
    """Every message between this rank and one peer in one window of one phase: never split between batches."""

    phase: str
    window: int
    peer: int
    messages: tuple[Message, ...]

    @property
    def key(self) -> tuple:
        """Its place in the order every rank posts in (module docstring); the peer's unit has the same key."""
        first = self.messages[0].key
        return (first[0], first[1], min(first[2], first[3]), max(first[2], first[3]))


def largest_unit_numel(layout: FixedLayout, windows: list[tuple[int, int]]) -> int:
    """A bound on the elements a unit moves in one direction: one window, at most one shard of it (a rank owns
    one range of a window, and what it needs from an owner lies in that owner's range)."""
    return min(max((hi - lo for lo, hi in windows), default=0), layout.shard_numel)


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
        self.push_fills: list[list[tuple[int, Ranges]]] = []
        """Per window: (owner, ranges of this rank's buffer) that this rank pushes to each owner (``fills`` less
        what it does not push: ``Redistribution.pushes``)."""
        self.push_serves: list[list[tuple[int, Ranges]]] = []
        """Per window: (rank, ranges of this rank's shard) whose gradients that rank pushes (``serves`` less what
        it does not push)."""
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
            self.push_fills.append([(owner, buf) for owner in range(self.world_size)
                                    for a, b in intersect(layout.owner_ranges(owner), lo, hi)
                                    for buf in [move.buffer_ranges(intersect(move.pushes, a, b))] if buf])
            self.push_serves.append([(j, r) for j, push in enumerate(move.push_serves) for sa, sb in mine_here
                                     for r in [intersect(push, sa, sb)] if r])
        self.pull: list[Message] = []
        """This rank's messages of a step's pull."""
        self.push: list[Message] = []
        """This rank's messages of a step's push."""
        for g in range(len(windows)):
            for j, ranges in self.serves[g]:
                if j != self.rank:
                    for c, n in self.chunks(total(ranges)):
                        self.pull.append(Message((0, g, self.rank, j, c), "pull", True, j, g, c, n, ranges))
            for owner, start, count in self.fills[g]:
                if owner != self.rank:
                    for c, n in self.chunks(count):
                        self.pull.append(Message((0, g, owner, self.rank, c), "pull", False, owner, g, start + c, n))
            for j, ranges in self.push_serves[g]:
                if j != self.rank:
                    for c, n in self.chunks(total(ranges)):
                        self.push.append(Message((1, -g, j, self.rank, c), "push", False, j, g, c, n, ranges))
            for owner, buf in self.push_fills[g]:
                if owner != self.rank:
                    for c, n in self.chunks(total(buf)):
                        self.push.append(Message((1, -g, self.rank, owner, c), "push", True, owner, g, c, n, buf))
        self.units: list[Unit] = []
        """This rank's units in posting order (module docstring): the pull's windows ascending, then the push's
        descending; in a window, the peers ascending."""
        for phase, messages, way in (("pull", self.pull, 1), ("push", self.push, -1)):
            by: dict[tuple[int, int], list[Message]] = {}
            for m in sorted(messages, key=lambda m: m.key):
                by.setdefault((m.window, m.peer), []).append(m)
            for (g, peer), unit in sorted(by.items(), key=lambda item: (way * item[0][0], item[0][1])):
                self.units.append(Unit(phase, g, peer, tuple(unit)))
        self.pull_ends = [sum(1 for u in self.units if u.phase == "pull" and u.window <= g)
                          for g in range(len(windows))]
        """Per window: how many of the pull's units (a prefix) must be complete for it to be in place."""

    def own_pieces(self, g: int) -> list[tuple[int, int, int]]:
        """(position in this rank's buffer, offset in its shard, length) of what window ``g`` of its buffer holds
        from its own shard (no message: copied in the pull; the push adds :meth:`own_push_pieces`)."""
        out = []
        for owner, start, count in self.fills[g]:
            if owner == self.rank:
                local = next(r for j, r in self.serves[g] if j == self.rank)
                out += [(start + pos, off, n) for pos, off, n in pieces(local, 0, count)]
        return out

    def own_push_pieces(self, g: int) -> list[tuple[int, int, int]]:
        """(position in this rank's buffer, offset in its shard, length) of the gradients this rank pushes in
        window ``g`` that its own shard holds (no message: added in the push)."""
        local = next((r for j, r in self.push_serves[g] if j == self.rank), [])
        return [piece for owner, buf in self.push_fills[g] if owner == self.rank for piece in zip_spans(buf, local)]

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

    def start(self, layout: FixedLayout, flat: torch.Tensor, params: StageParams | None = None,
              reduce_dtype: torch.dtype = torch.float32,
              inflight_bytes: int = DEFAULT_INFLIGHT_BYTES, stream: "torch.cuda.Stream | None" = None
              ) -> "MovementInFlight":
        """Start a step's movement: the pull into ``flat`` (this rank's buffer) and, with ``params`` (their
        gradient buffer zeroed for the step), the push of its gradients as :meth:`MovementInFlight.accumulated`
        reports them complete. ``stream``: the movement stream (:func:`movement_stream`, kept by the caller
        for every step); on a GPU without one, one is made for this step alone (which is what the caller should
        not do every step: module docstring)."""
        return MovementInFlight(self, layout, flat, params, reduce_dtype, inflight_bytes, stream)


class MovementError(RuntimeError):
    """The overlapped movement failed on this rank (a peer gone, a collective timeout, its progress thread not
    started): says which rank, and which message or why."""


class _ProgressThread:
    """A movement's progress thread, started so that starting it cannot hang. ``threading.Thread.start`` waits
    without a bound for the new thread to say that it runs, and a thread that dies before it does (a
    ``MemoryError`` in its bootstrap, on a rank out of memory) leaves the rank waiting there forever while its
    peers wait for its messages. This one is an OS thread whose first act is to say so; :meth:`start` waits a
    bounded time for that, and the compute side sees it end (:attr:`ended`) even if its target could not
    record why."""

    def __init__(self, target: Callable[[], None], name: str):
        self.target, self.name = target, name
        self._running = threading.Event()
        self._ended = threading.Event()

    def start(self, within_s: float) -> None:
        """Start the thread and wait at most ``within_s`` seconds for it to run: a RuntimeError (no thread could
        be made), a MemoryError, or a TimeoutError naming the wait (it died before running, or is still not
        running: then it does nothing once it does, see :meth:`_main`)."""
        _thread.start_new_thread(self._main, ())
        if not self._running.wait(within_s):
            self._ended.set()  # given up: a thread that runs later leaves at once
            raise TimeoutError(f"the thread {self.name} was started but did not run within {within_s:g} s (it "
                               f"died starting: is the rank out of memory?)")

    def _main(self) -> None:
        """The thread's body: say that it runs (unless :meth:`start` gave up on it), run the target, say that it
        ended."""
        if self._ended.is_set():
            return
        self._running.set()
        try:
            self.target()
        finally:
            self._ended.set()

    @property
    def ended(self) -> bool:
        """Whether the thread has ended (or never ran)."""
        return self._ended.is_set()

    def join(self, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for the thread to end."""
        self._ended.wait(timeout)


class MovementInFlight:
    """One step's movement on this rank, run by a progress thread (module docstring): the pull, waited window by
    window by the compute (:meth:`wait`), and the push of the gradient buffer, window by window as the last
    backward completes them (:meth:`accumulated`), summed into the shard's gradient by :meth:`finish`."""

    def __init__(self, plan: WindowedMovement, layout: FixedLayout, flat: torch.Tensor, params: StageParams | None,
                 reduce_dtype: torch.dtype, inflight_bytes: int, stream: "torch.cuda.Stream | None" = None):
        if flat.numel() != plan.move.numel:
            raise ValueError(f"the buffer has {flat.numel()} elements, this rank computes with {plan.move.numel}")
        check_inflight_bytes(inflight_bytes)
        self.plan, self.layout, self.flat, self.params = plan, layout, flat, params
        self.reduce_dtype, self.bound = reduce_dtype, inflight_bytes
        self.shard = layout.shard.detach()
        self.device = self.shard.device
        self.cuda = self.device.type == "cuda"
        reduce_size = torch.empty((), dtype=reduce_dtype).element_size()
        self.wait_s, self.peak_bytes = 0.0, 0
        """Seconds the compute waited for pull windows; most bytes of buffers in flight at once."""
        with torch.no_grad():  # this rank's own slices: copied at once
            for g in range(len(plan.windows)):
                for at, off, n in plan.own_pieces(g):
                    flat[at:at + n].copy_(self.shard[off:off + n])
        size = flat.element_size()
        self.traffic = Traffic(params_received=sum(m.count for m in plan.pull if not m.send) * size,
                               params_sent=sum(m.count for m in plan.pull if m.send) * size)
        """Bytes the pull moves."""
        self._push_traffic = Traffic()
        self._units = [u for u in plan.units if u.phase == "pull" or params is not None]
        grads_cast = params is not None and params.grad_dtype != reduce_dtype
        self._unit_bytes = [sum(0 if not m.send or self._is_view(m.ranges, m.at, m.count) else m.count * size
                                for m in u.messages) if u.phase == "pull" else
                            sum(m.count * reduce_size if grads_cast or not m.send
                                or len(list(pieces(m.ranges, m.at, m.count))) > 1 else 0 for m in u.messages)
                            for u in self._units]
        if params is not None:
            self._push_traffic = Traffic(grads_sent=sum(m.count for m in plan.push if m.send) * reduce_size,
                                         grads_received=sum(m.count for m in plan.push if not m.send) * reduce_size)
            self.window_of_param = plan.windows_of(params)
            self._waiting: list[set[str]] = [set() for _ in plan.windows]
            """Per window: the parameters whose last gradient has not been accumulated yet."""
            for name, g in self.window_of_param.items():
                self._waiting[g].add(name)
            self._ready = [not w for w in self._waiting]
            self._ready_events: list[torch.cuda.Event | None] = [None] * len(plan.windows)
            self._weighed = [False] * len(plan.windows)
            self.shard_grad = torch.zeros(layout.shard_numel, dtype=torch.float32, device=self.device)
        self._group = comm.movement_group()  # here: making it is collective, in the order every rank reaches it
        self._cond = threading.Condition()
        self._completed = 0
        self._error: BaseException | None = None
        self._failed_at: list[Unit] = []
        self._stopping = False
        self._all_done = False
        self._stream = (stream if stream is not None else movement_stream(self.device)) if self.cuda else None
        """The movement stream (the caller's, kept across steps; else one for this step)."""
        self._start_event = torch.cuda.Event() if self.cuda else None
        if self._start_event is not None:
            self._start_event.record()  # the shard as the compute stream leaves it (the last update)
        self._wait_timeout = comm.p2p_timeout(self._group)  # once a step: the timeout in force (warm-up's or the job's)
        self._thread = _ProgressThread(self._run, f"hydraulis-movement-rank{plan.rank}")
        within_s = THREAD_START_TIMEOUT_S
        if self._group is not None:
            within_s = min(within_s, comm.timeout_of(self._group) / 2)
        try:
            self._thread.start(within_s)
        except Exception as error:  # RuntimeError (can't start new thread), MemoryError, TimeoutError
            self._stopping = True
            raise MovementError(f"rank {plan.rank}: the overlapped movement's progress thread did not start, so its "
                                f"peers' messages with it cannot travel: {type(error).__name__}: {error}") from error

    def _is_view(self, ranges: Ranges | None, at: int, count: int) -> bool:
        return self.shard.dtype == self.flat.dtype and len(list(pieces(ranges or [], at, count))) == 1

    # -- the compute's side ------------------------------------------------------------------------------------

    def wait(self, window: int) -> None:
        """Block until every pull window up to ``window`` is in place."""
        started = time.perf_counter()
        need = self.plan.pull_ends[window]
        with self._cond:
            while self._completed < need and self._error is None and not self._thread.ended:
                self._cond.wait(timeout=1.0)
            if self._completed < need and self._error is None:  # ended without saying why (out of memory)
                self._error = RuntimeError("the progress thread ended before the pull was in place")
        self._raise_if_failed()
        self.wait_s += time.perf_counter() - started

    def wait_all(self) -> None:
        """Block until the whole pull is in place (this rank's sends of it included)."""
        if self.plan.windows:
            self.wait(len(self.plan.windows) - 1)

    def accumulated(self, name: str) -> None:
        """The step's last gradient of parameter ``name`` is in the buffer: its window's sends may go once all
        of its parameters' are."""
        if self.params is None:
            return
        g = self.window_of_param.get(name)
        if g is None or self._ready[g]:
            return
        self._waiting[g].discard(name)
        if not self._waiting[g]:
            event = None
            if self.cuda:
                event = torch.cuda.Event()
                event.record()  # the backward's kernels that wrote the window
            with self._cond:
                self._ready_events[g] = event
                self._ready[g] = True
                self._cond.notify_all()

    def finish(self, layout: FixedLayout) -> Traffic:
        """The backward is over: let every window go, wait for the whole movement, sum this rank's own gradients
        and the received ones into ``layout.shard.grad`` (fp32) and return the push's bytes."""
        if self.params is None:
            raise RuntimeError("this movement has no push (started without params)")
        if self.cuda:
            final = torch.cuda.Event()
            final.record()
        with self._cond:
            for g, ready in enumerate(self._ready):
                if not ready:
                    self._ready[g], self._ready_events[g] = True, final if self.cuda else None
            self._cond.notify_all()
        self._join()
        plan, grads = self.plan, self.params.grad_flat
        for g in range(len(plan.windows)):
            if not self._weighed[g]:
                self.params.weigh_grads(*plan.spans[g])
            for at, off, n in plan.own_push_pieces(g):
                self.shard_grad[off:off + n].add_(grads[at:at + n])
        layout.shard.grad, self.shard_grad = self.shard_grad, None
        return self._push_traffic

    def finish_pull(self) -> None:
        """Wait for a movement started without a push to end (a dry run's)."""
        self._join()

    def abort(self) -> None:
        """Stop posting (the step failed): the thread leaves once the message it waits on, if any, is done."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def _join(self) -> None:
        while not self._thread.ended:
            self._thread.join(timeout=1.0)
            if self._error is not None:
                break
        with self._cond:
            if self._error is None and not self._all_done:  # ended without saying why (out of memory)
                self._error = RuntimeError("the progress thread ended before the movement was complete")
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            units = self._failed_at
            where = "" if not units else (f" at the {units[0].phase}'s messages with rank(s) "
                                          f"{sorted({u.peer for u in units})} (window {units[0].window})")
            raise MovementError(f"rank {self.plan.rank}: the overlapped movement failed{where}: "
                                f"{type(self._error).__name__}: {self._error}") from self._error

    # -- the progress thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self.cuda:
                with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                    self._stream.wait_event(self._start_event)
                    self._progress()
            else:
                self._progress()
        except BaseException as error:  # reported to the compute's next wait
            with self._cond:
                self._error = error
                self._cond.notify_all()

    def _progress(self) -> None:
        """Post this rank's units in order, consecutive units of one window as one batch, and complete the
        batches oldest first, at most ``bound`` bytes of buffers in flight (one unit alone when it is larger); a
        push window only once the backward has finished it."""
        group, units = self._group, self._units
        flight: deque[tuple[list[Unit], list[comm.Work], int, list[Callable[[], None]]]] = deque()
        held = i = 0
        while i < len(units) or flight:
            if self._stopping:
                return
            if i < len(units):
                first = units[i]
                if first.phase == "pull" or self._is_ready(first.window):
                    batch, nbytes = [], 0
                    while i < len(units) and (units[i].phase, units[i].window) == (first.phase, first.window):
                        more = self._unit_bytes[i]
                        if (batch or flight) and held + nbytes + more > self.bound:
                            break
                        batch.append(units[i])
                        nbytes += more
                        i += 1
                    if batch:
                        self._failed_at = batch
                        works, afters = self._post_batch(batch, group)
                        flight.append((batch, works, nbytes, afters))
                        held += nbytes
                        self.peak_bytes = max(self.peak_bytes, held)
                        continue
                elif not flight:
                    with self._cond:
                        while not self._ready[first.window] and not self._stopping:
                            self._cond.wait()
                    continue
            batch, works, nbytes, afters = flight.popleft()
            self._failed_at = batch
            comm.wait(works, self._wait_timeout)  # gloo: bounded by the timeout in force, not the group's first
            for after in afters:
                after()
            if self.cuda:
                self._stream.synchronize()  # in place, and its buffers free
            held -= nbytes
            with self._cond:
                self._completed += sum(1 for u in batch if u.phase == "pull")
                self._cond.notify_all()
        self._failed_at = []
        self._all_done = True

    def _is_ready(self, window: int) -> bool:
        with self._cond:
            return self._ready[window]

    def _post_batch(self, batch: list[Unit], group: comm.ProcessGroup | None
                    ) -> tuple[list[comm.Work], list[Callable[[], None]]]:
        """Post the messages of these units (one window, one phase) as one batch; return its works and what to do
        once it is complete."""
        sends: list[tuple[torch.Tensor, int]] = []
        recvs: list[tuple[torch.Tensor, int]] = []
        afters: list[Callable[[], None]] = []
        g = batch[0].window
        if batch[0].phase == "push" and not self._weighed[g]:
            if self._ready_events[g] is not None:
                self._stream.wait_event(self._ready_events[g])
            self.params.weigh_grads(*self.plan.spans[g])
            self._weighed[g] = True
        for unit in batch:
            for m in unit.messages:
                if m.phase == "pull" and m.send:
                    sends.append((gather_ranges(self.shard, m.ranges, m.at, m.count, self.flat.dtype), m.peer))
                elif m.phase == "pull":
                    recvs.append((self.flat[m.at:m.at + m.count], m.peer))
                elif m.send:
                    sends.append((gather_ranges(self.params.grad_flat, m.ranges, m.at, m.count, self.reduce_dtype),
                                  m.peer))
                else:
                    buf = torch.empty(m.count, dtype=self.reduce_dtype, device=self.device)
                    recvs.append((buf, m.peer))
                    afters.append(self._adder(buf, m))
        return comm.post(sends, recvs, group), afters

    def _adder(self, buf: torch.Tensor, m: Message) -> Callable[[], None]:
        def add() -> None:
            for pos, off, n in pieces(m.ranges, m.at, m.count):
                self.shard_grad[off:off + n].add_(buf[pos - m.at:pos - m.at + n])
        return add
