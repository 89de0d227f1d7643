"""Pipeline split: cut a forward into pp stages balanced by cost, each a GraphModule with explicit boundaries.

Owns the decision (:func:`decide_pipeline_split`: a networkx graph of the FX graph, every node weighted by
the analysis's FLOPs, cut into pp contiguous pieces of nearly equal cost, each cut placed where the fewest
activation bytes cross it) and the rewrite (``split_pipeline_pass``), whose result is a parent module
``stage_0 -> stage_1 -> ...`` that composes to the original. Stage s takes the user inputs it reads plus
the boundary tensors of stage s-1 and returns the boundary tensors stage s+1 needs (values needed two
stages later travel through the stage between, as in 1F1B); the last stage returns the graph's outputs.
Parameters are read where they are used, so a weight tied across stages appears in both.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
from torch import fx, nn

from passes.graph.analyze import node_flops
from passes.graph.pass_runner import PassContext, PassError, PassResult

__all__ = ["PipelinePlan", "StageSpec", "decide_pipeline_split", "check_cut_fits", "cut_graph", "split_pipeline_pass",
           "graph_to_networkx", "costed_nodes"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StageSpec:
    """One stage: its nodes and its explicit inputs and outputs."""

    index: int
    """Stage number, 0-based."""
    nodes: tuple[str, ...]
    """Compute nodes (call_*) of the stage, in graph order."""
    inputs: tuple[str, ...]
    """User inputs (placeholders) the stage reads."""
    boundary_in: tuple[str, ...]
    """Values received from the previous stage."""
    boundary_out: tuple[str, ...]
    """Values sent to the next stage (the graph outputs for the last stage)."""
    cost: float
    """Sum of the stage's node costs (FLOPs of one micro-batch)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelinePlan:
    """How one graph is cut into stages."""

    stages: tuple[StageSpec, ...]
    """The stages in order."""

    def __post_init__(self) -> None:
        if not self.stages:
            raise PassError("a pipeline plan needs at least one stage, got none")

    @property
    def imbalance(self) -> float:
        """Largest stage cost over the mean (1.0 is perfect)."""
        costs = [s.cost for s in self.stages]
        mean = sum(costs) / len(costs)
        return max(costs) / mean if mean else 1.0

    def describe(self) -> str:
        """One line per stage: node span, boundary sizes and share of the cost."""
        total = sum(s.cost for s in self.stages) or 1.0
        return "\n".join(
            f"stage {s.index}: {s.nodes[0]}..{s.nodes[-1]} ({len(s.nodes)} nodes, {100 * s.cost / total:.1f}% cost) "
            f"in={list(s.inputs) + list(s.boundary_in)} out={list(s.boundary_out)}"
            for s in self.stages
        )


