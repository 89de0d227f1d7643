"""Token mixing: the ops of a packed forward that read other tokens of the sequence, besides its attention.

Owns :func:`token_mixing_sites`, a data-flow analysis of a torch-level graph: which dims of every value carry
tokens (from the token ids through embeddings, views, transposes, elementwise ops and contractions over other
dims) and which ops combine values along such a dim; and ``check_token_mixing_pass``, the lowering pass that
refuses a graph with such an op, by name, before any step. It runs on the graph the packed-attention pass made
(``passes.graph.packed_attention``), at every model size and whether the lowering self-check runs or not. There,
attention is ``codegen.packed_attention`` (which keeps the packed sequences apart), positions restart at every
sequence (``packed_positions``) and the masks are gone, so any op left that mixes tokens along the sequence (a
convolution over tokens, as LFM2's short convolutions or Mamba layers have; a state-space scan; a cumulative
sum; a shift by slicing, concatenating or padding; a reduction, softmax, sort or top-k over tokens; a matmul
contracting tokens; a gather across tokens) would read the tokens of the sequences packed beside each one, and
the model would train silently wrong. An op without a rule here, on a value that carries tokens, is refused too
(as unknown) rather than passed. Values made without the token ids (parameters, constants, factories) carry no
tokens. One movement of tokens is followed rather than refused: a mixture of experts' routing, which sorts the
(token, expert) pairs by the experts the tokens chose (an integer sort of ``topk`` indices), gathers the rows
in that order, runs a grouped matmul whose groups are counts of those choices, and gathers them back by the
inverse permutation: every row stays one token's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

import codegen
from passes.graph.analyze import SDPA_TARGETS
from passes.graph.attention_masks import packed_positions
from passes.graph.collectives import TP_ALL_GATHER, TP_ALL_REDUCE, TP_COPY, TP_GRAD_SHARE, vocab_parallel_embedding
from passes.graph.pass_runner import PassContext, PassError, PassResult
from passes.graph.sharding import _index_dims, _is_pointwise, _op_name

__all__ = ["MixingSite", "token_mixing_sites", "check_token_mixing_pass", "token_dims"]

Dims = frozenset
"""The dims of a tensor value that carry tokens (empty: none)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MixingSite:
    """One op that reads other tokens of the sequence than its own."""

    node: str
    """The graph node."""
    op: str
    """The op's name (``conv1d``, ``cumsum``, ...)."""
    module: str
    """The innermost module of the model that made it, with its class (``model.layers.0.conv (Lfm2ShortConv)``)."""
    source: str
    """The model's source line that made it (``file:line``), when the capture recorded it."""
    why: str
    """What it does to the token dim."""

    def describe(self) -> str:
        """E.g. ``conv1d in model.layers.0.conv (Lfm2ShortConv) at modeling_lfm2.py:304 (node 'conv1d'):
        convolves over the token dim 2 ...``."""
        source = f" at {self.source}" if self.source else ""
        return f"{self.op} in {self.module}{source} (node {self.node!r}): {self.why}"


class _Mixes(Exception):
    """Raised by a rule: the op reads across the token dim (the message says how)."""


def _val(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, fx.Node) else None


def _shape(x: Any) -> tuple[int, ...] | None:
    val = _val(x)
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return tuple(int(s) for s in val.shape)
    except (TypeError, ValueError):  # a symbolic size
        return None


def _none_like(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return Dims()
    if isinstance(val, (tuple, list)):
        return tuple(_none_like(v) for v in val)
    return None


def _carries(dims: Any) -> bool:
    if isinstance(dims, frozenset):
        return bool(dims)
    if isinstance(dims, tuple):
        return any(_carries(d) for d in dims)
    return False


def _source(node: fx.Node) -> str:
    """``file:line`` of the innermost frame of the model's code (not torch's) that made ``node``."""
    frames = [(path, line) for path, line in re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace")
                                                        or "") if "/torch/" not in path]
    return f"{frames[-1][0].rsplit('/', 1)[-1]}:{frames[-1][1]}" if frames else ""


_MODULE_ROOT = re.compile(r"^L\['[A-Za-z_]+'\](\[\d+\])*\.?")


