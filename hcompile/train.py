"""Heterogeneous training: ``hcompile.compile(model, loss="causal_lm", optimizer=...)`` returns a
``Trainer`` whose ``train_step(batch)`` plans the global batch (strategy, dispatch, packing), runs this
rank's replica with compiled variants, and steps the optimiser on the fixed ZeRO-1 layout.

Owns the bridge between the compiler and the runtime: ``CompiledProvider`` turns a ``CompiledModel`` into
the runtime's stage programs (tensor-parallel rewrite, then packed attention, per token bucket, cached),
and the default CPU cost model (graph analysis with a per-rank token cap).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import fx

from hcompile.api import CompiledModel, _copy_graph, _pad_to_bucket
from passes.analyze import Hardware, analytic_cost_model, analyze_graph
from passes.datasets import LengthDataset
from passes.ir import CostModel, ParallelScheme, PlanError, Strategy
from passes.packed_attention import rewrite_packed_attention_pass
from passes.pass_runner import PassContext, run_passes
from passes.plan_policies import POLICIES, Planner, sized_homogeneous
from passes.plan_pool import build_pool
from passes.tensor_parallel import ParamSlice, decide_tensor_parallel, shard_tensor_parallel_pass
from passes.variant import TokenBuckets
from runtime.checkpoint import load_checkpoint, save_checkpoint
from runtime.distributed import DistContext, init_distributed
from runtime.executor import Executor, StepStats
from runtime.fixed_layout import FixedLayout, full_slice
from runtime.planning import PlanService
from runtime.topology import Cluster, place

__all__ = ["TrainOptions", "Trainer", "CompiledProvider", "cpu_cost_model", "cap_tokens"]

CPU = Hardware(name="cpu", peak_tflops=0.2, memory_gib=1024.0, reserved_gib=0.0, link_gbps=5.0,
               fixed_ms_per_layer=0.2, gpus_per_node=1024)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainOptions:
    """How to train a compiled model."""

    loss: str = "causal_lm"
    """The loss; ``causal_lm`` (next-token cross-entropy within each sequence, mean over the global batch)."""
    optimizer: type = torch.optim.AdamW
    """Optimiser class, applied to this rank's shard of the fixed layout (elementwise optimisers only)."""
    optimizer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of the optimiser."""
    strategies: str | tuple[str, ...] = "auto"
    """``auto`` (a pool built from the data) or strategies such as ``("4x(tp1)", "1x(tp2)+2x(tp1)")``."""
    max_tokens: int | None = None
    """Per-rank memory cap in tokens (a scheme with tensor-parallel degree tp holds tp times as many);
    None: the given cost model's caps, or 1024 tokens per rank with the default CPU cost model."""
    policy: str = "hydraulis"
    """Planner policy (the baselines are available for side-by-side runs)."""
    buckets: TokenBuckets | None = None
    """Token buckets micro-batches are padded to; default powers of two from 64 tokens."""

    def __post_init__(self) -> None:
        if self.loss != "causal_lm":
            raise ValueError(f"unknown loss {self.loss!r}; supported: 'causal_lm'")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer or None, got {self.max_tokens!r}")
        if self.strategies != "auto":
            for text in self.strategies:
                Strategy.parse(text)


class _PackedStage:
    """A StageProgram: rank ``tp_rank``'s part of the whole model (pp = 1) over a packed micro-batch."""

    def __init__(self, provider: "CompiledProvider", scheme: ParallelScheme, tp_rank: int, group_name: str | None):
        self.provider, self.scheme, self.tp_rank, self.group_name = provider, scheme, tp_rank, group_name
        self.param_slices: dict[str, ParamSlice] = provider.slices(scheme, tp_rank)

    def __call__(self, params: Mapping[str, torch.Tensor], x: torch.Tensor, cu_seqlens: torch.Tensor,
                 max_seqlen: int) -> torch.Tensor:
        ids, cu, max_len, total, bucket = _pad_to_bucket(x, cu_seqlens, self.provider.buckets)
        gm = self.provider.graph(self.scheme, self.tp_rank, self.group_name, bucket)
        out = torch.func.functional_call(gm, dict(params), (ids, cu, max_len), strict=False)
        return out[self.provider.compiled.captured(bucket).output_index][0, :total]


