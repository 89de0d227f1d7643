"""Heterogeneous training: ``hcompile.compile(model).trainer(loss="causal_lm", optimizer=...)`` returns a
``Trainer`` whose ``train_step(batch)`` plans the global batch (strategy, dispatch, packing), runs this
rank's replica with compiled variants, and steps the optimiser on the fixed ZeRO-1 layout.

Owns the bridge between the compiler and the runtime: ``CompiledProvider`` turns a ``CompiledModel`` into
the runtime's stage programs (tensor-parallel rewrite, then packed attention, per token bucket, cached),
and the default CPU cost model (graph analysis with a per-rank token cap).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch import fx

from hcompile.api import CompiledModel
from hcompile.export import save_pretrained
from hcompile.memory import bound_caps, tokens_a_rank_holds
from hcompile.verify import prepare_strategy
from passes.graph.analyze import Hardware, analytic_cost_model, analyze_graph, token_vocab
from passes.graph.hardware import hardware_for_device
from passes.graph.normalize import canonical_graph
from passes.graph.tensor_parallel import ParamSlice, split_dims
from passes.graph.variant import TokenBuckets, Variant, VariantKey, build_variant
from passes.plan.cost_model import HCOMPILE_RUNTIME, RuntimeMemory, hcompile_runtime
from passes.plan.datasets import LengthDataset
from passes.plan.ir import CostModel, ParallelScheme, PlanError, ReplicaPlan, StepPlan, Strategy
from passes.plan.policies import POLICIES, Planner, sized_homogeneous
from passes.plan.pool import build_pool
from runtime import distributed as comm
from runtime.batch_check import agree_on_batch
from runtime.calibration import OnlineCalibration
from runtime.checkpoint import DEFAULT_KEEP, load_checkpoint, save_checkpoint
from runtime.distributed import DistContext, init_distributed
from runtime.executor import Executor, StepStats, Traffic
from runtime.fixed_layout import FixedLayout, Init
from runtime.loss import global_pair_count
from runtime.planning import DEFAULT_PLAN_TIMEOUT_S, PlanService
from runtime.topology import Cluster, place

__all__ = ["TrainOptions", "Trainer", "CompiledProvider", "default_cost_model", "cap_tokens", "ELEMENTWISE_OPTIMIZERS"]

log = logging.getLogger("hcompile")

ANALYSIS_TOKENS = 64
"""Tokens of the capture that graph analysis (cost model, tensor-parallel split dims) reads."""

ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.ASGD, torch.optim.Rprop)
"""Optimisers that update each element from its own gradient and state alone, so that a shard of the fixed
layout steps exactly as the whole vector would (and their subclasses)."""

CPU = Hardware(name="cpu", peak_tflops=0.2, memory_gib=1024.0, reserved_gib=0.0, link_gbps=5.0,
               fixed_ms_per_layer=0.2, gpus_per_node=1024)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainOptions:
    """How to train a compiled model."""

    loss: str = "causal_lm"
    """The loss; ``causal_lm`` (next-token cross-entropy within each sequence, mean over the global batch)."""
    optimizer: type = torch.optim.AdamW
    """Optimiser class, applied to this rank's shard of the fixed layout: one of ``ELEMENTWISE_OPTIMIZERS`` (or
    a subclass), others only with ``elementwise_optimizer=True``."""
    elementwise_optimizer: bool = False
    """True: ``optimizer`` is not a supported class but updates every element from that element's gradient
    and state alone (its results would otherwise depend on how the layout is sharded); the trainer takes it."""
    optimizer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of the optimiser."""
    strategies: str | tuple[str, ...] = "auto"
    """``auto`` (a pool built from the data; each step may also use another mix of the pool's schemes, which
    compiles nothing new) or strategies such as ``("4x(tp1)", "1x(tp2)+2x(tp1)")`` (or one, ``"4x(tp1)"``),
    used as listed."""
    tokens_per_rank: int | None = None
    """Per-rank memory cap in tokens (a scheme with tensor-parallel degree tp holds tp times as many);
    None: the given cost model's caps, or 1024 tokens per rank with the default CPU cost model."""
    policy: str = "hydraulis"
    """Planner policy (the baselines are available for side-by-side runs)."""
    buckets: TokenBuckets | None = None
    """Token buckets micro-batches are padded to; default: the compiled model's, else powers of two from 64
    tokens. The trainer keeps its own and leaves the compiled model's alone."""
    replicas_take_turns: bool = False
    """Replicas compute one after the other within a step (``Executor.take_turns``): for measuring per-rank
    busy times on a host with fewer cores than ranks; slower in wall-clock time."""
    calibrate: bool = True
    """Scale each scheme's cost by its measured-over-predicted ratio (median of the last 8 steps,
    ``runtime.calibration``) when planning later steps; False plans with the given cost model throughout.
    A rank's busy time is its compute phase timed by CUDA events on GPUs, its CPU time on the CPU."""

    param_dtype: torch.dtype | None = None
    """dtype of the compute copies of the parameters (and of their gradients): None is bfloat16 on GPUs and
    float32 on the CPU. Master weights and optimiser state are float32 whatever it is."""
    reduce_dtype: torch.dtype = torch.float32
    """dtype gradients travel to their owners in (summed there in float32)."""
    plan_timeout_s: float = DEFAULT_PLAN_TIMEOUT_S
    """How long a step waits for rank 0's plan before every rank raises ``PlanTimeout``."""
    self_check: bool = True
    """Before a strategy's first step, run each rank's lowering (tensor parallel, packed attention, pipeline
    split) on a small random probe against the model itself, eager, and refuse the strategy with a
    ``LoweringError`` naming every parameter whose gradient differs (``hcompile.verify``). Once per (scheme,
    TP rank); skipped, with a warning, for models above ``self_check_max_params`` parameters (the probe holds
    the whole model twice on every rank)."""
    self_check_max_params: int = 1 << 28
    """The largest model (in parameters) the self-check runs on."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in (torch.float32, torch.bfloat16):
                raise ValueError(f"{name} must be torch.float32 or torch.bfloat16, got {value!r}")
        if self.loss != "causal_lm":
            raise ValueError(f"unknown loss {self.loss!r}; supported: 'causal_lm'")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")
        value = self.tokens_per_rank
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"tokens_per_rank must be a positive integer or None, got {value!r}")
        _check_optimizer(self.optimizer, self.elementwise_optimizer)
        if isinstance(self.strategies, str) and self.strategies != "auto":  # one strategy, not its characters
            object.__setattr__(self, "strategies", (self.strategies,))
        if self.strategies != "auto":
            if not isinstance(self.strategies, (list, tuple)) or not self.strategies:
                raise ValueError(f"strategies must be 'auto' or strategies such as ('4x(tp1)',), got "
                                 f"{self.strategies!r}")
            object.__setattr__(self, "strategies", tuple(self.strategies))
            for text in self.strategies:
                Strategy.parse(text)


def _check_optimizer(optimizer: Any, trusted: bool) -> None:
    """A supported optimiser class, or one the user vouches for; otherwise a ValueError naming them."""
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer class, got {optimizer!r}")
    if not trusted and not issubclass(optimizer, ELEMENTWISE_OPTIMIZERS):
        names = ", ".join(o.__name__ for o in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(f"optimizer {optimizer.__name__} is not supported: the fixed layout steps each rank's "
                         f"shard alone, so only elementwise optimisers give the same result on any number of "
                         f"ranks ({names}); pass elementwise_optimizer=True if {optimizer.__name__} is one")


class _VariantStage:
    """A StageProgram over the compiler's variants of one (scheme, stage, TP rank): a micro-batch runs the
    variant of its token bucket. Every bucket's variant computes with the same Parameters (the runtime's
    compute copy, bound once), so the gradients of all micro-batches of a step accumulate in one place."""

    def __init__(self, provider: "CompiledProvider", scheme: ParallelScheme, stage: int, tp_rank: int,
                 group_name: str | None):
        self.provider, self.scheme, self.stage, self.tp_rank, self.group = provider, scheme, stage, tp_rank, group_name
        first = provider.variant(scheme, stage, provider.buckets.sizes[0], tp_rank, group_name)
        self.param_slices: dict[str, ParamSlice] = {sl.name: sl for sl in first.params}
        self._params: dict[str, torch.nn.Parameter] | None = None
        self._variants: dict[int, Variant] = {}
        self._buffers: dict[str, torch.Tensor] = {}

    def bind(self, params: Mapping[str, torch.nn.Parameter]) -> None:
        missing = sorted(set(self.param_slices) - set(params))
        if missing:
            raise KeyError(f"stage {self.stage} of {self.scheme.describe()} needs parameters {missing[:5]}")
        self._params = dict(params)
        for v in self._variants.values():
            v.bind_(self._params, self._buffer)

    def _buffer(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """One copy per stage of each buffer: the model's own (a stand-in when captured for another dtype or
        device), on the parameters' device, in its own dtype (the capture traced it in that dtype)."""
        if name not in self._buffers:
            if value.device.type == "meta":
                value = self.provider.buffer(name)
            like = next(iter(self._params.values()), None)
            self._buffers[name] = value.to(device=like.device if like is not None else value.device)
        return self._buffers[name]

    def _variant(self, bucket: int) -> Variant:
        if bucket not in self._variants:
            if self._params is None:
                raise RuntimeError(f"stage {self.stage} of {self.scheme.describe()} runs before bind()")
            v = self.provider.variant(self.scheme, self.stage, bucket, self.tp_rank, self.group)
            if {sl.name: sl for sl in v.params} != self.param_slices:
                raise RuntimeError(f"bucket {bucket} of stage {self.stage} of {self.scheme.describe()} reads other "
                                   f"parameter slices than bucket {self.provider.buckets.sizes[0]}")
            v.bind_(self._params, self._buffer)
            self._variants[bucket] = v
        return self._variants[bucket]

    def boundary_in(self, tokens: int) -> list:
        """What this stage receives for a micro-batch of ``tokens`` tokens (its bucket's variant's inputs)."""
        return self._variant(self.provider.buckets.bucket_for(tokens)).boundary_in_specs()

    def __call__(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                 boundary: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        total = int(input_ids.shape[0])
        variant = self._variant(self.provider.buckets.bucket_for(total))
        outs = variant(input_ids, cu_seqlens, *boundary)
        if self.stage == self.scheme.pp - 1:
            return (variant.logits(outs, total),)
        return tuple(outs)


class CompiledProvider:
    """Stage programs from a CompiledModel's variants (tensor parallel, packed attention, pipeline split,
    compiled once per (scheme, stage, TP rank, bucket)), captured for compute copies in ``dtype`` on
    ``device``."""

    def __init__(self, compiled: CompiledModel, buckets: TokenBuckets, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        self.compiled, self.buckets, self.dtype, self.device = compiled, buckets, dtype, device
        self._stages: dict[tuple, _VariantStage] = {}
        self._variants: dict[tuple, Variant] = {}

    def captured(self, tokens: int):
        """The model captured on (1, tokens) for this provider's compute dtype and device."""
        return self.compiled.captured(tokens, self.dtype, self.device)

    def variant(self, scheme: ParallelScheme, stage: int, bucket: int, tp_rank: int, group: str | None) -> Variant:
        """This provider's variant of (scheme, stage, bucket) for one TP rank, built once. A variant is bound to
        one trainer's parameters, so trainers over one CompiledModel share its captures, not its variants."""
        cache = (scheme, stage, bucket, tp_rank, group)
        if cache not in self._variants:
            captured = self.captured(bucket)
            self._variants[cache] = build_variant(
                captured.graph_module, VariantKey(scheme=scheme, stage=stage, bucket=bucket), tp_rank=tp_rank,
                tp_group=group, output_index=captured.output_index,
                compile_backend=self.compiled.backend_for(self.device), attention_kernel=self.compiled.kernel)
        return self._variants[cache]

    def buffer(self, name: str) -> torch.Tensor:
        """The model's own buffer ``name`` (what a captured buffer or constant stands for)."""
        buffers = dict(self.compiled.model.named_buffers())
        if name not in buffers:
            raise KeyError(f"the graph reads {name!r}, which is not a buffer of {type(self.compiled.model).__name__} "
                           "(a tensor attribute captured as a constant cannot be given a dtype or device)")
        return buffers[name]

    def stage(self, scheme: ParallelScheme, stage: int, tp_rank: int,
              tp_group: comm.ProcessGroup | None) -> _VariantStage:
        group = comm.group_name(tp_group)
        key = (scheme, stage, tp_rank, group)
        if key not in self._stages:
            self._stages[key] = _VariantStage(self, scheme, stage, tp_rank, group)
        return self._stages[key]

    def recompiles(self) -> int:
        """torch.compile compilations of every variant this provider built so far."""
        return sum(v.counter.count for v in self._variants.values())

    def largest_bucket(self, up_to: int) -> int:
        """The largest bucket (up to the first >= ``up_to``) the model can be captured at. Capture runs the
        model on one packed row, so a learned position table bounds a micro-batch's tokens."""
        largest = 0
        for bucket in self.buckets.sizes:
            try:
                self.captured(bucket)
            except Exception:
                if largest == 0:
                    raise
                break
            largest = bucket
            if bucket >= up_to:
                break
        return largest


def default_cost_model(captured: fx.GraphModule, name: str, world_size: int, tokens_per_rank: int | None,
                       runtime: RuntimeMemory = HCOMPILE_RUNTIME,
                       device: torch.device | str = "cpu") -> CostModel:
    """Analytic cost model of a captured graph on ``device``'s hardware: the CPU (a 0.2 TFLOP model), or on a GPU
    its preset (``passes.graph.hardware.hardware_for_device``: A100, A800, H100, H200; another GPU is refused,
    never planned as a CPU). Schemes (tp, pp) with tp dividing the head count (and within a node), pp at most
    the layer count and tp*pp dividing the world size, each capped by the memory ``runtime`` leaves and at
    ``tokens_per_rank * tp`` tokens per micro-batch (on the CPU 1024 per rank when None)."""
    analysis = analyze_graph(canonical_graph(captured))
    if not analysis.attention:
        raise ValueError(f"{name} has no attention (no scaled_dot_product_attention call, nor a softmax(q @ k^T) @ v "
                         "written out): hcompile trains Transformer decoders, and plans by their attention")
    device = torch.device(device)
    hardware = hardware_for_device(torch.cuda.get_device_name(device)) if device.type == "cuda" else CPU
    heads = min((site.heads for site in analysis.attention), default=1)
    schemes = [ParallelScheme(tp=tp, pp=pp) for tp in range(1, world_size + 1) for pp in range(1, world_size + 1)
               if world_size % (tp * pp) == 0 and heads % tp == 0 and pp <= max(1, analysis.layers)
               and tp <= hardware.gpus_per_node]
    model = analytic_cost_model(analysis, hardware, schemes, name=f"{name}@{hardware.name}", world_size=world_size,
                                runtime=runtime)
    per_rank = (1024 if hardware is CPU else None) if tokens_per_rank is None else tokens_per_rank
    return model if per_rank is None else cap_tokens(model, {e.scheme: per_rank * e.scheme.tp for e in model.entries})


def cap_tokens(model: CostModel, caps: Mapping[ParallelScheme, int]) -> CostModel:
    """``model`` with each scheme's ``max_tokens`` lowered to ``caps[scheme]``."""
    entries = tuple(dataclasses.replace(e, max_tokens=min(e.max_tokens, caps.get(e.scheme, e.max_tokens)))
                    for e in model.entries)
    return dataclasses.replace(model, entries=entries)


class Trainer:
    """Data-parallel replicas of any strategy, planned per step, on every rank of the job."""

    def __init__(self, compiled: CompiledModel, options: TrainOptions, *, cost_model: CostModel | None = None,
                 dataset: LengthDataset | None = None, cluster: Cluster | None = None, init: Init | None = None,
                 state_dict: Mapping[str, torch.Tensor] | None = None):
        """``init``: a deterministic per-parameter initialiser (``init(name, full_fp32_tensor)``, called on
        every rank for the parameters its shard holds); ``state_dict``: initial values on rank 0 (other ranks
        may pass None), streamed to the owners. Neither: the model's own values (every rank's model must
        then hold the same ones). A model built on the meta device needs one of them."""
        self.options, self.dataset = options, dataset
        self.ctx = _context()
        buckets = options.buckets or compiled.buckets or TokenBuckets.powers_of_two(64, 1 << 20)
        self.param_dtype = options.param_dtype or (torch.bfloat16 if self.ctx.device.type == "cuda" else torch.float32)
        """The compute copies' dtype (the master weights and optimiser state stay fp32)."""
        self.provider = CompiledProvider(compiled, buckets, self.param_dtype, self.ctx.device)
        self.layout = _layout(self.provider, self.ctx, init=init, state_dict=state_dict)
        self.vocab_size = token_vocab(self.provider.captured(ANALYSIS_TOKENS).graph_module)
        """Token ids of a batch must be below it (None: the graph's token table was not found; unchecked)."""
        self.optimizer = options.optimizer([self.layout.shard], **dict(options.optimizer_kwargs))
        self.cluster = cluster or Cluster.local(self.ctx.world_size)
        self.executor = Executor(self.ctx, self.cluster, self.layout, self.optimizer, self.provider,
                                 take_turns=options.replicas_take_turns, param_dtype=self.param_dtype,
                                 reduce_dtype=options.reduce_dtype)
        memory = hcompile_runtime(param_bytes=_bytes(self.param_dtype), reduce_bytes=_bytes(options.reduce_dtype),
                                  chunk_numel=self.executor.chunk_numel)
        model = cost_model or default_cost_model(self.provider.captured(ANALYSIS_TOKENS).graph_module,
                                                 type(compiled.model).__name__, self.ctx.world_size,
                                                 options.tokens_per_rank, memory, self.ctx.device)
        if cost_model is not None and options.tokens_per_rank is not None:
            model = cap_tokens(model, {e.scheme: options.tokens_per_rank * e.scheme.tp for e in model.entries})
        model = bound_caps(model, self._holds(memory), options.tokens_per_rank)  # before any capture at the cap
        _check_strategies(options.strategies, model, self.provider.captured(ANALYSIS_TOKENS).graph_module,
                          self.ctx.world_size)
        capturable = self.provider.largest_bucket(max(e.max_tokens for e in model.entries))
        self.cost_model = dataclasses.replace(cap_tokens(model, {e.scheme: capturable for e in model.entries}),
                                              buckets=buckets.sizes)
        """What the planner plans with: capped at the largest capturable bucket, each micro-batch charged the
        padding up to its bucket, as the variants run it."""
        params = sum(p.numel() for p in compiled.model.parameters())
        self._self_check = options.self_check and params <= options.self_check_max_params
        if options.self_check and not self._self_check and self.ctx.rank == 0:
            log.warning("the lowering self-check is skipped: the model has %d parameters, more than "
                        "self_check_max_params=%d (check the same architecture at a smaller size instead)",
                        params, options.self_check_max_params)
        calibrate = options.calibrate and self.ctx.rank == 0  # busy times: CUDA events on GPUs, CPU time here
        self.calibration = OnlineCalibration(self.cost_model) if calibrate else None
        """Rank 0's per-scheme correction of the cost model from measured steps (None: not calibrating)."""
        self._service: PlanService | None = None
        self._restored_pool: tuple[list[Strategy], Strategy] | None = None
        self._warm: set[Strategy] = set()
        self._warm_places: set[tuple[ParallelScheme, tuple[int, ...]]] = set()
        """(scheme, ranks) of every replica of the warmed strategies: where compiled variants exist."""
        self._checked: set[tuple[ParallelScheme, int]] = set()
        """(scheme, TP rank) whose lowering this rank has checked."""
        self._submitted: tuple[tuple[int, ...], str | None] | None = None
        self.last_plan = None

    def _holds(self, memory: RuntimeMemory) -> tuple[int, float, int]:
        """How many tokens a rank of this job holds (the smallest over the ranks; collective)."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.ctx.world_size))
        return tokens_a_rank_holds(self.provider.captured(ANALYSIS_TOKENS).graph_module, ANALYSIS_TOKENS,
                                   self.ctx.device, local, self.layout.numel, self.ctx.world_size, memory)

    def _planner(self, seq_lens: Sequence[int]) -> PlanService:
        if self._service is None:
            if self._restored_pool is not None:  # resumed: the pool the run started with
                pool, fixed = self._restored_pool
            else:
                data = self.dataset or LengthDataset.from_lengths("first-batch", list(seq_lens))
                longest = max(data.max_len, max(seq_lens))
                fixed = sized_homogeneous(self.cost_model, self.ctx.world_size, longest)
                if self.options.strategies == "auto":
                    pool = build_pool(self.cost_model, self.ctx.world_size, data, sum(seq_lens), fixed)
                else:
                    pool = [Strategy.parse(s) for s in self.options.strategies]
            planner = Planner(self.cost_model, self.ctx.world_size, list(pool), fixed,
                              refine=self.options.strategies == "auto",  # a listed pool is kept as listed
                              allow=self._compiled_placement)
            self._service = PlanService(planner, self.ctx.rank, self.options.policy, self.executor.cpu_clock,
                                        timeout_s=self.options.plan_timeout_s)
            if self.calibration is not None and self.calibration.state_dict():  # resumed with measured ratios
                self._service.set_cost_model(self.calibration.model())
            self.warm_up([*pool, fixed])
        return self._service

    def _compiled_placement(self, strategy: Strategy) -> bool:
        """Whether every replica of ``strategy`` lands on ranks where a warmed strategy has the same scheme's
        replica: then every variant, TP group and compute copy it needs exists already (no new compilation)."""
        return all(place in self._warm_places for place in _replica_places(strategy, self.cluster))

    def warm_up(self, strategies: Sequence[Strategy]) -> None:
        """Lower, check and compile, before the first step, every variant these strategies can need: for each
        strategy, this rank's lowering is built and checked on a probe (``hcompile.verify``: a strategy that
        cannot be lowered or computes anything else is the same ``LoweringError`` on every rank); then for each
        token bucket up to its replicas' caps, a dry-run step (forward and backward, parameters untouched)
        with one micro-batch of that bucket on every replica that can hold it (collective)."""
        sizes = self.provider.buckets.sizes
        for strategy in strategies:
            if strategy in self._warm:
                continue
            prepare_strategy(strategy, rank=self.ctx.rank, cluster=self.cluster,
                             groups=self.executor.groups, provider=self.provider, self_check=self._self_check,
                             checked=self._checked, vocab=self.vocab_size)
            self._warm.add(strategy)
            self._warm_places.update(_replica_places(strategy, self.cluster))
            replicas = strategy.replicas()
            top = [self.provider.buckets.bucket_for(self.cost_model.max_tokens(s)) for s in replicas]
            for bucket in (b for b in sizes if b <= max(top)):
                lens = [min(bucket, self.cost_model.max_tokens(s)) if bucket <= t else 0
                        for s, t in zip(replicas, top)]
                self.executor.run_step(_dry_plan(strategy, lens, self.cluster), [
                    torch.zeros(n, dtype=torch.long) for n in lens if n], dry_run=True)

    def _submit(self, seq_lens: Sequence[int], strategy: str | None) -> None:
        self._planner(seq_lens).submit(list(seq_lens), Strategy.parse(strategy) if strategy else None)
        self._submitted = (tuple(seq_lens), strategy)

    def train_step(self, batch: Sequence[torch.Tensor], strategy: str | None = None,
                   next_batch: Sequence[torch.Tensor] | None = None) -> StepStats:
        """Train on one global batch (the same list of 1-D token tensors on every rank). ``strategy`` forces
        one; ``next_batch`` lets rank 0 plan the next step while this one runs."""
        seq_lens = agree_on_batch(batch, self.vocab_size)  # before any other collective
        if next_batch is not None:
            agree_on_batch(next_batch, self.vocab_size)
        if global_pair_count(seq_lens) == 0:
            return self._skip(seq_lens, next_batch)
        if self._submitted != (tuple(seq_lens), strategy):
            if self._submitted is not None:
                self._service.take()  # a stale prefetch: drain it so every rank stays in step
            self._submit(seq_lens, strategy)
        self._submitted = None
        planned = self._service.take()
        if next_batch is not None:
            self._submit([int(t.numel()) for t in next_batch], None)
        self.last_plan = planned
        stats = self.executor.run_step(planned.plan, batch)  # each rank copies only its micro-batches over
        if self.calibration is not None:  # plans submitted from the next step on use the corrected model
            self.calibration.observe(planned.plan, stats.busy_ms)
            self._service.set_cost_model(self.calibration.model())
        return dataclasses.replace(stats, plan_ms=planned.plan_ms, plan_hidden=planned.hidden)

    def _skip(self, seq_lens: Sequence[int], next_batch: Sequence[torch.Tensor] | None) -> StepStats:
        """A batch without a next-token pair (only 1-token sequences): nothing runs and nothing changes (no
        optimiser step, no weight decay); a plan prefetched for it is drained and the next batch's submitted."""
        if self._submitted is not None:
            self._service.take()
            self._submitted = None
        if next_batch is not None:
            self._submit([int(t.numel()) for t in next_batch], None)
        world = self.ctx.world_size
        return StepStats(loss=0.0, tokens=sum(seq_lens), strategy="", busy_ms=(0.0,) * world, wall_ms=0.0,
                         recompiles=self.provider.recompiles(), traffic=Traffic(), tokens_per_rank=(0,) * world,
                         skipped=True)

    def save(self, path: str, step: int, data_position: Any, keep: int = DEFAULT_KEEP) -> None:
        """Checkpoint the fixed layout, optimiser state, RNG, step, data position, strategy pool and cost-model
        calibration (collective, atomic: ``runtime.checkpoint``). ``data_position``: anything JSON gives back
        exactly, e.g. ``TokenBatches.state_dict()`` (a tuple, a non-finite float, ... are refused). ``keep``:
        how many of the checkpoint's versions stay (the newest); nothing else in ``path`` is touched."""
        extra: dict = {}
        if self._service is not None:
            planner = self._service.planner
            extra["pool"] = [s.describe() for s in planner.pool]
            extra["fixed"] = planner.fixed.describe()
        if self.calibration is not None:
            extra["calibration"] = self.calibration.state_dict()
        save_checkpoint(path, self.layout, self.optimizer, step=step, data_position=data_position, extra=extra,
                        keep=keep)

    def load(self, path: str) -> dict:
        """Resume from ``save`` on any number of ranks; returns ``{"step", "data_position", ...}``. Restored:
        the master weights, the optimiser state and param groups, and, with the same number of ranks, the
        strategy pool, the calibration and the RNG, so the steps after a resume are the steps an uninterrupted
        run takes. Explicit arguments win: listed ``strategies`` and the ``optimizer_kwargs`` entries
        replace what the checkpoint held, which one logged line names."""
        explicit = set(self.options.optimizer_kwargs)
        meta = load_checkpoint(path, self.layout, self.optimizer, override=explicit, check_extra=_extra_problem)
        extra = meta["extra"]
        held = [f"{k}={g[k]!r}" for g in meta["optimizer"]["param_groups"][:1] for k in sorted(explicit)
                if k in g and g[k] != _plain(self.options.optimizer_kwargs[k])]
        if meta["world_size"] == self.ctx.world_size and "pool" in extra and self._service is None:
            pool = [Strategy.parse(s) for s in extra["pool"]]
            if self.options.strategies != "auto":
                listed = [Strategy.parse(s) for s in self.options.strategies]
                held += [f"strategies {[s.describe() for s in pool]}"] if listed != pool else []
                pool = listed
            self._restored_pool = (pool, Strategy.parse(extra["fixed"]))
        if self.calibration is not None and "calibration" in extra:
            self.calibration.load_state_dict(extra["calibration"])
        if held and self.ctx.rank == 0:
            log.warning("resuming from %s: the explicit arguments replace what the checkpoint held (%s)", path,
                         ", ".join(held))
        return meta

    def save_pretrained(self, path: str, *, dtype: torch.dtype = torch.float32,
                        max_shard_size: int | str = "5GB") -> list[str] | None:
        """Write the trained parameters as a Hugging Face folder (``hcompile.export``): the model's own names,
        a tied weight once, safetensors shards of at most ``max_shard_size``, the model's config; loads with
        ``AutoModelForCausalLM.from_pretrained(path)``. Collective (rank 0 writes; returns its file names)."""
        return save_pretrained(self.provider.compiled.model, self.layout, path, dtype=dtype,
                               max_shard_size=max_shard_size)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The current parameters under the original module's names (collective)."""
        return self.layout.full_state_dict()


def _extra_problem(extra: dict) -> str | None:
    """What is wrong with what ``Trainer.save`` added to a checkpoint (None: nothing)."""
    try:
        for text in [*extra.get("pool", []), *([extra["fixed"]] if "pool" in extra else [])]:
            Strategy.parse(text)
    except (PlanError, TypeError, AttributeError, KeyError) as exc:
        return f"its strategy pool is not one: {exc}"
    calibration = extra.get("calibration", {})
    return None if isinstance(calibration, dict) else f"'extra.calibration' is {calibration!r}"


def _plain(value: Any) -> Any:
    """``value`` as JSON gives it back (a tuple as a list), to compare with a checkpoint's."""
    return [_plain(v) for v in value] if isinstance(value, (tuple, list)) else value


def _check_strategies(strategies: str | tuple[str, ...], model: CostModel, graph: fx.GraphModule, world: int) -> None:
    """Listed strategies that this job can run: every one covering the job's ranks with schemes of the cost
    model; otherwise a ValueError saying why (the head count a TP degree does not divide, ...)."""
    if strategies == "auto":
        return
    known = {e.scheme for e in model.entries}
    analysis = analyze_graph(canonical_graph(graph))
    heads = min((site.heads for site in analysis.attention), default=1)
    for text in strategies:
        strategy = Strategy.parse(text)
        if strategy.gpus != world:
            raise ValueError(f"strategy {text!r} covers {strategy.gpus} ranks, the job has {world}")
        for scheme in strategy.schemes:
            if heads % scheme.tp:
                raise ValueError(f"strategy {text!r}: tp{scheme.tp} does not divide the model's {heads} attention "
                                 "heads")
            if scheme.pp > max(1, analysis.layers):
                raise ValueError(f"strategy {text!r}: pp{scheme.pp} is more than the model's {analysis.layers} "
                                 "layers")
            if scheme not in known:
                raise ValueError(f"strategy {text!r}: {scheme.describe()} is not a scheme of the cost model "
                                 f"({', '.join(s.describe() for s in sorted(known, key=str))})")


def _layout(provider: CompiledProvider, ctx: DistContext, *, init: Init | None,
            state_dict: Mapping[str, torch.Tensor] | None) -> FixedLayout:
    """The fixed layout of the model's parameters (split dims stored outermost), filled once from what rank 0
    was given: a state dict (streamed to the owners), an initialiser, or else the model's own values."""
    if init is not None and state_dict is not None:
        raise ValueError("pass an initialiser or a state dict, not both")
    named = dict(provider.compiled.model.named_parameters())
    dims = split_dims(canonical_graph(provider.captured(ANALYSIS_TOKENS).graph_module))
    layout = FixedLayout({n: tuple(p.shape) for n, p in named.items()}, ctx.rank, ctx.world_size, ctx.device, dims)
    source = comm.broadcast_object("state_dict" if state_dict is not None else "init" if init is not None else "model")
    if source == "state_dict":
        layout.stream_from_rank0(state_dict if ctx.rank == 0 else None)
    elif source == "init":
        if init is None:
            raise ValueError(f"rank 0 initialises the parameters with an initialiser, rank {ctx.rank} has none")
        layout.initialise(init)
    else:
        layout.fill_from(named)
    return layout


def _replica_places(strategy: Strategy, cluster: Cluster) -> list[tuple[ParallelScheme, tuple[int, ...]]]:
    """Each replica of ``strategy`` as (scheme, ranks), where the runtime places it."""
    return list(zip(strategy.replicas(), place(strategy, cluster).replica_ranks))


def _dry_plan(strategy: Strategy, lens: list[int], cluster: Cluster) -> StepPlan:
    """A plan giving replica i one sequence of ``lens[i]`` tokens (none when 0)."""
    placement = place(strategy, cluster)
    seq_lens, replicas = [], []
    for scheme, ranks, n in zip(strategy.replicas(), placement.replica_ranks, lens):
        micro = ((len(seq_lens),),) if n else ()
        seq_lens.extend([n] if n else [])
        replicas.append(ReplicaPlan(scheme=scheme, ranks=ranks, micro_batches=micro, max_tokens=max(n, 1), est_ms=0.0))
    return StepPlan(strategy=strategy, seq_lens=tuple(seq_lens), replicas=tuple(replicas), est_step_ms=0.0,
                    lower_bound_ms=0.0, policy="warm-up")


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _context() -> DistContext:
    if comm.is_initialized():
        return DistContext(rank=comm.rank(), world_size=comm.world_size(), dist_backend=comm.backend(),
                           device=comm.group_device())
    return init_distributed()