def _module(node: fx.Node) -> str:
    """The innermost ``nn.Module`` of the model on ``node``'s stack, with its class (``<top>``: the model's own
    forward)."""
    entries = list((node.meta.get("nn_module_stack") or {}).values())
    modules = [(path, cls) for path, cls in entries if str(path).startswith("L[")]
    if not modules:
        return "<top>"
    path, cls = modules[-1]
    return f"{_MODULE_ROOT.sub('', str(path)) or '<top>'} ({getattr(cls, '__name__', cls)})"


def _arg(node: fx.Node, pos: int, key: str, default: Any = None) -> Any:
    if key in node.kwargs:
        return node.kwargs[key]
    return node.args[pos] if len(node.args) > pos else default


def _dims_list(dim: Any, ndim: int) -> list[int] | None:
    """Normalised dims of a ``dim`` argument (None: every dim)."""
    if dim is None:
        return None
    items = dim if isinstance(dim, (tuple, list)) else [dim]
    return [int(d) % ndim for d in items] if ndim else []


def token_dims(node: fx.Node, state: dict) -> Dims:
    """The token dims of ``node``'s value (a tensor; empty when it carries none)."""
    dims = state.get(node)
    return dims if isinstance(dims, frozenset) else Dims()


def _aligned(node: fx.Node, state: dict, operands: list) -> Dims:
    """Broadcasting: every operand's token dims aligned to the output's right end."""
    out = _shape(node)
    if out is None:
        raise _Mixes("has no shape to follow the token dims through")
    dims = set()
    for a in operands:
        shape = _shape(a)
        if shape is not None:
            dims.update(d + len(out) - len(shape) for d in token_dims(a, state))
    return Dims(dims)


def _reshaped(src: tuple[int, ...], out: tuple[int, ...], dims: Dims, total: int | None = None) -> Dims:
    """Token dims through a reshape: every output dim sharing some of a token dim's elements (by the spans of
    the cumulative products; size-1 dims span nothing): a token dim split in two marks both, one merged with
    feature dims marks the merged dim. With ``total`` (rows gathered back by a routing permutation, whose
    (token, expert) pairs are tokens outer), a merged dim cut into a dim of exactly the ``total`` tokens at its
    start and the rest marks that dim alone."""
    result = set()
    for d in dims:
        lo, hi = math.prod(src[:d]), math.prod(src[:d + 1])
        whole = [j for j in range(len(out)) if out[j] == total and math.prod(out[:j]) == lo]
        if total and src[d] != total and src[d] % total == 0 and whole:
            result.add(whole[0])
            continue
        for j in range(len(out)):
            olo, ohi = math.prod(out[:j]), math.prod(out[:j + 1])
            if out[j] > 1 and olo < hi and lo < ohi:
                result.add(j)
    return Dims(result)


# --- rules: each takes (node, state) and returns the output's token dims, or raises _Mixes ---------------------

def _identity(node: fx.Node, state: dict) -> Dims:
    return token_dims(node.args[0], state)


def _pointwise(node: fx.Node, state: dict) -> Dims:
    return _aligned(node, state, [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)])


def _reshape(node: fx.Node, state: dict) -> Dims:
    src, out = _shape(node.args[0]), _shape(node)
    if src is None or out is None:
        raise _Mixes("has no shape to follow the token dims through")
    routed = node.args[0] in state["routed"]  # rows of (token, expert) pairs, tokens outer
    return _reshaped(src, out, token_dims(node.args[0], state), state.get("total") if routed else None)


def _transpose(node: fx.Node, state: dict) -> Dims:
    ndim = len(_shape(node.args[0]))
    if _op_name(node) == "t":
        a, b = 0, max(ndim - 1, 0)
    else:
        a, b = (int(_arg(node, i, k)) % ndim for i, k in ((1, "dim0"), (2, "dim1")))
    swap = {a: b, b: a}
    return Dims(swap.get(d, d) for d in token_dims(node.args[0], state))


def _permute(node: fx.Node, state: dict) -> Dims:
    order = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else \
        node.kwargs.get("dims", node.args[1:])
    ndim = len(order)
    order = [int(d) % ndim for d in order]
    return Dims(order.index(d) for d in token_dims(node.args[0], state))


def _expand(node: fx.Node, state: dict) -> Dims:
    return _aligned(node, state, [node.args[0]])


