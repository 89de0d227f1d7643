"""Lowerings: what one rank runs for one stage of a scheme, decided once and applied to every token bucket.

Owns :class:`Lowering` (the tensor-parallel plan, the pipeline cut and the parameter slices of one (scheme,
stage, TP rank), typed), :func:`decide_lowerings` (the decisions, made once on the analysed capture), the
lowering passes and :func:`lower_graph` (which applies decided plans to any capture of the model: a capture
whose nodes differ from the analysed one is a ``PassError``, never another layout), and
:class:`LoweringCache`, the one cache of lowerings, variants and stage programs. A stage program
(:class:`StageVariants`) is what the runtime's executor runs: one variant per token bucket, all computing with
the Parameters the runtime binds once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from passes.graph.analyze import OpClass, classify_node
from passes.graph.attention_masks import MaskLimits, decide_attention_limits
from passes.graph.context_parallel import rewrite_context_parallel_pass
from passes.graph.normalize import CANONICAL_PASSES, canonical_graph
from passes.graph.packed_attention import rewrite_packed_attention_pass
from passes.graph.pass_runner import PassContext, PassRecord, copy_graph_module, propagate_vals, run_passes
from passes.graph.pipeline_split import (
    PipelinePlan,
    costed_nodes,
    cut_graph,
    decide_pipeline_split,
    split_pipeline_pass,
)
from passes.graph.tensor_parallel import (
    ParamSlice,
    TensorParallelPlan,
    decide_tensor_parallel,
    shard_tensor_parallel_pass,
)
from passes.graph.token_mixing import check_token_mixing_pass
from passes.graph.variant import CompileCounter, TokenBuckets, Variant, VariantKey
from passes.plan.ir import ParallelScheme

__all__ = ["LOWERING_PASSES", "Lowering", "Lowered", "decide_lowerings", "lower_graph", "LoweringCache",
           "StageVariants", "PIPELINE_TOLERANCE", "recompute_pieces"]

LOWERING_PASSES = (*CANONICAL_PASSES, shard_tensor_parallel_pass, rewrite_packed_attention_pass,
                   check_token_mixing_pass, rewrite_context_parallel_pass, split_pipeline_pass)
"""What turns a captured forward into one rank's replica program, in order."""

