"""Sharding propagation: how a tensor split along one dim flows through the ops of a torch-level graph.

Owns :class:`Shard` (dim + the fraction of that dim a rank holds) and the per-op rules the
tensor-parallel rewrite applies node by node: each rule takes the node, its inputs' shardings and the
full (unsharded) shapes from ``meta["val"]``, and returns the output sharding plus the rewritten
arguments, e.g. a ``view(1, T, 12, 64)`` of a head-sharded tensor becomes ``view(1, T, 3, 64)`` on tp=4.
Ops are handled in three ways. Shape ops with constants (view, reshape, expand, split) and ops that move or
mix along dims (transpose, permute, getitem, cat, reductions, softmax, norms) have explicit rules. Pointwise
ops (those aten tags ``pointwise``: add, mul, where, gt, silu, ...) broadcast: a replicated operand that spans
the sharded dim is cut to the rank's block (``Propagation.narrow``, e.g. a norm weight over a split
projection). Any other op is run on fake tensors of the local shapes, and the one dim whose size shrank is
where the shard went (``torch.stack`` of rotary halves, ``flatten``); ops that mix values along a dim are
refused by name first (:data:`_MIXING`), since shapes cannot show it. A sum or mean over the sharded dim is
a local reduction followed by an all-reduce (``Propagation.reduce``). An op without a rule, or a sharding a
rule cannot carry, raises :class:`passes.graph.pass_runner.PassError` naming the node and module. A
replicated tensor is ``None``. The lowering self-check (``passes.graph.lowering_check``) backs every rule:
a rewrite that computes anything else is refused before training.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from passes.graph.pass_runner import PassError

__all__ = ["Shard", "Spec", "Propagation", "propagate_node", "where", "block_index"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Shard:
    """A tensor of which each rank holds ``frac`` of dim ``dim`` (a contiguous block of it)."""

    dim: int
    """The sharded dim, non-negative."""
    frac: Fraction
    """The fraction of the dim one rank holds, e.g. 1/tp."""


Spec = Shard | None | tuple  # tuple: one Spec per element of a tuple-valued node (split)


@dataclass(frozen=True, slots=True)
class Propagation:
    """What one node becomes on a rank: its output sharding, its rewritten arguments, and what the rewrite
    must add around it."""

    spec: Spec
    """The output's sharding."""
    args: tuple
    """The node's arguments for the local shapes."""
    kwargs: dict = field(default_factory=dict)
    """The node's keyword arguments for the local shapes."""
    narrow: tuple[tuple[fx.Node, int, Fraction], ...] = ()
    """Replicated operands to cut to this rank's block of one of their dims: (operand, dim, fraction)."""
    reduce: str | None = None
    """``sum`` or ``mean``: the node reduces over the sharded dim; its local result is all-reduced over the
    group (a mean is then divided by the group size)."""


def block_index(frac: Fraction, tp: int, rank: int) -> int:
    """Which block of a dim rank ``rank`` holds when each holds ``frac`` of it (blocks replicated on tp*frac
    ranks when there are fewer blocks than ranks)."""
    parts = int(1 / frac)
    return rank * parts // tp


_DYNAMO_ROOT = re.compile(r"^L\['[A-Za-z_]+'\](\[\d+\])*\.?")
"""The prefix dynamo puts before a module path (``L['self'].``, ``L['args'][0].``)."""


def where(node: fx.Node) -> str:
    """``node 'x' (module 'h.0.attn')`` for error messages."""
    stack = node.meta.get("nn_module_stack") or {}
    module = _DYNAMO_ROOT.sub("", str(list(stack.values())[-1][0])) if stack else ""
    return f"node {node.name!r} (module {module or '<top>'!r})"


def _shape(x: Any) -> tuple[int, ...] | None:
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    return tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


def _fail(node: fx.Node, why: str) -> PassError:
    return PassError(f"tensor parallel: {where(node)}: {why}")


_UNARY_FUNCTIONS = {operator.neg, torch.rsqrt, torch.sqrt, torch.exp, torch.tanh, torch.sigmoid, torch.cos,
                    torch.sin, F.gelu, F.silu, F.relu, F.dropout, torch.nn.functional.dropout}
_UNARY_METHODS = {"contiguous", "clone", "float", "half", "bfloat16", "to", "neg", "rsqrt", "sqrt", "exp", "cos",
                  "sin", "tanh", "sigmoid", "detach"}
