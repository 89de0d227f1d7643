"""Tensor parallelism: decide how a captured forward is split over tp ranks, then rewrite it for one rank.

Owns the decision (:func:`decide_tensor_parallel`, a pure function of the graph, tp and rank, returning a
:class:`TensorParallelPlan`) and the rewrite (``shard_tensor_parallel_pass``), Megatron style:

- linears fed by a replicated tensor are column-parallel (output features split; a fused projection that
  is ``split`` afterwards is split chunk by chunk), linears fed by a split tensor are row-parallel
  (input features split, followed by an all-reduce); the last linear before the output (the LM head)
  and the embeddings stay replicated, or with option ``tensor_parallel.vocab_parallel`` are split by
  vocabulary rows (masked lookup + all-reduce; logits gathered);
- attention heads are split: query heads must divide by tp; key/value heads are split when they divide
  by tp, replicated (each rank keeps the kv head its query heads use) when tp divides them, else error;
- ``tp_copy`` (backward all-reduce) is inserted before column-parallel inputs and ``tp_all_reduce``
  (forward all-reduce) after row-parallel outputs, so replicated parameters get full gradients;
- reshape/view/split constants are rewritten by sharding propagation (:mod:`passes.graph.sharding`).

The rewritten module holds only this rank's slice of each parameter; :class:`ParamSlice` declares, per
parameter, which slice of the full tensor it expects.
"""

from __future__ import annotations

import enum
import logging
import math
import operator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch import fx, nn

from passes.graph.analyze import OpClass, attention_sites, classify_node
from passes.graph.collectives import TP_ALL_GATHER, TP_ALL_REDUCE, TP_COPY, TP_GRAD_SHARE, vocab_parallel_embedding
from passes.graph.pass_runner import PassContext, PassError, PassResult, fill_vals, propagate_vals
from passes.graph.sharding import Shard, block_index, propagate_node, where

log = logging.getLogger(__name__)

__all__ = ["LinearRole", "ParamSlice", "TensorParallelPlan", "decide_tensor_parallel", "check_plan_fits", "split_dims",
           "shard_tensor_parallel_pass"]

_LINEAR_TARGETS = (torch._C._nn.linear, torch.nn.functional.linear)


