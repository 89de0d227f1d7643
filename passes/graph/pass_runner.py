"""The pass runner: the one place graph passes are named, ordered, disabled, timed and checked.

A graph pass is ``def <verb>_<object>_pass(gm: GraphModule, ctx: PassContext) -> PassResult``. It
returns the module it was given (``modified=False``) when it changes nothing, and never logs or times
itself: :func:`run_passes` does that, lints each result, refuses a pass that claims no change but
returns a different module, and records one :class:`PassRecord` per pass.

Also owns :func:`propagate_vals`, which refreshes every node's ``meta["val"]`` (a fake tensor) after a
rewrite, so later passes and the analysis always see the shapes of the graph as it now is; and
:func:`fill_vals`, which gives a val only to the nodes a rewrite added, for rewrites that leave every other
node's value as it was (most of a lowering's time on a small model went to propagating whole graphs again).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import snapshot_fake
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from passes.plan.ir import ParallelScheme

__all__ = ["PassContext", "PassResult", "PassRecord", "PassError", "GraphPass", "run_passes", "propagate_vals",
           "fill_vals", "same_val", "folded_result"]

_PASS_NAME = re.compile(r"[a-z]+_[a-z0-9_]+_pass")


class PassError(RuntimeError):
    """A pass cannot handle this graph; the message names the node or module at fault."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PassContext:
    """Everything a pass may read besides the graph: the variant being built and the runner's switches."""

    scheme: ParallelScheme = field(default_factory=ParallelScheme)
    """The replica layout the variant is for."""
    tp_rank: int = 0
    """This rank's index inside its tensor-parallel group."""
    tp_group: str | None = None
    """Name of the tensor-parallel process group (``ProcessGroup.group_name``); None when tp == 1."""
    disabled: frozenset[str] = frozenset()
    """Names of passes to skip."""
    check: bool = True
    """Lint every result and verify the no-change contract."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Per-pass options keyed ``<pass name>.<option>``."""

    def __post_init__(self) -> None:
        if not isinstance(self.scheme, ParallelScheme):
            raise PassError(f"scheme must be a ParallelScheme, got {self.scheme!r}")
        rank = self.tp_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.scheme.tp:
            raise PassError(f"tp_rank must be in [0, {self.scheme.tp}), got {self.tp_rank!r}")
        if self.scheme.tp > 1 and not self.tp_group:
            raise PassError(f"tp={self.scheme.tp} needs a tp_group name, got {self.tp_group!r}")

    def option(self, key: str, default: Any = None) -> Any:
        """One per-pass option, e.g. ``ctx.option("split_pipeline_pass.stages")``."""
        return self.options.get(key, default)


@dataclass(frozen=True, slots=True, kw_only=True)
class PassResult:
    """What a pass returns: the (possibly new) module, whether it changed, and what it decided."""

    graph_module: fx.GraphModule
    """The result; the input module itself when ``modified`` is False."""
    modified: bool
    """Whether the pass changed anything."""
    info: Mapping[str, Any] = field(default_factory=dict)
    """The pass's decisions, for reports and later passes (e.g. the parameter slices)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PassRecord:
    """One line of a run report."""

    name: str
    """The pass's function name."""
    ran: bool
    """False when the pass was disabled."""
    modified: bool
    """Whether it changed the graph."""
    ms: float
    """Wall-clock time of the pass."""
    info: Mapping[str, Any] = field(default_factory=dict)
    """The pass's ``PassResult.info``."""


GraphPass = Callable[[fx.GraphModule, PassContext], PassResult]


def folded_result(gm: fx.GraphModule, folded: int) -> PassResult:
    """What a folding pass returns: ``gm`` unchanged when it folded nothing, else cleaned of the nodes the folds
    left dead and recompiled, ``info={"folded": folded}``."""
    if not folded:
        return PassResult(graph_module=gm, modified=False)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return PassResult(graph_module=gm, modified=True, info={"folded": folded})


def _pass_name(p: GraphPass) -> str:
    name = getattr(p, "__name__", repr(p))
    if not _PASS_NAME.fullmatch(name):
        raise PassError(f"pass {name!r} is not named '<verb>_<object>_pass'")
    return name


def run_passes(
    gm: fx.GraphModule, passes: Sequence[GraphPass], ctx: PassContext
) -> tuple[fx.GraphModule, tuple[PassRecord, ...]]:
    """Run ``passes`` in order; returns the final module and one record per pass."""
    names = {_pass_name(p) for p in passes}
    unknown = sorted(k for k in ctx.options if k.partition(".")[0] not in names)
    if unknown:
        raise PassError(f"options {unknown} name no pass of this run ({', '.join(sorted(names))}); keys are "
                        "'<pass name>.<option>'")
    records: list[PassRecord] = []
    for p in passes:
        name = _pass_name(p)
        if name in ctx.disabled:
            records.append(PassRecord(name=name, ran=False, modified=False, ms=0.0))
            continue
        start = time.perf_counter()
        result = p(gm, ctx)
        ms = (time.perf_counter() - start) * 1e3
        if not isinstance(result, PassResult):
            raise PassError(f"pass {name} returned {type(result).__name__}, not a PassResult")
        if ctx.check:
            if not result.modified and result.graph_module is not gm:
                raise PassError(f"pass {name} reported no change but returned a different module")
            result.graph_module.graph.lint()
        records.append(PassRecord(name=name, ran=True, modified=result.modified, ms=ms, info=result.info))
        gm = result.graph_module
    return gm, tuple(records)


