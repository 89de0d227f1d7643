"""Sharding propagation: how a tensor split along one dim flows through the ops of a torch-level graph.

Owns :class:`Shard` (dim + the fraction of that dim a rank holds) and the per-op rules the
tensor-parallel rewrite applies node by node: each rule takes the node, its inputs' shardings and the
full (unsharded) shapes from ``meta["val"]``, and returns the output sharding plus the rewritten
arguments, e.g. a ``view(1, T, 12, 64)`` of a head-sharded tensor becomes ``view(1, T, 3, 64)`` on tp=4.
An op without a rule, or a sharding a rule cannot carry, raises :class:`passes.graph.pass_runner.PassError`
naming the node and module. A replicated tensor is ``None``.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import fx

from passes.graph.pass_runner import PassError

__all__ = ["Shard", "Spec", "propagate_node", "where"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Shard:
    """A tensor of which each rank holds ``frac`` of dim ``dim`` (a contiguous block of it)."""

    dim: int
    """The sharded dim, non-negative."""
    frac: Fraction
    """The fraction of the dim one rank holds, e.g. 1/tp."""


Spec = Shard | None | tuple  # tuple: one Spec per element of a tuple-valued node (split)


def where(node: fx.Node) -> str:
    """``node 'x' (module 'h.0.attn')`` for error messages."""
    stack = node.meta.get("nn_module_stack") or {}
    module = list(stack.values())[-1][0] if stack else "<top>"
    return f"node {node.name!r} (module {module!r})"


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
_BINARY_METHODS = {"add", "sub", "mul", "div", "pow", "type_as"}


def _binary(node: fx.Node, specs: dict, args: tuple) -> tuple[Spec, tuple]:
    out_shape = _shape(node)
    if out_shape is None:
        raise _fail(node, "no shape metadata")
    dims: set[tuple[int, Fraction]] = set()
    tensors = [a for a in args if isinstance(a, fx.Node)]
    for a in tensors:
        spec, shape = specs.get(a), _shape(a) or ()
        if isinstance(spec, Shard):
            dims.add((spec.dim + len(out_shape) - len(shape), spec.frac))
    if not dims:
        return None, args
    if len(dims) > 1:
        raise _fail(node, f"operands are sharded differently {sorted(dims)}")
    (dim, frac), = dims
    for a in tensors:
        shape = _shape(a) or ()
        offset = len(out_shape) - len(shape)
        if specs.get(a) is None and dim - offset >= 0 and shape[dim - offset] != 1:
            raise _fail(node, f"replicated operand {a.name!r} of shape {shape} spans sharded dim {dim}")
    return Shard(dim=dim, frac=frac), args


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


def _reduce(node: fx.Node, specs: dict, args: tuple) -> tuple[Spec, tuple]:
    spec = specs.get(args[0])
    if spec is None:
        return None, args
    ndim = len(_shape(args[0]))
    dims = _dim_arg(node, args, 1)
    dims = [d % ndim for d in (dims if isinstance(dims, (tuple, list)) else [dims])] if dims is not None else None
    if dims is None or spec.dim in dims:
        raise _fail(node, f"reduces over sharded dim {spec.dim}")
    keep = node.kwargs.get("keepdim", args[2] if len(args) > 2 else False)
    return Shard(dim=spec.dim - (0 if keep else sum(d < spec.dim for d in dims)), frac=spec.frac), args


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


_METHOD_RULES = {"view": _reshape, "reshape": _reshape, "transpose": _transpose, "permute": _permute,
                 "mean": _reduce, "sum": _reduce, "unsqueeze": _unsqueeze_squeeze, "squeeze": _unsqueeze_squeeze,
                 "softmax": _softmax}
_FUNCTION_RULES = {torch.reshape: _reshape, torch.transpose: _transpose, torch.permute: _permute,
                   operator.getitem: _getitem, torch.cat: _cat, torch.mean: _reduce, torch.sum: _reduce,
                   torch.unsqueeze: _unsqueeze_squeeze, torch.squeeze: _unsqueeze_squeeze, F.softmax: _softmax}


def propagate_node(
    node: fx.Node, specs: dict, args: tuple, chunk_sizes: Callable[[fx.Node], list[int] | None]
) -> tuple[Spec, tuple, dict]:
    """Output sharding and (possibly rewritten) args and kwargs of one generic node (not linear/attention)."""
    sharded = any(specs.get(a) is not None for a in node.all_input_nodes)
    target, kwargs = node.target, dict(node.kwargs)
    if node.op == "call_method" and target in ("split", "chunk") or target in (torch.split, torch.chunk):
        if target in ("chunk", torch.chunk) and sharded:
            raise _fail(node, "chunk of a sharded tensor; use split")
        return _split(node, specs, args, chunk_sizes)
    if not sharded:
        return None, args, kwargs
    if node.op == "call_method":
        if target in _UNARY_METHODS:
            return specs.get(args[0]), args, kwargs
        if target in _BINARY_METHODS:
            return (*_binary(node, specs, args), kwargs)
        if target in _METHOD_RULES:
            return (*_METHOD_RULES[target](node, specs, args), kwargs)
    if node.op == "call_function":
        if target in _UNARY_FUNCTIONS:
            return specs.get(args[0]), args, kwargs
        if target in _BINARY_FUNCTIONS:
            return (*_binary(node, specs, args), kwargs)
        if target in _FUNCTION_RULES:
            return (*_FUNCTION_RULES[target](node, specs, args), kwargs)
    raise _fail(node, f"no sharding rule for {node.op} {getattr(target, '__name__', target)!s} on a sharded input")