def _tokens(gm: fx.GraphModule) -> int:
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() >= 1:
            # token ids (B, T) hold one element per token; activations (..., hidden) one row per token
            return int(val.numel()) if not val.is_floating_point() else int(val.numel() // val.shape[-1])
    return 1


def graph_to_networkx(gm: fx.GraphModule, seq_len: int | None = None) -> nx.DiGraph:
    """Data-dependence DiGraph of ``gm``: node attrs ``order``, ``op``, ``cost`` (FLOPs), ``bytes``."""
    tokens = _tokens(gm)
    seq = seq_len or tokens
    g = nx.DiGraph()
    for i, node in enumerate(gm.graph.nodes):
        lin, attn = node_flops(node)
        val = node.meta.get("val")
        nbytes = val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0
        # tokens/seq sequences of length seq, each costing attn * seq^2: attn * seq * tokens in all
        g.add_node(node.name, order=i, op=node.op, cost=lin * tokens + attn * seq * tokens, bytes=nbytes)
        for src in node.all_input_nodes:
            g.add_edge(src.name, node.name)
    return g


def _crossing_bytes(g: nx.DiGraph, order: list[str]) -> list[int]:
    """bytes[i]: activation bytes live across a cut after ``order[i]`` (sweep over last uses)."""
    pos = {n: i for i, n in enumerate(order)}
    delta = [0] * (len(order) + 1)
    for n in order:
        users = [pos[u] for u in g.successors(n) if u in pos]
        if users and max(users) > pos[n]:
            delta[pos[n]] += g.nodes[n]["bytes"]
            delta[max(users)] -= g.nodes[n]["bytes"]
    out, live = [], 0
    for i in range(len(order)):
        live += delta[i]
        out.append(live)
    return out


def _choose_cuts(costs: list[float], crossing: list[int], pp: int, tolerance: float) -> list[int]:
    total = sum(costs)
    prefix, acc = [], 0.0
    for c in costs:
        acc += c
        prefix.append(acc)
    cuts, last = [], -1
    for k in range(1, pp):
        target = k * total / pp
        window = [i for i in range(last + 1, len(costs) - (pp - k)) if abs(prefix[i] - target) <= tolerance * total / pp
                  and prefix[i] > (prefix[last] if last >= 0 else 0.0)]
        if not window:
            window = [min(range(last + 1, len(costs) - (pp - k)), key=lambda i: abs(prefix[i] - target))]
        best = min(window, key=lambda i: (crossing[i], abs(prefix[i] - target), i))
        cuts.append(best)
        last = best
    return cuts


def costed_nodes(gm: fx.GraphModule) -> int:
    """How many of ``gm``'s nodes carry a cost (linears, attention): the most pieces it can be cut into."""
    return sum(1 for n in gm.graph.nodes if n.op.startswith("call_") and sum(node_flops(n)) > 0)


def decide_pipeline_split(gm: fx.GraphModule, pp: int, *, tolerance: float = 0.1,
                          seq_len: int | None = None) -> PipelinePlan:
    """Cut ``gm`` into ``pp`` stages of nearly equal cost, each cut where the fewest bytes cross."""
    g = graph_to_networkx(gm, seq_len)
    order = [n for n in nx.lexicographical_topological_sort(g, key=lambda n: g.nodes[n]["order"])
             if g.nodes[n]["op"].startswith("call_")]
    costs = [g.nodes[n]["cost"] for n in order]
    if pp < 1 or sum(1 for c in costs if c > 0) < pp:
        raise PassError(f"pipeline split: cannot cut {type(gm).__name__} into pp={pp} stages: it has "
                        f"{sum(1 for c in costs if c > 0)} costed nodes (linears/attention)")
    cuts = _choose_cuts(costs, _crossing_bytes(g, order), pp, tolerance)
    bounds = [-1, *cuts, len(order) - 1]
    stage_of = {n: s for s in range(pp) for n in order[bounds[s] + 1: bounds[s + 1] + 1]}
    return PipelinePlan(stages=tuple(_stage_spec(gm, g, order, stage_of, bounds, s) for s in range(pp)))


def _stage_spec(gm: fx.GraphModule, g: nx.DiGraph, order: list[str], stage_of: dict[str, int],
                bounds: list[int], s: int) -> StageSpec:
    pp = len(bounds) - 1
    nodes = order[bounds[s] + 1: bounds[s + 1] + 1]
    reads = {p for n in nodes for p in g.predecessors(n)}
    inputs = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder" and n.name in reads)

    def live_after(k: int) -> tuple[str, ...]:
        """Values made in stages <= k and read by a stage > k (or by the output when k is last)."""
        if k == pp - 1:
            out = next(n for n in gm.graph.nodes if n.op == "output")
            return tuple(a.name for a in out.all_input_nodes)
        keep = []
        for n in order:
            if stage_of[n] <= k and any(stage_of.get(u, pp) > k for u in g.successors(n)):
                keep.append(n)
        return tuple(keep)

    boundary_in = live_after(s - 1) if s > 0 else ()
    return StageSpec(index=s, nodes=tuple(nodes), inputs=inputs, boundary_in=boundary_in,
                     boundary_out=live_after(s), cost=sum(g.nodes[n]["cost"] for n in nodes))


def _build_stage(gm: fx.GraphModule, spec: StageSpec) -> fx.GraphModule:
    by_name = {n.name: n for n in gm.graph.nodes}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    root = nn.Module()
    for name in (*spec.inputs, *spec.boundary_in):
        env[by_name[name]] = graph.placeholder(name)
        env[by_name[name]].meta.update(by_name[name].meta)

    def value(n: fx.Node) -> fx.Node:
        if n not in env and n.op == "get_attr":
            _share_attr(root, gm, n.target)
            env[n] = graph.create_node("get_attr", n.target, name=n.name)
            env[n].meta.update(n.meta)
        return env[n]

    for name in spec.nodes:
        node = by_name[name]
        for a in node.all_input_nodes:
            value(a)
        env[node] = graph.node_copy(node, lambda a: env[a])
    outs = tuple(env[by_name[n]] for n in spec.boundary_out)
    graph.output(outs)
    return fx.GraphModule(root, graph, class_name=f"Stage{spec.index}")


def _share_attr(root: nn.Module, gm: fx.GraphModule, target: str) -> None:
    *path, leaf = target.split(".")
    src: Any = gm
    dst = root
    for part in path:
        src = getattr(src, part)
        if not hasattr(dst, part):
            dst.add_module(part, nn.Module())
        dst = getattr(dst, part)
    value = getattr(src, leaf)
    if isinstance(value, nn.Parameter):
        dst.register_parameter(leaf, value)  # the same Parameter object: gradients of every stage land on it
    else:
        dst.register_buffer(leaf, value)


def _compose(gm: fx.GraphModule, plan: PipelinePlan, stages: list[fx.GraphModule]) -> fx.GraphModule:
    graph = fx.Graph()
    root = nn.Module()
    env: dict[str, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node.name] = graph.placeholder(node.name, type_expr=node.type)
            env[node.name].meta.update(node.meta)
    for spec, stage in zip(plan.stages, stages):
        root.add_module(f"stage_{spec.index}", stage)
        call = graph.call_module(f"stage_{spec.index}", tuple(env[n] for n in (*spec.inputs, *spec.boundary_in)))
        for i, name in enumerate(spec.boundary_out):
            env[name] = graph.call_function(operator.getitem, (call, i))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    graph.output(fx.node.map_arg(out.args[0], lambda n: env[n.name]))
    return fx.GraphModule(root, graph, class_name=f"Pipeline{len(stages)}")


def check_cut_fits(plan: PipelinePlan, gm: fx.GraphModule, pp: int) -> None:
    """A cut decided on another capture of the same model applies to ``gm``: ``pp`` stages that together hold
    exactly ``gm``'s compute nodes (by name), each reading values that exist; otherwise a PassError."""
    if len(plan.stages) != pp:
        raise PassError(f"pipeline split: the cut has {len(plan.stages)} stages, the scheme pp={pp}")
    names = {n.name for n in gm.graph.nodes}
    compute = [n.name for n in gm.graph.nodes if n.op.startswith("call_")]
    cut = [n for s in plan.stages for n in s.nodes]
    if sorted(compute) != sorted(cut):
        extra, missing = sorted(set(compute) - set(cut)), sorted(set(cut) - set(compute))
        raise PassError(f"pipeline split: this capture's nodes differ from the analysed capture's (new {extra[:4]}, "
                        f"gone {missing[:4]})")
    for s in plan.stages:
        unknown = [n for n in (*s.inputs, *s.boundary_in, *s.boundary_out) if n not in names]
        if unknown:
            raise PassError(f"pipeline split: stage {s.index} reads or returns {unknown[:4]}, not in this capture")


def cut_graph(gm: fx.GraphModule, plan: PipelinePlan) -> fx.GraphModule:
    """``gm`` cut as ``plan`` says (a ``PassError`` unless the cut fits it): a parent module that calls
    ``stage_0``, ``stage_1``, ... in turn and composes to ``gm``; each piece holds the same Parameter objects as
    ``gm`` for what it reads."""
    check_cut_fits(plan, gm, len(plan.stages))
    return _compose(gm, plan, [_build_stage(gm, spec) for spec in plan.stages])


def split_pipeline_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Split ``gm`` into ``ctx.scheme.pp`` stages; the result calls ``stage_0``, ``stage_1``, ... in turn."""
    pp = ctx.scheme.pp
    if pp == 1 or any(n.op == "call_module" and str(n.target).startswith("stage_") for n in gm.graph.nodes):
        return PassResult(graph_module=gm, modified=False)
    plan = ctx.option("split_pipeline_pass.plan")
    if plan is None:
        plan = decide_pipeline_split(gm, pp, tolerance=ctx.option("split_pipeline_pass.tolerance", 0.2),
                                     seq_len=ctx.option("split_pipeline_pass.seq_len"))
    check_cut_fits(plan, gm, pp)  # the stage count too: cut_graph checks the nodes alone
    return PassResult(graph_module=cut_graph(gm, plan), modified=True, info={"plan": plan})