PIPELINE_TOLERANCE = 0.2
"""How far (relative) a pipeline stage's cost may exceed the mean when the cut looks for fewer crossing bytes."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Lowering:
    """What one TP rank runs for one pipeline stage of a scheme, the same for every token bucket."""

    scheme: ParallelScheme
    """The replica's layout."""
    stage: int
    """The pipeline stage, 0 <= stage < scheme.pp."""
    tp_rank: int
    """This rank's index in the stage's tensor-parallel group."""
    tensor_parallel: TensorParallelPlan | None
    """Roles of the linears and this rank's slices (None when tp == 1)."""
    pipeline: PipelinePlan | None
    """The cut of the whole replica into stages (None when pp == 1)."""
    params: tuple[ParamSlice, ...]
    """The parameters the stage reads, each with this rank's slice."""
    inputs: tuple[str, ...]
    """User inputs the stage takes, from ``("input_ids", "cu_seqlens", "max_seqlen")``."""
    boundary_in: tuple[str, ...]
    """Values received from the previous stage."""
    boundary_out: tuple[str, ...]
    """Values the stage returns (the last stage: the model's outputs, the logits first)."""
    pieces: PipelinePlan | None = None
    """The stage cut into pieces run one after the other, so that the parameters of a later piece can arrive
    while an earlier one computes (overlapped movement), and, under recomputation (``scheme.rc``), at least one
    piece per attention layer, each recomputed in the backward; None: one piece."""
    cp_rank: int = 0
    """This rank's index in its context-parallel group (0 when cp == 1)."""
    cp_group: str | None = None
    """Name of the context-parallel process group the attention gathers over (None when cp == 1)."""
    attention: tuple[tuple[str, MaskLimits], ...] = ()
    """Per attention (node name), what it keeps of each sequence, decided for every length the scheme trains
    (``passes.graph.attention_masks.decide_attention_limits``); empty: each capture's own."""
    kv_splits: int = 1
    """Under cp > 1, the head groups the attention's K/V exchange is pipelined over, at most
    (``passes.graph.kv_exchange``; 1: one all-gather before the attention)."""
    vocab_range: tuple[int, int] | None = None
    """The last stage of a vocab-parallel head whose logits stay split: (start, stop) of the vocabulary columns
    this rank's logits hold, the other ranks of its TP group holding the rest; None: the logits are whole."""

    @property
    def attention_limits(self) -> dict[str, MaskLimits] | None:
        """:attr:`attention` as the packed pass's option (None when not decided)."""
        return dict(self.attention) if self.attention else None

    def describe(self) -> str:
        """E.g. ``(tp2,pp2)/stage1/tp-rank0: 14 parameters, in [...], out [...]``."""
        cp = f"/cp-rank{self.cp_rank}" if self.scheme.cp > 1 else ""
        return (f"{self.scheme.describe()}/stage{self.stage}/tp-rank{self.tp_rank}{cp}: {len(self.params)} "
                f"parameters, in {list(self.boundary_in)}, out {list(self.boundary_out)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Lowered:
    """A captured forward rewritten for one rank of a scheme: every stage (composed when pp > 1)."""

    graph_module: fx.GraphModule
    """The rank's program over all stages: ``stage_0 -> stage_1 -> ...`` when pp > 1; inputs (input_ids (1, T),
    cu_seqlens, max_seqlen)."""
    params: tuple[ParamSlice, ...]
    """Every parameter the program reads, with this rank's slice."""
    records: tuple[PassRecord, ...]
    """What each pass did."""


def _context(scheme: ParallelScheme, tp_rank: int, tp_group: str | None, kernel: str,
             tensor_parallel: TensorParallelPlan | None, pipeline: PipelinePlan | None, cp_rank: int = 0,
             cp_group: str | None = None, attention: Mapping[str, MaskLimits] | None = None,
             kv_splits: int = 1) -> PassContext:
    options: dict = {"rewrite_packed_attention_pass.kernel": kernel}
    if attention is not None:
        options["rewrite_packed_attention_pass.limits"] = dict(attention)
    if scheme.cp > 1:
        options.update({"rewrite_context_parallel_pass.group": cp_group, "rewrite_context_parallel_pass.rank": cp_rank,
                        "rewrite_context_parallel_pass.kv_splits": kv_splits})
    if tensor_parallel is not None:
        options["shard_tensor_parallel_pass.plan"] = tensor_parallel
    if pipeline is not None:
        options["split_pipeline_pass.plan"] = pipeline
    return PassContext(scheme=scheme, tp_rank=tp_rank, tp_group=tp_group, options=options)


def _replicated(gm: fx.GraphModule) -> tuple[ParamSlice, ...]:
    return tuple(ParamSlice(name=name, full_shape=tuple(p.shape)) for name, p in gm.named_parameters())


def lower_graph(captured: fx.GraphModule, scheme: ParallelScheme, *, tp_rank: int = 0, tp_group: str | None = None,
                attention_kernel: str = "auto", tensor_parallel: TensorParallelPlan | None = None,
                pipeline: PipelinePlan | None = None, cp_rank: int = 0, cp_group: str | None = None,
                attention: Mapping[str, MaskLimits] | None = None, kv_splits: int = 1) -> Lowered:
    """Apply the lowering passes to a copy of ``captured`` with decided plans (:func:`decide_lowerings`):
    canonical forms, tensor parallel (``tensor_parallel``, required when tp > 1), packed attention (each
    attention's decided limits, ``attention``; None: the capture's own), the token-mixing check (an op that reads
    other tokens than attention is a ``PassError``: ``passes.graph.token_mixing``), context parallel (cp > 1: attention
    over ``cp_group``, this rank ``cp_rank``, its K/V exchange pipelined over ``kv_splits`` head groups at most),
    the pipeline cut (``pipeline``, required when pp > 1). Nothing is decided here."""
    if (scheme.tp > 1) != (tensor_parallel is not None) or (scheme.pp > 1) != (pipeline is not None):
        raise ValueError(f"lowering {scheme.describe()} needs a tensor-parallel plan exactly when tp > 1 and a "
                         f"pipeline cut exactly when pp > 1; got {type(tensor_parallel).__name__}, "
                         f"{type(pipeline).__name__}")
    ctx = _context(scheme, tp_rank, tp_group, attention_kernel, tensor_parallel, pipeline, cp_rank, cp_group,
                   attention, kv_splits)
    gm, records = run_passes(copy_graph_module(captured), LOWERING_PASSES, ctx)
    params = tensor_parallel.params if tensor_parallel is not None else _replicated(captured)
    return Lowered(graph_module=gm, params=params, records=records)


def decide_lowerings(analysed: fx.GraphModule, scheme: ParallelScheme, *, tp_rank: int = 0,
                     tp_group: str | None = None, attention_kernel: str = "auto", vocab_parallel: bool = False,
                     cost_tokens: int | None = None, pieces: int = 1, cp_rank: int = 0,
                     cp_group: str | None = None, attention: Mapping[str, MaskLimits] | None = None,
                     kv_splits: int = 1, split_logits: bool = False) -> tuple[Lowering, ...]:
    """One :class:`Lowering` per pipeline stage of ``scheme`` for TP rank ``tp_rank``, decided on ``analysed``
    (any capture of the model): the tensor-parallel plan on its canonical form, the pipeline cut on its
    tensor-parallel, packed form with attention costed at ``cost_tokens`` tokens per sequence (the longest
    micro-batch the scheme runs; None: the capture's own tokens). ``vocab_parallel``: split the token
    embedding and LM head by vocabulary rows when tp > 1 (where the model allows), the logits left split with
    ``split_logits`` (:attr:`Lowering.vocab_range`). ``pieces``: cut each stage into this many pieces of
    about equal cost (at most one per costed node) for overlapped movement; a recomputing scheme (``rc``) cuts
    at least one piece per attention of the stage (:func:`recompute_pieces`). ``cp_rank`` / ``cp_group``: this
    rank's place in its context-parallel group (cp > 1); the pipeline cut is decided on the CP graph.
    ``attention``: every attention's limits, decided for the run (None: each capture's own). ``kv_splits``: as
    :func:`lower_graph` takes it."""
    gm, _ = run_passes(copy_graph_module(analysed), CANONICAL_PASSES, PassContext())
    tensor_parallel = None
    if scheme.tp > 1:
        if "val" not in next(iter(gm.graph.nodes)).meta:
            propagate_vals(gm)
        tensor_parallel = decide_tensor_parallel(gm, scheme.tp, tp_rank, vocab_parallel=vocab_parallel,
                                                 split_logits=split_logits)
    pipeline = None
    if scheme.pp > 1:  # the cut is decided on the rewritten graph; without one, lower_graph below rewrites it
        ctx = _context(scheme, tp_rank, tp_group, attention_kernel, tensor_parallel, None, cp_rank, cp_group,
                       attention, kv_splits)
        gm, _ = run_passes(gm, [shard_tensor_parallel_pass, rewrite_packed_attention_pass,
                                rewrite_context_parallel_pass], ctx)
        pipeline = decide_pipeline_split(gm, scheme.pp, tolerance=PIPELINE_TOLERANCE, seq_len=cost_tokens)
    lowered = lower_graph(analysed, scheme, tp_rank=tp_rank, tp_group=tp_group, attention_kernel=attention_kernel,
                          tensor_parallel=tensor_parallel, pipeline=pipeline, cp_rank=cp_rank, cp_group=cp_group,
                          attention=attention, kv_splits=kv_splits)
    out = []
    for s in range(scheme.pp):
        lowering = dataclasses.replace(_stage_lowering(lowered, scheme, s, tp_rank, tensor_parallel, pipeline),
                                       cp_rank=cp_rank, cp_group=cp_group,
                                       attention=tuple(sorted((attention or {}).items())), kv_splits=kv_splits,
                                       vocab_range=tensor_parallel.vocab_range if tensor_parallel is not None
                                       and s == scheme.pp - 1 else None)
        stage_gm = _stage_module(lowered.graph_module, pipeline, s)
        count = min(max(pieces, recompute_pieces(stage_gm) if scheme.rc else 1), costed_nodes(stage_gm))
        if count > 1:
            cut = decide_pipeline_split(stage_gm, count, tolerance=PIPELINE_TOLERANCE, seq_len=cost_tokens)
            lowering = dataclasses.replace(lowering, pieces=cut)
        out.append(lowering)
    return tuple(out)


def recompute_pieces(stage_gm: fx.GraphModule) -> int:
    """The pieces a recomputing stage is cut into: one per attention (a transformer layer each, the cut placed
    where the fewest bytes cross, so each piece keeps about one layer's input)."""
    return max(1, sum(1 for n in stage_gm.graph.nodes if classify_node(n) is OpClass.ATTENTION))


def _stage_lowering(lowered: Lowered, scheme: ParallelScheme, stage: int, tp_rank: int,
                    tensor_parallel: TensorParallelPlan | None, pipeline: PipelinePlan | None) -> Lowering:
    stage_gm = _stage_module(lowered.graph_module, pipeline, stage)
    read = {n.target for n in stage_gm.graph.nodes if n.op == "get_attr"}
    placeholders = [n.name for n in stage_gm.graph.nodes if n.op == "placeholder"]
    if pipeline is None:
        inputs, boundary_in = placeholders, ()
        boundary_out = tuple(a.name for a in next(n for n in stage_gm.graph.nodes if n.op == "output").all_input_nodes)
    else:
        spec = pipeline.stages[stage]
        inputs, boundary_in, boundary_out = list(spec.inputs), spec.boundary_in, spec.boundary_out
    first = next(n.name for n in lowered.graph_module.graph.nodes if n.op == "placeholder")
    return Lowering(scheme=scheme, stage=stage, tp_rank=tp_rank, tensor_parallel=tensor_parallel, pipeline=pipeline,
                    params=tuple(sl for sl in lowered.params if sl.name in read),
                    inputs=tuple("input_ids" if n == first else n for n in inputs), boundary_in=tuple(boundary_in),
                    boundary_out=tuple(boundary_out))


def _stage_module(gm: fx.GraphModule, pipeline: PipelinePlan | None, stage: int) -> fx.GraphModule:
    return gm if pipeline is None else getattr(gm, f"stage_{stage}")


def apply_lowering(lowering: Lowering, captured: fx.GraphModule, bucket: int, *, tp_group: str | None = None,
                   attention_kernel: str = "auto", compile_backend: str = "eager") -> Variant:
    """The variant of ``lowering`` for a graph captured on input (1, ``bucket``): the decided plans applied to
    it, its stage kept and compiled once (``eager``: not compiled, the rewritten graph runs as it is). Under
    recomputation (``scheme.rc``) each piece runs under ``torch.utils.checkpoint`` (non-reentrant): only its
    inputs are kept, and its forward runs again in the backward."""
    key = VariantKey(scheme=lowering.scheme, stage=lowering.stage, bucket=bucket)
    ids_val = next(n for n in captured.graph.nodes if n.op == "placeholder").meta.get("val")
    if ids_val is None or tuple(ids_val.shape) != (1, bucket):
        raise ValueError(f"variant {key.describe()} needs a graph captured on input (1, {bucket}), got "
                         f"{None if ids_val is None else tuple(ids_val.shape)}")
    lowered = lower_graph(captured, lowering.scheme, tp_rank=lowering.tp_rank, tp_group=tp_group,
                          attention_kernel=attention_kernel, tensor_parallel=lowering.tensor_parallel,
                          pipeline=lowering.pipeline, cp_rank=lowering.cp_rank, cp_group=lowering.cp_group,
                          attention=lowering.attention_limits, kv_splits=lowering.kv_splits)
    stage_gm = _stage_module(lowered.graph_module, lowering.pipeline, lowering.stage)
    counter = CompileCounter(compile_backend)

    def compile_(gm: fx.GraphModule) -> Callable:
        # "eager" compiles nothing: the rewritten graph runs as it is (dynamo would only trace it); any other
        # backend compiles once per bucket, the sequence count dynamic
        if compile_backend == "eager":
            return gm
        return torch.compile(gm, backend=counter, dynamic=False, fullgraph=True)

    variant = dict(key=key, tp_rank=lowering.tp_rank, graph_module=stage_gm, params=lowering.params,
                   inputs=lowering.inputs, boundary_in=lowering.boundary_in, boundary_out=lowering.boundary_out,
                   records=lowered.records, counter=counter, vocab_range=lowering.vocab_range)
    recompute = lowering.scheme.rc
    if lowering.pieces is None:
        compiled = compile_(stage_gm)
        return Variant(**variant, compiled=_Recomputed(compiled) if recompute else compiled)
    composed = cut_graph(stage_gm, lowering.pieces)
    gate: list = [None]
    pieces = tuple(getattr(composed, f"stage_{i}") for i in range(len(lowering.pieces.stages)))
    names = tuple(tuple(n for n, _ in piece.named_parameters()) for piece in pieces)
    for i, (piece, read) in enumerate(zip(pieces, names)):
        setattr(composed, f"stage_{i}", _Piece(compile_(piece), read, gate, recompute))
    return Variant(**variant, compiled=composed, pieces=pieces, piece_params=names, gate=gate)


def _recomputed(run: Callable, args: tuple) -> tuple:
    """``run(*args)`` keeping only its inputs for the backward, which runs it again (non-reentrant checkpoint: the
    collectives inside run again in the same order on every rank of their group; the RNG state is restored);
    ``run(*args)`` as it is when no gradient is recorded."""
    if not torch.is_grad_enabled():
        return run(*args)
    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)


