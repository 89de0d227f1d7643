"""Packed attention: rewrite a batch-1 forward into one that runs n whole sequences packed along tokens.

Owns ``rewrite_packed_attention_pass``. On a graph captured with input (1, T):

- every causal ``scaled_dot_product_attention(q, k, v)`` (or ``codegen.reference.extended_attention``, whose
  score cap and sinks the op takes) with q (1, H, T, D) becomes
  ``codegen.packed_attention(q', k', v', cu_seqlens, max_seqlen, window=..., chunk=...)`` with q' (T, H, D), so
  no token attends across a sequence boundary (grouped-query attention passes through: the op takes fewer kv
  heads);
- every position construction ``torch.arange(T)`` becomes :func:`packed_positions` (each token's index
  inside its own sequence), so learned absolute positions and RoPE both restart at every sequence; an
  ``arange`` used only to index (a mask builder's query and key indices) stays; positions counted as
  ``cumsum(ones(1, T))`` (OPT) restart the same way;
- ``cu_seqlens`` (int32, n+1) and ``max_seqlen`` become new graph inputs, after the user's inputs.

An attention mask is accepted when the graph builds it from positions alone (as Hugging Face models do:
causal, within the sequences that positions restarting at 0 delimit, perhaps inside a sliding window or
chunks) and it is exactly causal within a left window and chunks in each sequence
(``passes.graph.attention_masks.classify_mask``): it is then dropped and the op takes the window and chunk.
Option ``limits`` (node name -> ``MaskLimits``, what ``decide_attention_limits`` decided for the whole run)
gives each attention its limits, which this capture's mask must agree with; without it each capture's own are
used. Any other mask, dropout, a batch other than 1 or positions sliced from a table (``cos_cached[:T]``) is
an error that names the node and its module; a graph with no attention at all is an error too. A graph
already packed is returned unchanged. Option ``kernel`` picks the op's kernel (default "auto").
"""

from __future__ import annotations

import operator
from typing import Any, Mapping

import torch
from torch import fx

import codegen
from passes.graph.analyze import SDPA_TARGETS
from passes.graph.attention_masks import (
    MaskLimits,
    classify_mask,
    find_position_aranges,
    index_aranges,
    packed_positions,
    sdpa_arg,
    where,
)
from passes.graph.eager_attention import unrecognised_softmaxes
from passes.graph.pass_runner import PassContext, PassError, PassResult, fill_vals

__all__ = ["rewrite_packed_attention_pass", "packed_positions", "find_position_aranges"]


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _check_sdpa(node: fx.Node) -> None:
    if sdpa_arg(node, "dropout_p", 0.0) not in (0, 0.0):
        raise PassError(f"packed attention: {where(node)} uses attention dropout {sdpa_arg(node, 'dropout_p')!r}; "
                        "not supported (set the model's attention dropout to 0)")
    q = _val(node.args[0])
    if q is None or q.dim() != 4 or q.shape[0] != 1:
        shape = None if q is None else tuple(q.shape)
        raise PassError(f"packed attention: {where(node)} has q of shape {shape}; expected (1, heads, tokens, dim)")


def _limits_of(gm: fx.GraphModule, node: fx.Node, total: int, decided: Mapping[str, MaskLimits] | None
               ) -> MaskLimits:
    """The node's limits: decided for the whole run (checked against this capture), else found in this one."""
    local = classify_mask(gm, node, total)
    if decided is None:
        return local
    if node.name not in decided:
        raise PassError(f"packed attention: {where(node)} has no decided limits (decided for {sorted(decided)[:4]})")
    limits = decided[node.name]
    positions = torch.arange(total)
    if not bool((local.first_keys(positions) == limits.first_keys(positions)).all()):
        raise PassError(f"packed attention: {where(node)} keeps {local.describe()} in this capture of {total} "
                        f"tokens, but {limits.describe()} was decided for the run")
    return limits


def _constant_only(node: fx.Node, cache: dict[fx.Node, bool]) -> bool:
    """True when ``node`` depends on parameters/buffers/constants only (no graph input, no arange)."""
    if node not in cache:
        if node.op == "placeholder" or (node.op == "call_function" and node.target is torch.arange):
            cache[node] = False
        else:
            cache[node] = all(_constant_only(a, cache) for a in node.all_input_nodes)
    return cache[node]