_BINARY_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.pow, torch.add, torch.sub,
                     torch.mul, torch.div, torch.pow}
_BINARY_METHODS = {"add", "sub", "mul", "div", "pow"}


def _binary(node: fx.Node, specs: dict, args: tuple, kwargs: dict | None = None) -> Propagation:
    """A broadcasting pointwise op: the output is sharded where its sharded operands are; a replicated operand
    spanning that dim is cut to the rank's block."""
    out_shape = _shape(node)
    if out_shape is None:
        raise _fail(node, "no shape metadata")
    dims: set[tuple[int, Fraction]] = set()
    tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, fx.Node)]
    for a in tensors:
        spec, shape = specs.get(a), _shape(a) or ()
        if isinstance(spec, Shard):
            dims.add((spec.dim + len(out_shape) - len(shape), spec.frac))
    if not dims:
        return Propagation(None, args, dict(kwargs or {}))
    if len(dims) > 1:
        raise _fail(node, f"operands are sharded differently {sorted(dims)}")
    (dim, frac), = dims
    narrow = []
    for a in tensors:
        shape = _shape(a)
        if shape is None:
            continue
        offset = len(out_shape) - len(shape)
        if specs.get(a) is None and dim - offset >= 0 and shape[dim - offset] != 1:
            if shape[dim - offset] != out_shape[dim] or Fraction(shape[dim - offset]) * frac % 1:
                raise _fail(node, f"replicated operand {a.name!r} of shape {shape} spans sharded dim {dim}")
            narrow.append((a, dim - offset, frac))
    return Propagation(Shard(dim=dim, frac=frac), args, dict(kwargs or {}), narrow=tuple(narrow))


def _reshape_target(full_in: tuple, full_out: tuple, spec: Shard, node: fx.Node) -> tuple[int, list[int]]:
    before = math.prod(full_in[: spec.dim])
    for j, size in enumerate(full_out):
        if math.prod(full_out[:j]) == before and size > 1:
            local = Fraction(size) * spec.frac
            if local.denominator != 1:
                raise _fail(node, f"dim {j} of size {size} cannot hold a {spec.frac} shard")
            out = list(full_out)
            out[j] = int(local)
            return j, out
    raise _fail(node, f"reshape {full_in} -> {full_out} moves sharded dim {spec.dim} inside another dim")


def _reshape(node: fx.Node, specs: dict, args: tuple) -> tuple[Spec, tuple]:
    src = args[0]
    spec = specs.get(src)
    if spec is None:
        return None, args
    full_in, full_out = _shape(src), _shape(node)
    j, local = _reshape_target(full_in, full_out, spec, node)
    return Shard(dim=j, frac=spec.frac), (src, *local)


def _transpose(node: fx.Node, specs: dict, args: tuple) -> tuple[Spec, tuple]:
    spec = specs.get(args[0])
    if spec is None:
        return None, args
    ndim = len(_shape(args[0]))
    a, b = (d % ndim for d in args[1:3])
    dim = b if spec.dim == a else a if spec.dim == b else spec.dim
    return Shard(dim=dim, frac=spec.frac), args


def _permute(node: fx.Node, specs: dict, args: tuple) -> tuple[Spec, tuple]:
    spec = specs.get(args[0])
    if spec is None:
        return None, args
    order = args[1] if isinstance(args[1], (tuple, list)) else args[1:]
    ndim = len(order)
    return Shard(dim=[d % ndim for d in order].index(spec.dim), frac=spec.frac), args


def _index_dims(index: Any, ndim: int) -> list[Any]:
    items = list(index) if isinstance(index, tuple) else [index]
    if Ellipsis in items:
        k = items.index(Ellipsis)
        fill = ndim - sum(1 for i in items if i is not None and i is not Ellipsis)
        items = items[:k] + [slice(None)] * fill + items[k + 1:]
    return items + [slice(None)] * (ndim - sum(1 for i in items if i is not None))


def _getitem(node: fx.Node, specs: dict, args: tuple) -> tuple[Spec, tuple]:
    src, index = args
    spec = specs.get(src)
    if isinstance(spec, tuple):
        return spec[index], args
    if spec is None:
        return None, args
    in_dim = out_dim = 0
    for item in _index_dims(index, len(_shape(src))):
        if item is None:
            out_dim += 1
            continue
        if in_dim == spec.dim:
            if item != slice(None):
                raise _fail(node, f"indexes sharded dim {spec.dim} with {item!r}")
            return Shard(dim=out_dim, frac=spec.frac), args
        out_dim += 0 if isinstance(item, int) else 1
        in_dim += 1
    raise _fail(node, f"cannot follow sharded dim {spec.dim} through index {index!r}")


