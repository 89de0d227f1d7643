"""The trainer's default cost model: the captured graph analysed, on this device's hardware, capped per rank.

Owns :data:`CPU` (the 0.2 TFLOP model CPU ranks plan with), :data:`ANALYSIS_TOKENS` (the capture that graph
analysis reads), :func:`default_cost_model`, :func:`cap_tokens`, :func:`check_strategies` (listed
strategies this job can run, or a ValueError saying why not) and :func:`compute_layout` (where each place of
each scheme computes in the fixed layout, for the planner's count of parameter and gradient movement).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import torch
from torch import fx

from passes.graph.analyze import Hardware, analytic_cost_model, analyze_graph
from passes.graph.hardware import hardware_for_device
from passes.graph.lowering import LoweringCache
from passes.graph.normalize import canonical_graph
from passes.plan.cost_model import HCOMPILE_RUNTIME, RuntimeMemory
from passes.plan.ir import CostModel, ParallelScheme, SchemeCost, Strategy
from passes.plan.memory import ModelMemory
from passes.plan.movement import ComputeLayout, compute_scheme, merged
from runtime.fixed_layout import FixedLayout
from runtime.overlap import layout_windows

__all__ = ["ANALYSIS_TOKENS", "CPU", "default_cost_model", "cap_tokens", "check_strategies", "compute_layout",
           "add_listed_cp_schemes", "add_needed_cp_schemes", "token_ranks",
           "refuse_context_parallel_model"]

ANALYSIS_TOKENS = 64
"""Tokens of the capture that graph analysis (cost model, tensor-parallel split dims, vocabulary) reads."""

CPU = Hardware(name="cpu", peak_tflops=0.2, memory_gib=1024.0, reserved_gib=0.0, link_gbps=5.0,
               fixed_ms_per_layer=0.2, gpus_per_node=1024)
"""What CPU ranks plan with before calibration corrects it (one node; memory bounded by ``hcompile.memory``)."""


def default_cost_model(captured: fx.GraphModule, name: str, world_size: int, tokens_per_rank: int | None,
                       runtime: RuntimeMemory = HCOMPILE_RUNTIME,
                       device: torch.device | str = "cpu", memory: ModelMemory | None = None,
                       memory_bytes: float | None = None, hardware: Hardware | None = None,
                       recompute: bool = False) -> CostModel:
    """Analytic cost model of a captured graph on ``device``'s hardware: the CPU (a 0.2 TFLOP model), or on a GPU
    its preset (``passes.graph.hardware.hardware_for_device``: A100, A800, H100, H200; another GPU is refused,
    never planned as a CPU); ``hardware`` overrides it. Schemes (tp, pp) with tp dividing the head count (and
    within a node), pp at most the layer count and tp*pp dividing the world size, each capped by the one memory
    model (``memory``: the model as ``hcompile.memory.model_memory`` reads it; ``memory_bytes``: what each rank
    may fill, default the hardware's) beside ``runtime``'s states and at ``tokens_per_rank * tp`` tokens per
    micro-batch (on the CPU 1024 per rank when None). ``recompute``: each scheme's recomputing twin (``rc``) beside
    it, its cap from the memory model's recomputation figures and its time the forward's twice."""
    analysis = analyze_graph(canonical_graph(captured))
    if not analysis.attention:
        raise ValueError(f"{name} has no attention (no scaled_dot_product_attention call, nor a softmax(q @ k^T) @ v "
                         "written out): hcompile trains Transformer decoders, and plans by their attention")
    device = torch.device(device)
    if hardware is None:
        hardware = hardware_for_device(torch.cuda.get_device_name(device)) if device.type == "cuda" else CPU
    heads = min((site.heads for site in analysis.attention), default=1)
    schemes = [ParallelScheme(tp=tp, pp=pp) for tp in range(1, world_size + 1) for pp in range(1, world_size + 1)
               if world_size % (tp * pp) == 0 and heads % tp == 0 and pp <= max(1, analysis.layers)
               and tp <= hardware.gpus_per_node]
    if recompute:
        schemes += [dataclasses.replace(s, rc=True) for s in schemes]
    model = analytic_cost_model(analysis, hardware, schemes, name=f"{name}@{hardware.name}", world_size=world_size,
                                runtime=runtime, memory=memory, memory_bytes=memory_bytes)
    per_rank = (1024 if hardware is CPU else None) if tokens_per_rank is None else tokens_per_rank
    return model if per_rank is None else cap_tokens(model, {e.scheme: per_rank * e.scheme.tp for e in model.entries})


def token_ranks(scheme: ParallelScheme) -> int:
    """Ranks whose memory one micro-batch of ``scheme`` spreads over (on one stage): tp times cp."""
    return scheme.tp * scheme.cp


def add_listed_cp_schemes(model: CostModel, strategies: str | Sequence[str]) -> CostModel:
    """``model`` with an entry for every context-parallel scheme the listed ``strategies`` name (none for
    "auto": :func:`add_needed_cp_schemes` decides those once the data is known), derived from its (tp, pp)
    scheme's (:func:`_derived_cp`). A listed CP scheme whose (tp, pp) scheme the model lacks is left to
    :func:`check_strategies` to refuse."""
    if strategies == "auto":
        return model
    wanted = [s for text in strategies for s in Strategy.parse(text).schemes if s.cp > 1]
    return _with_derived_cp(model, wanted)


def add_needed_cp_schemes(model: CostModel, world: int, longest: int) -> CostModel:
    """``strategies="auto"``: ``model`` with the context-parallel schemes a sequence of ``longest`` tokens needs,
    when it is longer than every scheme without CP holds (``passes.plan.context_parallel.needs_cp``): for every
    (tp) scheme, ``(tp, cp)`` for each power of two cp from 2 up to the least that holds it, within ``world``
    ranks (``cp_schemes``), derived as :func:`_derived_cp` derives them; ``model`` itself otherwise."""
    from passes.plan.context_parallel import cp_schemes, needs_cp

    if not needs_cp(model, world, longest):
        return model
    return _with_derived_cp(model, [dataclasses.replace(base, cp=cp) for base, cp in cp_schemes(model, world, longest)])


def _with_derived_cp(model: CostModel, schemes: Sequence[ParallelScheme]) -> CostModel:
    known = {e.scheme: e for e in model.entries}
    added = {}
    for scheme in schemes:
        base = known.get(dataclasses.replace(scheme, cp=1))
        if scheme not in known and base is not None:
            added[scheme] = _derived_cp(base, scheme.cp)
    return dataclasses.replace(model, entries=model.entries + tuple(added.values())) if added else model


def _derived_cp(base: SchemeCost, cp: int) -> SchemeCost:
    """A (tp, pp, cp) scheme's cost from its (tp, pp) scheme's: the per-token and attention work split over the cp
    ranks (the layout gives each the same causal work), the fixed cost and the K/V all-gather not modelled (a CPU
    job runs what it plans; ``hcompile plan`` models CP at scale), ``cp`` times the tokens (each rank holds the
    base scheme's share)."""
    return dataclasses.replace(base, scheme=dataclasses.replace(base.scheme, cp=cp), a=base.a / cp, b=base.b / cp,
                               max_tokens=base.max_tokens * cp)


def cap_tokens(model: CostModel, caps: Mapping[ParallelScheme, int]) -> CostModel:
    """``model`` with each scheme's ``max_tokens`` lowered to ``caps[scheme]``."""
    entries = tuple(dataclasses.replace(e, max_tokens=min(e.max_tokens, caps.get(e.scheme, e.max_tokens)))
                    for e in model.entries)
    return dataclasses.replace(model, entries=entries)


def check_strategies(strategies: str | tuple[str, ...], model: CostModel, graph: fx.GraphModule, world: int) -> None:
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


def refuse_context_parallel_model(model: CostModel) -> None:
    """A ValueError for a given cost model with context-parallel schemes: the trainer derives its CP schemes
    itself, where a listed strategy names them (``add_listed_cp_schemes``) or, with ``strategies="auto"``, where
    the data needs them (``add_needed_cp_schemes``)."""
    bad = [e.scheme.describe() for e in model.entries if e.scheme.cp > 1]
    if bad:
        raise ValueError(f"cost model {model.name!r} has context-parallel schemes {', '.join(bad)}: the trainer "
                         "derives its CP schemes itself, for listed strategies (e.g. strategies=['1x(cp2)+2x(tp1)']) "
                         "or, with strategies='auto', where a sequence needs them; give a cost model with cp1 "
                         "schemes")


def compute_layout(lowerings: LoweringCache, layout: FixedLayout,
                   schemes: Sequence[ParallelScheme]) -> ComputeLayout:
    """Where every (scheme, stage, TP rank) of ``schemes`` computes in ``layout``: the flat ranges of its
    lowering's parameter slices (``FixedLayout.slice_ranges``, what ``runtime.stage_params`` holds), for the
    planner's movement count (``passes.plan.movement``), with the windows the overlapped runtime cuts ``layout``
    into by default (``runtime.overlap.layout_windows``). Decides the lowerings it has not met yet."""
    ranges, pushes = {}, {}
    for scheme in sorted({compute_scheme(s) for s in schemes}):  # a CP rank computes as its TP rank
        for stage in range(scheme.pp):
            for tp_rank in range(scheme.tp):
                group = "movement" if scheme.tp > 1 else None  # decisions do not depend on the group's name
                lowering = lowerings.lowering(scheme, stage, tp_rank, group)
                ranges[(scheme, stage, tp_rank)] = merged([r for sl in lowering.params
                                                           for r in layout.slice_ranges(sl)])
                if tp_rank > 0:  # replicated slices: pushed by TP rank 0 alone (runtime.stage_params)
                    pushes[(scheme, stage, tp_rank)] = merged([r for sl in lowering.params if sl.dim is not None
                                                               for r in layout.slice_ranges(sl)])
    return ComputeLayout(numel=layout.numel, ranges=ranges, regions=tuple(layout.regions),
                         windows=len(layout_windows(layout)), pushes=pushes)
