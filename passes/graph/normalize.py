"""Canonical attention: graph rewrites that put what models write in several ways into one form the other
passes understand.

Owns ``fold_repeat_kv_pass``. Grouped-query attention written the Hugging Face way repeats each key/value head
for its group of query heads before calling SDPA::

    k[:, :, None, :, :].expand(B, kv, n_rep, T, D).reshape(B, kv * n_rep, T, D)   # repeat_kv

The pass passes the unrepeated ``k`` (and ``v``) to SDPA with ``enable_gqa=True`` instead, which computes the
same attention: tensor parallelism can then split or replicate kv heads as they are, and the packed op takes
fewer kv heads directly.
"""

from __future__ import annotations

import operator

from torch import fx

from passes.graph.analyze import SDPA_TARGETS
from passes.graph.pass_runner import PassContext, PassResult

__all__ = ["fold_repeat_kv_pass", "unrepeated_kv"]


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
    if not folded:
        return PassResult(graph_module=gm, modified=False)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return PassResult(graph_module=gm, modified=True, info={"folded": folded})
