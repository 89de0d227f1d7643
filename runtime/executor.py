"""The step executor: runs this rank's part of a ``StepPlan``.

Every rank pulls the parameter slices its stage program computes with from the fixed layout's owners
(``runtime.redistribute``) into the program's compute copy (``runtime.stage_params``), runs its replica's
micro-batches (tensor parallel inside the program; a 1F1B pipeline over point-to-point sends when pp > 1,
shapes sent ahead of tensors) with the loss divided by the global pair count, pushes the gradient slices
back to their owners and steps the optimiser on its shard. The compute copy exists only during the step.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

import torch
from torch import nn
from torch.profiler import record_function

from passes.plan.ir import ParallelScheme, StepPlan, Strategy
from runtime import distributed as comm
from runtime.cpu_clock import RankCpuClock
from runtime.distributed import DistContext, GroupCache
from runtime.fixed_layout import FixedLayout, ParamSlice
from runtime.loss import global_pair_count, packed_causal_lm_loss_sum
from runtime.redistribute import DEFAULT_CHUNK_NUMEL, Redistribution, Traffic
from runtime.stage_params import StageParams
from runtime.topology import Cluster, Placement, place

__all__ = ["StageProgram", "VariantProvider", "StepStats", "Executor", "pack_micro_batch"]


class StageProgram(Protocol):
    """One pipeline stage of one scheme on one TP rank. The runtime owns the parameters it computes with
    (one ``nn.Parameter`` per slice, in the compute dtype, their storage swapped in for each step); the
    program is bound to them once and uses them in every call."""

    param_slices: Mapping[str, ParamSlice]
    """Every parameter the stage uses, and the slice of it this rank holds."""

    def bind(self, params: Mapping[str, nn.Parameter]) -> None:
        """Compute with ``params`` (by name, shaped as the slices) from now on, in every token bucket."""

    def __call__(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                 boundary: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The stage's outputs: the tensors the next stage takes, or ``(logits,)`` (T, vocab) on the last."""

    def boundary_in(self, tokens: int) -> list:
        """What the stage receives from the previous one for a micro-batch of ``tokens`` tokens, in order: per
        item a ``(shape, dtype)``, or a list of them for a tuple-valued item (known from the program, so no
        header travels with the activations)."""


class VariantProvider(Protocol):
    """Where stage programs come from (the compiler's variant cache)."""

    def stage(self, scheme: ParallelScheme, stage: int, tp_rank: int,
              tp_group: comm.ProcessGroup | None) -> StageProgram:
        """The program of ``stage`` of ``scheme`` for TP rank ``tp_rank``."""

    def recompiles(self) -> int:
        """Compilations so far."""


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
    """Per rank: CPU time of its forward, backward and their communication (the computing thread plus the
    communication threads; background planning left out; ``runtime.cpu_clock``), ms."""
    wall_ms: float
    """Wall-clock time of the step on this rank, ms."""
    recompiles: int
    """Compilations so far (all variants)."""
    traffic: Traffic
    """Bytes this rank moved this step: parameter slices in, its shard's parts out, gradients both ways."""
    tokens_per_rank: tuple[int, ...]
    """Tokens each rank computed (a TP group's ranks each count their replica's tokens)."""
    plan_ms: float = 0.0
    """Planning wall time of this step on rank 0, ms (0 when the plan was given)."""
    plan_hidden: bool = False
    """Whether planning had finished before the step needed the plan."""
    compute_thread_ms: tuple[float, ...] = ()
    """Per rank: CPU time of the computing thread alone over the same window (communication threads left
    out), ms."""
    skipped: bool = False
    """The global batch had no next-token pair (only 1-token sequences): nothing ran, nothing changed (no
    optimiser step), ``loss`` is 0."""


