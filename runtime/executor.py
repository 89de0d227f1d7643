"""The step executor: runs this rank's part of a ``StepPlan``.

Every rank gathers the parameters from the fixed layout, takes the slices its stage program declares, runs
its replica's micro-batches (tensor parallel inside the program; a 1F1B pipeline over point-to-point sends
when pp > 1, shapes sent ahead of tensors), accumulates gradients with the loss divided by the global pair
count, reduces the gradient slices back into the layout and steps the optimiser on its shard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import torch
import torch.distributed as dist

from passes.ir import ParallelScheme, StepPlan
from runtime.distributed import DistContext, GroupCache
from runtime.fixed_layout import FixedLayout, ParamSlice, grad_weight
from runtime.loss import global_pair_count, packed_causal_lm_loss_sum
from runtime.topology import Cluster, Placement, place

__all__ = ["StageProgram", "VariantProvider", "StepStats", "Executor", "pack_micro_batch"]


class StageProgram(Protocol):
    """One pipeline stage of one scheme on one TP rank: a function of its parameters and its input."""

    param_slices: Mapping[str, ParamSlice]
    """Every parameter the stage uses, and the slice of it this rank holds."""

    def __call__(self, params: Mapping[str, torch.Tensor], x: torch.Tensor, cu_seqlens: torch.Tensor,
                 max_seqlen: int) -> torch.Tensor:
        """Stage 0 takes token ids (T,), later stages the previous stage's output; the last returns logits."""


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
    """Per rank: CPU time of the thread that computed (forward, backward, sends), ms."""
    wall_ms: float
    """Wall-clock time of the step on this rank, ms."""
    recompiles: int
    """Compilations so far (all variants)."""
    param_bytes_moved: int
    """Bytes this rank received to gather parameters this step."""
    grad_bytes_moved: int
    """Bytes this rank moved to reduce gradients this step."""
    tokens_per_rank: tuple[int, ...]
    """Tokens each rank computed (a TP group's ranks each count their replica's tokens)."""
    plan_ms: float = 0.0
    """Planning wall time of this step on rank 0, ms (0 when the plan was given)."""
    plan_hidden: bool = False
    """Whether planning had finished before the step needed the plan."""


