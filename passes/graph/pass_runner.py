"""The pass runner: the one place graph passes are named, ordered, disabled, timed and checked.

A graph pass is ``def <verb>_<object>_pass(gm: GraphModule, ctx: PassContext) -> PassResult``. It
returns the module it was given (``modified=False``) when it changes nothing, and never logs or times
itself: :func:`run_passes` does that, lints each result, refuses a pass that claims no change but
returns a different module, and records one :class:`PassRecord` per pass.

Also owns :func:`propagate_vals`, which refreshes every node's ``meta["val"]`` (a fake tensor) after a
rewrite, so later passes and the analysis always see the shapes of the graph as it now is.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from passes.plan.ir import ParallelScheme

__all__ = ["PassContext", "PassResult", "PassRecord", "PassError", "GraphPass", "run_passes", "propagate_vals",
           "folded_result"]

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
