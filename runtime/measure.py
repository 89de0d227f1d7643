"""Measurement of a step, as hooks on the executor's phases: what a step did, read once per step.

Owns :class:`StepStats`, :class:`StepState` (one step on this rank as the hooks see it), the hook protocol and
the two hooks the runtime has: :class:`StepMeter` (busy time of the compute phase: CUDA events on a GPU, the
rank's CPU time on the CPU; before the optimiser steps, one all-gather of the loss, the gradient norm, the
finiteness probe of the master weights, busy times and token counts, the step's one read of device values)
and :class:`TakeTurns` (replicas compute one after the other, for measuring per-rank busy times on a host with
fewer cores than ranks). The executor runs the step and calls the hooks; it measures nothing itself.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from passes.plan.ir import StepPlan
from runtime import distributed as comm
from runtime.cpu_clock import RankCpuClock
from runtime.loss import global_pair_count
from runtime.redistribute import Traffic

__all__ = ["PHASES", "PhaseHook", "StepState", "StepStats", "StepMeter", "TakeTurns"]

PHASES = ("pull", "pulled", "compute", "group", "computed", "push", "optimizer", "end")
"""A step's phases in order (a dry run has no ``push`` nor ``optimizer``); ``pulled``: the parameters are in place
and the gradient buffer is ready, before any hook at ``compute`` waits (for its replica's turn); ``group``: only in
a regrouped plan, before each of the rank's groups (``StepState.group``). Hooks entering a phase run in the order
they were added; at ``computed``, which closes the compute window, in the reverse order, so that a hook opened
first is closed last."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepStats:
    """What one training step did."""

    loss: float
    """Mean next-token loss over the global batch."""
    tokens: int
    """Tokens in the global batch."""
    strategy: str
    """The step's strategy, ``1x(tp2,pp1)+2x(tp1,pp1)`` form."""
    busy_ms: tuple[float, ...]
    """Per rank: busy time of its compute phase (forward, backward and their communication): CUDA events on a
    GPU; on the CPU the process's CPU time with its communication threads, background planning left out
    (``runtime.cpu_clock``), ms."""
    wall_ms: float
    """Wall-clock time of the step on this rank, ms."""
    compilations: int
    """torch.compile compilations of every variant so far (constant once the variants are warm)."""
    traffic: Traffic
    """Bytes this rank moved this step: parameter slices in, its shard's parts out, gradients both ways."""
    tokens_computed: tuple[int, ...]
    """Per rank: the tokens it computed this step (a TP group's ranks each count their replica's tokens)."""
    plan_ms: float = 0.0
    """Planning wall time of this step on rank 0, ms (0 when the plan was given)."""
    plan_hidden: bool = False
    """Whether this step's plan was computed while the previous step ran: planning started before the previous
    step's compute phase ended and finished before this step needed the plan (``Trainer.fit``)."""
    compute_thread_ms: tuple[float, ...] = ()
    """Per rank: CPU time of the computing thread alone over the compute phase (communication threads left
    out), ms."""
    compute_window: tuple[float, float] = (0.0, 0.0)
    """This rank's compute phase, (start, end) in ``time.perf_counter`` seconds."""
    plan_window: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """This step's planning on rank 0: (started, finished, needed by the step), ``time.perf_counter`` seconds
    on rank 0 (zeros when nothing was planned)."""
    skipped: bool = False
    """The global batch had no next-token pair (only 1-token sequences): nothing ran, nothing changed (no
    optimiser step), ``loss`` is 0."""
    pull_ms: tuple[float, ...] = ()
    """Per rank: its pull phase (parameters from their owners and the new buffers), ms: CUDA events on a GPU,
    wall clock on the CPU."""
    push_ms: tuple[float, ...] = ()
    """Per rank: its push phase (gradients to their owners), ms, timed alike; a rank that reaches it early
    includes its wait for the later ones (0 in a dry run)."""
    pull_wait_ms: tuple[float, ...] = ()
    """Per rank, with overlapped movement: host wall time its compute waited for parameter windows still
    travelling, ms (inside the compute phase; on GPUs too: the progress thread reports a window in place once its
    stream has synchronized, and the compute thread launches the kernels that read it after that)."""
    grad_norm: float = 0.0
    """L2 norm of the step's summed gradient (every rank's shard), read before the optimiser steps (0 in a dry
    run)."""
    non_finite_skips: int = 0
    """Steps skipped so far because their loss or gradient norm was not finite (``TrainOptions(non_finite=
    "skip")``; with the default ``"raise"`` such a step is a ``NonFiniteError`` instead)."""


@dataclass(slots=True, kw_only=True)
class StepState:
    """One step on this rank, as the executor fills it in and the hooks read it."""

    plan: StepPlan
    """The step's plan."""
    replica: int
    """This rank's replica (index into ``plan.replicas``)."""
    stage: int
    """This rank's pipeline stage."""
    tp_rank: int
    """This rank's index in its stage's TP group."""
    dry_run: bool = False
    """Forward and backward only (warm-up): parameters and optimiser untouched."""
    group: int = -1
    """In a regrouped plan, at phase ``group``: the index into ``plan.replicas`` of the group the rank runs
    next."""
    loss_sum: torch.Tensor | None = None
    """The loss this rank counts (summed over its micro-batches, on the device; zero on ranks that do not count
    it), set when the compute phase ends."""
    tokens_computed: int = 0
    """Tokens of this rank's micro-batches."""
    traffic: Traffic = field(default_factory=Traffic)
    """Bytes moved so far."""
    pull_wait_ms: float = 0.0
    """With overlapped movement: host time the compute waited for parameter windows still travelling, ms."""
    finite_probe: Callable[[], torch.Tensor] | None = None
    """Set before the ``optimizer`` phase: computes (on the device, once the push is timed) the norm of this
    rank's shard of the summed gradient and the largest magnitude of its master weights (NaN or infinite when
    one is), read with the statistics."""
    settings_finite: bool = True
    """Whether every number of this rank's optimiser settings (lr, betas, ...) is finite."""
    checks: list[tuple[float, float, bool]] = field(default_factory=list)
    """Per rank, once read: (gradient norm of its shard, largest magnitude of its master weights, its settings
    finite)."""
    stats: StepStats | None = None
    """What the step did, once a meter has read it (at ``optimizer``, before the optimiser steps; at ``end`` in
    a dry run)."""


class PhaseHook(Protocol):
    """Called as a step enters each phase of :data:`PHASES`."""

    def __call__(self, phase: str, step: StepState) -> None:
        ...


class _Span:
    """Elapsed time between ``start`` and ``stop``: CUDA events on a GPU (read once the step is over), the wall
    clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.ms = 0.0
        if self.cuda:
            self.begin, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.started = time.perf_counter()

    def stop(self) -> "_Span":
        if self.cuda:
            self.end.record()
        else:
            self.ms = (time.perf_counter() - self.started) * 1e3
        return self

    def read(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.begin.elapsed_time(self.end)
        return self.ms


class _BusyClock:
    """Busy time over a window: CUDA events on the current stream on a GPU (the kernels' time, read once the step
    is over), CPU time of the process less background threads on the CPU."""

    def __init__(self, cpu_clock: RankCpuClock, device: torch.device):
        self.cuda = device.type == "cuda"
        self.cpu_start, self.thread_start = cpu_clock.seconds(), time.thread_time()
        self.cpu_clock, self.cpu_ms, self.thread_ms = cpu_clock, 0.0, 0.0
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()

    def stop(self) -> None:
        self.thread_ms = (time.thread_time() - self.thread_start) * 1e3
        self.cpu_ms = (self.cpu_clock.seconds() - self.cpu_start) * 1e3
        if self.cuda:
            self.end.record()

    def read(self) -> tuple[float, float]:
        """(busy ms, computing thread's CPU ms)."""
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end), self.thread_ms
        return self.cpu_ms, self.thread_ms


class StepMeter:
    """Times the step and its compute phase, and gathers the statistics of every rank in one all-gather (the
    step's one read of device values) into ``step.stats``: as the optimiser phase begins, so that the loss and
    the gradient norm are known before anything changes (at ``end`` in a dry run, which has none); ``wall_ms``
    is set at ``end``."""

    def __init__(self, cpu_clock: RankCpuClock, device: torch.device):
        self.cpu_clock, self.device = cpu_clock, device
        self._started = 0.0
        self._window = (0.0, 0.0)
        self._clock: _BusyClock | None = None
        self._pull: _Span | None = None
        self._push: _Span | None = None

    def __call__(self, phase: str, step: StepState) -> None:
        if phase == "pull":
            self._started = time.perf_counter()
            self._pull, self._push = _Span(self.device), None
        elif phase == "push":
            self._push = _Span(self.device)
        elif phase == "optimizer":
            if self._push is not None:
                self._push.stop()
            step.stats = self._gather(step)
        elif phase == "pulled":
            self._pull.stop()
        elif phase == "compute":
            self._clock = _BusyClock(self.cpu_clock, self.device)
            self._window = (time.perf_counter(), 0.0)
        elif phase == "computed":
            self._clock.stop()
            self._window = (self._window[0], time.perf_counter())
        elif phase == "end":
            stats = step.stats if step.stats is not None else self._gather(step)
            step.stats = dataclasses.replace(stats, wall_ms=(time.perf_counter() - self._started) * 1e3)

    def _gather(self, step: StepState) -> StepStats:
        busy_ms, thread_ms = self._clock.read()  # after the step: a CUDA event is read once, here
        pull_ms = self._pull.read()
        push_ms = self._push.read() if self._push is not None else 0.0
        counted = step.loss_sum
        probe = step.finite_probe() if step.finite_probe is not None else torch.zeros(2, device=counted.device)
        summary = torch.cat([counted.reshape(1).double(), torch.tensor(
            [busy_ms, float(step.tokens_computed), thread_ms, pull_ms, push_ms, step.pull_wait_ms,
             float(step.settings_finite)], dtype=torch.float64, device=counted.device), probe.double()])
        gathered = torch.stack(comm.all_gather(summary)).cpu().tolist()
        step.checks = [(g[8], g[9], g[7] == 1.0) for g in gathered]
        plan = step.plan
        return StepStats(
            loss=sum(g[0] for g in gathered) / max(1, global_pair_count(plan.seq_lens)), tokens=sum(plan.seq_lens),
            strategy=plan.strategy.describe(), busy_ms=tuple(g[1] for g in gathered),
            wall_ms=(time.perf_counter() - self._started) * 1e3, compilations=0, traffic=step.traffic,
            tokens_computed=tuple(int(g[2]) for g in gathered), compute_thread_ms=tuple(g[3] for g in gathered),
            compute_window=self._window, pull_ms=tuple(g[4] for g in gathered), push_ms=tuple(g[5] for g in gathered),
            pull_wait_ms=tuple(g[6] for g in gathered), grad_norm=math.sqrt(sum(g[8] ** 2 for g in gathered)))


class TakeTurns:
    """Replicas compute their micro-batches one after the other (a barrier between turns) instead of at once.
    For measurement on a host with fewer cores than ranks: each replica then has the cores to itself, so a
    rank's busy time is what it would be with a core of its own, not inflated by other ranks time-slicing its
    core; the step's wall time becomes the sum of the replicas' times. Add it before the meter."""

    def __init__(self) -> None:
        self._passed = 0
        """Barriers this rank has passed in the step: barrier ``g`` closes turn ``g - 1``."""

    def __call__(self, phase: str, step: StepState) -> None:
        """Turn ``g`` runs once every rank has passed barriers 1..g; a rank passes the next one only when its
        turn is done, so the turns run one by one, in order. A turn is a replica (the rank's own, entered at
        ``compute``), or in a regrouped plan each of its groups (entered at ``group``), in the plan's order."""
        if phase == "compute":
            self._passed = 0
            if not step.plan.regrouped:
                self._pass_to(step.replica)
        elif phase == "group":
            self._pass_to(step.group)
        elif phase == "computed":  # this rank's last turn ends, then the later ones'
            self._pass_to(len(step.plan.replicas))

    def _pass_to(self, barriers: int) -> None:
        for _ in range(self._passed, barriers):
            comm.barrier()
        self._passed = max(self._passed, barriers)