class CompiledProvider:
    """Stage programs from a CompiledModel: per (scheme, TP rank, bucket) one rewritten graph, built once."""

    def __init__(self, compiled: CompiledModel, buckets: TokenBuckets):
        self.compiled, self.buckets = compiled, buckets
        self.compiled.buckets = buckets
        self._graphs: dict[tuple, fx.GraphModule] = {}
        self._slices: dict[tuple[ParallelScheme, int], dict[str, ParamSlice]] = {}
        self.builds = 0

    def stage(self, scheme: ParallelScheme, stage: int, tp_rank: int,
              tp_group: dist.ProcessGroup | None) -> _PackedStage:
        if scheme.pp != 1 or stage != 0:
            raise PlanError(f"scheme {scheme.describe()}: pipeline stages of compiled models are not supported yet "
                            f"(use schemes with pp=1)")
        return _PackedStage(self, scheme, tp_rank, None if tp_group is None else tp_group.group_name)

    def slices(self, scheme: ParallelScheme, tp_rank: int) -> dict[str, ParamSlice]:
        """Every parameter the model reads, with rank ``tp_rank``'s slice (whole parameters when tp = 1)."""
        key = (scheme, tp_rank)
        if key not in self._slices:
            if scheme.tp == 1:
                self._slices[key] = {n: full_slice(n, tuple(p.shape)) for n, p in self.compiled.model.named_parameters()}
            else:
                gm = self.compiled.captured(self.buckets.sizes[0]).graph_module
                plan = decide_tensor_parallel(gm, scheme.tp, tp_rank)
                self._slices[key] = {p.name: p for p in plan.params}
        return self._slices[key]

    def graph(self, scheme: ParallelScheme, tp_rank: int, group_name: str | None, bucket: int) -> fx.GraphModule:
        """The packed (and, for tp > 1, sharded) graph for ``bucket`` tokens."""
        key = (scheme, tp_rank, group_name, bucket)
        if key not in self._graphs:
            source = self.compiled.captured(bucket).graph_module
            gm = fx.GraphModule(source, _copy_graph(source))
            ctx = PassContext(scheme=scheme, tp_rank=tp_rank, tp_group=group_name)
            gm, _ = run_passes(gm, [shard_tensor_parallel_pass, rewrite_packed_attention_pass], ctx)
            self._graphs[key] = gm
            self.builds += 1
        return self._graphs[key]

    def recompiles(self) -> int:
        return self.builds

    def largest_bucket(self, up_to: int) -> int:
        """The largest bucket (up to the first >= ``up_to``) the model can be captured at. Capture runs the
        model on one packed row, so a learned position table bounds a micro-batch's tokens."""
        largest = 0
        for bucket in self.buckets.sizes:
            try:
                self.compiled.captured(bucket)
            except Exception:
                if largest == 0:
                    raise
                break
            largest = bucket
            if bucket >= up_to:
                break
        return largest


def cpu_cost_model(compiled: CompiledModel, world_size: int, max_tokens: int | None) -> CostModel:
    """Analytic cost model of the captured graph on a CPU, schemes tp in divisors of the head count (pp = 1),
    each capped at ``max_tokens * tp`` tokens per micro-batch (1024 per rank when None)."""
    analysis = analyze_graph(compiled.captured(64).graph_module)
    heads = min((site.heads for site in analysis.attention), default=1)
    schemes = [ParallelScheme(tp=tp) for tp in range(1, world_size + 1)
               if world_size % tp == 0 and heads % tp == 0]
    model = analytic_cost_model(analysis, CPU, schemes, name=f"{type(compiled.model).__name__}@cpu")
    per_rank = 1024 if max_tokens is None else max_tokens
    return cap_tokens(model, {e.scheme: per_rank * e.scheme.tp for e in model.entries})


def cap_tokens(model: CostModel, caps: Mapping[ParallelScheme, int]) -> CostModel:
    """``model`` with each scheme's ``max_tokens`` lowered to ``caps[scheme]``."""
    entries = tuple(dataclasses.replace(e, max_tokens=min(e.max_tokens, caps.get(e.scheme, e.max_tokens)))
                    for e in model.entries)
    return dataclasses.replace(model, entries=entries)