def _repeat(node: fx.Node, state: dict) -> Dims:
    src, out = _shape(node.args[0]), _shape(node)
    offset = len(out) - len(src)
    for d in token_dims(node.args[0], state):
        if out[d + offset] != src[d]:
            raise _Mixes(f"repeats the token dim {d}")
    return _aligned(node, state, [node.args[0]])


def _full_slice(item: slice, size: int) -> bool:
    start, stop, step = item.start, item.stop, item.step
    return (start in (None, 0) and step in (None, 1) and (stop is None or (isinstance(stop, int) and stop >= size)))


def _getitem(node: fx.Node, state: dict) -> Any:
    src, index = node.args
    dims = state.get(src)
    if isinstance(dims, tuple):
        return dims[index] if isinstance(index, int) else _none_like(_val(node))
    if not isinstance(dims, frozenset) or not dims and not _index_carries(index, state):
        return _none_like(_val(node))
    shape = _shape(src)
    items = _index_dims(index, len(shape))
    tensors = [i for i in items if isinstance(i, fx.Node)]
    out: set = set()
    in_dim = out_dim = 0
    for item in items:
        if item is None:
            out_dim += 1
            continue
        token = in_dim in dims
        if isinstance(item, fx.Node):
            if token and item not in state["routes"]:
                raise _Mixes(f"indexes the token dim {in_dim} with a tensor (a gather across tokens)")
            if token:
                state["routed"].add(node)
            if len(tensors) > 1 and _carries(state.get(item)):
                raise _Mixes("indexes with several tensors, some carrying tokens")
            ishape = _shape(item) or ()
            out.update(out_dim + d for d in token_dims(item, state))
            out_dim += len(ishape)
        elif isinstance(item, slice):
            if token and not _full_slice(item, shape[in_dim]):
                raise _Mixes(f"slices the token dim {in_dim} with {item!r} (a shift along the sequence)")
            if token:
                out.add(out_dim)
            out_dim += 1
        else:  # an int (or a SymInt)
            if token:
                raise _Mixes(f"selects one token ({item!r}) of the token dim {in_dim}")
        in_dim += 1
    return Dims(out)


def _index_carries(index: Any, state: dict) -> bool:
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, fx.Node) and _carries(state.get(i)) for i in items)


def _split(node: fx.Node, state: dict) -> Any:
    name = _op_name(node)
    src = node.args[0]
    ndim = len(_shape(src))
    dim = int(_arg(node, 1 if name == "unbind" else 2, "dim", 0)) % ndim
    dims = token_dims(src, state)
    if dim in dims:
        raise _Mixes(f"cuts the token dim {dim} into pieces")
    pieces = len(_val(node)) if isinstance(_val(node), (tuple, list)) else 1
    if name == "unbind":
        dims = Dims(d - (d > dim) for d in dims)
    return (dims,) * pieces


def _cat(node: fx.Node, state: dict) -> Dims:
    parts = [p for p in node.args[0] if isinstance(p, fx.Node)]
    ndim = len(_shape(node))
    dim = int(_arg(node, 1, "dim", 0))
    if _op_name(node) == "stack":
        dim %= ndim
        return Dims(d + (d >= dim) for p in parts for d in token_dims(p, state))
    dim %= ndim
    dims = Dims(d for p in parts for d in token_dims(p, state))
    if dim in dims:
        raise _Mixes(f"concatenates along the token dim {dim} (a shift or padding along the sequence)")
    return dims


def _linear(node: fx.Node, state: dict) -> Dims:
    x, w = node.args[0], _arg(node, 1, "weight")
    dims = token_dims(x, state)
    if len(_shape(x)) - 1 in dims:
        raise _Mixes("contracts the token dim (a linear over tokens)")
    if _carries(state.get(w)) or _carries(state.get(_arg(node, 2, "bias"))):
        raise _Mixes("computes its weight from the tokens")
    return dims


def _matmul_dims(a: fx.Node, b: fx.Node, node: fx.Node, state: dict) -> Dims:
    """``a @ b`` (torch.matmul's broadcasting): fine unless a contracted dim carries tokens."""
    sa, sb, out = _shape(a), _shape(b), len(_shape(node))
    da, db = token_dims(a, state), token_dims(b, state)
    if len(sa) - 1 in da or (len(sb) - 2 if len(sb) > 1 else 0) in db:
        raise _Mixes("contracts the token dim (a matmul over tokens, outside the attention)")
    result = set()
    if len(sa) > 1:  # a's rows and batch dims
        result.update(d + out - len(sa) + (len(sb) == 1) for d in da)
    if len(sb) > 1:  # b's columns and batch dims
        result.update(out - 1 if d == len(sb) - 1 else d + out - len(sb) + (len(sa) == 1) for d in db)
    return Dims(d for d in result if 0 <= d < out)