class LinearRole(enum.Enum):
    """How one linear is split."""

    COLUMN = "column"
    ROW = "row"
    REPLICATED = "replicated"
    VOCAB = "vocab"
    """The LM head split by vocabulary rows, its logits gathered (vocab-parallel)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamSlice:
    """Which part of a full parameter one rank holds: blocks ``ranges`` of dim ``dim`` (None: all of it)."""

    name: str
    """Fully qualified parameter name (the ``get_attr`` target of the captured graph)."""
    full_shape: tuple[int, ...]
    """Shape of the whole parameter."""
    dim: int | None = None
    """The split dim; None when replicated."""
    ranges: tuple[tuple[int, int], ...] = ()
    """(start, stop) blocks of ``dim``, concatenated in order."""
    shared_by: int = 1
    """How many ranks hold this same slice (replicated kv heads); their gradients are summed."""
    range_shares: tuple[int, ...] = ()
    """Per range, how many ranks hold it, when that differs between ranges (a fused projection whose query
    rows are split and whose key/value rows are replicated); empty: ``shared_by`` for every range."""

    def __post_init__(self) -> None:
        if self.dim is not None:
            size = self.full_shape[self.dim]
            if not self.ranges or any(not 0 <= a < b <= size for a, b in self.ranges):
                raise PassError(f"slice of {self.name!r}: bad ranges {self.ranges!r} for dim of size {size}")
        if self.range_shares and len(self.range_shares) != len(self.ranges):
            raise PassError(f"slice of {self.name!r}: {len(self.range_shares)} range shares for "
                            f"{len(self.ranges)} ranges")

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the slice."""
        if self.dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] = sum(b - a for a, b in self.ranges)
        return tuple(shape)

    def shares(self) -> tuple[int, ...]:
        """Per range, how many ranks of the group hold it with identical gradients."""
        return self.range_shares or (self.shared_by,) * len(self.ranges)

    def range_weights(self, tp: int) -> tuple[float, ...]:
        """Per range (one entry when replicated): the factor on a rank's gradient of it before the gradients
        of all ranks are summed. The rewrite leaves identical gradients on every rank that holds the same
        elements (a replicated parameter on all ``tp`` ranks of the group; replicated key/value rows on the
        ranks that share them), so those count once; partial gradients of one parameter on different
        pipeline stages (tied embeddings) and on different replicas add up."""
        return (1.0 / tp,) if self.dim is None else tuple(1.0 / s for s in self.shares())

    def weight_regions(self, tp: int) -> list[tuple[int, int, float]]:
        """(first element, elements, factor) of the slice's gradient stored with ``dim`` outermost (the fixed
        layout's order), touching regions of one factor joined."""
        numel = math.prod(self.local_shape)
        if self.dim is None:
            return [(0, numel, 1.0 / tp)]
        inner = numel // self.local_shape[self.dim]
        regions: list[tuple[int, int, float]] = []
        offset = 0
        for (a, b), w in zip(self.ranges, self.range_weights(tp)):
            if regions and regions[-1][2] == w:
                regions[-1] = (regions[-1][0], regions[-1][1] + (b - a) * inner, w)
            else:
                regions.append((offset * inner, (b - a) * inner, w))
            offset += b - a
        return regions

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``full`` (a new tensor when split)."""
        if tuple(full.shape) != self.full_shape:
            raise PassError(f"parameter {self.name!r}: expected shape {self.full_shape}, got {tuple(full.shape)}")
        if self.dim is None:
            return full
        return torch.cat([full.narrow(self.dim, a, b - a) for a, b in self.ranges], dim=self.dim)

    def describe(self) -> str:
        """E.g. ``h.0.attn.c_attn.weight[0:16,64:80,128:144 of dim 0]``."""
        if self.dim is None:
            return f"{self.name}[replicated]"
        blocks = ",".join(f"{a}:{b}" for a, b in self.ranges)
        shares = self.shares()
        shared = ("" if max(shares) == 1 else f" shared by {shares[0]}" if len(set(shares)) == 1
                  else f" shared by {','.join(map(str, shares))}")
        return f"{self.name}[{blocks} of dim {self.dim}{shared}]"


@dataclass(frozen=True, slots=True, kw_only=True)
class _Chunk:
    size: int
    parts: int
    index: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorParallelPlan:
    """One rank's tensor-parallel decisions for one graph."""

    tp: int
    """Tensor-parallel degree."""
    rank: int
    """This rank's index in the group."""
    roles: tuple[tuple[str, LinearRole], ...]
    """(linear node name, role) in graph order."""
    chunks: tuple[tuple[str, tuple[_Chunk, ...]], ...]
    """Per column-parallel linear: its output chunks and which part of each this rank holds."""
    params: tuple[ParamSlice, ...]
    """Every parameter the graph reads, with this rank's slice."""
    split_logits: bool = False
    """With a vocab-parallel LM head: its logits stay this rank's vocabulary columns (no all-gather; the loss
    assembles them over the group, ``runtime.loss.vocab_parallel_loss_sum``)."""

    @property
    def vocab_range(self) -> tuple[int, int] | None:
        """(start, stop) of the vocabulary columns this rank's logits hold when they stay split, else None."""
        if not self.split_logits:
            return None
        head = next((name for name, role in self.roles if role is LinearRole.VOCAB), None)
        return None if head is None else self._head_rows(head)

    def _head_rows(self, head: str) -> tuple[int, int] | None:
        weight = dict(self.weights).get(head)
        return None if weight is None else self.param(weight).ranges[0]

    weights: tuple[tuple[str, str], ...] = ()
    """(linear node name, its weight parameter's name) of the vocab-parallel head, when there is one."""

    def role(self, node: str) -> LinearRole:
        """The role of linear ``node``."""
        return dict(self.roles)[node]

    def local_chunks(self, node: str) -> list[int] | None:
        """Local sizes of a column-parallel linear's chunks (None for other nodes)."""
        chunks = dict(self.chunks).get(node)
        return None if chunks is None else [c.size // c.parts for c in chunks]

    def param(self, name: str) -> ParamSlice:
        """The slice of parameter ``name``."""
        return next(p for p in self.params if p.name == name)

    def describe(self) -> str:
        """Stable multi-line text: roles then slices."""
        lines = [f"tp={self.tp} rank={self.rank}"]
        lines += [f"  {name}: {role.value}" for name, role in self.roles]
        lines += [f"  {p.describe()}" for p in self.params]
        return "\n".join(lines)


def _is_linear(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target in _LINEAR_TARGETS or node.target is torch.addmm)


@dataclass(frozen=True, slots=True)
class _LinearArgs:
    """A linear's operands whichever way it is written: ``linear(x, w[out, in], b)`` or, as GPT-2's Conv1D
    does, ``addmm(b, x, w[in, out])``."""

    x_pos: int
    """Position of the input among the node's args."""
    weight: Any
    bias: Any
    out_dim: int
    """The weight dim of the output features."""


def _linear_args(node: fx.Node) -> _LinearArgs:
    if node.target is torch.addmm:
        return _LinearArgs(1, node.args[2], node.args[0], 1)
    return _LinearArgs(0, node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs.get("bias"), 0)


def _linear_input(node: fx.Node) -> Any:
    return node.args[_linear_args(node).x_pos]


_SHAPE_METHODS = ("view", "reshape", "unsqueeze", "contiguous")


def _last_dim(node: Any) -> int | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return int(val.shape[-1]) if isinstance(val, torch.Tensor) and val.dim() else None


def _keeps_last_dim(view: fx.Node) -> bool:
    """A view, reshape, unsqueeze or contiguous whose output has its input's last dim."""
    return (view.op == "call_method" and view.target in _SHAPE_METHODS and isinstance(view.args[0], fx.Node)
            and _last_dim(view) is not None and _last_dim(view) == _last_dim(view.args[0]))


def _through_views(node: fx.Node) -> fx.Node:
    """``node`` followed down its chain of sole-user views and reshapes that keep the last dim."""
    while len(node.users) == 1 and _keeps_last_dim(next(iter(node.users))):
        node = next(iter(node.users))
    return node


def _view_source(node: fx.Node) -> fx.Node:
    """The node of which ``node`` is a chain of last-dim-keeping views (itself when it is not a view)."""
    while _keeps_last_dim(node):
        node = node.args[0]
    return node


def _reaches_output_directly(node: fx.Node) -> bool:
    """True when some path from ``node`` reaches the output without another linear or attention."""
    stack, seen = list(node.users), set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "output":
            return True
        if _is_linear(n) or classify_node(n) is OpClass.ATTENTION:
            continue
        stack.extend(n.users)
    return False


def _decide_roles(gm: fx.GraphModule, head: LinearRole = LinearRole.REPLICATED) -> dict[str, LinearRole]:
    split: dict[fx.Node, bool] = {}
    roles: dict[str, LinearRole] = {}
    for node in gm.graph.nodes:
        if _is_linear(node):
            if split.get(_linear_input(node), False):
                roles[node.name], split[node] = LinearRole.ROW, False
            elif _reaches_output_directly(node):
                roles[node.name], split[node] = head, False
            else:
                roles[node.name], split[node] = LinearRole.COLUMN, True
        else:
            split[node] = any(split.get(a, False) for a in node.all_input_nodes)
    return roles


def _kv_parts(gm: fx.GraphModule, tp: int) -> dict[str, int]:
    """Per attention node: how many parts its kv heads are cut into (tp, or kv_heads when replicated)."""
    parts = {}
    for site in attention_sites(gm):
        if site.heads % tp:
            raise PassError(f"tensor parallel: attention {site.node!r} (module {site.module!r}) has {site.heads} "
                            f"query heads, not divisible by tp={tp}")
        if site.kv_heads % tp == 0:
            parts[site.node] = tp
        elif tp % site.kv_heads == 0:
            parts[site.node] = site.kv_heads
        else:
            raise PassError(f"tensor parallel: attention {site.node!r} (module {site.module!r}) has {site.kv_heads} "
                            f"key/value heads: neither divisible by tp={tp} nor replicable (tp not a multiple)")
    return parts


def _feeds_kv(start: fx.Node) -> str | None:
    """The attention node whose k or v ``start`` feeds (through non-linear ops), if any."""
    stack, seen = [(start, n) for n in start.users], set()
    while stack:
        prev, n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if classify_node(n) is OpClass.ATTENTION:
            if prev in n.args[1:3]:
                return n.name
            continue
        if not _is_linear(n):
            stack.extend((n, u) for u in n.users)
    return None


def _split_dim(split: fx.Node) -> int:
    ndim = len(split.args[0].meta["val"].shape)
    dim = split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)
    return dim - ndim if dim >= 0 else dim