def _check_no_sliced_positions(gm: fx.GraphModule, total: int) -> None:
    """A table sliced to the sequence length (``cos_cached[:T]``, ``wpe.weight[:T]``) would give packed
    tokens the positions of one long sequence; that construction is out of scope and an error."""
    cache: dict[fx.Node, bool] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not operator.getitem:
            continue
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if any(isinstance(i, slice) and i.stop == total for i in index) and _constant_only(node.args[0], cache):
            raise PassError(f"packed attention: {where(node)} slices a position table to the sequence length "
                            f"({total}); build positions with torch.arange or take a position_ids argument")


def _counted_ones(node: fx.Node, total: int) -> bool:
    """``torch.cumsum(torch.ones(1, T) or torch.ones(T), dim=<the token dim>)``: positions 1..T counted (OPT)."""
    if node.op != "call_function" or node.target is not torch.cumsum or not node.args:
        return False
    ones = node.args[0]
    if not (isinstance(ones, fx.Node) and ones.op == "call_function" and ones.target is torch.ones):
        return False
    shape = tuple(ones.args[0]) if len(ones.args) == 1 and isinstance(ones.args[0], (tuple, list)) else ones.args
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    return shape in ((1, total), (total,)) and dim is not None and dim % len(shape) == len(shape) - 1


def _rewrite_counted_positions(graph: fx.Graph, cu_seqlens: fx.Node, total: int,
                               replaced: list[tuple[Any, fx.Node]]) -> int:
    """Positions counted by a cumulative sum of ones (1..T) restart at every packed sequence too (each
    replaced value and its new node appended to ``replaced``)."""
    counted = [n for n in graph.nodes if _counted_ones(n, total)]
    for node in counted:
        ones = node.args[0]
        dtype = node.kwargs.get("dtype") or ones.kwargs.get("dtype") or torch.get_default_dtype()
        with graph.inserting_before(node):
            pos = graph.call_function(packed_positions, (cu_seqlens, total), {"dtype": dtype})
            one_based = graph.call_function(operator.add, (pos, 1))
            shaped = graph.call_method("view", (one_based, *_val(node).shape)) if _val(node) is not None else \
                one_based
        replaced.append((node.meta.get("val"), shaped))
        node.replace_all_uses_with(shaped)
        graph.erase_node(node)
    return len(counted)


_REDUCTIONS = frozenset({"max", "amax", "min", "amin", "sum", "mean", "prod", "cumsum", "cumprod", "cummax", "cummin",
                         "logsumexp", "argmax", "argmin", "sort", "argsort", "topk", "median", "std", "var", "norm",
                         "diff"})


def _check_no_position_reductions(graph: fx.Graph, total: int) -> None:
    """Positions must stay per token: a reduction over the token axis of a value computed from positions alone
    (Phi-3's longrope takes ``max(position_ids)`` to choose its frequencies) would give every packed sequence the
    whole micro-batch's value. Refused, naming the node. Values that mix positions with activations (rotary
    products, everything after them) are not followed: their reductions run over features."""
    pure: set[fx.Node] = set()
    constant: dict[fx.Node, bool] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is packed_positions:
            pure.add(node)
            continue
        inputs = node.all_input_nodes
        if not inputs or not any(a in pure for a in inputs) or \
                not all(a in pure or _constant_only(a, constant) for a in inputs):
            continue
        pure.add(node)
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        source = _val(node.args[0]) if node.args else None
        if name not in _REDUCTIONS or source is None or total not in tuple(source.shape):
            continue
        dims = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 and not isinstance(node.args[1], fx.Node)
                               else None)
        dims = range(source.dim()) if dims is None else (dims if isinstance(dims, (tuple, list)) else (dims,))
        if any(isinstance(d, int) and source.shape[d % source.dim()] == total for d in dims):
            raise PassError(f"packed attention: {where(node)} takes the {name} of positions over the micro-batch's "
                            f"{total} tokens: packed, every sequence would get the whole micro-batch's value "
                            "(longrope and dynamic RoPE choose their frequencies from the largest position this "
                            "way); not supported: use a static rope scaling, or none")


def _to_packed(graph: fx.Graph, x: fx.Node) -> fx.Node:
    return graph.call_method("transpose", (graph.call_method("squeeze", (x, 0)), 0, 1))  # (1,H,T,D) -> (T,H,D)