def _matmul(node: fx.Node, state: dict) -> Dims:
    return _matmul_dims(node.args[0], node.args[1], node, state)


def _addmm(node: fx.Node, state: dict) -> Dims:
    dims = set(_matmul_dims(node.args[1], node.args[2], node, state))
    dims.update(_aligned(node, state, [node.args[0]]))
    return Dims(dims)


def _einsum(node: fx.Node, state: dict) -> Dims:
    equation = node.args[0]
    operands = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
    if not isinstance(equation, str) or "..." in equation or "->" not in equation:
        raise _Mixes(f"is an einsum {equation!r} the analysis cannot follow")
    inputs, output = equation.replace(" ", "").split("->")
    letters = set()
    for spec, operand in zip(inputs.split(","), operands):
        letters.update(spec[d] for d in token_dims(operand, state))
    if any(letter not in output for letter in letters):
        raise _Mixes(f"contracts the token dim (einsum {equation!r})")
    return Dims(output.index(letter) for letter in letters)


def _embedding(node: fx.Node, state: dict) -> Dims:
    if _carries(state.get(node.args[1])):
        raise _Mixes("looks up a table computed from the tokens")
    return token_dims(node.args[0], state)


def _all_gather(node: fx.Node, state: dict) -> Dims:
    dims = token_dims(node.args[0], state)
    if int(_arg(node, 2, "dim")) % len(_shape(node.args[0])) in dims:
        raise _Mixes("gathers along the token dim")
    return dims


def _norm(node: fx.Node, state: dict) -> Dims:
    x, shape = node.args[0], _arg(node, 1, "normalized_shape")
    count = len(shape) if isinstance(shape, (tuple, list, torch.Size)) else 1
    dims = token_dims(x, state)
    if any(d >= len(_shape(x)) - count for d in dims):
        raise _Mixes("normalises over the token dim")
    return dims


_DIM_POS = {"norm": 2, "vector_norm": 2, "kthvalue": 2, "topk": 2, "diff": 2, "normalize": 2, "logsumexp": 1}
"""Where the ``dim`` argument sits, where it is not second."""
_DEFAULT_DIM = {"sort": -1, "argsort": -1, "topk": -1, "kthvalue": -1, "diff": -1, "glu": -1, "normalize": 1}


def _reduce(node: fx.Node, state: dict) -> Any:
    """A reduction (the dims it reduces are gone unless kept) or an op along a dim (the shape kept)."""
    name = _op_name(node)
    x = node.args[0]
    shape = _shape(x)
    dims = token_dims(x, state)
    dim = _arg(node, _DIM_POS.get(name, 1), "dim", _DEFAULT_DIM.get(name))
    if name == "roll":
        dim = _arg(node, 2, "dims")
    if name == "flip":
        dim = _arg(node, 1, "dims")
    if isinstance(dim, (fx.Node, str)):
        dim = None
    reduced = _dims_list(dim, len(shape))
    hit = sorted(dims) if reduced is None else sorted(d for d in dims if d in reduced)
    if hit and name in ("sort", "argsort") and x in state["choices"] and not _val(x).is_floating_point():
        state["routes"].add(node)  # routing: the tokens permuted by the experts they chose
        hit = []
    if not hit and name in ("topk", "argmax", "argmin"):
        state["choices"].add(node)  # per token, a choice over features (experts)
    if hit:
        raise _Mixes(f"takes the {name} over the token dim {hit[0]}")
    out = _val(node)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    results = []
    for o in outs:
        if not isinstance(o, torch.Tensor):
            results.append(None)
        elif o.dim() == len(shape):
            results.append(dims)
        else:
            gone = reduced or []
            results.append(Dims(d - sum(g < d for g in gone) for d in dims))
    return tuple(results) if isinstance(out, (tuple, list)) else results[0]


