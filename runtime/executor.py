"""The step executor: runs this rank's part of a ``StepPlan``.

Every rank pulls the parameter slices its stage program computes with from the fixed layout's owners
(``runtime.redistribute``) into the program's compute copy (``runtime.stage_params``), runs its replica's
micro-batches (tensor parallel inside the program; a 1F1B pipeline over point-to-point sends when pp > 1,
shapes sent ahead of tensors) with the loss divided by the global pair count, pushes the gradient slices
back to their owners and steps the optimiser on its shard. The compute copy exists only during the step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from passes.plan.ir import ParallelScheme, StepPlan, Strategy
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


class VariantProvider(Protocol):
    """Where stage programs come from (the compiler's variant cache)."""

    def stage(self, scheme: ParallelScheme, stage: int, tp_rank: int,
              tp_group: dist.ProcessGroup | None) -> StageProgram:
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
    """Concatenate whole sequences: (input_ids (T,), cu_seqlens int32 (n+1,), max_seqlen)."""
    seqs = [batch[i] for i in indices]
    lens = torch.tensor([0] + [len(s) for s in seqs], dtype=torch.int32)
    return torch.cat(seqs).to(device), torch.cumsum(lens, 0, dtype=torch.int32).to(device), int(lens.max())


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
            dist.barrier()
        busy_start, thread_start = self.cpu_clock.seconds(), time.thread_time()
        micro = [pack_micro_batch(batch, mb, self.ctx.device) for mb in plan.replicas[replica].micro_batches]
        with record_function("hydraulis.compute"):
            if scheme.pp == 1:
                loss_sum = self._run_local(program, micro, pairs)
            else:
                loss_sum = _Pipeline(self, placement, replica, stage, tp_rank).run(program, micro, pairs)
        thread_ms = (time.thread_time() - thread_start) * 1e3
        busy_ms = (self.cpu_clock.seconds() - busy_start) * 1e3
        for _ in range(min(replica, turns), turns):  # this replica's turn ends, then the later ones'
            dist.barrier()
        counted = loss_sum if (stage == scheme.pp - 1 and tp_rank == 0) else 0.0
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
        summary = torch.tensor([counted, busy_ms, float(tokens), thread_ms], dtype=torch.float64,
                               device=self.ctx.device)
        gathered = [torch.zeros_like(summary) for _ in range(self.ctx.world_size)]
        dist.all_gather(gathered, summary)
        return StepStats(
            loss=sum(float(g[0]) for g in gathered) / max(1, pairs), tokens=sum(plan.seq_lens),
            strategy=plan.strategy.describe(), busy_ms=tuple(float(g[1]) for g in gathered),
            wall_ms=(time.perf_counter() - started) * 1e3, recompiles=self.provider.recompiles(),
            traffic=traffic, tokens_per_rank=tuple(int(g[2]) for g in gathered),
            compute_thread_ms=tuple(float(g[3]) for g in gathered),
        )

    def _phase(self, name: str) -> None:
        if self.on_phase is not None:
            self.on_phase(name)

    def redistribution_of(self, strategy: Strategy) -> Redistribution | None:
        """The movement plan of ``strategy`` once a step has run it (None before)."""
        return self._moves.get(strategy)

    @staticmethod
    def _run_local(program: StageProgram, micro: list, pairs: int) -> float:
        total = 0.0
        for ids, cu, max_len in micro:
            (logits,) = program(ids, cu, max_len, ())
            loss = packed_causal_lm_loss_sum(logits, ids, cu)
            (loss / pairs).backward()
            total += float(loss.detach())
        return total


class _Pipeline:
    """1F1B over the replica's stages: stage s runs ``min(pp - s - 1, v)`` forwards ahead, then alternates
    one forward and one backward, then drains the backwards. Activations go to the same TP rank of the
    next stage, preceded by their shape; gradients come back the same way."""

    def __init__(self, ex: Executor, placement: Placement, replica: int, stage: int, tp_rank: int):
        groups = placement.tp_groups(replica)
        self.pp, self.stage = len(groups), stage
        self.prev = groups[stage - 1][tp_rank] if stage > 0 else None
        self.next = groups[stage + 1][tp_rank] if stage + 1 < len(groups) else None
        self.device = ex.ctx.device
        self.in_flight: list[tuple[dist.Work, torch.Tensor]] = []

    def _send(self, items: Sequence, dst: int) -> None:
        """Non-blocking (neighbours sending to each other at once cannot deadlock): a header with the
        items' structure (a tensor, or a tuple of k tensors) and each tensor's dtype and shape, then the
        tensors."""
        structure, leaves = _flatten(items)
        header = [len(leaves), len(structure), *structure, *([0] * (_MAX_ITEMS - len(structure)))]
        for t in leaves:
            header += [_DTYPES.index(t.dtype), t.dim(), *t.shape, *([0] * (_MAX_DIMS - t.dim()))]
        header_t = torch.tensor(header + [0] * (_HEADER - len(header)), dtype=torch.int64)
        self.in_flight.append((dist.isend(header_t, dst), header_t))
        for t in leaves:
            payload = t.detach().contiguous()
            self.in_flight.append((dist.isend(payload, dst), payload))

    def _recv(self, src: int) -> list:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        dist.recv(header, src)
        values = header.tolist()
        n_leaves, n_items = values[0], values[1]
        structure, pos, leaves = values[2:2 + n_items], 2 + _MAX_ITEMS, []
        for _ in range(n_leaves):
            dtype, dims = _DTYPES[values[pos]], values[pos + 1]
            t = torch.empty(values[pos + 2:pos + 2 + dims], dtype=dtype, device=self.device)
            pos += 2 + _MAX_DIMS
            dist.recv(t, src)
            leaves.append(t)
        return _unflatten(structure, leaves)

    def run(self, program: StageProgram, micro: list, pairs: int) -> float:
        v = len(micro)
        warmup = min(self.pp - self.stage - 1, v)
        pending: list[tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]] = []
        total = 0.0
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
        inputs = [] if self.prev is None else self._recv(self.prev)
        for t in _flatten(inputs)[1]:
            if t.is_floating_point():
                t.requires_grad_(True)
        outs = program(ids, cu, max_len, tuple(inputs))
        if self.next is not None:
            self._send(outs, self.next)
            return outs, inputs, 0.0
        loss = packed_causal_lm_loss_sum(outs[0], ids, cu)
        return (loss / pairs,), inputs, float(loss.detach())

    def _backward(self, outs: tuple[torch.Tensor, ...], inputs: list[torch.Tensor]) -> None:
        if self.next is None:
            outs[0].backward()
        else:
            grads = iter(_flatten(self._recv(self.next))[1])
            pairs = [(o, next(grads)) for o in _flatten(outs)[1] if o.is_floating_point()]
            pairs = [(o, g) for o, g in pairs if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if self.prev is not None:
            self._send([t.grad if t.grad is not None else torch.zeros_like(t)
                        for t in _flatten(inputs)[1] if t.is_floating_point()], self.prev)


def _flatten(items: Sequence) -> tuple[list[int], list[torch.Tensor]]:
    """Boundary items (tensors, or tuples of tensors) as a structure (-1: a tensor, k: a k-tuple) and leaves."""
    structure, leaves = [], []
    for item in items:
        if isinstance(item, torch.Tensor):
            structure.append(-1)
            leaves.append(item)
        elif isinstance(item, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in item):
            structure.append(len(item))
            leaves.extend(item)
        else:
            raise TypeError(f"a pipeline boundary carries tensors or tuples of tensors, got {type(item).__name__}")
    if len(structure) > _MAX_ITEMS or len(leaves) > _MAX_LEAVES:
        raise ValueError(f"a pipeline boundary of {len(structure)} items / {len(leaves)} tensors is too large")
    return structure, leaves


def _unflatten(structure: list[int], leaves: list[torch.Tensor]) -> list:
    out, pos = [], 0
    for k in structure:
        if k == -1:
            out.append(leaves[pos])
            pos += 1
        else:
            out.append(tuple(leaves[pos:pos + k]))
            pos += k
    return out


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.float64]
_MAX_DIMS, _MAX_ITEMS, _MAX_LEAVES = 4, 8, 16
_HEADER = 2 + _MAX_ITEMS + _MAX_LEAVES * (2 + _MAX_DIMS)
