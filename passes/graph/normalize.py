"""Canonical forms: graph rewrites that put what models write in several ways into one form the other passes
understand.

Owns four passes, run before tensor parallelism:

- ``fold_eager_attention_pass`` (``passes.graph.eager_attention``): attention written out becomes one SDPA-form
  call, which the packed-attention pass knows;
- ``fold_transposed_matmul_pass``: a linear written as a matmul with a transposed parameter (``x @ w.T``,
  ``torch.matmul(x, w.t())``, ``x.matmul(w.transpose(0, 1))``), plus a bias parameter added right after, becomes
  ``F.linear(x, w, b)``;
- ``fold_fused_slices_pass``: the pieces of a fused projection taken other than by one ``split``: ``chunk``
  becomes ``split``; contiguous slices of the last dim that tile it (``qkv[..., :q]``, ``qkv[..., q:q + kv]``,
  ...) become one ``split`` and its items;
- ``fold_repeat_kv_pass`` (below).

``fold_repeat_kv_pass``. Grouped-query attention written the Hugging Face way repeats each key/value head
for its group of query heads before calling SDPA::

    k[:, :, None, :, :].expand(B, kv, n_rep, T, D).reshape(B, kv * n_rep, T, D)   # repeat_kv

The pass passes the unrepeated ``k`` (and ``v``) to SDPA with ``enable_gqa=True`` instead, which computes the
same attention: tensor parallelism can then split or replicate kv heads as they are, and the packed op takes
fewer kv heads directly.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch import fx

from passes.graph.analyze import SDPA_TARGETS
from passes.graph.eager_attention import fold_eager_attention_pass
from passes.graph.pass_runner import PassContext, PassResult, copy_graph_module, folded_result, run_passes

__all__ = ["CANONICAL_PASSES", "canonical_graph", "fold_repeat_kv_pass", "fold_transposed_matmul_pass",
           "fold_fused_slices_pass", "fold_eager_attention_pass", "unrepeated_kv"]


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(int(s) for s in val.shape) if val is not None and hasattr(val, "shape") else None


def unrepeated_kv(node: fx.Node) -> fx.Node | None:
    """The (B, kv, T, D) tensor that ``node`` repeats to (B, kv * n_rep, T, D), when ``node`` is the end of a
    repeat_kv (index with a new axis 2, expand of that axis, reshape merging it into the heads); else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and node.target == "reshape"):
        return None
    expand = node.args[0]
    if not (isinstance(expand, fx.Node) and expand.op == "call_method" and expand.target == "expand"):
        return None
    index = expand.args[0]
    if not (isinstance(index, fx.Node) and index.op == "call_function" and index.target is operator.getitem):
        return None
    source, item = index.args
    full, expanded, out = _shape(source), _shape(expand), _shape(node)
    if full is None or expanded is None or out is None or len(full) != 4 or len(expanded) != 5:
        return None
    items = list(item) if isinstance(item, tuple) else [item]
    if len(items) != 5 or items[2] is not None or any(i != slice(None) for j, i in enumerate(items) if j != 2):
        return None
    b, kv, t, d = full
    n_rep = expanded[2]
    if expanded != (b, kv, n_rep, t, d) or out != (b, kv * n_rep, t, d):
        return None
    return source


def fold_repeat_kv_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """SDPA over repeated key/value heads -> SDPA over the kv heads themselves with ``enable_gqa=True``."""
    folded = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in SDPA_TARGETS:
            continue
        k, v = unrepeated_kv(node.args[1]), unrepeated_kv(node.args[2])
        if k is None or v is None:
            continue
        node.args = (node.args[0], k, v, *node.args[3:])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        folded += 1
    return folded_result(gm, folded)


_MATMUL_FUNCTIONS = (operator.matmul, torch.matmul)
_TRANSPOSES = {("call_method", "t"), ("call_function", torch.t)}


def _param(gm: fx.GraphModule, node: Any) -> bool:
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return False
    try:
        gm.get_parameter(node.target)
        return True
    except AttributeError:
        return False


def _transposed_param(gm: fx.GraphModule, node: Any) -> fx.Node | None:
    """The 2-D parameter ``w`` when ``node`` is ``w.T``, ``w.t()``, ``w.mT`` or ``w.transpose(0, 1)``."""
    if not isinstance(node, fx.Node) or not node.args or not _param(gm, node.args[0]):
        return None
    w = node.args[0]
    if w.meta["val"].dim() != 2:
        return None
    if (node.op, node.target) in _TRANSPOSES:
        return w
    if node.op == "call_function" and node.target is getattr and node.args[1] in ("T", "mT"):
        return w
    if (node.op == "call_method" and node.target == "transpose" or node.target is torch.transpose) and \
            sorted(d % 2 for d in node.args[1:3]) == [0, 1]:
        return w
    if node.op == "call_method" and node.target == "permute" and tuple(node.args[1:]) in ((1, 0), ((1, 0),)):
        return w
    return None


def _is_matmul(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _MATMUL_FUNCTIONS) or \
        (node.op == "call_method" and node.target == "matmul")