def _conv(node: fx.Node, state: dict) -> Dims:
    x, w = node.args[0], _arg(node, 1, "weight")
    dims = token_dims(x, state)
    if _carries(state.get(w)):
        raise _Mixes("convolves with a kernel computed from the tokens")
    wshape = _shape(w)
    stride, padding = _arg(node, 3, "stride", 1), _arg(node, 4, "padding", 0)
    for d in dims:
        if d == 1:
            raise _Mixes("convolves over the token dim as channels")
        if d >= 2:
            k = wshape[d] if wshape is not None else 0
            pad = padding if isinstance(padding, (int, str)) else padding[d - 2]
            step = stride if isinstance(stride, int) else stride[d - 2]
            if k != 1 or pad not in (0, "valid", "same") or step != 1:
                raise _Mixes(f"convolves over the token dim {d} (kernel {k}, padding {padding!r}): each token "
                             "reads its neighbours")
    return dims


def _pad(node: fx.Node, state: dict) -> Dims:
    x, pad = node.args[0], _arg(node, 1, "pad")
    dims, ndim = token_dims(x, state), len(_shape(x))
    for i in range(0, len(pad), 2):
        d = ndim - 1 - i // 2
        if d in dims and (pad[i] or pad[i + 1]):
            raise _Mixes(f"pads the token dim {d} (a shift along the sequence)")
    return dims


def _narrow(node: fx.Node, state: dict) -> Dims:
    x = node.args[0]
    shape, dims = _shape(x), token_dims(x, state)
    dim = int(_arg(node, 1, "dim")) % len(shape)
    if dim in dims and _shape(node)[dim] != shape[dim]:
        raise _Mixes(f"narrows the token dim {dim} (a shift along the sequence)")
    return dims


def _repeat_interleave(node: fx.Node, state: dict) -> Dims:
    x = node.args[0]
    dims = token_dims(x, state)
    dim = _arg(node, 2, "dim")
    if dim is None or int(dim) % len(_shape(x)) in dims:
        raise _Mixes("repeats the tokens along the token dim")
    return dims


def _constant_like(node: fx.Node, state: dict) -> Dims:
    """``zeros_like(x)`` and the like: a new tensor of ``x``'s shape whose values owe nothing to the tokens."""
    return Dims()


def _view_as_complex(node: fx.Node, state: dict) -> Dims:
    dims = token_dims(node.args[0], state)
    if len(_shape(node.args[0])) - 1 in dims:
        raise _Mixes("pairs tokens into complex numbers")
    return dims


def _histc(node: fx.Node, state: dict) -> Dims:
    """Counts of a routing key per expert (the sizes of a grouped matmul's groups); counts of anything else over
    the tokens mix them."""
    if not any(a in state["routes"] for a in node.all_input_nodes):
        raise _Mixes("counts values over the tokens")
    state["routes"].add(node)
    return Dims()


def _grouped_mm(node: fx.Node, state: dict) -> Dims:
    """A grouped matmul (a mixture of experts): each row of the input times its group's weight, the groups cut
    by routing counts; rows stay apart."""
    x, w = node.args[0], node.args[1]
    offs = node.kwargs.get("offs", node.args[2] if len(node.args) > 2 else None)
    dims = token_dims(x, state)
    if len(_shape(x)) - 1 in dims or _carries(state.get(w)) or \
            (isinstance(offs, fx.Node) and _carries(state.get(offs)) and offs not in state["routes"]):
        raise _Mixes("contracts the token dim in a grouped matmul")
    return dims


def _setitem(node: fx.Node, state: dict) -> None:
    """``target[index] = value`` (in place): the target now carries what was written; a routing permutation
    written by itself (``inv[perm] = arange``) is its inverse."""
    target, index, value = node.args
    items = index if isinstance(index, tuple) else (index,)
    if len(items) == 1 and items[0] in state["routes"]:
        state["routes"].add(target)
        state[target] = token_dims(items[0], state)
        return None
    shape, dims = _shape(target), set(token_dims(target, state))
    for i, item in enumerate(_index_dims(index, len(shape))):
        if isinstance(item, fx.Node) or (isinstance(item, slice) and i in dims and not _full_slice(item, shape[i])):
            raise _Mixes("writes into the tokens by index or slice (a scatter or shift along the sequence)")
    if isinstance(value, fx.Node) and _shape(value) is not None:
        dims.update(d + len(shape) - len(_shape(value)) for d in token_dims(value, state))
    state[target] = Dims(dims)
    return None