def pack_micro_batch(batch: Sequence[torch.Tensor], indices: Sequence[int],
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Concatenate whole sequences: (input_ids (T,), cu_seqlens int32 (n+1,), max_seqlen)."""
    seqs = [batch[i] for i in indices]
    lens = torch.tensor([0] + [len(s) for s in seqs], dtype=torch.int32)
    return torch.cat(seqs).to(device), torch.cumsum(lens, 0, dtype=torch.int32).to(device), int(lens.max())


class Executor:
    """Runs planned steps on this rank."""

    def __init__(self, ctx: DistContext, cluster: Cluster, layout: FixedLayout, optimizer: torch.optim.Optimizer,
                 provider: VariantProvider):
        self.ctx, self.cluster, self.layout = ctx, cluster, layout
        self.optimizer, self.provider = optimizer, provider
        self.groups = GroupCache()

    def run_step(self, plan: StepPlan, batch: Sequence[torch.Tensor]) -> StepStats:
        """One training step: every rank calls it with the same plan and the same global batch."""
        started = time.perf_counter()
        bytes_before = (self.layout.param_bytes_moved, self.layout.grad_bytes_moved)
        placement = place(plan.strategy, self.cluster)
        self.groups.prepare(placement)
        replica, stage, tp_rank = placement.stage_of(self.ctx.rank)
        scheme = plan.replicas[replica].scheme
        tp_group = self.groups.get(placement.tp_groups(replica)[stage])
        program = self.provider.stage(scheme, stage, tp_rank, tp_group)
        full = self.layout.gather()
        params = {n: s.take(full[n]).detach().clone().requires_grad_(True) for n, s in program.param_slices.items()}
        pairs = global_pair_count(plan.seq_lens)
        busy_start = time.thread_time()
        micro = [pack_micro_batch(batch, mb, self.ctx.device) for mb in plan.replicas[replica].micro_batches]
        if scheme.pp == 1:
            loss_sum = self._run_local(program, params, micro, pairs)
        else:
            loss_sum = _Pipeline(self, placement, replica, stage, tp_rank).run(program, params, micro, pairs)
        busy_ms = (time.thread_time() - busy_start) * 1e3
        counted = loss_sum if (stage == scheme.pp - 1 and tp_rank == 0) else 0.0
        self.layout.reduce_gradients({n: (s, _grad_or_zeros(params[n]), grad_weight(s, scheme.tp))
                                     for n, s in program.param_slices.items()})
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = sum(plan.seq_lens[i] for mb in plan.replicas[replica].micro_batches for i in mb)
        summary = torch.tensor([counted, busy_ms, float(tokens)], dtype=torch.float64)
        gathered = [torch.zeros_like(summary) for _ in range(self.ctx.world_size)]
        dist.all_gather(gathered, summary)
        return StepStats(
            loss=sum(float(g[0]) for g in gathered) / max(1, pairs), tokens=sum(plan.seq_lens),
            strategy=plan.strategy.describe(), busy_ms=tuple(float(g[1]) for g in gathered),
            wall_ms=(time.perf_counter() - started) * 1e3, recompiles=self.provider.recompiles(),
            param_bytes_moved=self.layout.param_bytes_moved - bytes_before[0],
            grad_bytes_moved=self.layout.grad_bytes_moved - bytes_before[1],
            tokens_per_rank=tuple(int(g[2]) for g in gathered),
        )

    @staticmethod
    def _run_local(program: StageProgram, params: dict, micro: list, pairs: int) -> float:
        total = 0.0
        for ids, cu, max_len in micro:
            logits = program(params, ids, cu, max_len)
            loss = packed_causal_lm_loss_sum(logits, ids, cu)
            (loss / pairs).backward()
            total += float(loss.detach())
        return total


def _grad_or_zeros(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


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

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        """Non-blocking, so that neighbours sending to each other at once cannot deadlock."""
        shape = torch.tensor([tensor.dim(), *tensor.shape, *([0] * (4 - tensor.dim()))], dtype=torch.int64)
        payload = tensor.detach().contiguous()
        self.in_flight.append((dist.isend(shape, dst), shape))
        self.in_flight.append((dist.isend(payload, dst), payload))

    def _recv(self, src: int, dtype: torch.dtype) -> torch.Tensor:
        shape = torch.zeros(5, dtype=torch.int64)
        dist.recv(shape, src)
        out = torch.empty([int(d) for d in shape[1:1 + int(shape[0])]], dtype=dtype, device=self.device)
        dist.recv(out, src)
        return out

    def run(self, program: StageProgram, params: dict, micro: list, pairs: int) -> float:
        v = len(micro)
        warmup = min(self.pp - self.stage - 1, v)
        pending: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        total = 0.0
        order = ["F"] * warmup + ["F", "B"] * (v - warmup) + ["B"] * warmup
        forwards = 0
        for op in order:
            if op == "F":
                out, inp, loss = self._forward(program, params, micro[forwards], pairs)
                total += loss
                pending.append((out, inp))
                forwards += 1
            else:
                self._backward(*pending.pop(0))
        for work, _ in self.in_flight:
            work.wait()
        return total

    def _forward(self, program, params, mb, pairs):
        ids, cu, max_len = mb
        if self.prev is None:
            inp = None
            x = ids
        else:
            inp = self._recv(self.prev, torch.float32).requires_grad_(True)
            x = inp
        out = program(params, x, cu, max_len)
        if self.next is not None:
            self._send(out, self.next)
            return out, inp, 0.0
        loss = packed_causal_lm_loss_sum(out, ids, cu)
        return loss / pairs, inp, float(loss.detach())

    def _backward(self, out: torch.Tensor, inp: torch.Tensor | None) -> None:
        if self.next is None:
            out.backward()
        else:
            grad = self._recv(self.next, out.dtype)
            out.backward(grad)
        if inp is not None:
            self._send(inp.grad if inp.grad is not None else torch.zeros_like(inp), self.prev)
