"""Rehearsal: one rank of a large job run on this machine under fake tensors, its memory tracked by category.

Owns :func:`trainer_parts` (what a ``Trainer`` builds before its first step, built the trainer's way for a model,
a job of ``world`` ranks and a GPU preset: the analysed capture, ``model_memory``, ``trainer_runtime``,
``default_cost_model`` with the preset's memory, ``bound_caps``, the caps at the largest bucket, and the
``LoweringCache`` from ``CompiledModel.lowerings``), ``fake_world`` (``runtime.distributed``'s: a fake process
group of the whole job, ``torch.testing._internal.distributed.fake_pg``, as one rank of it) and
:func:`rehearse_rank`: the dry step of one (scheme, stage, TP rank) at one bucket, as the trainer's warm-up runs it,
under
``torch._subclasses.fake_tensor.FakeTensorMode`` with ``torch.distributed._tools.mem_tracker.MemTracker``
counting every byte it allocates, by category. Nothing of the model's size is ever allocated: the model is built
on the meta device and every tensor of the step is fake, so a rank of a 32B job rehearses on a laptop.

What a rehearsed rank runs, in the executor's order (``runtime.executor.Executor.run_step`` with overlapped
movement, the default), each with the runtime's own part:

1. its share of the fixed layout (``runtime.fixed_layout.FixedLayout``: the fp32 master shard) and the optimiser
   over it (AdamW by default, as ``TrainOptions``), whose state already exists: one step on a zero gradient first,
   so that the rehearsed step is a later step's (AdamW allocates its state at the first one);
2. the compute copy (``runtime.stage_params.StageParams``: the parameters in the compute dtype, bf16, and the
   fp32 gradient-accumulation buffer), bound to the stage program (``LoweringCache.program``), and the fp32 shard
   gradient the overlapped push receives into (``runtime.overlap.MovementInFlight`` allocates it when the step
   starts, zeros of the shard's size);
3. ``pp - stage`` forwards of one micro-batch each (1F1B: stage s of pp keeps that many micro-batches'
   activations before its first backward), of ``min(bucket, cap)`` real tokens of one sequence in the variant
   of ``bucket``, as ``Trainer.warm_up`` gives each replica one sequence; a stage after the first receives its
   boundary as fake tensors of the shapes ``StageVariants.boundary_in`` gives; the last stage's loss is the
   runtime's (``runtime.micro_batch.MicroBatch.loss_sum`` over the global pair count);
4. the backwards (the first stage's and middle stages' with fake output gradients of their outputs' shapes), the
   gradients accumulated into the fp32 buffer by the compute copy's hooks;
5. the compute copy's parameters dropped, the shard gradient handed to the master shard, the compute copy
   released, and the optimiser's step.

What is not rehearsed, and why (each the smallest honest way around what fake tensors cannot run):

- Tensors are fake CPU tensors, not fake CUDA tensors: this torch is built without CUDA, and Python indexing
  (``t[a:b]``, ``t[...] = v``) and ``.to("cuda")`` of a fake CUDA tensor need a CUDA device guard, which it does
  not have (``RuntimeError: PyTorch is not linked with support for cuda devices``). The compute dtype is the
  GPU's (bf16); nothing the rehearsal runs branches on the device type except the attention kernel, which under
  fake tensors is its registered fake (the same output and saved tensors whatever the kernel). ``MemTracker``
  rounds CUDA allocations up to 512 bytes and CPU ones not: negligible at these sizes. The caching allocator's
  fragmentation, the CUDA context and NCCL's buffers are not tensors and are not tracked (``reserve``).
- Variants are built before the fake step, outside fake mode: the lowering passes evaluate attention masks on
  real tensors (``passes.graph.attention_masks``). They are built with the ``eager`` backend: inductor's fused
  kernels would keep fewer temporaries than the eager graph; what the eager graph keeps for the backward is the
  same.
- The capture is the trainer's capture for another device (meta stand-ins; ``hcompile.capture``), made for the
  model's own (meta) device, which capture treats the same way; the graph's device constants are retargeted when
  the compute copy binds.
- Parameter and gradient movement is not run (its messages need peers): the overlapped runtime's in-flight
  buffers (``runtime.overlap.overlap_buffer_bytes``) are charged, not tracked; the shard gradient it receives
  into is allocated as it allocates it. Pipeline messages are not sent: a stage's received boundary is fake
  tensors of the right shapes, its sent activations are its outputs, which it holds anyway.
- The trainer's search for the largest capturable bucket (``Trainer._largest_capturable``, one capture per
  bucket) is not run: the caps are taken at the bucket that holds the largest cap (a model with a learned
  position table shorter than that would stop lower on a GPU).
- ``MemTracker`` allows one root forward per step: the micro-batches' forwards run inside one module call.

Time: the fake step itself takes seconds. What costs is the trainer's own work before it, once per top bucket:
``LoweringCache.attention_limits`` captures every bucket up to a scheme's top one and classifies every attention's
mask on each (a 7B at a top bucket of 16K: about 14 minutes on two shared cores, most of it in
``passes.graph.attention_masks``); schemes whose caps fall in the same top bucket share it.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from hcompile.api import CompiledModel
from hcompile.cost import ANALYSIS_TOKENS, cap_tokens, default_cost_model
from hcompile.memory import bound_caps, model_memory, trainer_runtime
from passes.graph.analyze import Hardware
from passes.graph.hardware import hardware_preset
from passes.graph.lowering import LoweringCache
from passes.graph.normalize import canonical_graph
from passes.graph.pass_runner import PassError
from passes.graph.tensor_parallel import split_dims
from passes.graph.variant import TokenBuckets
from passes.plan.context_parallel import KV_SPLITS
from passes.plan.cost_model import RuntimeMemory
from passes.plan.ir import CostModel, ParallelScheme, Strategy
from passes.plan.memory import ModelMemory, RankCharge, device_reserve_bytes, rank_charge
from runtime import distributed as comm
from runtime.distributed import fake_world
from runtime.fixed_layout import FixedLayout
from runtime.loss import vocab_shard_of
from runtime.micro_batch import MicroBatch
from runtime.overlap import DEFAULT_INFLIGHT_BYTES, DEFAULT_WINDOWS, largest_unit_numel, layout_windows
from runtime.redistribute import DEFAULT_CHUNK_NUMEL
from runtime.stage_params import StageParams

__all__ = ["TrainerParts", "RankRehearsal", "CATEGORIES", "trainer_parts", "fake_world", "rehearse_rank",
           "rank_places", "charged"]

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries", "buffers")
"""The categories a rehearsal reports its tracked bytes in, those of ``passes.plan.memory.RankCharge``: parameters
(the compute copy), gradients (its fp32 accumulation buffer and the compute-dtype gradients autograd hands out),
optimizer (the rank's share of the fixed layout: fp32 master shard, optimiser state, fp32 shard gradient),
activations (what the forwards allocate), temporaries (what the backwards allocate besides gradients; charged
within activations), buffers (the model's buffers; the movement buffers are charged, not run)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerParts:
    """What a trainer of ``world`` ranks builds before its first step (:func:`trainer_parts`); the lowering cache
    inside fills as ranks are rehearsed."""

    compiled: CompiledModel
    world: int
    hardware: Hardware
    memory_bytes: float
    """What each rank may fill: the preset's memory less ``reserve_bytes`` (or as given)."""
    reserve_bytes: float
    """What the trainer takes off a GPU of the preset before filling it (``device_reserve_bytes``: the CUDA
    context, NCCL's buffers, fragmentation): not tensors, not tracked."""
    pieces: int
    """Pieces each stage is cut into (overlapped movement; 1 without)."""
    model_memory: ModelMemory
    runtime: RuntimeMemory
    cost_model: CostModel
    """The trainer's cost model: caps bounded by the memory model, at most the largest bucket."""
    lowerings: LoweringCache
    buckets: TokenBuckets
    dims: Mapping[str, int]
    """Tensor parallelism's split dim of every parameter it splits (the fixed layout stores it outermost)."""
    shapes: Mapping[str, tuple[int, ...]]
    param_dtype: torch.dtype = torch.bfloat16
    grad_dtype: torch.dtype = torch.float32
    optimizer: type = torch.optim.AdamW
    optimizer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    device: torch.device = torch.device("cpu")
    """Where the fake tensors of the step live (module docstring: fake CUDA tensors need a CUDA build)."""

    def schemes(self) -> list[ParallelScheme]:
        """The schemes of the cost model whose cap is above 0, in the cost model's order."""
        return [e.scheme for e in self.cost_model.entries if e.max_tokens > 0]

    def top_bucket(self, scheme: ParallelScheme) -> int:
        """The largest bucket a rank of ``scheme`` runs: the one that holds its cap."""
        return self.buckets.bucket_for(self.cost_model.max_tokens(scheme) // scheme.cp)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankRehearsal:
    """One rank's rehearsed dry step: its peak and what it held after the forwards, in bytes, by category."""

    scheme: ParallelScheme
    stage: int
    tp_rank: int
    rank: int
    """The global rank rehearsed (replica 0 of the scheme's homogeneous strategy, placed as the planner does)."""
    world: int
    cap_tokens: int
    """The scheme's cap in the trainer's cost model."""
    bucket_tokens: int
    """The bucket the micro-batches ran in."""
    tokens: int
    """Real tokens of each micro-batch: ``min(bucket, cap)``."""
    micro_batches: int
    """Micro-batches in flight before the first backward (1F1B: ``pp - stage``)."""
    peak_bytes: int
    peak_by_category: Mapping[str, int]
    """The tracked bytes of each of :data:`CATEGORIES` at the moment of the peak."""
    held_after_forward_bytes: int
    held_after_forward_by_category: Mapping[str, int]
    charge: RankCharge
    """What the memory model charges this rank at its bucket (:func:`charged`)."""
    wall_s: float
    """Seconds the rehearsal took (building the variant included)."""

    def to_json(self) -> dict:
        """The rehearsal as one JSON object (bytes as integers; charged bytes without the reserve)."""
        charge = self.charge
        out = {"scheme": self.scheme.describe(), "stage": self.stage, "tp_rank": self.tp_rank, "rank": self.rank,
               "world": self.world, "cap_tokens": self.cap_tokens, "bucket_tokens": self.bucket_tokens,
               "tokens": self.tokens, "micro_batches": self.micro_batches,
               "charged_bytes": int(charge.tracked), "reserve_bytes": int(charge.reserve),
               "tracked_peak_bytes": self.peak_bytes, "held_after_forward_bytes": self.held_after_forward_bytes}
        for name in CATEGORIES:
            out[f"tracked_{name}_bytes"] = int(self.peak_by_category[name])
        for name in ("parameters", "gradients", "optimizer", "activations", "buffers"):
            out[f"charged_{name}_bytes"] = int(getattr(charge, name))
        out["wall_s"] = round(self.wall_s, 3)
        return out


def charged(parts: "TrainerParts", scheme: ParallelScheme, tokens: int) -> RankCharge:
    """What the memory model charges a rank of ``scheme`` running a micro-batch in a bucket of ``tokens`` tokens
    (``passes.plan.memory.rank_charge``, with the trainer's pieces and the reserve its ``usable_memory`` takes off
    a GPU of the preset: ``device_reserve_bytes``). The one place the rehearsal asks the memory model."""
    return rank_charge(parts.model_memory, scheme, parts.world, parts.runtime, tokens, reserve=parts.reserve_bytes)


def trainer_parts(model: nn.Module, world: int, *, hardware: str | Hardware = "a800-80g",
                  memory_bytes: float | None = None, buckets: TokenBuckets | None = None,
                  param_dtype: torch.dtype = torch.bfloat16, grad_dtype: torch.dtype = torch.float32,
                  reduce_dtype: torch.dtype = torch.float32, optimizer: type = torch.optim.AdamW,
                  optimizer_kwargs: Mapping[str, Any] | None = None, overlap: bool = True, pieces: int = 4,
                  tokens_per_rank: int | None = None, kernel: str = "auto",
                  vocab_parallel: bool | None = None) -> TrainerParts:
    """The parts ``hcompile.train.Trainer.__init__`` builds for ``model`` on a job of ``world`` ranks of the GPU
    ``hardware`` (a preset name or a ``Hardware``), in its order: the analysed capture (bf16 compute copies),
    tensor parallelism's split dims, the fixed layout's shape and windows (for the runtime's largest movement
    unit), ``trainer_runtime`` (overlapped movement unless ``overlap=False``), ``model_memory`` (measured, as on a
    GPU), ``default_cost_model`` with what a rank of the preset may fill (its memory less
    ``device_reserve_bytes``, as ``usable_memory`` on a GPU; or ``memory_bytes``), ``bound_caps``, the caps at
    the largest bucket and cut to buckets (``buckets_cut_to_caps``; powers of two from 64 to 2**20 tokens by
    default), and the lowering cache (``CompiledModel.lowerings``, ``cost_tokens`` the caps, ``pieces`` per stage
    with overlapped movement). ``vocab_parallel``: None, ``TrainOptions``' default.
    ``model``: built on the meta device (or real; it is never run), no graph breaks. Needs no process group."""
    from hcompile.memory import NCCL_COMMUNICATORS
    from hcompile.train import TrainOptions, buckets_cut_to_caps

    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive integer, got {world!r}")
    defaults = TrainOptions()
    vocab_parallel = defaults.vocab_parallel if vocab_parallel is None else vocab_parallel
    preset = hardware_preset(hardware) if isinstance(hardware, str) else hardware
    memory = preset.memory_gib * 2**30
    reserve = device_reserve_bytes(memory, NCCL_COMMUNICATORS, max(world - 1, 0))
    usable = memory - reserve if memory_bytes is None else float(memory_bytes)
    if not usable > 0:
        raise ValueError(f"memory_bytes must be > 0, got {memory_bytes!r}")
    pieces = pieces if overlap else 1
    buckets = buckets or TokenBuckets.powers_of_two(64, 1 << 20)
    compiled = CompiledModel(model, buckets=buckets, compile_backend="eager", kernel=kernel)
    analysed = compiled.captured(ANALYSIS_TOKENS, param_dtype, None).graph_module
    try:
        dims = split_dims(canonical_graph(analysed))
    except PassError:  # no tensor-parallel form: the layout stores parameters whole, tp > 1 is refused later
        dims = {}
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    layout = FixedLayout(shapes, 0, world, "meta", dims)  # its shape only: every rank's is the same size
    windows = layout_windows(layout, DEFAULT_WINDOWS) if overlap else []
    runtime = trainer_runtime(param_dtype, reduce_dtype, grad_dtype, DEFAULT_CHUNK_NUMEL,
                              DEFAULT_INFLIGHT_BYTES if overlap else None, largest_unit_numel(layout, windows), pieces)
    held = model_memory(analysed, ANALYSIS_TOKENS, vocab_parallel=vocab_parallel, measure=True,
                        twice=compiled.captured(2 * ANALYSIS_TOKENS, param_dtype, None).graph_module)
    cost = default_cost_model(analysed, type(model).__name__, world, tokens_per_rank, runtime, "cuda", memory=held,
                              memory_bytes=usable, hardware=preset)
    cost = bound_caps(cost, held, runtime, usable, world, tokens_per_rank)
    up_to = max(e.max_tokens // e.scheme.cp for e in cost.entries)
    top = buckets.bucket_for(up_to) if up_to <= buckets.sizes[-1] else buckets.sizes[-1]
    cost, buckets = buckets_cut_to_caps(cap_tokens(cost, {e.scheme: top * e.scheme.cp for e in cost.entries}),
                                        buckets)
    cost = dataclasses.replace(cost, buckets=buckets.sizes)
    lowerings = compiled.lowerings(param_dtype, None, buckets=buckets, cost_tokens=cost.max_tokens, pieces=pieces,
                                   kv_splits=KV_SPLITS, vocab_parallel=vocab_parallel)
    return TrainerParts(compiled=compiled, world=world, hardware=preset, memory_bytes=usable, reserve_bytes=reserve,
                        pieces=pieces, model_memory=held, runtime=runtime, cost_model=cost, lowerings=lowerings,
                        buckets=buckets, dims=dims, shapes=shapes, param_dtype=param_dtype, grad_dtype=grad_dtype,
                        optimizer=optimizer, optimizer_kwargs=dict(optimizer_kwargs or {}))


def rank_places(parts: TrainerParts, all_tp_ranks: bool = False) -> list[tuple[ParallelScheme, int, int]]:
    """(scheme, stage, TP rank) of every kind of rank of the cost model's schemes with a cap above 0: every stage,
    TP rank 0 and the last one (every TP rank with ``all_tp_ranks``)."""
    out = []
    for scheme in parts.schemes():
        for stage in range(scheme.pp):
            ranks = range(scheme.tp) if all_tp_ranks else sorted({0, scheme.tp - 1})
            out.extend((scheme, stage, t) for t in ranks)
    return out


def _placed(parts: TrainerParts, scheme: ParallelScheme):
    """The dry plan of ``scheme``'s homogeneous strategy, placed as the trainer's warm-up places it."""
    from hcompile.train import _dry_plan

    strategy = Strategy.homogeneous(scheme, parts.world)
    return _dry_plan(strategy, [1] * len(strategy.replicas()), parts.cost_model.gpus_per_node)


class _Forwards(nn.Module):
    """The root of one step's forwards: ``MemTracker`` takes a second root call for a second iteration."""

    def forward(self, run):  # noqa: D102
        return run()


def _label(tracker: Any, tensor: torch.Tensor, kind: Any) -> None:
    """Count ``tensor``'s storage as ``kind`` (MemTracker labels what it sees by when it was made; the runtime's
    own buffers are made outside any module)."""
    tracker._update_and_maybe_create_winfos(tensor, kind)


def _by_category(snapshot: Mapping) -> tuple[int, dict[str, int]]:
    from torch.distributed._tools.mem_tracker import _MemRefType

    found = {_MemRefType.PARAM: "parameters", _MemRefType.GRAD: "gradients", _MemRefType.OPT: "optimizer",
             _MemRefType.ACT: "activations", _MemRefType.TEMP: "temporaries", _MemRefType.BUFFER: "buffers",
             _MemRefType.OTH: "buffers"}
    out = dict.fromkeys(CATEGORIES, 0)
    total = 0
    for device_snap in snapshot.values():
        for key, value in device_snap.items():
            if key in found:
                out[found[key]] += int(value)
            elif key == "Total":
                total += int(value)
    return total, out


def rehearse_rank(parts: TrainerParts, scheme: ParallelScheme, stage: int, tp_rank: int,
                  bucket: int | None = None) -> RankRehearsal:
    """The dry step of TP rank ``tp_rank`` of ``stage`` of ``scheme`` at ``bucket`` (None: the scheme's largest,
    the one its cap falls in), run as the module docstring says in a fake world of the whole job as that rank
    (:func:`fake_world`; no process group may be initialised), its bytes tracked by category."""
    if scheme not in set(parts.schemes()):
        known = ", ".join(s.describe() for s in parts.schemes())
        raise ValueError(f"scheme {scheme.describe()} is not a scheme of the cost model with a cap above 0 ({known})")
    if scheme.cp > 1:
        raise ValueError(f"{scheme.describe()}: context-parallel ranks are not rehearsed (their micro-batches are "
                         "shares of sequences cp times as long)")
    if not 0 <= stage < scheme.pp or not 0 <= tp_rank < scheme.tp:
        raise ValueError(f"{scheme.describe()} has stages 0..{scheme.pp - 1} and TP ranks 0..{scheme.tp - 1}, got "
                         f"stage {stage}, TP rank {tp_rank}")
    cap = parts.cost_model.max_tokens(scheme)
    bucket = parts.top_bucket(scheme) if bucket is None else bucket
    if bucket not in parts.buckets.sizes:
        raise ValueError(f"bucket {bucket} is not one of the buckets {parts.buckets.sizes[:4]}...")
    start = time.perf_counter()
    plan = _placed(parts, scheme)
    replica = plan.replicas[0]
    rank = replica.rank_at(stage, 0, tp_rank)
    tokens = min(bucket, cap)
    in_flight = scheme.pp - stage
    with fake_world(rank, parts.world):
        groups = comm.GroupCache()
        groups.prepare(plan.replicas)  # every TP group of the strategy, in the trainer's order (their names)
        group = comm.group_name(groups.get(replica.tp_group(stage, 0)))
        program = parts.lowerings.program(scheme, stage, tp_rank, group)
        parts.lowerings.variant(scheme, stage, bucket, tp_rank, group)  # built on real tensors (docstring)
        peak, after = _dry_step(parts, scheme, program, rank, stage, tokens, in_flight)
    peak_total, peak_by = _by_category(peak)
    after_total, after_by = _by_category(after)
    return RankRehearsal(scheme=scheme, stage=stage, tp_rank=tp_rank, rank=rank, world=parts.world, cap_tokens=cap,
                         bucket_tokens=bucket, tokens=tokens, micro_batches=in_flight, peak_bytes=peak_total,
                         peak_by_category=peak_by, held_after_forward_bytes=after_total,
                         held_after_forward_by_category=after_by,
                         charge=charged(parts, scheme, bucket),
                         wall_s=time.perf_counter() - start)


def _dry_step(parts: TrainerParts, scheme: ParallelScheme, program, rank: int, stage: int, tokens: int,
              in_flight: int) -> tuple[Mapping, Mapping]:
    """The step under fake tensors and the tracker: (peak snapshot, snapshot after the forwards)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    device, last = parts.device, stage == scheme.pp - 1
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"torch\.distributed\._tools\..*")
        warnings.filterwarnings("ignore", message=".*Module is None.*")
        warnings.filterwarnings("ignore", message=".*Expected a tensor or a traceable wrapper-subclass.*")
        with FakeTensorMode(allow_non_fake_inputs=True), MemTracker() as tracker:
            layout = FixedLayout(dict(parts.shapes), rank, parts.world, device, dict(parts.dims))
            _label(tracker, layout.shard, _MemRefType.OPT)
            optimizer = parts.optimizer([layout.shard], **dict(parts.optimizer_kwargs))
            layout.shard.grad = torch.zeros_like(layout.shard)  # a first step: the optimiser's state exists
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            params = StageParams(layout, program.param_slices, scheme.tp, parts.param_dtype, device,
                                 grad_dtype=parts.grad_dtype)
            program.bind(params.params)
            _label(tracker, params.materialize(), _MemRefType.PARAM)
            params.zero_grads()
            _label(tracker, params.grad_flat, _MemRefType.GRAD)
            shard_grad = torch.zeros(layout.shard_numel, dtype=torch.float32, device=device)
            _label(tracker, shard_grad, _MemRefType.OPT)
            pairs = max(1, in_flight * (tokens - 1))
            outs: list[tuple[torch.Tensor, ...]] = []

            def forwards() -> None:
                for _ in range(in_flight):
                    ids = torch.zeros(tokens, dtype=torch.long, device=device)
                    cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
                    mb = MicroBatch(ids=ids, cu_seqlens=cu, max_seqlen=tokens, tokens=tokens)
                    received = []
                    if stage > 0:
                        for spec in program.boundary_in(tokens):
                            received.append(_received(spec, device))
                    out = mb.run(program, tuple(received))
                    outs.append((mb.loss_sum(out[0], vocab_shard_of(program)) / pairs,) if last else tuple(out))

            _Forwards()(forwards)
            after = tracker.get_tracker_snapshot("current")
            for out in outs:
                if last:
                    out[0].backward()
                else:
                    floating = [o for o in out if o.is_floating_point() and o.requires_grad]
                    torch.autograd.backward(floating, [torch.zeros_like(o) for o in floating])
            outs.clear()
            params.release_data()  # as the executor, once the backward is done
            layout.shard.grad = shard_grad  # what the push received into
            params.release()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            peak = tracker.get_tracker_snapshot("peak")
    return peak, after


def _received(spec: Any, device: torch.device) -> Any:
    """A received boundary item as fake tensors (requiring a gradient where floating, as the pipeline makes it)."""
    if isinstance(spec, list):
        return tuple(_received(s, device) for s in spec)
    shape, dtype = spec
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.requires_grad_(True) if t.is_floating_point() else t