def _to_fake(x: Any, mode: FakeTensorMode) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    with mode:
        return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device=x.device)


def copy_graph_module(gm: fx.GraphModule, class_name: str | None = None) -> fx.GraphModule:
    """A GraphModule over a deep copy of ``gm``'s graph (node metadata included) and ``gm``'s own attributes,
    so that a rewrite of the copy leaves ``gm`` intact."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph, class_name=class_name or type(gm).__name__)


def propagate_vals(gm: fx.GraphModule, inputs: Sequence[Any] | None = None) -> fx.GraphModule:
    """Recompute ``meta["val"]`` (a fake tensor) of every node from the placeholders' vals (or ``inputs``)."""
    if inputs is None:
        inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    mode = FakeTensorMode(allow_non_fake_inputs=True, static_shapes=True)
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*[_to_fake(x, mode) for x in inputs])
    return gm


def fill_vals(gm: fx.GraphModule, new_inputs: Mapping[fx.Node, Any],
              replaced: Iterable[tuple[Any, fx.Node]] = ()) -> fx.GraphModule:
    """Give ``meta["val"]`` to every node of ``gm`` without one, in graph order, from its inputs' vals, in the
    fake mode the graph's vals already share; the placeholders a rewrite added take theirs from ``new_inputs``
    (real tensors or Python numbers). Nodes that have a val keep it: for a rewrite that replaces values by new
    nodes of the same shape, dtype and strides (the tests of the packed-attention, tensor-parallel and
    context-parallel rewrites check every val they leave against :func:`propagate_vals`). Where the vals come
    from no fake mode or from several, or a placeholder's val is missing, or a node cannot run in that mode,
    every node is propagated again (:func:`propagate_vals`), as it would be without it. ``replaced``: (the val a
    value had before the rewrite, the node that gives it now); where one differs (:func:`same_val`), the nodes
    after it would keep stale vals, so every node is propagated again too."""
    nodes = list(gm.graph.nodes)
    modes = {id(v.fake_mode): v.fake_mode for n in nodes for v in _tensors(n.meta.get("val"))}
    inputs = [n.meta["val"] if "val" in n.meta else new_inputs.get(n) for n in nodes if n.op == "placeholder"]
    if len(modes) != 1 or any(x is None for x in inputs):
        return propagate_vals(gm, inputs)
    try:
        _FillVals(gm, next(iter(modes.values())), new_inputs).run_all()
    except Exception:  # a node its mode cannot run: as without the shortcut
        return propagate_vals(gm, inputs)
    if not all(same_val(old, node.meta.get("val")) for old, node in replaced):
        return propagate_vals(gm, inputs)
    return gm


def same_val(a: Any, b: Any) -> bool:
    """Whether two vals describe the same values to every node that reads them: tensors of one shape, dtype and
    device, with the same strides on every dim longer than 1 (a dim of 1 is never stepped along), numbers equal,
    sequences element by element."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                and all(x == y for x, y, n in zip(a.stride(), b.stride(), a.shape) if n != 1))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_val(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return a is not None and a == b


def _tensors(val: Any) -> list[FakeTensor]:
    if isinstance(val, FakeTensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _tensors(v)]
    return []


class _FillVals(fx.Interpreter):
    """Runs only the nodes without a val (:func:`fill_vals`), as FakeTensorProp runs them."""

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode, new_inputs: Mapping[fx.Node, Any]):
        super().__init__(gm)
        self.mode, self.new_inputs = mode, new_inputs

    def run_all(self) -> None:
        with self.mode:
            for node in self.graph.nodes:
                self.env[node] = self.run_node(node)

    def run_node(self, n: fx.Node) -> Any:
        if "val" in n.meta:
            return n.meta["val"]
        if n.op == "placeholder":
            result = _to_fake(self.new_inputs[n], self.mode)
        else:
            result = super().run_node(n)
            if n.op == "get_attr" and isinstance(result, torch.Tensor) and not isinstance(result, FakeTensor):
                result = self.mode.from_tensor(result, static_shapes=True)
        val = fx.node.map_aggregate(result, self._snapshot)
        if val is not None:
            n.meta["val"] = val
        return result

    def _snapshot(self, obj: Any) -> Any:
        if isinstance(obj, FakeTensor):
            return snapshot_fake(obj)
        if isinstance(obj, torch.Tensor):
            return snapshot_fake(self.mode.from_tensor(obj, static_shapes=True))
        return obj if isinstance(obj, (int, float, bool)) else None