def _query(node: fx.Node, state: dict) -> None:
    return None


def _attention(node: fx.Node, state: dict) -> Dims:
    """The attention the lowering packs: per packed sequence; its output carries the query's token dims."""
    return token_dims(node.args[0], state)


_IDENTITY = {"contiguous", "clone", "float", "half", "bfloat16", "double", "to", "type_as", "detach", "type",
             "dropout", "requires_grad_", "cpu", "cuda", "long", "int", "bool", "alias"}
_POINTWISE = {"add", "sub", "mul", "div", "pow", "where", "masked_fill", "clamp", "clip", "maximum", "minimum",
              "lerp", "addcmul", "addcdiv", "floor_divide", "remainder", "bitwise_and", "bitwise_or", "neg", "silu",
              "gelu", "relu", "softplus", "logical_not", "logical_and", "logical_or", "polar", "complex"}
_RESHAPES = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "squeeze", "unsqueeze"}
_REDUCTIONS = {"sum", "mean", "nansum", "nanmean", "amax", "amin", "prod", "std", "var", "norm", "logsumexp",
               "argmax", "argmin", "all", "any", "count_nonzero", "median", "nanmedian", "mode", "max", "min",
               "kthvalue", "var_mean", "std_mean", "aminmax", "softmax", "log_softmax", "cumsum", "cumprod", "cummax",
               "cummin", "logcumsumexp", "sort", "argsort", "topk", "flip", "roll", "diff", "normalize", "glu",
               "vector_norm"}
_QUERIES = {"size", "dim", "numel", "stride", "element_size", "is_floating_point", "is_contiguous", "get_device"}
"""Methods that read a tensor's metadata, not its values."""
_RULES_BY_NAME = {
    **{n: _reshape for n in _RESHAPES}, "transpose": _transpose, "swapaxes": _transpose, "swapdims": _transpose,
    "t": _transpose, "permute": _permute, "expand": _expand, "expand_as": _expand, "broadcast_to": _expand,
    "repeat": _repeat, "getitem": _getitem, "split": _split, "chunk": _split, "unbind": _split,
    "tensor_split": _split, "split_with_sizes": _split, "cat": _cat, "concat": _cat, "concatenate": _cat,
    "stack": _cat, "linear": _linear, "matmul": _matmul, "mm": _matmul, "bmm": _matmul, "addmm": _addmm,
    "baddbmm": _addmm, "einsum": _einsum, "embedding": _embedding, "layer_norm": _norm, "rms_norm": _norm,
    "conv1d": _conv, "conv2d": _conv, "conv3d": _conv, "pad": _pad, "narrow": _narrow,
    "repeat_interleave": _repeat_interleave, "view_as_complex": _view_as_complex, "view_as_real": _identity,
    "zeros_like": _constant_like, "ones_like": _constant_like, "empty_like": _constant_like,
    "full_like": _constant_like, "histc": _histc, "bincount": _histc, "grouped_mm_fallback": _grouped_mm,
    "grouped_mm": _grouped_mm, "_grouped_mm": _grouped_mm, "setitem": _setitem,
    **{n: _reduce for n in _REDUCTIONS}, **{n: _identity for n in _IDENTITY}, **{n: _query for n in _QUERIES},
}
_RULES_BY_TARGET = {TP_COPY: _identity, TP_ALL_REDUCE: _identity, TP_GRAD_SHARE: _identity, TP_ALL_GATHER: _all_gather,
                    vocab_parallel_embedding: _embedding, codegen.packed_attention: _attention,
                    **{t: _attention for t in SDPA_TARGETS}}


_KEEPS_ROUTES = (_identity, _pointwise, _reshape, _getitem, _expand)
"""Rules whose output of a routing permutation (or of the experts chosen) is one still (``perm // k``,
``perm.view(-1)``), where every input that carries tokens is one."""


def _rule(node: fx.Node) -> Any:
    if node.op == "call_function" and node.target in _RULES_BY_TARGET:
        return _RULES_BY_TARGET[node.target]
    name = _op_name(node)
    if name in ("max", "min") and len(node.args) > 1 and isinstance(node.args[1], fx.Node):
        return _pointwise  # torch.max(a, b): elementwise
    if node.op in ("call_function", "call_method") and name in _RULES_BY_NAME:
        return _RULES_BY_NAME[name]
    if name in _POINTWISE or (node.op in ("call_function", "call_method") and _is_pointwise(node)):
        return _pointwise
    return None