def _dim_arg(node: fx.Node, args: tuple, pos: int, default: Any = None) -> Any:
    return node.kwargs.get("dim", args[pos] if len(args) > pos else default)


def _split(node: fx.Node, specs: dict, args: tuple, chunk_sizes: Callable[[fx.Node], list[int] | None]) -> tuple:
    src = args[0]
    spec = specs.get(src)
    ndim = len(_shape(src))
    dim = _dim_arg(node, args, 2, 0) % ndim
    pieces = len(node.meta["val"])
    if spec is None:
        return (None,) * pieces, args, node.kwargs
    if dim != spec.dim:
        return (spec,) * pieces, args, node.kwargs
    local = chunk_sizes(src)
    if local is None:
        raise _fail(node, "splits a sharded dim that does not come from a column-parallel linear's chunks")
    full = [int(v.shape[dim]) for v in node.meta["val"]]
    outs = tuple(Shard(dim=dim, frac=Fraction(lo, fu)) for lo, fu in zip(local, full))
    kwargs = {k: v for k, v in node.kwargs.items() if k != "dim"}
    return outs, (src, list(local), dim), kwargs


def _reduce(node: fx.Node, specs: dict, args: tuple) -> Propagation:
    spec = specs.get(args[0])
    if spec is None:
        return Propagation(None, args, dict(node.kwargs))
    ndim = len(_shape(args[0]))
    dims = _dim_arg(node, args, 1)
    dims = [d % ndim for d in (dims if isinstance(dims, (tuple, list)) else [dims])] if dims is not None else None
    kind = "sum" if _op_name(node) == "sum" else "mean"
    if dims is None or spec.dim in dims:  # a local reduction, then the all-reduce the rewrite adds
        return Propagation(None, args, dict(node.kwargs), reduce=kind)
    keep = node.kwargs.get("keepdim", args[2] if len(args) > 2 else False)
    return Propagation(Shard(dim=spec.dim - (0 if keep else sum(d < spec.dim for d in dims)), frac=spec.frac), args,
                       dict(node.kwargs))


def _cat(node: fx.Node, specs: dict, args: tuple) -> tuple[Spec, tuple]:
    parts = args[0]
    got = {specs.get(p) for p in parts}
    if got == {None}:
        return None, args
    if len(got) != 1:
        raise _fail(node, f"concatenates tensors sharded differently {got}")
    spec = got.pop()
    ndim = len(_shape(parts[0]))
    if _dim_arg(node, args, 1, 0) % ndim == spec.dim:
        raise _fail(node, f"concatenates along sharded dim {spec.dim}")
    return spec, args


def _unsqueeze_squeeze(node: fx.Node, specs: dict, args: tuple) -> tuple[Spec, tuple]:
    spec = specs.get(args[0])
    if spec is None:
        return None, args
    in_nd, out_nd = len(_shape(args[0])), len(_shape(node))
    d = _dim_arg(node, args, 1)
    if out_nd > in_nd:
        d %= out_nd
        return Shard(dim=spec.dim + (d <= spec.dim), frac=spec.frac), args
    if d is None or d % in_nd == spec.dim:
        raise _fail(node, "squeezes around a sharded dim")
    return Shard(dim=spec.dim - (d % in_nd < spec.dim), frac=spec.frac), args


def _softmax(node: fx.Node, specs: dict, args: tuple) -> tuple[Spec, tuple]:
    spec = specs.get(args[0])
    if spec is not None and _dim_arg(node, args, 1) % len(_shape(args[0])) == spec.dim:
        raise _fail(node, "normalises over a sharded dim")
    return spec, args


def _expand(node: fx.Node, specs: dict, args: tuple) -> tuple[Spec, tuple]:
    """``expand(*sizes)``: the sharded dim's size becomes the local one."""
    spec = specs.get(args[0])
    sizes = list(args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:])
    dim = spec.dim + len(sizes) - len(_shape(args[0]))
    if sizes[dim] != -1:
        local = Fraction(sizes[dim]) * spec.frac
        if local.denominator != 1:
            raise _fail(node, f"expands sharded dim {dim} to {sizes[dim]}, which a {spec.frac} shard cannot hold")
        sizes[dim] = int(local)
    return Shard(dim=dim, frac=spec.frac), (args[0], *sizes)