def _bias_of(gm: fx.GraphModule, linear: fx.Node, out_features: int) -> tuple[fx.Node, fx.Node] | None:
    """(the add, the bias parameter) when the linear's only user adds a (out_features,) parameter to it."""
    if len(linear.users) != 1:
        return None
    add = next(iter(linear.users))
    if not ((add.op == "call_function" and add.target in (operator.add, torch.add))
            or (add.op == "call_method" and add.target == "add")) or len(add.args) != 2 or add.kwargs:
        return None
    other = add.args[1] if add.args[0] is linear else add.args[0]
    if _param(gm, other) and tuple(other.meta["val"].shape) == (out_features,):
        return add, other
    return None


def fold_transposed_matmul_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """``x @ w.T (+ b)`` with parameters ``w`` (out, in) and ``b`` (out,) -> ``F.linear(x, w, b)``."""
    folded = 0
    for node in list(gm.graph.nodes):
        if not _is_matmul(node) or len(node.args) != 2:
            continue
        w = _transposed_param(gm, node.args[1])
        if w is None:
            continue
        bias = _bias_of(gm, node, int(w.meta["val"].shape[0]))
        with gm.graph.inserting_after(node):
            linear = gm.graph.call_function(torch.nn.functional.linear, (node.args[0], w, bias[1] if bias else None))
        linear.meta.update(node.meta)
        last = bias[0] if bias else node
        if bias:
            linear.meta["val"] = last.meta.get("val")
        last.replace_all_uses_with(linear)
        folded += 1
    return folded_result(gm, folded)


def _last_dim_slice(node: fx.Node, source: fx.Node) -> tuple[int, int] | None:
    """(start, stop) when ``node`` is ``source[..., a:b]`` (every other dim whole, step 1)."""
    if not (node.op == "call_function" and node.target is operator.getitem and node.args[0] is source):
        return None
    shape = source.meta["val"].shape
    items = list(node.args[1]) if isinstance(node.args[1], tuple) else [node.args[1]]
    if Ellipsis in items:
        k = items.index(Ellipsis)
        items = items[:k] + [slice(None)] * (len(shape) - len(items) + 1) + items[k + 1:]
    if len(items) != len(shape) or any(not isinstance(i, slice) for i in items) or \
            any(i != slice(None) for i in items[:-1]):
        return None
    start, stop, step = items[-1].indices(int(shape[-1]))
    return (start, stop) if step == 1 and stop > start else None


def _tiling_slices(source: fx.Node) -> list[tuple[int, int, fx.Node]] | None:
    """Every user of ``source`` as (start, stop, user), when they are last-dim slices tiling it exactly."""
    cuts = []
    for user in source.users:
        span = _last_dim_slice(user, source)
        if span is None:
            return None
        cuts.append((*span, user))
    cuts.sort(key=lambda c: c[:2])
    ends = [0] + [c[1] for c in cuts]
    if len(cuts) < 2 or any(c[0] != e for c, e in zip(cuts, ends)) or ends[-1] != int(source.meta["val"].shape[-1]):
        return None
    return cuts


def _chunk_to_split(gm: fx.GraphModule, node: fx.Node) -> bool:
    is_chunk = (node.op == "call_method" and node.target == "chunk") or \
        (node.op == "call_function" and node.target is torch.chunk)
    if not is_chunk:
        return False
    src, chunks = node.args[0], node.kwargs.get("chunks", node.args[1] if len(node.args) > 1 else None)
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)
    size = int(src.meta["val"].shape[dim])
    with gm.graph.inserting_before(node):
        split = gm.graph.call_method("split", (src, math.ceil(size / chunks)), {"dim": dim})
    split.meta.update(node.meta)
    node.replace_all_uses_with(split)
    gm.graph.erase_node(node)
    return True


def fold_fused_slices_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """``chunk`` -> ``split``; last-dim slices that tile a tensor -> one ``split`` and its items (the form the
    tensor-parallel pass splits a fused projection by)."""
    folded = 0
    for node in list(gm.graph.nodes):
        if _chunk_to_split(gm, node):
            folded += 1
            continue
        cuts = _tiling_slices(node) if isinstance(node.meta.get("val"), torch.Tensor) else None
        if cuts is None:
            continue
        with gm.graph.inserting_after(node):
            split = gm.graph.call_method("split", (node, [b - a for a, b, _ in cuts]), {"dim": -1})
        split.meta["val"] = tuple(user.meta["val"] for _, _, user in cuts)
        for i, (_, _, user) in enumerate(cuts):
            with gm.graph.inserting_after(split):
                item = gm.graph.call_function(operator.getitem, (split, i))
            item.meta.update(user.meta)
            user.replace_all_uses_with(item)
            gm.graph.erase_node(user)
        folded += 1
    if not folded:
        return PassResult(graph_module=gm, modified=False)
    gm.graph.lint()
    gm.recompile()
    return PassResult(graph_module=gm, modified=True, info={"folded": folded})


CANONICAL_PASSES = (fold_transposed_matmul_pass, fold_fused_slices_pass, fold_eager_attention_pass, fold_repeat_kv_pass)
"""The canonical-form passes, in the order the lowering runs them."""


def canonical_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` in canonical form (every pass of ``CANONICAL_PASSES``): what graph analysis and the
    tensor-parallel decisions should read."""
    out, _ = run_passes(copy_graph_module(gm), CANONICAL_PASSES, PassContext())
    return out