class _Recomputed:
    """A whole stage recomputed in its backward (one piece)."""

    def __init__(self, run: Callable):
        self.run = run

    def __call__(self, *args):
        return _recomputed(self.run, args)


class _Piece(nn.Module):
    """One piece of a stage cut for overlapped movement or recomputation: asks the gate for the parameters it
    reads (when one is set), then runs (compiled on its own; under ``torch.utils.checkpoint`` when
    ``recompute``: the gate is asked once, in the forward, not again when the backward recomputes)."""

    def __init__(self, run: Callable, reads: Sequence[str], gate: list, recompute: bool = False):
        super().__init__()
        self._run, self.reads, self.gate = (run,), tuple(reads), gate  # a tuple: not registered as a submodule
        self.recompute = recompute

    def forward(self, *args):
        if self.gate[0] is not None:
            self.gate[0](self.reads)
        if self.recompute:
            return _recomputed(self._run[0], args)
        return self._run[0](*args)


class LoweringCache:
    """The one cache of lowerings and variants for one model captured for one kind of compute copy.

    ``capture(tokens)`` gives the model's forward captured on input (1, tokens); the lowerings are decided on
    the capture at the smallest bucket (the analysed capture), each bucket's variant applies them to that
    bucket's capture. ``buffers``: the model's own buffers, for those a capture on meta stand-ins read.
    ``cost_tokens(scheme)``: the longest micro-batch a scheme runs, which the pipeline cut costs attention
    at (None: the analysed capture's tokens). ``kv_splits``: the head groups a CP rank's K/V exchange is
    pipelined over, at most (1: one all-gather before each attention)."""

    def __init__(self, capture: Callable[[int], fx.GraphModule], buckets: TokenBuckets, *, kernel: str = "auto",
                 compile_backend: str = "eager", buffers: Mapping[str, torch.Tensor] | None = None,
                 cost_tokens: Callable[[ParallelScheme], int] | None = None, vocab_parallel: bool = False,
                 model_name: str = "the model", pieces: int = 1, kv_splits: int = 1, split_logits: bool = False):
        if isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1:
            raise ValueError(f"pieces must be a positive integer, got {pieces!r}")
        if isinstance(kv_splits, bool) or not isinstance(kv_splits, int) or kv_splits < 1:
            raise ValueError(f"kv_splits must be a positive integer, got {kv_splits!r}")
        self.kv_splits = kv_splits
        self.pieces = pieces
        """Pieces each stage is cut into for overlapped movement (1: not cut)."""
        self.capture, self.buckets, self.kernel, self.compile_backend = capture, buckets, kernel, compile_backend
        self.buffers = dict(buffers or {})
        self.cost_tokens, self.vocab_parallel, self.model_name = cost_tokens, vocab_parallel, model_name
        self.split_logits = split_logits
        """With ``vocab_parallel``: the last stage's logits stay split by vocabulary (``Lowering.vocab_range``)."""
        self._lowerings: dict[tuple, tuple[Lowering, ...]] = {}
        self._variants: dict[tuple, Variant] = {}
        self._programs: dict[tuple, StageVariants] = {}
        self._limits: dict[tuple[int, int], dict[str, MaskLimits]] = {}

    def top_bucket(self, scheme: ParallelScheme) -> int:
        """The largest bucket a rank of ``scheme`` runs: its longest micro-batch's share (the smallest bucket
        when no cost is known)."""
        if self.cost_tokens is None:
            return self.buckets.sizes[0]
        share = -(-self.cost_tokens(scheme) // scheme.cp)
        return self.buckets.bucket_for(share) if share <= self.buckets.sizes[-1] else self.buckets.sizes[-1]

    def longest_sequence(self, scheme: ParallelScheme) -> int:
        """The longest sequence ``scheme`` trains: its longest micro-batch (its top bucket when unknown)."""
        return self.cost_tokens(scheme) if self.cost_tokens is not None else self.top_bucket(scheme)

    def attention_limits(self, scheme: ParallelScheme) -> dict[str, MaskLimits]:
        """Every attention's limits for the buckets and sequence lengths ``scheme`` trains, decided once per
        (top bucket, longest sequence) on the canonical captures of every bucket up to the top."""
        key = (self.top_bucket(scheme), self.longest_sequence(scheme))
        if key not in self._limits:
            captures = [canonical_graph(self.capture(b)) for b in self.buckets.sizes if b <= key[0]]
            self._limits[key] = decide_attention_limits(captures, key[1])
        return self._limits[key]

    def lowering(self, scheme: ParallelScheme, stage: int, tp_rank: int = 0, tp_group: str | None = None,
                 cp_rank: int = 0, cp_group: str | None = None) -> Lowering:
        """The lowering of (scheme, stage, TP rank, CP rank), decided once (for every stage of the scheme at
        once)."""
        key = (scheme, tp_rank, tp_group, cp_rank, cp_group)
        if key not in self._lowerings:
            self._lowerings[key] = decide_lowerings(
                self.capture(self.buckets.sizes[0]), scheme, tp_rank=tp_rank, tp_group=tp_group,
                attention_kernel=self.kernel, vocab_parallel=self.vocab_parallel,
                cost_tokens=self.cost_tokens(scheme) if self.cost_tokens is not None else None, pieces=self.pieces,
                cp_rank=cp_rank, cp_group=cp_group, attention=self.attention_limits(scheme), kv_splits=self.kv_splits,
                split_logits=self.split_logits)
        return self._lowerings[key][stage]

    def variant(self, scheme: ParallelScheme, stage: int, bucket: int, tp_rank: int = 0,
                tp_group: str | None = None, cp_rank: int = 0, cp_group: str | None = None) -> Variant:
        """The variant of (scheme, stage, TP rank, CP rank) for ``bucket``, built once (it computes with the
        Parameters the lowering left in it until a stage program binds its own)."""
        key = (scheme, stage, bucket, tp_rank, tp_group, cp_rank, cp_group)
        if key not in self._variants:
            self._variants[key] = apply_lowering(
                self.lowering(scheme, stage, tp_rank, tp_group, cp_rank, cp_group), self.capture(bucket), bucket,
                tp_group=tp_group, attention_kernel=self.kernel, compile_backend=self.compile_backend)
        return self._variants[key]

    def program(self, scheme: ParallelScheme, stage: int, tp_rank: int = 0, tp_group: str | None = None,
                cp_rank: int = 0, cp_group: str | None = None) -> "StageVariants":
        """The stage program of (scheme, stage, TP rank, CP rank): what the executor runs, over every bucket."""
        key = (scheme, stage, tp_rank, tp_group, cp_rank, cp_group)
        if key not in self._programs:
            self._programs[key] = StageVariants(
                self, self.lowering(scheme, stage, tp_rank, tp_group, cp_rank, cp_group), tp_group)
        return self._programs[key]

    def buffer(self, name: str) -> torch.Tensor:
        """The model's own buffer ``name`` (what a captured buffer or constant stands for)."""
        if name not in self.buffers:
            raise KeyError(f"the graph reads {name!r}, which is not a buffer of {self.model_name} (a tensor "
                           "attribute captured as a constant cannot be given a dtype or device)")
        return self.buffers[name]

    def compilations(self) -> int:
        """torch.compile compilations of every variant built so far (0 with the ``eager`` backend)."""
        return sum(v.counter.count for v in self._variants.values())


class StageVariants:
    """The stage program of one lowering: a micro-batch runs the variant of its token bucket. Every bucket's
    variant computes with the same Parameters (the runtime's compute copy, bound once), so the gradients of all
    micro-batches of a step accumulate in one place."""

    def __init__(self, cache: LoweringCache, lowering: Lowering, tp_group: str | None):
        self.cache, self.lowering, self.tp_group = cache, lowering, tp_group
        self.gate: Callable[[Sequence[str]], None] | None = None
        """When set (by the runtime, for a step's first forward), called with the names of the parameters the
        stage is about to read, before it reads them: before each piece of a stage cut into pieces, else once
        with every parameter before the stage runs."""
        self.param_slices: dict[str, ParamSlice] = {sl.name: sl for sl in lowering.params}
        self._params: dict[str, nn.Parameter] | None = None
        self._bound: set[int] = set()
        self._buffers: dict[str, torch.Tensor] = {}

    def bind(self, params: Mapping[str, nn.Parameter]) -> None:
        """Compute with ``params`` (by name, shaped as the slices) from now on, in every token bucket: each
        bucket's variant takes them at its next run (when the runtime has filled them; they may be empty now)."""
        missing = sorted(set(self.param_slices) - set(params))
        if missing:
            raise KeyError(f"{self.lowering.describe()} needs parameters {missing[:5]}")
        self._params = dict(params)
        self._bound.clear()

    def _buffer(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """One copy per stage of each buffer: the model's own (a stand-in when captured for another dtype or
        device), on the parameters' device, in its own dtype (the capture traced it in that dtype)."""
        if name not in self._buffers:
            if value.device.type == "meta":
                value = self.cache.buffer(name)
            like = next(iter(self._params.values()), None)
            self._buffers[name] = value.to(device=like.device if like is not None else value.device)
        return self._buffers[name]

    def _variant(self, bucket: int) -> Variant:
        lowering = self.lowering
        variant = self.cache.variant(lowering.scheme, lowering.stage, bucket, lowering.tp_rank, self.tp_group,
                                     lowering.cp_rank, lowering.cp_group)
        if bucket not in self._bound:
            if self._params is None:
                raise RuntimeError(f"{lowering.describe()} runs before bind()")
            variant.bind_(self._params, self._buffer)
            self._bound.add(bucket)
        return variant

    def boundary_in(self, tokens: int) -> list:
        """What this stage receives for a micro-batch of ``tokens`` tokens (its bucket's variant's inputs)."""
        return self._variant(self.cache.buckets.bucket_for(tokens)).boundary_in_specs()

    def bucket(self, tokens: int) -> int:
        """The token bucket a micro-batch of ``tokens`` tokens runs in (its padded size)."""
        return self.cache.buckets.bucket_for(tokens)

    def __call__(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                 boundary: tuple[torch.Tensor, ...],
                 cp_inputs: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
        """The stage's outputs for one packed micro-batch: the boundary the next stage takes, or ``(logits,)``
        (T, vocab) of the real tokens on the last stage. ``cp_inputs``: under context parallelism, the values of
        ``passes.graph.context_parallel.CP_INPUTS`` (``input_ids`` then already fills its bucket). ``max_seqlen``:
        the micro-batch's longest span (its padding's included), which sizes the attention kernels' grid."""
        total = int(input_ids.shape[0])
        variant = self._variant(self.cache.buckets.bucket_for(total))
        if self.gate is not None and not variant.pieces:
            self.gate(tuple(self.param_slices))
        variant.gate[0] = self.gate
        outs = variant(input_ids, cu_seqlens, *boundary, cp_inputs=cp_inputs, max_seqlen=max_seqlen)
        if self.lowering.stage == self.lowering.scheme.pp - 1:
            return (variant.logits(outs, total),)
        return tuple(outs)