def _rewrite_sdpa(graph: fx.Graph, node: fx.Node, cu_seqlens: fx.Node, max_seqlen: fx.Node, kernel: str,
                  limits: MaskLimits) -> fx.Node:
    q, k, v = node.args[:3]
    scale = sdpa_arg(node, "scale")
    softcap = node.kwargs.get("softcap") or None  # codegen.reference.extended_attention's cap
    sinks = node.kwargs.get("sinks")  # and its sinks
    extra = {"softcap": softcap, "window": limits.window, "chunk": limits.chunk, "sinks": sinks}
    with graph.inserting_before(node):
        q3, k3, v3 = (_to_packed(graph, x) for x in (q, k, v))
        out = graph.call_function(codegen.packed_attention, (q3, k3, v3, cu_seqlens, max_seqlen),
                                  {"causal": True, "softmax_scale": scale, "kernel": kernel, "validate": False,
                                   **{key: value for key, value in extra.items() if value is not None}})
        out4 = graph.call_method("unsqueeze", (graph.call_method("transpose", (out, 0, 1)), 0))  # (T,H,D)->(1,H,T,D)
    out.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
    node.replace_all_uses_with(out4)
    graph.erase_node(node)
    return out4


def rewrite_packed_attention_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """SDPA -> ``codegen.packed_attention`` and arange positions -> per-sequence positions."""
    graph = gm.graph
    sdpa = [n for n in graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]
    already = [n for n in graph.nodes if n.op == "call_function" and n.target is codegen.packed_attention]
    if not sdpa:
        if already:
            return PassResult(graph_module=gm, modified=False)
        softmaxes = unrecognised_softmaxes(gm)
        if softmaxes:
            raise PassError(f"packed attention: {type(gm).__name__} has no attention in a form the passes know: "
                            f"the softmax at {where(softmaxes[0])} is not softmax(q @ k^T * scale [+ mask]) @ v "
                            "(with a score cap or sinks), nor does the model call F.scaled_dot_product_attention")
        raise PassError(f"packed attention: no scaled_dot_product_attention call found in {type(gm).__name__}; "
                        "the model's attention must call F.scaled_dot_product_attention")
    total = int(_val(sdpa[0].args[0]).shape[2])
    decided = ctx.option("rewrite_packed_attention_pass.limits")
    limits = {}
    for node in sdpa:
        _check_sdpa(node)
        limits[node] = _limits_of(gm, node, total, decided)
    _check_no_sliced_positions(gm, total)
    indexing = set(index_aranges(gm, total))
    device = _val(sdpa[0].args[0]).device
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]):
        max_seqlen = graph.placeholder("max_seqlen", type_expr=int)
    with graph.inserting_after(placeholders[-1]):
        cu_seqlens = graph.placeholder("cu_seqlens", type_expr=torch.Tensor)
    replaced = []  # (the value a rewrite replaced, the node that now gives it)
    for node in sdpa:
        replaced.append((node.meta.get("val"), _rewrite_sdpa(
            graph, node, cu_seqlens, max_seqlen, ctx.option("rewrite_packed_attention_pass.kernel", "auto"),
            limits[node])))
    graph.eliminate_dead_code()  # the masks the attention no longer reads
    aranges = [n for n in find_position_aranges(gm, total) if n not in indexing]
    for node in aranges:
        dtype = node.kwargs.get("dtype") or torch.long
        with graph.inserting_before(node):
            pos = graph.call_function(packed_positions, (cu_seqlens, total), {"dtype": dtype})
        replaced.append((node.meta.get("val"), pos))
        node.replace_all_uses_with(pos)
        graph.erase_node(node)
    counted = _rewrite_counted_positions(graph, cu_seqlens, total, replaced)
    graph.eliminate_dead_code()
    _check_no_position_reductions(graph, total)
    graph.lint()
    gm.recompile()
    # vals for the new nodes only: the rest keep theirs where every replaced value kept its shape, dtype, strides
    fill_vals(gm, {cu_seqlens: torch.tensor([0, total], dtype=torch.int32, device=device), max_seqlen: total},
              replaced)
    return PassResult(graph_module=gm, modified=True,
                      info={"attention_sites": len(sdpa), "positions": len(aranges) + counted, "tokens": total})