def pack_micro_batch(batch: Sequence[torch.Tensor], indices: Sequence[int],
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Concatenate whole sequences: (input_ids (T,), cu_seqlens int32 (n+1,), max_seqlen), built on the host
    from the host batch and copied to ``device``: only these sequences travel, and nothing is read back."""
    seqs = [batch[i] for i in indices]
    lengths = [int(t.numel()) for t in seqs]  # host tensors: no device read
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cpu")
    ids = torch.cat([t.cpu() for t in seqs])
    return ids.to(device, non_blocking=True), cu.to(device, non_blocking=True), max(lengths)


class Executor:
    """Runs planned steps on this rank."""

    def __init__(self, ctx: DistContext, cluster: Cluster, layout: FixedLayout, optimizer: torch.optim.Optimizer,
                 provider: VariantProvider, take_turns: bool = False, param_dtype: torch.dtype = torch.float32,
                 reduce_dtype: torch.dtype = torch.float32, chunk_numel: int = DEFAULT_CHUNK_NUMEL):
        self.ctx, self.cluster, self.layout = ctx, cluster, layout
        self.optimizer, self.provider = optimizer, provider
        self.take_turns = take_turns
        """Replicas compute their micro-batches one after the other (a barrier between turns) instead of at once.
        For measurement on a host with fewer cores than ranks: each replica then has the cores to itself, so
        a rank's busy time is what it would be with a core of its own, not inflated by other ranks
        time-slicing its core; the step's wall time becomes the sum of the replicas' times."""
        self.param_dtype, self.reduce_dtype, self.chunk_numel = param_dtype, reduce_dtype, chunk_numel
        self.groups = GroupCache()
        self.cpu_clock = RankCpuClock()
        """This rank's CPU clock; background threads (planning) register with it so busy times leave them out."""
        self._params: dict[int, tuple[StageProgram, StageParams]] = {}
        self._moves: dict[Strategy, Redistribution] = {}
        self.on_phase: Callable[[str], None] | None = None
        """Called with ``pull``, ``compute``, ``push``, ``optimizer`` and ``end`` as a step enters each phase
        (instrumentation: memory and time per phase)."""

    def stage_params(self, program: StageProgram, scheme: ParallelScheme) -> StageParams:
        """The compute copy of ``program``'s slices (made and bound once per program)."""
        key = id(program)
        if key not in self._params:
            params = StageParams(self.layout, program.param_slices, scheme.tp, self.param_dtype, self.ctx.device)
            program.bind(params.params)
            self._params[key] = (program, params)  # the program is kept so that its id stays its own
        return self._params[key][1]

    def redistribution(self, strategy: Strategy, params: StageParams) -> Redistribution:
        """The movement plan of ``strategy`` (built collectively on its first step, then cached)."""
        if strategy not in self._moves:
            self._moves[strategy] = Redistribution.build(self.layout, params.ranges, self.chunk_numel)
        return self._moves[strategy]

    def run_step(self, plan: StepPlan, batch: Sequence[torch.Tensor], dry_run: bool = False) -> StepStats:
        """One training step: every rank calls it with the same plan and the same global batch. A dry run
        computes forward and backward (compiling what it meets) but leaves parameters and optimiser alone."""
        started = time.perf_counter()
        placement = place(plan.strategy, self.cluster)
        self.groups.prepare(placement)
        replica, stage, tp_rank = placement.stage_of(self.ctx.rank)
        scheme = plan.replicas[replica].scheme
        tp_group = self.groups.get(placement.tp_groups(replica)[stage])
        program = self.provider.stage(scheme, stage, tp_rank, tp_group)
        params = self.stage_params(program, scheme)
        move = self.redistribution(plan.strategy, params)
        self._phase("pull")
        with record_function("hydraulis.pull_params"):
            traffic = move.pull(self.layout, params.materialize())
        params.zero_grads()
        self._phase("compute")
        pairs = global_pair_count(plan.seq_lens)
        turns = len(plan.replicas) if self.take_turns else 0
        for _ in range(min(replica, turns)):  # earlier replicas' turns
            comm.barrier()
        clock = _BusyClock(self.cpu_clock, self.ctx.device)
        micro = [pack_micro_batch(batch, mb, self.ctx.device) for mb in plan.replicas[replica].micro_batches]
        with record_function("hydraulis.compute"):
            if scheme.pp == 1:
                loss_sum = self._run_local(program, micro, pairs, self.ctx.device)
            else:
                loss_sum = _Pipeline(self, placement, replica, stage, tp_rank).run(program, micro, pairs)
        clock.stop()
        for _ in range(min(replica, turns), turns):  # this replica's turn ends, then the later ones'
            comm.barrier()
        counted = loss_sum if (stage == scheme.pp - 1 and tp_rank == 0) else torch.zeros_like(loss_sum)
        params.release_data()  # backward is done: only the gradients are still needed
        if not dry_run:
            self._phase("push")
            with record_function("hydraulis.push_grads"):
                traffic += move.push(self.layout, params.weighted_grads(), self.reduce_dtype)
            params.release()
            self._phase("optimizer")
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        params.release()
        self._phase("end")
        tokens = sum(plan.seq_lens[i] for mb in plan.replicas[replica].micro_batches for i in mb)
        busy_ms, thread_ms = clock.read()  # after the step: a CUDA event is read once, here
        summary = torch.cat([counted.reshape(1).double(), torch.tensor(
            [busy_ms, float(tokens), thread_ms], dtype=torch.float64, device=counted.device)])
        gathered = torch.stack(comm.all_gather(summary)).cpu().tolist()  # the step's one read of device values
        return StepStats(
            loss=sum(g[0] for g in gathered) / max(1, pairs), tokens=sum(plan.seq_lens),
            strategy=plan.strategy.describe(), busy_ms=tuple(g[1] for g in gathered),
            wall_ms=(time.perf_counter() - started) * 1e3, recompiles=self.provider.recompiles(),
            traffic=traffic, tokens_per_rank=tuple(int(g[2]) for g in gathered),
            compute_thread_ms=tuple(g[3] for g in gathered),
        )

    def _phase(self, name: str) -> None:
        if self.on_phase is not None:
            self.on_phase(name)

    def redistribution_of(self, strategy: Strategy) -> Redistribution | None:
        """The movement plan of ``strategy`` once a step has run it (None before)."""
        return self._moves.get(strategy)

    @staticmethod
    def _run_local(program: StageProgram, micro: list, pairs: int, device: torch.device) -> torch.Tensor:
        """Forward and backward of every micro-batch; the loss sum stays on the device (read once per step)."""
        total = torch.zeros((), dtype=torch.float64, device=device)
        for ids, cu, max_len in micro:
            (logits,) = program(ids, cu, max_len, ())
            loss = packed_causal_lm_loss_sum(logits, ids, cu)
            (loss / pairs).backward()
            total += loss.detach()
        return total


class _BusyClock:
    """A rank's busy time over the compute phase: CUDA events on the current stream on a GPU (the kernels'
    time, read once the step is over), CPU time of the process less background threads on the CPU."""

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


class _Pipeline:
    """1F1B over the replica's stages: stage s runs ``min(pp - s - 1, v)`` forwards ahead, then alternates
    one forward and one backward, then drains the backwards. Activations go to the same TP rank of the next
    stage, gradients come back the same way; no header travels: the receiver knows every shape and dtype
    from its program (``StageProgram.boundary_in`` for the micro-batch's tokens; its own outputs for their
    gradients), and the loss stays on the device."""

    def __init__(self, ex: Executor, placement: Placement, replica: int, stage: int, tp_rank: int):
        groups = placement.tp_groups(replica)
        self.pp, self.stage = len(groups), stage
        self.prev = groups[stage - 1][tp_rank] if stage > 0 else None
        self.next = groups[stage + 1][tp_rank] if stage + 1 < len(groups) else None
        self.device = ex.ctx.device
        self.in_flight: list[tuple[comm.Work, torch.Tensor]] = []

    def _send(self, leaves: Sequence[torch.Tensor], dst: int) -> None:
        """Non-blocking (neighbours sending to each other at once cannot deadlock), leaf by leaf in order."""
        for t in leaves:
            self.in_flight.append(comm.isend(t.detach(), dst))

    def _recv(self, specs: list, src: int) -> list:
        """Boundary items shaped as ``specs`` (``(shape, dtype)`` or a list of them per item), received."""
        items = []
        for spec in specs:
            group = spec if isinstance(spec, list) else [spec]
            leaves = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in group]
            for t in leaves:
                comm.recv(t, src)
            items.append(leaves if isinstance(spec, list) else leaves[0])
        return [tuple(i) if isinstance(i, list) else i for i in items]

    def run(self, program: StageProgram, micro: list, pairs: int) -> torch.Tensor:
        v = len(micro)
        warmup = min(self.pp - self.stage - 1, v)
        pending: list[tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]] = []
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        order = ["F"] * warmup + ["F", "B"] * (v - warmup) + ["B"] * warmup
        forwards = 0
        for op in order:
            if op == "F":
                outs, inputs, loss = self._forward(program, micro[forwards], pairs)
                total += loss
                pending.append((outs, inputs))
                forwards += 1
            else:
                self._backward(*pending.pop(0))
        for work, _ in self.in_flight:
            work.wait()
        return total

    def _forward(self, program: StageProgram, mb: tuple, pairs: int):
        ids, cu, max_len = mb
        inputs = [] if self.prev is None else self._recv(program.boundary_in(int(ids.shape[0])), self.prev)
        for t in _leaves(inputs):
            if t.is_floating_point():
                t.requires_grad_(True)
        outs = program(ids, cu, max_len, tuple(inputs))
        if self.next is not None:
            self._send(_leaves(outs), self.next)
            return outs, inputs, torch.zeros((), dtype=torch.float64, device=self.device)
        loss = packed_causal_lm_loss_sum(outs[0], ids, cu)
        return (loss / pairs,), inputs, loss.detach()

    def _backward(self, outs: tuple[torch.Tensor, ...], inputs: list[torch.Tensor]) -> None:
        if self.next is None:
            outs[0].backward()
        else:
            floating = [o for o in _leaves(outs) if o.is_floating_point()]
            grads = self._recv([(tuple(o.shape), o.dtype) for o in floating], self.next)
            pairs = [(o, g) for o, g in zip(floating, grads) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if self.prev is not None:
            self._send([t.grad if t.grad is not None else torch.zeros_like(t)
                        for t in _leaves(inputs) if t.is_floating_point()], self.prev)


def _leaves(items: Sequence) -> list[torch.Tensor]:
    """The tensors of boundary items (tensors, or tuples of tensors), in order."""
    leaves: list[torch.Tensor] = []
    for item in items:
        if isinstance(item, torch.Tensor):
            leaves.append(item)
        elif isinstance(item, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in item):
            leaves.extend(item)
        else:
            raise TypeError(f"a pipeline boundary carries tensors or tuples of tensors, got {type(item).__name__}")
    return leaves