def _guess(node: fx.Node, state: dict) -> Any:
    """After a refusal, the token dims the analysis goes on with: the first input's, where the rank is kept."""
    val = _val(node)
    first = next((a for a in node.all_input_nodes if _carries(state.get(a))), None)
    if isinstance(val, torch.Tensor) and first is not None and _shape(first) is not None \
            and len(_shape(first)) == val.dim():
        return token_dims(first, state)
    return _none_like(val)


def token_mixing_sites(gm: fx.GraphModule) -> list[MixingSite]:
    """Every op of ``gm`` (a packed forward, its first input the token ids (1, T): dim 1 the tokens) that reads
    other tokens of the sequence than its own, besides attention; in graph order."""
    state: dict[Any, Any] = {"routes": set(), "choices": set(), "routed": set()}  # and "total": the tokens
    sites: list[MixingSite] = []
    first = True
    total = None
    for node in gm.graph.nodes:
        val = _val(node)
        if node.op == "placeholder":
            shape = _shape(node)
            if first and shape:  # the token ids (1, T), or activations (1, T, ...) in a hand-built graph
                dim = 1 if len(shape) > 1 else 0
                state[node], total = Dims({dim}), shape[dim]
                state["total"] = total
            else:
                state[node] = _none_like(val)
            first = False
            continue
        if node.op in ("get_attr", "output"):
            state[node] = _none_like(val)
            continue
        if node.op == "call_function" and node.target is packed_positions:
            state[node] = Dims({0})
            continue
        if node.op == "call_function" and node.target is torch.arange and _shape(node) == (total,):
            state[node] = Dims({0})  # the token index (an index arange the packed pass kept)
            continue
        if not any(_carries(state.get(a)) for a in node.all_input_nodes):
            state[node] = _none_like(val)
            continue
        rule = _rule(node)
        try:
            if rule is None:
                raise _Mixes("is an op the analysis has no rule for, on a value that carries tokens, so it "
                             "cannot show that it keeps the packed sequences apart")
            state[node] = rule(node, state)
            carriers = [a for a in node.all_input_nodes if _carries(state.get(a))]
            for kind in ("routes", "choices"):
                if rule in _KEEPS_ROUTES and carriers and all(a in state[kind] for a in carriers):
                    state[kind].add(node)
        except Exception as e:  # noqa: BLE001 - a rule that cannot follow its node refuses it, named, like any other
            why = str(e) if isinstance(e, _Mixes) else \
                f"could not be followed by the analysis ({type(e).__name__}: {str(e)[:80]}), so it is not shown safe"
            sites.append(MixingSite(node=node.name, op=_op_name(node) or str(node.target), module=_module(node),
                                    source=_source(node), why=why))
            state[node] = _guess(node, state)
    return sites


def check_token_mixing_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Refuse a packed forward with an op that reads other tokens of the sequence besides its attention
    (:func:`token_mixing_sites`), naming each; the graph is not changed."""
    del ctx
    if not any(n.op == "call_function" and n.target is codegen.packed_attention for n in gm.graph.nodes):
        return PassResult(graph_module=gm, modified=False)  # not packed (yet): nothing to check here
    sites = token_mixing_sites(gm)
    if sites:
        shown = "; ".join(s.describe() for s in sites[:3])
        more = f" (and {len(sites) - 3} more)" if len(sites) > 3 else ""
        raise PassError(
            f"token mixing: {type(gm).__name__} has {len(sites)} op(s) that mix tokens along the sequence besides "
            f"its attention: {shown}{more}. Packed, several sequences share one row, and only attention is kept "
            "to each sequence, so such an op (a convolution over tokens, a state-space scan, a cumulative sum, a "
            "shift, a reduction over tokens) would read the tokens of the neighbouring sequences and the model "
            "would train silently wrong. hydraulis cannot train this model as it is: replace these layers, or "
            "train it with another trainer")
    return PassResult(graph_module=gm, modified=False, info={"checked": sum(1 for _ in gm.graph.nodes)})