def _norm(node: fx.Node, specs: dict, args: tuple) -> tuple[Spec, tuple]:
    """``layer_norm`` / ``rms_norm`` over the last dims: fine when the sharded dim is not among them (the
    weight and bias stay replicated; the rewrite sums their gradients over the group)."""
    spec = specs.get(args[0])
    shape = node.kwargs.get("normalized_shape", args[1] if len(args) > 1 else None)
    count = len(shape) if isinstance(shape, (tuple, list)) else 1
    if spec is not None and spec.dim >= len(_shape(args[0])) - count:
        raise _fail(node, f"normalises over sharded dim {spec.dim}")
    return spec, args


def _fresh(node: fx.Node, specs: dict, args: tuple) -> tuple[Spec, tuple]:
    """``x.new_zeros(size)`` and the like: a new replicated tensor of the given size."""
    return None, args


_METHOD_RULES = {"view": _reshape, "reshape": _reshape, "transpose": _transpose, "permute": _permute,
                 "mean": _reduce, "sum": _reduce, "unsqueeze": _unsqueeze_squeeze, "squeeze": _unsqueeze_squeeze,
                 "softmax": _softmax, "expand": _expand, "new_zeros": _fresh, "new_ones": _fresh, "new_full": _fresh,
                 "new_empty": _fresh, "new_tensor": _fresh}
_FUNCTION_RULES = {torch.reshape: _reshape, torch.transpose: _transpose, torch.permute: _permute,
                   operator.getitem: _getitem, torch.cat: _cat, torch.mean: _reduce, torch.sum: _reduce,
                   torch.unsqueeze: _unsqueeze_squeeze, torch.squeeze: _unsqueeze_squeeze, F.softmax: _softmax,
                   F.layer_norm: _norm, F.rms_norm: _norm}

_MIXING = frozenset({
    # reductions and scans: values of the sharded dim combine (sum and mean have a rule)
    "amax", "amin", "max", "min", "prod", "std", "var", "var_mean", "std_mean", "norm", "logsumexp", "argmax",
    "argmin", "all", "any", "cumsum", "cumprod", "cummax", "cummin", "sort", "argsort", "topk", "kthvalue",
    "median", "mode", "log_softmax", "softmax", "count_nonzero",
    # contractions and normalisations
    "matmul", "bmm", "mm", "einsum", "linear", "conv1d", "conv2d", "baddbmm", "addmm", "addbmm", "tensordot", "dot",
    "outer", "kron", "normalize", "group_norm", "batch_norm", "instance_norm", "cross_entropy", "nll_loss",
    # values move along a dim, or depend on their position in it, keeping the shape
    "gather", "scatter", "scatter_add", "scatter_reduce", "index_select", "take_along_dim", "index_put", "flip",
    "fliplr", "flipud", "roll", "rot90", "pad", "repeat", "tile", "repeat_interleave", "unfold", "fold",
    "interpolate", "diff", "tril", "triu", "diagonal", "diag_embed", "cross", "narrow", "select", "take",
    "embedding", "searchsorted", "bucketize", "unique", "nonzero", "masked_select", "chunk", "split", "cat",
    "concat", "concatenate", "hstack", "vstack", "dstack",
})
"""Ops the fake-shape fallback must not accept: they mix values along a dim (or depend on where a value is in
it) while the shapes may look like a plain shard."""
_OPERATOR_NAMES = {"truediv": "div", "floordiv": "floor_divide", "mod": "remainder", "and_": "bitwise_and",
                   "or_": "bitwise_or", "xor": "bitwise_xor", "invert": "bitwise_not", "iadd": "add", "isub": "sub",
                   "imul": "mul", "itruediv": "div"}


def _op_name(node: fx.Node) -> str:
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return _OPERATOR_NAMES.get(name, name)


def _is_pointwise(node: fx.Node) -> bool:
    """Whether the op is elementwise with broadcasting: its aten namesake is tagged ``pointwise``."""
    packet = getattr(torch.ops.aten, _op_name(node), None)
    if packet is None or not hasattr(packet, "overloads"):
        return False
    return any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())


