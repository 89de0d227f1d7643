"""The step executor: runs this rank's part of a ``StepPlan`` with the stage program it is given.

Every rank pulls the parameter slices its stage program computes with from the fixed layout's owners
(``runtime.redistribute``) into the program's compute copy (``runtime.stage_params``), runs its replica's
micro-batches (tensor parallel inside the program; a 1F1B pipeline when pp > 1, ``runtime.pipeline``, its
point-to-point messages paired per gap as NCCL needs them, no headers: shapes come from the receiving program)
with the loss divided by the global pair count, pushes the gradient slices back to their owners and steps the
optimiser on its shard. The compute copy exists only
during the step. Where each replica runs is the plan's (``ReplicaPlan.ranks``); what the step measured comes
from the phase hooks (``runtime.measure``), which the executor calls and does not implement.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager, Iterator, Mapping, Protocol, Sequence

import torch
from torch import nn
from torch.profiler import record_function

from passes.graph.tensor_parallel import ParamSlice
from passes.plan.ir import ParallelScheme, PlanError, ReplicaPlan, StepPlan, Strategy
from runtime import distributed as comm
from runtime import micro_batch
from runtime.cpu_clock import RankCpuClock
from runtime.distributed import DistContext, GroupCache
from runtime.fixed_layout import FixedLayout
from runtime.loss import global_pair_count, vocab_shard_of
from runtime.measure import PhaseHook, StepMeter, StepState, StepStats
from runtime.overlap import (
    DEFAULT_INFLIGHT_BYTES,
    DEFAULT_WINDOWS,
    MovementInFlight,
    WindowedMovement,
    check_inflight_bytes,
    layout_windows,
    movement_stream,
)
from runtime.pipeline import Pipeline
from runtime.redistribute import DEFAULT_CHUNK_NUMEL, Redistribution
from runtime.stage_params import StageParams
from runtime.topology import Cluster, check_placement

__all__ = ["StageProgram", "Executor", "NonFiniteError", "NON_FINITE_POLICIES", "pack_micro_batch", "setting_problem"]

NON_FINITE_POLICIES = ("raise", "skip")
"""What a step whose loss or gradient norm is not finite does: a ``NonFiniteError``, or no optimiser step."""


class NonFiniteError(FloatingPointError):
    """A step met a NaN or an infinity (its loss, its gradient, the master weights or the optimiser's settings);
    the same on every rank, naming the step, raised before the optimiser changed anything."""


def setting_problem(settings: Mapping) -> str | None:
    """Which number of an optimiser's settings (a param group, or its keyword arguments) is NaN or infinite,
    as ``lr=nan`` (None: all are finite). Tensors on a device are not read (that would wait for it)."""
    for key, value in settings.items():
        if key == "params":
            continue
        for v in (value if isinstance(value, (tuple, list)) else (value,)):
            if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.is_floating_point() and v.numel() == 1:
                v = float(v)
            if isinstance(v, float) and not math.isfinite(v):
                return f"{key}={value!r}"
    return None


class StageProgram(Protocol):
    """One pipeline stage of one scheme on one TP rank. The runtime owns the parameters it computes with
    (one ``nn.Parameter`` per slice, in the compute dtype, their storage swapped in for each step); the
    program is bound to them once and uses them in every call."""

    param_slices: Mapping[str, ParamSlice]
    """Every parameter the stage uses, and the slice of it this rank holds."""

    gate: Callable[[Sequence[str]], None] | None
    """Set by the runtime during a step's first forward (None otherwise): the program calls it with the names of
    the parameters it is about to read, before reading them, covering every parameter it reads (a stage cut into
    pieces asks before each piece). With overlapped movement that is where the runtime waits for them; a
    program without the attribute gets every parameter before its first call."""

    def bind(self, params: Mapping[str, nn.Parameter]) -> None:
        """Compute with ``params`` (by name, shaped as the slices) from now on, in every token bucket."""

    def __call__(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                 boundary: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The stage's outputs: the tensors the next stage takes, or ``(logits,)`` (T, vocab) on the last. A
        program of a context-parallel scheme also takes ``cp_inputs=`` (``runtime.micro_batch.MicroBatch``) and
        has ``bucket(tokens)``, the padded size a share of ``tokens`` tokens runs at."""

    def boundary_in(self, tokens: int) -> list:
        """What the stage receives from the previous one for a micro-batch of ``tokens`` tokens, in order: per
        item a ``(shape, dtype)``, or a list of them for a tuple-valued item (known from the program, so no
        header travels with the activations)."""


def pack_micro_batch(batch: Sequence[torch.Tensor], indices: Sequence[int],
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Concatenate whole sequences: (input_ids (T,), cu_seqlens int32 (n+1,), max_seqlen), built on the host
    from the host batch and copied to ``device``: only these sequences travel, and nothing is read back."""
    mb = micro_batch.packed(batch, indices, device)
    return mb.ids, mb.cu_seqlens, mb.max_seqlen


class Executor:
    """Runs planned steps on this rank: ``run_step(plan, batch, program)``."""

    def __init__(self, ctx: DistContext, cluster: Cluster, layout: FixedLayout, optimizer: torch.optim.Optimizer, *,
                 param_dtype: torch.dtype = torch.float32, reduce_dtype: torch.dtype = torch.float32,
                 chunk_numel: int = DEFAULT_CHUNK_NUMEL, hooks: Sequence[PhaseHook] = (), overlap: bool = False,
                 windows: int = DEFAULT_WINDOWS, inflight_bytes: int = DEFAULT_INFLIGHT_BYTES,
                 non_finite: str = "raise", grad_dtype: torch.dtype = torch.float32):
        """``overlap``: move parameters and gradients window by window (``runtime.overlap``), the pull of later
        layers travelling while the forward computes earlier ones and the push of later layers' gradients while
        the backward computes earlier ones, in ``windows`` windows of the fixed layout; otherwise all of the pull
        before the compute and all of the push after it (``runtime.redistribute``), in rounds of pairs.
        ``inflight_bytes``: with ``overlap``, the most bytes of movement buffers in flight at once
        (``runtime.overlap.overlap_buffer_bytes``).
        ``non_finite``: ``"raise"`` (a step whose loss or gradient norm is not finite is a ``NonFiniteError``)
        or ``"skip"`` (it changes nothing and is counted in ``non_finite_skips``). ``grad_dtype``: what the
        micro-batches' gradients accumulate in on this rank (``runtime.stage_params``; float32 whatever
        ``param_dtype`` is, unless asked otherwise)."""
        if non_finite not in NON_FINITE_POLICIES:
            raise ValueError(f"non_finite must be one of {NON_FINITE_POLICIES}, got {non_finite!r}")
        self.ctx, self.cluster, self.layout, self.optimizer = ctx, cluster, layout, optimizer
        self.non_finite = non_finite
        self.steps_run = 0
        """Training steps run (dry runs not counted): the number a ``NonFiniteError`` names the step by."""
        self.non_finite_skips = 0
        """Steps skipped because their loss or gradient norm was not finite (``non_finite="skip"``)."""
        self.param_dtype, self.reduce_dtype, self.chunk_numel = param_dtype, reduce_dtype, chunk_numel
        self.grad_dtype = grad_dtype
        self.overlap = overlap
        self.inflight_bytes = check_inflight_bytes(inflight_bytes)
        self.windows = layout_windows(layout, windows) if overlap else []
        """The fixed layout's movement windows (overlapped movement only)."""
        self.movement_stream = movement_stream(ctx.device) if overlap else None
        """The stream every step's overlapped movement works on, made once for the executor's life
        (``runtime.overlap.movement_stream``: high priority, never one of a communicator's; None on the CPU or
        without overlapped movement)."""
        self._windowed: dict[Strategy, WindowedMovement] = {}
        self.groups = GroupCache()
        self.cpu_clock = RankCpuClock()
        """This rank's CPU clock; background threads (planning) register with it so busy times leave them out."""
        self.hooks: list[PhaseHook] = [*hooks, StepMeter(self.cpu_clock, ctx.device)]
        """Called as a step enters each phase (``runtime.measure.PHASES``); the last is the meter whose
        statistics ``run_step`` returns. Instrumentation (memory per phase, ...) inserts before it."""
        self._params: dict[tuple, tuple[StageParams, dict, list[StageProgram]]] = {}
        """Per position: the compute copy, the slices it holds, the programs bound to it."""
        self._moves: dict[Strategy, Redistribution] = {}
        self._checked: set[tuple[tuple[int, ...], ...]] = set()

    def groups_for(self, plan: StepPlan) -> GroupCache:
        """The process groups of ``plan``'s placement, made on first use (collective: every rank calls it with
        the same plan). A regrouped plan's groups are checked to share each rank's parameter slice."""
        placement = tuple(r.ranks for r in plan.replicas)
        if placement not in self._checked:
            check_placement(plan.replicas, self.cluster, plan.regrouped)
            if plan.regrouped and (problem := plan.slot_problem()) is not None:
                raise PlanError(f"the {plan.policy} plan of {plan.strategy.describe()} cannot run: {problem}")
            if len(self._checked) < comm.MAX_REMEMBERED_PLACEMENTS:  # a memo, bounded (regrouped plans vary)
                self._checked.add(placement)
        self.groups.prepare(plan.replicas)
        return self.groups

    def tp_group(self, replica: ReplicaPlan, stage: int, cp_rank: int = 0) -> comm.ProcessGroup | None:
        """The TP group of ``stage`` (at ``cp_rank``) of ``replica`` (None for one rank)."""
        return self.groups.get(replica.tp_group(stage, cp_rank))

    def stage_params(self, program: StageProgram, scheme: ParallelScheme, position: tuple,
                     also: Sequence[StageProgram] = (), shared: bool = False, tp_rank: int | None = None
                     ) -> StageParams:
        """The compute copy of ``program``'s slices at ``position``, made once per position and bound to the
        programs it serves. ``also``: more programs that compute with the same slices (the groups of a regrouped
        step), bound to the same copy; ``shared``: a new program at a known position joins its copy too (a
        regrouped rank's slot) instead of replacing it. A program whose slices differ is a ValueError.
        ``tp_rank``: this rank's place in its TP group (part of ``position``), so that only TP rank 0 pushes the
        replicated parameters (``runtime.stage_params``); None: every TP rank pushes them at ``1/tp``."""
        held = self._params.get(position)
        if held is None or not (shared or any(p is program for p in held[2])):
            params = StageParams(self.layout, program.param_slices, scheme.tp, self.param_dtype, self.ctx.device,
                                 grad_dtype=self.grad_dtype, tp_rank=tp_rank)
            self._params[position] = held = (params, dict(program.param_slices), [])
        copy, slices, bound = held
        for other in (program, *also):
            if any(other is p for p in bound):
                continue
            if dict(other.param_slices) != slices:
                raise ValueError(f"the programs of one rank's groups must compute with the same parameter slices; "
                                 f"{sorted(set(other.param_slices) ^ set(slices))[:3] or 'their ranges'} differ")
            other.bind(copy.params)
            bound.append(other)
        return copy

    def compute_copies(self) -> list[StageParams]:
        """Every compute copy made so far, one per position this rank has computed at."""
        return [params for params, _, _ in self._params.values()]

    def redistribution(self, strategy: Strategy, params: StageParams) -> Redistribution:
        """The movement plan of ``strategy`` (built collectively on its first step, then cached)."""
        if strategy not in self._moves:
            self._moves[strategy] = Redistribution.build(self.layout, params.ranges, self.chunk_numel,
                                                         params.push_ranges)
        return self._moves[strategy]

    def run_step(self, plan: StepPlan, batch: Sequence[torch.Tensor],
                 program: StageProgram | Sequence[StageProgram], dry_run: bool = False) -> StepStats:
        """One training step: every rank calls it with the same plan and global batch, and the program of its
        own place in the plan (``plan.place_of(rank)``); in a regrouped plan, one program per place of the rank
        (``plan.places_of(rank)``, the order it runs its groups in), all computing with one compute copy: the
        parameters are pulled once, every group's gradients accumulate in it, and they are pushed once. A dry
        run computes forward and backward (compiling what it meets) but leaves parameters and optimiser
        alone."""
        places = plan.places_of(self.ctx.rank)
        programs = list(program) if isinstance(program, (list, tuple)) else [program]
        if not places:
            raise PlanError(f"rank {self.ctx.rank} is in no replica of {plan.strategy.describe()}")
        if len(programs) != len(places) or (len(places) > 1 and not plan.regrouped):
            raise ValueError(f"rank {self.ctx.rank} has {len(places)} place(s) in the plan and was given "
                             f"{len(programs)} program(s); expected one per place")
        self.groups_for(plan)
        first, first_replica = places[0], plan.replicas[places[0].replica]
        step = StepState(plan=plan, replica=first.replica, stage=first.stage, tp_rank=first.tp_rank, dry_run=dry_run)
        scheme = first_replica.scheme
        position = (scheme, first.stage, first.tp_rank, first.cp_rank, first_replica.tp_group(first.stage,
                                                                                              first.cp_rank))
        if plan.regrouped:  # keyed by the slot, whatever the CP size of the group the rank meets first
            position = ("slot", scheme.tp, scheme.pp, first.stage, first.tp_rank, position[-1])
        params = self.stage_params(programs[0], scheme, position, also=programs[1:], shared=plan.regrouped,
                                   tp_rank=first.tp_rank)
        move = self.redistribution(plan.strategy, params)
        self._phase("pull", step)
        flight: MovementInFlight | None = None
        with record_function("hydraulis.pull_params"):
            if self.overlap:
                flat = params.materialize()
                params.zero_grads()
                flight = self.windowed(plan.strategy, move).start(
                    self.layout, flat, None if dry_run else params, self.reduce_dtype, self.inflight_bytes,
                    stream=self.movement_stream)
                step.traffic = flight.traffic
            else:
                step.traffic = move.pull(self.layout, params.materialize())
                params.zero_grads()
        flow = _Flow(programs[0], params, flight,
                     self._windowed[plan.strategy].windows_of(params) if flight is not None else {})
        self._phase("pulled", step)
        self._phase("compute", step)
        pairs = global_pair_count(plan.seq_lens)
        micro = [self._micro_batches(batch, plan.replicas[p.replica], p.cp_rank, prog)
                 for p, prog in zip(places, programs)]
        busy = [k for k, m in enumerate(micro) if m]  # the first forward gates, the last backward reports
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        try:
            with record_function("hydraulis.compute"):
                for k, (place, prog) in enumerate(zip(places, programs)):
                    replica = plan.replicas[place.replica]
                    if plan.regrouped:
                        step.group = place.replica
                        self._phase("group", step)
                    part = flow.part(prog, first=bool(busy) and k == busy[0], last=bool(busy) and k == busy[-1])
                    if replica.scheme.pp == 1:
                        loss = self._run_local(prog, micro[k], pairs, self.ctx.device, part)
                    else:
                        loss = Pipeline(self.ctx.device, replica, place).run(prog, micro[k], pairs, part)
                    if place.stage == replica.scheme.pp - 1 and place.tp_rank == 0:  # each counted pair once
                        loss_sum += loss
            if flight is not None:
                flight.wait_all()
                step.pull_wait_ms = flight.wait_s * 1e3
        except BaseException:
            if flight is not None:
                flight.abort()
            raise
        finally:
            params.on_accumulated = None
        step.loss_sum = loss_sum
        step.tokens_computed = sum(mb.tokens for m in micro for mb in m)
        self._phase("computed", step)
        params.release_data()  # backward is done: only the gradients are still needed
        if dry_run:
            if flight is not None:
                flight.finish_pull()
        else:
            self._phase("push", step)
            with record_function("hydraulis.push_grads"):
                if flight is not None:
                    step.traffic += flight.finish(self.layout)
                else:
                    step.traffic += move.push(self.layout, params.weighted_grads(), self.reduce_dtype)
            self.layout.drop_frozen_grads()  # frozen parameters: no gradient in the norm or the optimiser
        params.release()
        if not dry_run:
            step.finite_probe = self._finite_probe
            step.settings_finite = self._settings_problem() is None
            self._phase("optimizer", step)  # the meter reads the step's statistics and checks: one read
            self.steps_run += 1
            try:
                with self.layout.keep_frozen(self.optimizer):  # frozen parameters keep their values, bit for bit
                    if self._may_step(step):
                        self.optimizer.step()
            finally:
                self.optimizer.zero_grad(set_to_none=True)
        self._phase("end", step)
        return step.stats

    def _finite_probe(self) -> torch.Tensor:
        """(norm of this rank's shard of the summed gradient, largest magnitude of its master weights), on the
        device: NaN or infinite when a value is (an empty shard: zeros)."""
        shard, grad = self.layout.shard.detach(), self.layout.shard.grad
        if shard.numel() == 0:
            return torch.zeros(2, dtype=torch.float64, device=shard.device)
        norm = torch.linalg.vector_norm(grad) if grad is not None else torch.zeros((), device=shard.device)
        return torch.stack([norm.double(), torch.linalg.vector_norm(shard, float("inf")).double()])

    def _settings_problem(self) -> str | None:
        """Which of this rank's optimiser settings is not finite, as ``param group 0: lr=nan`` (None: none)."""
        for i, group in enumerate(self.optimizer.param_groups):
            if (problem := setting_problem(group)) is not None:
                return f"param group {i}: {problem}"
        return None

    def _may_step(self, step: StepState) -> bool:
        """Whether the optimiser may step on what the step read: True when every value is finite; False for a
        skipped step (``non_finite="skip"``, a loss or gradient norm only); else a NonFiniteError on every rank."""
        stats, checks = step.stats, step.checks
        settings = [r for r, (_, _, ok) in enumerate(checks) if not ok]
        weights = [r for r, (_, top, _) in enumerate(checks) if not math.isfinite(top)]
        if not settings and not weights:
            if math.isfinite(stats.loss) and math.isfinite(stats.grad_norm):
                return True
            if self.non_finite == "skip":
                self.non_finite_skips += 1
                return False
        raise NonFiniteError(f"step {self.steps_run}: {self._non_finite_reason(stats, settings, weights)}")

    def _non_finite_reason(self, stats: StepStats, settings: list[int], weights: list[int]) -> str:
        """Why the step stops, the same on every rank (the ranks' details gathered: this is the failure path)."""
        local = self._settings_problem() if settings else self._first_non_finite_weight() if weights else None
        details = comm.all_gather_object(local)
        if settings:
            return (f"the optimiser's settings are not finite on rank {settings[0]} ({details[settings[0]]}): the "
                    f"update would make the weights NaN; not stepped, nothing changed")
        if weights:
            return (f"the master weights are not finite before this step's update (rank {weights[0]}: "
                    f"{details[weights[0]]}), from an earlier update or set outside training; not stepped")
        hint = "" if self.non_finite == "skip" else " (TrainOptions(non_finite='skip') skips such steps instead)"
        return (f"the loss is {stats.loss} and the gradient norm {stats.grad_norm}, expected finite values; not "
                f"stepped, nothing changed{hint}")

    def _first_non_finite_weight(self) -> str:
        """The first parameter whose master weights on this rank hold a NaN or an infinity, and how many do."""
        shard = self.layout.shard.detach()
        bad = (~torch.isfinite(shard)).nonzero().flatten().cpu()
        at = self.layout.flat_index(int(bad[0])) if bad.numel() else None
        name = next((n for n, s in self.layout.specs.items() if at is not None and s.offset <= at < s.offset + s.numel),
                    "padding")
        return f"{name!r} holds {shard[int(bad[0])].item() if bad.numel() else None} ({bad.numel()} values)"

    def _micro_batches(self, batch: Sequence[torch.Tensor], replica: ReplicaPlan, cp_rank: int,
                       program: StageProgram) -> list[micro_batch.MicroBatch]:
        """This rank's micro-batches: whole sequences, or under context parallelism its share of them, padded to
        the bucket of the group's widest share (``StageProgram.bucket``)."""
        cp, device = replica.scheme.cp, self.ctx.device
        if cp == 1:
            return [micro_batch.packed(batch, mb, device) for mb in replica.micro_batches]
        bucket = getattr(program, "bucket", None)
        if bucket is None:
            raise TypeError(f"a {replica.scheme.describe()} replica runs a stage program with a bucket() method "
                            f"(its token buckets); {type(program).__name__} has none")
        return [micro_batch.context_parallel(batch, mb, cp, cp_rank, bucket, device) for mb in replica.micro_batches]

    def _phase(self, name: str, step: StepState) -> None:
        for hook in (reversed(self.hooks) if name == "computed" else self.hooks):
            hook(name, step)

    def windowed(self, strategy: Strategy, move: Redistribution) -> WindowedMovement:
        """The overlapped movement plan of ``strategy`` (made once from its movement plan)."""
        if strategy not in self._windowed:
            self._windowed[strategy] = WindowedMovement(move, self.layout, self.windows, self.chunk_numel)
        return self._windowed[strategy]

    def redistribution_of(self, strategy: Strategy) -> Redistribution | None:
        """The movement plan of ``strategy`` once a step has run it (None before)."""
        return self._moves.get(strategy)

    @staticmethod
    def _run_local(program: StageProgram, micro: list, pairs: int, device: torch.device,
                   flow: "_Flow") -> torch.Tensor:
        """Forward and backward of every micro-batch; the loss sum stays on the device (read once per step)."""
        total = torch.zeros((), dtype=torch.float64, device=device)
        for i, mb in enumerate(micro):
            with flow.forward(first=i == 0):
                (logits,) = mb.run(program, ())
            loss = mb.loss_sum(logits, vocab_shard_of(program))
            flow.backward(last=i == len(micro) - 1)
            (loss / pairs).backward()
            total += loss.detach()
        return total


class _Flow:
    """Where overlapped movement meets the compute loop: during the first forward the program's gate waits for
    the windows of the parameters it is about to read (a program without a gate gets the whole pull first), and
    during the last backward every accumulated gradient is reported to the movement, whose progress thread sends
    each window once it is complete. Without overlapped movement both do nothing (the pull is done and the push
    comes after the compute)."""

    def __init__(self, program: StageProgram, params: StageParams, flight: MovementInFlight | None,
                 windows: dict[str, int]):
        self.program, self.params, self.flight, self.windows = program, params, flight, windows

    def forward(self, first: bool) -> ContextManager:
        if self.flight is None or not first:
            return contextlib.nullcontext()
        if hasattr(self.program, "gate"):
            return self._gated()
        self.flight.wait_all()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _gated(self) -> Iterator[None]:
        self.program.gate = self._wait_for
        try:
            yield
        finally:
            self.program.gate = None

    def _wait_for(self, names: Sequence[str]) -> None:
        """Block until the windows of these parameters are in place."""
        last = max((self.windows[n] for n in names if n in self.windows), default=-1)
        if last >= 0:
            self.flight.wait(last)

    def backward(self, last: bool) -> None:
        if last and self.flight is not None and self.flight.params is not None:
            self.params.on_accumulated = self.flight.accumulated

    def part(self, program: StageProgram, first: bool, last: bool) -> "_Flow":
        """The flow of one of a rank's groups (a regrouped step runs several, with programs of their own): only
        the first group that computes gates its first forward, only the last one reports its last backward."""
        return _GroupFlow(self, program, first, last)


class _GroupFlow(_Flow):
    """One group's view of the step's flow (``_Flow.part``)."""

    def __init__(self, whole: _Flow, program: StageProgram, first: bool, last: bool):
        super().__init__(program, whole.params, whole.flight, whole.windows)
        self.first_group, self.last_group = first, last

    def forward(self, first: bool) -> ContextManager:
        return super().forward(first and self.first_group)

    def backward(self, last: bool) -> None:
        super().backward(last and self.last_group)