def _chunks(node: fx.Node, tp: int, rank: int, kv_parts: dict[str, int]) -> tuple[_Chunk, ...]:
    lin = _linear_args(node)
    out_features = int(lin.weight.meta["val"].shape[lin.out_dim])
    users = list(_through_views(node).users)
    heads = [node]
    sizes = [out_features]
    if len(users) == 1 and users[0].target in ("split", torch.split) and _split_dim(users[0]) == -1:
        split = users[0]
        sizes = [int(v.shape[-1]) for v in split.meta["val"]]
        getitems = {u.args[1]: u for u in split.users}
        heads = [getitems.get(i) for i in range(len(sizes))]
    chunks = []
    for size, head in zip(sizes, heads):
        site = _feeds_kv(head) if head is not None else None
        parts = kv_parts.get(site, tp) if site else tp
        if size % parts:
            raise PassError(f"tensor parallel: {where(node)} has an output chunk of {size} features, "
                            f"not divisible into {parts} parts")
        chunks.append(_Chunk(size=size, parts=parts, index=rank * parts // tp))
    return tuple(chunks)


def _column_ranges(chunks: tuple[_Chunk, ...]) -> tuple[tuple[int, int], ...]:
    ranges, offset = [], 0
    for c in chunks:
        width = c.size // c.parts
        ranges.append((offset + c.index * width, offset + (c.index + 1) * width))
        offset += c.size
    return tuple(ranges)


def _param_name(node: Any) -> str | None:
    return node.target if isinstance(node, fx.Node) and node.op == "get_attr" else None


def _block(name: str, shape: tuple[int, ...], dim: int, tp: int, rank: int, node: fx.Node) -> ParamSlice:
    """Rank ``rank``'s contiguous 1/tp block of dim ``dim``; the dim must divide."""
    if shape[dim] % tp:
        raise PassError(f"tensor parallel: {where(node)}: dim {dim} of {name!r} has {shape[dim]} rows, "
                        f"not divisible by tp={tp}")
    width = shape[dim] // tp
    return ParamSlice(name=name, full_shape=shape, dim=dim, ranges=((rank * width, (rank + 1) * width),))


def _linear_slices(node: fx.Node, role: LinearRole, tp: int, rank: int, kv_parts: dict[str, int],
                   chunks: dict[str, tuple[_Chunk, ...]]) -> dict[str, ParamSlice]:
    lin = _linear_args(node)
    weight, bias = _param_name(lin.weight), _param_name(lin.bias)
    if weight is None:
        raise PassError(f"tensor parallel: {where(node)}: the weight is computed, not a parameter")
    shape = tuple(lin.weight.meta["val"].shape)
    new: dict[str, ParamSlice] = {}
    if role is LinearRole.COLUMN:
        chunks[node.name] = c = _chunks(node, tp, rank, kv_parts)
        shares = tuple(tp // chunk.parts for chunk in c)  # a fused projection may replicate only its kv rows
        sharing = dict(shared_by=shares[0]) if len(set(shares)) == 1 else dict(range_shares=shares)
        new[weight] = ParamSlice(name=weight, full_shape=shape, dim=lin.out_dim, ranges=_column_ranges(c),
                                 **sharing)
        if bias:
            new[bias] = ParamSlice(name=bias, full_shape=(shape[lin.out_dim],), dim=0, ranges=_column_ranges(c),
                                   **sharing)
    elif role is LinearRole.ROW:
        new[weight] = _block(weight, shape, 1 - lin.out_dim, tp, rank, node)
    elif role is LinearRole.VOCAB:
        if lin.out_dim != 0:
            raise PassError(f"tensor parallel: vocab-parallel {where(node)} is not a linear(x, weight); not supported")
        if bias:
            raise PassError(f"tensor parallel: vocab-parallel {where(node)} has a bias; not supported")
        new[weight] = _block(weight, shape, 0, tp, rank, node)
    return new


def _is_token_embedding(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is torch.nn.functional.embedding
            and node.args[0].op == "placeholder" and _param_name(node.args[1]) is not None)


def decide_tensor_parallel(gm: fx.GraphModule, tp: int, rank: int, *, vocab_parallel: bool = False,
                           split_logits: bool = False) -> TensorParallelPlan:
    """Roles of the linears, chunking of column outputs and the slice of every parameter, for one rank.

    ``vocab_parallel``: split the token embedding and the LM head by vocabulary rows instead of
    replicating them; the logits are gathered, so the graph's output is unchanged, unless ``split_logits``:
    then they stay this rank's columns (:attr:`TensorParallelPlan.vocab_range`). A model whose head or
    embedding cannot be split so (a vocabulary tp does not divide, a head with a bias, a tied embedding read
    whole elsewhere) keeps them replicated, as without ``vocab_parallel``."""
    if vocab_parallel and tp > 1:
        try:
            return _decide(gm, tp, rank, vocab_parallel=True, split_logits=split_logits)
        except PassError as exc:
            log.debug("tensor parallel: the LM head and embedding stay replicated (%s)", exc)
    return _decide(gm, tp, rank, vocab_parallel=False, split_logits=False)


def _decide(gm: fx.GraphModule, tp: int, rank: int, *, vocab_parallel: bool, split_logits: bool
            ) -> TensorParallelPlan:
    if tp < 1 or not 0 <= rank < tp:
        raise PassError(f"tensor parallel: need 0 <= rank < tp, got rank={rank!r} tp={tp!r}")
    if tp > 1:
        _refuse_experts(gm, tp)
    kv_parts = _kv_parts(gm, tp)
    roles = _decide_roles(gm, LinearRole.VOCAB if vocab_parallel else LinearRole.REPLICATED)
    chunks: dict[str, tuple[_Chunk, ...]] = {}
    slices: dict[str, ParamSlice] = {}
    whole: dict[str, fx.Node] = {}
    """Per parameter an embedding reads whole (not a vocabulary-parallel token embedding): that embedding."""
    for node in gm.graph.nodes:
        if _is_linear(node):
            new = _linear_slices(node, roles[node.name], tp, rank, kv_parts, chunks)
        elif vocab_parallel and _is_token_embedding(node):
            weight = _param_name(node.args[1])
            new = {weight: _block(weight, tuple(node.args[1].meta["val"].shape), 0, tp, rank, node)}
        else:
            if node.op == "call_function" and node.target is torch.nn.functional.embedding \
                    and _param_name(node.args[1]) is not None:
                whole.setdefault(_param_name(node.args[1]), node)
            continue
        for name, sl in new.items():
            if slices.get(name, sl) != sl:
                raise PassError(f"tensor parallel: parameter {name!r} is used by linears split differently")
            slices[name] = sl
    for name, embedding in whole.items():
        if name in slices and slices[name].dim is not None:
            linear = next(n for n in gm.graph.nodes if _is_linear(n) and name in (
                _param_name(_linear_args(n).weight), _param_name(_linear_args(n).bias)))
            raise PassError(f"tensor parallel: parameter {name!r} is read whole by {where(embedding)} and split along "
                            f"dim {slices[name].dim} by the {roles[linear.name].value}-parallel {where(linear)} (a "
                            f"tied embedding whose head reads a split input): this model has no tensor-parallel form")
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target not in slices and _is_param(gm, node.target):
            slices[node.target] = ParamSlice(name=node.target, full_shape=tuple(node.meta["val"].shape))
    heads = tuple((n.name, _param_name(_linear_args(n).weight)) for n in gm.graph.nodes
                  if _is_linear(n) and roles[n.name] is LinearRole.VOCAB)
    return TensorParallelPlan(tp=tp, rank=rank, roles=tuple(roles.items()), chunks=tuple(chunks.items()),
                              params=tuple(slices.values()), split_logits=split_logits and bool(heads),
                              weights=heads)


def check_plan_fits(plan: TensorParallelPlan, gm: fx.GraphModule, tp: int, rank: int) -> None:
    """A plan decided on another capture of the same model applies to ``gm``: the same degree and rank, the
    same linears (by node name) and the same parameter shapes; otherwise a PassError saying what differs."""
    if (plan.tp, plan.rank) != (tp, rank):
        raise PassError(f"tensor parallel: the plan is for tp={plan.tp} rank={plan.rank}, the pass for tp={tp} "
                        f"rank={rank}")
    linears = [n.name for n in gm.graph.nodes if _is_linear(n)]
    planned = [name for name, _ in plan.roles]
    if linears != planned:
        extra, missing = sorted(set(linears) - set(planned)), sorted(set(planned) - set(linears))
        raise PassError(f"tensor parallel: this capture's linears differ from the analysed capture's (new "
                        f"{extra[:4]}, gone {missing[:4]}{', or in another order' if not extra + missing else ''})")
    shapes = {n.target: tuple(n.meta["val"].shape) for n in gm.graph.nodes
              if n.op == "get_attr" and "val" in n.meta and _is_param(gm, n.target)}
    for sl in plan.params:
        if sl.name in shapes and shapes[sl.name] != sl.full_shape:
            raise PassError(f"tensor parallel: parameter {sl.name!r} has shape {shapes[sl.name]} in this capture, "
                            f"{sl.full_shape} in the analysed one")


def split_dims(gm: fx.GraphModule) -> dict[str, int]:
    """Per parameter that tensor parallelism splits, the dim it splits (the same at every degree): what the
    fixed layout stores outermost. A graph without a tensor-parallel form raises the PassError that says why
    (the caller decides whether a job without tensor parallelism goes on)."""
    plan = decide_tensor_parallel(gm, 1, 0)
    return {sl.name: sl.dim for sl in plan.params if sl.dim is not None}


def _set_attr(root: nn.Module, name: str, value: torch.Tensor, as_param: bool, requires_grad: bool = True) -> None:
    *path, leaf = name.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if as_param:
        mod.register_parameter(leaf, nn.Parameter(value.detach().clone(), requires_grad=requires_grad))
    else:
        mod.register_buffer(leaf, value)


class _Rewriter:
    """Builds one rank's graph from the captured graph and a plan, node by node."""

    def __init__(self, gm: fx.GraphModule, plan: TensorParallelPlan, group: str) -> None:
        self.gm, self.plan, self.group = gm, plan, group
        self.graph = fx.Graph()
        self.root = nn.Module()
        self.env: dict[fx.Node, fx.Node] = {}
        self.specs: dict[fx.Node, Any] = {}
        self.copies: dict[fx.Node, fx.Node] = {}
        """Per replicated value: its ``tp_copy`` (forward identity, gradient summed over the group)."""
        self.sharded_params: set[fx.Node] = set()
        self.carried: list[tuple[fx.Node, fx.Node]] = []
        """(captured node, its copy) of the values that stay whole, the copy keeping the capture's val."""
        self.grad_flow: dict[fx.Node, bool] = {}

    def new(self, op: str, target: Any, args: tuple, kwargs: dict | None = None,
            like: fx.Node | None = None) -> fx.Node:
        node = self.graph.create_node(op, target, fx.node.map_arg(args, self.env.__getitem__),
                                      fx.node.map_arg(kwargs or {}, self.env.__getitem__),
                                      name=like.name if like is not None else None)
        if like is not None:
            node.meta.update({k: v for k, v in like.meta.items() if k in ("nn_module_stack", "stack_trace")})
        return node

    def run(self) -> fx.GraphModule:
        for node in self.gm.graph.nodes:
            self.env[node] = self.visit(node)
        out = fx.GraphModule(self.root, self.graph, class_name=f"TP{self.plan.tp}Rank{self.plan.rank}Module")
        # vals for what is split or new; what stays whole kept its own, right where its inputs' vals are its
        # original's (the same op on inputs of the same vals)
        return fill_vals(out, {}, self._carried_inputs())

    def _carried_inputs(self) -> list[tuple[object, fx.Node]]:
        """(the capture's val, the copy's input) of every input of a copy that kept the capture's val (a copy
        reading other inputs than its original: (None, the copy), which never matches)."""
        pairs: list[tuple[object, fx.Node]] = []
        for node, new in self.carried:
            before, after = node.all_input_nodes, new.all_input_nodes
            pairs += zip((a.meta.get("val") for a in before), after) if len(before) == len(after) else [(None, new)]
        return pairs

    def visit(self, node: fx.Node) -> fx.Node:
        if node.op == "placeholder":
            new = self.graph.placeholder(node.name, type_expr=node.type)
            new.meta.update(node.meta)
            return new
        if node.op == "get_attr":
            return self.get_attr(node)
        if node.op == "output":
            split_logits = Shard(dim=-1, frac=Fraction(1, self.plan.tp))
            for a in node.all_input_nodes:
                spec = self.specs.get(a)
                if spec is not None and not (self.plan.split_logits and _last_dim_split(spec, a) == split_logits):
                    raise PassError(f"tensor parallel: graph output {where(a)} is still split over ranks")
            return self.new("output", "output", node.args)
        if _is_token_embedding(node) and node.args[1] in self.sharded_params:
            return self.embedding(node)
        if any(a in self.sharded_params for a in node.all_input_nodes) and not _is_linear(node):
            raise PassError(f"tensor parallel: {where(node)} uses a split parameter outside its linear")
        if _is_linear(node):
            return self.linear(node)
        if classify_node(node) is OpClass.ATTENTION:
            return self.attention(node)
        prop = propagate_node(node, self.specs, node.args, lambda n: self.plan.local_chunks(_view_source(n).name))
        self.specs[node] = prop.spec
        new = self.new(node.op, node.target, prop.args, prop.kwargs, like=node)
        if (prop.spec is None and not prop.reduce and not prop.narrow and "val" in node.meta
                and tuple(prop.args) == tuple(node.args) and dict(prop.kwargs) == dict(node.kwargs)
                and all(self.specs.get(a) is None for a in node.all_input_nodes)):
            new.meta["val"] = node.meta["val"]  # whole inputs, a whole result: the value the capture computed
            self.carried.append((node, new))
        if prop.spec is not None or prop.reduce:
            self.reduce_replicated_grads(node, new)
        for operand, dim, frac in prop.narrow:
            self.narrow_operand(new, operand, dim, frac)
        return self.all_reduce(node, new, prop.reduce) if prop.reduce else new

    def narrow_operand(self, new: fx.Node, operand: fx.Node, dim: int, frac: Fraction) -> None:
        """Cut a replicated operand (already routed through ``tp_copy`` when it needs a gradient) to this
        rank's block of ``dim`` where ``new`` reads it."""
        size = int(operand.meta["val"].shape[dim])
        width = int(size * frac)
        start = block_index(frac, self.plan.tp, self.plan.rank) * width
        source = next(a for a in new.all_input_nodes if a in (self.env[operand], self.copies.get(operand)))
        with self.graph.inserting_before(new):
            cut = self.graph.call_method("narrow", (source, dim, start, width))
        new.replace_input_with(source, cut)

    def all_reduce(self, node: fx.Node, new: fx.Node, kind: str) -> fx.Node:
        """A local sum or mean over the sharded dim, completed over the group: a mean over equal blocks is the
        mean of the ranks' means; a sum counts each block once (a block held by several ranks, as replicated
        kv heads are, is divided by their number)."""
        copies = self.specs[node.args[0]].frac * self.plan.tp  # ranks holding each block (replicated kv heads)
        reduced = self.graph.call_function(TP_ALL_REDUCE, (new, self.group))
        divisor = self.plan.tp if kind == "mean" else copies
        return reduced if divisor == 1 else self.graph.call_function(torch.div, (reduced, int(divisor)))

    def reduce_replicated_grads(self, node: fx.Node, new: fx.Node) -> None:
        """A replicated operand that meets a split one (a per-head norm weight times head-split queries) gets
        only its own heads' part of the gradient on each rank: route it through ``tp_copy`` so the gradient is
        summed over the group, as every replicated value's gradient must be (identical on every rank)."""
        for a in node.all_input_nodes:
            if self.specs.get(a) is not None or not self.needs_grad(a):
                continue
            if a not in self.copies:
                with self.graph.inserting_before(new):
                    self.copies[a] = self.graph.call_function(TP_COPY, (self.env[a], self.group))
            new.replace_input_with(self.env[a], self.copies[a])

    def needs_grad(self, node: fx.Node) -> bool:
        """Whether a floating-point value depends on a trainable parameter (its gradient is wanted)."""
        if node not in self.grad_flow:
            val = node.meta.get("val")
            vals = val if isinstance(val, (tuple, list)) else (val,)  # a split's pieces
            floating = any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in vals)
            if node.op == "get_attr":
                self.grad_flow[node] = floating and _is_param(self.gm, node.target) and \
                    self.gm.get_parameter(node.target).requires_grad
            else:
                self.grad_flow[node] = floating and any(self.needs_grad(a) for a in node.all_input_nodes)
        return self.grad_flow[node]

    def get_attr(self, node: fx.Node) -> fx.Node:
        full = self.gm.get_parameter(node.target) if _is_param(self.gm, node.target) else None
        if full is None:
            _set_attr(self.root, node.target, _fetch(self.gm, node.target), as_param=False)
            return self.new("get_attr", node.target, (), like=node)
        sl = self.plan.param(node.target)
        _set_attr(self.root, node.target, sl.take(full.detach()), as_param=True, requires_grad=full.requires_grad)
        new = self.new("get_attr", node.target, (), like=node)
        if sl.dim is not None:
            self.sharded_params.add(node)
        shares = sl.shares() if sl.dim is not None else ()
        if len(set(shares)) == 1 and shares[0] > 1:
            return self.grad_share(new, shares[0])
        if any(share > 1 for share in shares):  # only some rows replicated: share those blocks' gradients
            pieces = self.graph.call_method("split", (new, [b - a for a, b in sl.ranges], sl.dim))
            blocks = [self.graph.call_function(operator.getitem, (pieces, i)) for i in range(len(shares))]
            blocks = [self.grad_share(b, share) if share > 1 else b for b, share in zip(blocks, shares)]
            new = self.graph.call_function(torch.cat, (blocks, sl.dim))
        return new

    def grad_share(self, value: fx.Node, share: int) -> fx.Node:
        """``value`` (held alike by ``share`` ranks) with its gradient summed over those ranks."""
        return self.graph.call_function(TP_GRAD_SHARE, (value, self.group, self.plan.tp // share,
                                                        self.plan.rank // share))

    def linear(self, node: fx.Node) -> fx.Node:
        role = self.plan.role(node.name)
        lin = _linear_args(node)
        x = node.args[lin.x_pos]
        spec = self.specs.get(x)
        ndim = len(x.meta["val"].shape)
        if role in (LinearRole.COLUMN, LinearRole.VOCAB):
            if spec is not None:
                raise PassError(f"tensor parallel: {role.value}-parallel {where(node)} has a split input")
            if x not in self.copies:
                self.copies[x] = self.graph.call_function(TP_COPY, (self.env[x], self.group))
            new = self.new("call_function", node.target, node.args, like=node)
            new.update_arg(lin.x_pos, self.copies[x])
            if role is LinearRole.VOCAB:
                if self.plan.split_logits:  # this rank's vocabulary columns, as the loss takes them
                    self.specs[node] = Shard(dim=ndim - 1, frac=Fraction(1, self.plan.tp))
                    return new
                self.specs[node] = None
                return self.graph.call_function(TP_ALL_GATHER, (new, self.group, ndim - 1, self.plan.tp,
                                                                self.plan.rank))
            local = sum(self.plan.local_chunks(node.name))
            self.specs[node] = Shard(dim=ndim - 1, frac=Fraction(local, int(node.meta["val"].shape[-1])))
            return new
        if role is LinearRole.ROW:
            if spec != Shard(dim=ndim - 1, frac=Fraction(1, self.plan.tp)):
                raise PassError(f"tensor parallel: row-parallel {where(node)} expects its input split 1/tp along "
                                f"the last dim, got {spec}")
            bias = lin.bias
            if node.target is torch.addmm:
                partial = self.new("call_function", torch.mm, (x, lin.weight), like=node)
            else:
                partial = self.new("call_function", node.target, (x, lin.weight, None), like=node)
            reduced = self.graph.call_function(TP_ALL_REDUCE, (partial, self.group))
            self.specs[node] = None
            return reduced if bias is None else self.graph.call_function(
                torch.add, (reduced, self.env[bias]))
        if spec is not None:
            raise PassError(f"tensor parallel: replicated {where(node)} (the LM head) has a split input")
        self.specs[node] = None
        return self.new("call_function", node.target, node.args, node.kwargs, like=node)

    def embedding(self, node: fx.Node) -> fx.Node:
        """Token ids -> rows of a vocabulary-split table, all-reduced."""
        sl = self.plan.param(node.args[1].target)
        start = sl.ranges[0][0]
        padding_idx = node.kwargs.get("padding_idx", node.args[2] if len(node.args) > 2 else None)
        if padding_idx is not None and padding_idx < 0:
            padding_idx += sl.full_shape[0]
        self.specs[node] = None
        return self.new("call_function", vocab_parallel_embedding,
                        (node.args[0], node.args[1], start, self.group, padding_idx), like=node)

    def attention(self, node: fx.Node) -> fx.Node:
        head_axis = 1
        specs = [self.specs.get(a) for a in node.args[:3]]
        # k and v of one kv head replicated on every rank (multi-query) are whole: frac 1 on whatever dim
        if any(s is None or (s.dim != head_axis and s.frac != 1) for s in specs):
            raise PassError(f"tensor parallel: {where(node)} expects q, k, v split by heads, got {specs}")
        self.specs[node] = specs[0]
        new = self.new(node.op, node.target, node.args, node.kwargs, like=node)
        sinks = node.kwargs.get("sinks")
        if isinstance(sinks, fx.Node):  # one logit per query head: this rank's heads', gradient summed over the group
            if self.specs.get(sinks) is not None:
                raise PassError(f"tensor parallel: {where(node)} takes sinks split as {self.specs[sinks]}; expected "
                                "them whole (one logit per query head)")
            self.reduce_replicated_grads(node, new)
            self.narrow_operand(new, sinks, 0, specs[0].frac)
        return new


def _last_dim_split(spec: Shard, node: fx.Node) -> Shard:
    """``spec`` with its dim counted from the end (what the vocabulary split of logits is)."""
    ndim = len(node.meta["val"].shape) if isinstance(node.meta.get("val"), torch.Tensor) else 0
    return Shard(dim=spec.dim - ndim if spec.dim >= 0 else spec.dim, frac=spec.frac)


def _is_param(gm: fx.GraphModule, name: str) -> bool:
    try:
        gm.get_parameter(name)
        return True
    except AttributeError:
        return False


def _fetch(gm: fx.GraphModule, name: str) -> torch.Tensor:
    obj: Any = gm
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


_ROUTING = frozenset({"topk", "histc", "bincount", "one_hot"})


def _refuse_experts(gm: fx.GraphModule, tp: int) -> None:
    """A mixture of experts (a router choosing each token's experts by ``topk``, its experts run by a grouped or
    indexed matmul) is not split yet: refused by name under tp > 1 rather than split wrong (the router's softmax
    would normalise over a split dim); tp1 schemes, pipeline stages and context parallelism train it."""
    for node in gm.graph.nodes:
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))
        if name in _ROUTING or "grouped_mm" in str(name):
            raise PassError(f"tensor parallel: {where(node)} routes tokens to experts ({name}): mixture-of-experts "
                            f"layers are not split over tp={tp} ranks yet; train this model with tp1 schemes "
                            "(pipeline stages and context parallelism work)")


def _refuse_dropout(gm: fx.GraphModule, tp: int) -> None:
    """Dropout with p > 0 under tensor parallelism: each rank draws its own mask, so a replicated activation
    would be dropped differently on the ranks that must hold it alike (and no single-device run computes what
    they do together). Refused, naming the node, rather than trained wrong."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (torch.nn.functional.dropout, torch.dropout):
            p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
            training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
            if p and training:
                raise PassError(f"tensor parallel: {where(node)} applies dropout p={p} under tp={tp}: the ranks "
                                "would drop a replicated activation with different masks; set the model's dropout "
                                "to 0 or train with tp1 schemes")


def shard_tensor_parallel_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Rewrite ``gm`` into rank ``ctx.tp_rank``'s part of a ``ctx.scheme.tp``-way tensor-parallel forward."""
    tp = ctx.scheme.tp
    already = any(n.op == "call_function" and n.target in (TP_ALL_REDUCE, TP_COPY) for n in gm.graph.nodes)
    if tp == 1 or already:
        return PassResult(graph_module=gm, modified=False)
    if "val" not in next(iter(gm.graph.nodes)).meta:
        propagate_vals(gm)
    _refuse_dropout(gm, tp)
    plan = ctx.option("shard_tensor_parallel_pass.plan")
    if plan is None:
        vocab_parallel = bool(ctx.option("shard_tensor_parallel_pass.vocab_parallel", False))
        split_logits = bool(ctx.option("shard_tensor_parallel_pass.split_logits", False))
        plan = decide_tensor_parallel(gm, tp, ctx.tp_rank, vocab_parallel=vocab_parallel, split_logits=split_logits)
    else:
        check_plan_fits(plan, gm, tp, ctx.tp_rank)
    out = _Rewriter(gm, plan, ctx.tp_group).run()
    return PassResult(graph_module=out, modified=True, info={"plan": plan})