def _by_shapes(node: fx.Node, specs: dict, args: tuple, kwargs: dict) -> Propagation:
    """Run the op on fake tensors of the local shapes: the dim that shrank by the input's fraction is the
    output's sharded dim (per element of a tuple output)."""
    fracs = {s.frac for a in node.all_input_nodes if isinstance(s := specs.get(a), Shard)}
    if len(fracs) != 1:
        raise _fail(node, f"operands are sharded differently {sorted(fracs)}")
    frac = fracs.pop()
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def local(a: Any) -> Any:
        val = a.meta.get("val") if isinstance(a, fx.Node) else a
        if not isinstance(a, fx.Node) or not isinstance(val, torch.Tensor):
            return val
        shape, spec = list(val.shape), specs.get(a)
        if isinstance(spec, Shard):
            shape[spec.dim] = int(shape[spec.dim] * spec.frac)
        with mode:
            return torch.empty(shape, dtype=val.dtype, device=val.device)

    try:
        largs, lkwargs = fx.node.map_aggregate(args, local), fx.node.map_aggregate(kwargs, local)
        with mode:
            out = (getattr(largs[0], node.target)(*largs[1:], **lkwargs) if node.op == "call_method"
                   else node.target(*largs, **lkwargs))
    except Exception as e:  # noqa: BLE001 - the op does not run on the local shapes: no rule
        raise _fail(node, f"no sharding rule for {node.op} {_op_name(node)} on a sharded input (on the local "
                          f"shapes it fails: {str(e).splitlines()[0][:120]})") from e
    full = node.meta.get("val")
    if isinstance(full, (tuple, list)):
        return Propagation(tuple(_shrunk_dim(node, o, f, frac) for o, f in zip(out, full)), args, kwargs)
    return Propagation(_shrunk_dim(node, out, full, frac), args, kwargs)


def _shrunk_dim(node: fx.Node, local: Any, full: Any, frac: Fraction) -> Spec:
    if not isinstance(full, torch.Tensor) or not isinstance(local, torch.Tensor) or local.dim() != full.dim():
        raise _fail(node, f"no sharding rule for {node.op} {_op_name(node)} on a sharded input")
    shrunk = [d for d in range(full.dim()) if local.shape[d] != full.shape[d]]
    if len(shrunk) != 1 or Fraction(int(local.shape[shrunk[0]]), int(full.shape[shrunk[0]])) != frac:
        raise _fail(node, f"no sharding rule for {node.op} {_op_name(node)} on a sharded input (local shape "
                          f"{tuple(local.shape)} against {tuple(full.shape)})")
    return Shard(dim=shrunk[0], frac=frac)


def propagate_node(
    node: fx.Node, specs: dict, args: tuple, chunk_sizes: Callable[[fx.Node], list[int] | None]
) -> Propagation:
    """Output sharding and (possibly rewritten) args and kwargs of one generic node (not linear/attention),
    and what the rewrite must add around it."""
    sharded = any(specs.get(a) is not None for a in node.all_input_nodes)
    target, kwargs, name = node.target, dict(node.kwargs), _op_name(node)
    if name in ("split", "chunk") and (node.op == "call_method" or target in (torch.split, torch.chunk)):
        src_spec = specs.get(args[0])
        if name == "chunk" and isinstance(src_spec, Shard) and \
                _dim_arg(node, args, 2, 0) % len(_shape(args[0])) == src_spec.dim:
            raise _fail(node, "chunk along a sharded dim (the normalisation turns chunks of projections into "
                              "splits; this one was not)")
        return Propagation(*_split(node, specs, args, chunk_sizes))
    if not sharded:
        return Propagation(None, args, kwargs)
    if name in ("type_as", "to") or target in _UNARY_FUNCTIONS or (node.op == "call_method" and target in
                                                                   _UNARY_METHODS):
        return Propagation(specs.get(args[0]), args, kwargs)
    rules = _METHOD_RULES if node.op == "call_method" else _FUNCTION_RULES
    if target in rules:
        out = rules[target](node, specs, args)
        return out if isinstance(out, Propagation) else Propagation(*out, kwargs)
    if name in ("max", "min", "maximum", "minimum") and len(args) > 1 and isinstance(args[1], fx.Node):
        return _binary(node, specs, args, kwargs)  # torch.max(a, b): elementwise, not a reduction over a dim
    if name in _MIXING:
        raise _fail(node, f"no sharding rule for {node.op} {name} on a sharded input")
    if target in _BINARY_FUNCTIONS or (node.op == "call_method" and target in _BINARY_METHODS) or \
            _is_pointwise(node):
        return _binary(node, specs, args, kwargs)
    return _by_shapes(node, specs, args, kwargs)