class Trainer:
    """Data-parallel replicas of any strategy, planned per step, on every rank of the job."""

    def __init__(self, compiled: CompiledModel, options: TrainOptions, *, cost_model: CostModel | None = None,
                 dataset: LengthDataset | None = None, cluster: Cluster | None = None):
        self.options, self.dataset = options, dataset
        self.ctx = _context()
        buckets = options.buckets or TokenBuckets.powers_of_two(64, 1 << 20)
        self.provider = CompiledProvider(compiled, buckets)
        self.layout = FixedLayout(dict(compiled.model.named_parameters()), self.ctx.rank, self.ctx.world_size,
                                  self.ctx.device)
        self.optimizer = options.optimizer([self.layout.shard], **dict(options.optimizer_kwargs))
        self.cluster = cluster or Cluster.local(self.ctx.world_size)
        self.executor = Executor(self.ctx, self.cluster, self.layout, self.optimizer, self.provider)
        model = cost_model or cpu_cost_model(compiled, self.ctx.world_size, options.max_tokens)
        if cost_model is not None and options.max_tokens is not None:
            model = cap_tokens(model, {e.scheme: options.max_tokens * e.scheme.tp for e in model.entries})
        capturable = self.provider.largest_bucket(max(e.max_tokens for e in model.entries))
        self.cost_model = cap_tokens(model, {e.scheme: capturable for e in model.entries})
        self._service: PlanService | None = None
        self._submitted: tuple[tuple[int, ...], str | None] | None = None
        self.last_plan = None

    def _planner(self, seq_lens: Sequence[int]) -> PlanService:
        if self._service is None:
            data = self.dataset or LengthDataset.from_lengths("first-batch", list(seq_lens))
            longest = max(data.max_len, max(seq_lens))
            fixed = sized_homogeneous(self.cost_model, self.ctx.world_size, longest)
            if self.options.strategies == "auto":
                pool = build_pool(self.cost_model, self.ctx.world_size, data, sum(seq_lens), fixed)
            else:
                pool = [Strategy.parse(s) for s in self.options.strategies]
            planner = Planner(self.cost_model, self.ctx.world_size, pool, fixed)
            self._service = PlanService(planner, self.ctx.rank, self.options.policy)
            self.warm_up([*pool, fixed])
        return self._service

    def warm_up(self, strategies: Sequence[Strategy]) -> None:
        """Build, ahead of the first step, every graph these strategies can ask this rank for: its stage of
        its replica's scheme at every token bucket up to the scheme's cap (collective: groups are made)."""
        sizes = self.provider.buckets.sizes
        for strategy in strategies:
            placement = place(strategy, self.cluster)
            self.executor.groups.prepare(placement)
            replica, stage, tp_rank = placement.stage_of(self.ctx.rank)
            scheme = strategy.replicas()[replica]
            group = self.executor.groups.get(placement.tp_groups(replica)[stage])
            cap = self.cost_model.max_tokens(scheme)
            for bucket in sizes[: next((i + 1 for i, b in enumerate(sizes) if b >= cap), len(sizes))]:
                self.provider.graph(scheme, tp_rank, None if group is None else group.group_name, bucket)

    def _submit(self, seq_lens: Sequence[int], strategy: str | None) -> None:
        self._planner(seq_lens).submit(list(seq_lens), Strategy.parse(strategy) if strategy else None)
        self._submitted = (tuple(seq_lens), strategy)

    def train_step(self, batch: Sequence[torch.Tensor], strategy: str | None = None,
                   next_batch: Sequence[torch.Tensor] | None = None) -> StepStats:
        """Train on one global batch (the same list of 1-D token tensors on every rank). ``strategy`` forces
        one; ``next_batch`` lets rank 0 plan the next step while this one runs."""
        seq_lens = _check_batch(batch)
        if self._submitted != (tuple(seq_lens), strategy):
            if self._submitted is not None:
                self._service.take()  # a stale prefetch: drain it so every rank stays in step
            self._submit(seq_lens, strategy)
        self._submitted = None
        planned = self._service.take()
        if next_batch is not None:
            self._submit(_check_batch(next_batch), None)
        self.last_plan = planned
        stats = self.executor.run_step(planned.plan, [t.to(self.ctx.device) for t in batch])
        return dataclasses.replace(stats, plan_ms=planned.plan_ms, plan_hidden=planned.hidden)

    def save(self, path: str, step: int, data_position: int) -> None:
        """Checkpoint the fixed layout, optimiser state, step and data position (collective, atomic)."""
        save_checkpoint(path, self.layout, self.optimizer, step=step, data_position=data_position)

    def load(self, path: str) -> dict:
        """Resume from ``save``; returns ``{"step", "data_position", ...}``."""
        return load_checkpoint(path, self.layout, self.optimizer)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The current parameters under the original module's names (collective)."""
        return self.layout.full_state_dict()


def _check_batch(batch: Sequence[torch.Tensor]) -> list[int]:
    if not isinstance(batch, (list, tuple)) or not batch:
        raise ValueError("a global batch is a non-empty list of 1-D token tensors")
    for i, t in enumerate(batch):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() < 1 or t.dtype not in (torch.long, torch.int):
            raise ValueError(f"sequence {i} of the batch must be a non-empty 1-D integer tensor, got "
                             f"{type(t).__name__} {getattr(t, 'shape', '')}")
    return [int(t.numel()) for t in batch]


def _context() -> DistContext:
    if dist.is_initialized():
        backend = dist.get_backend()
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), backend=backend, device=device)
    return init_distributed()
