"""Packed attention: rewrite a batch-1 forward into one that runs n whole sequences packed along tokens.

Owns ``rewrite_packed_attention_pass``. On a graph captured with input (1, T):

- every causal ``scaled_dot_product_attention(q, k, v)`` (or ``codegen.reference.softcapped_attention``, whose
  score cap the op takes) with q (1, H, T, D) becomes
  ``codegen.packed_attention(q', k', v', cu_seqlens, max_seqlen)`` with q' (T, H, D), so no token attends
  across a sequence boundary (grouped-query attention passes through: the op takes fewer kv heads);
- every position construction ``torch.arange(T)`` becomes :func:`packed_positions` (each token's index
  inside its own sequence), so learned absolute positions and RoPE both restart at every sequence; an
  ``arange`` used only to index (a mask builder's query and key indices) stays; positions counted as
  ``cumsum(ones(1, T))`` (OPT) restart the same way;
- ``cu_seqlens`` (int32, n+1) and ``max_seqlen`` become new graph inputs, after the user's inputs.

An attention mask is accepted when the graph builds it from positions alone (as Hugging Face models do:
causal, within the sequences that positions restarting at 0 delimit, perhaps inside a sliding window) and,
evaluated on a probe of several packed sequences, it is exactly causal within each sequence: it is then
dropped. Any other mask, dropout, a batch other than 1 or positions sliced from a table (``cos_cached[:T]``)
is an error that names the node and its module; a graph with no attention at all is an error too. A graph
already packed is returned unchanged. Option ``packed_attention.kernel`` picks the op's kernel (default
"auto").
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

import codegen
from passes.graph.analyze import SDPA_TARGETS
from passes.graph.pass_runner import PassContext, PassError, PassResult, propagate_vals

__all__ = ["rewrite_packed_attention_pass", "packed_positions", "find_position_aranges"]


def packed_positions(cu_seqlens: torch.Tensor, total: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """(total,) index of every token inside its own sequence; ``cu_seqlens[-1]`` must equal ``total``."""
    offsets = cu_seqlens.to(torch.long)
    token = torch.arange(total, device=cu_seqlens.device)  # (T,)
    seq = torch.searchsorted(offsets[1:], token, right=True)  # (T,) sequence of each token
    return (token - offsets[seq]).to(dtype)


def _where(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    module = list(stack.values())[-1][0] if stack else "<top>"
    return f"node {node.name!r} (module {module!r})"


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _sdpa_arg(node: fx.Node, name: str, default: Any = None) -> Any:
    position = {"attn_mask": 3, "dropout_p": 4, "is_causal": 5, "scale": 6}[name]
    return node.kwargs.get(name, node.args[position] if len(node.args) > position else default)


def _check_sdpa(gm: fx.GraphModule, node: fx.Node, total: int) -> None:
    mask = _sdpa_arg(node, "attn_mask")
    if _sdpa_arg(node, "dropout_p", 0.0) not in (0, 0.0):
        raise PassError(f"packed attention: {_where(node)} uses attention dropout {_sdpa_arg(node, 'dropout_p')!r}; "
                        "not supported (set the model's attention dropout to 0)")
    if mask is not None:
        _check_position_mask(gm, node, mask, total)
    elif _sdpa_arg(node, "is_causal") is not True:
        raise PassError(f"packed attention: {_where(node)} is not causal; only causal attention is supported")
    q = _val(node.args[0])
    if q is None or q.dim() != 4 or q.shape[0] != 1:
        shape = None if q is None else tuple(q.shape)
        raise PassError(f"packed attention: {_where(node)} has q of shape {shape}; expected (1, heads, tokens, dim)")


def _probe_offsets(total: int) -> list[int]:
    """Boundaries of a few uneven sequences filling ``total`` tokens (one sequence when total < 4)."""
    cuts = sorted({max(1, total // 3), max(1, total // 3 + total // 4), max(1, total - total // 6)} - {total})
    return [0, *[c for c in cuts if 0 < c < total], total]


def _check_position_mask(gm: fx.GraphModule, node: fx.Node, mask: Any, total: int) -> None:
    """A mask built from positions alone that is causal within each sequence on a probe, or an error."""
    if not isinstance(mask, fx.Node):
        raise PassError(f"packed attention: {_where(node)} passes a constant attention mask; only causal masks "
                        "built from positions are supported")
    offsets = _probe_offsets(total)
    try:
        value = _evaluate_from_positions(gm, mask, total, offsets)
    except PassError as exc:
        raise PassError(f"packed attention: {_where(node)} passes an attention mask that is not built from "
                        f"positions alone ({exc}); only causal masks are supported") from None
    seq = torch.searchsorted(torch.tensor(offsets[1:]), torch.arange(total), right=True)
    causal = (seq[:, None] == seq[None, :]) & (torch.arange(total)[None, :] <= torch.arange(total)[:, None])
    attend = value if value.dtype == torch.bool else value == 0
    attend = attend.reshape(-1, total, total)
    if not bool((attend == causal).all()):
        raise PassError(f"packed attention: {_where(node)} passes an attention mask that is not causal within "
                        f"each packed sequence (a sliding window shorter than {total} tokens, or another mask); "
                        "not supported")


def _evaluate_from_positions(gm: fx.GraphModule, target: fx.Node, total: int, offsets: list[int]) -> torch.Tensor:
    """``target`` computed on the CPU for a packed batch with boundaries ``offsets``: position aranges give
    each token's index in its sequence, index aranges stay plain; a graph input on the way is an error."""
    cu = torch.tensor(offsets, dtype=torch.int32)
    index = set(_index_aranges(gm, total))
    positions = set(find_position_aranges(gm, total)) - index
    env: dict[fx.Node, Any] = {}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    needed, stack = set(), [target]
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            if n not in positions:
                stack.extend(n.all_input_nodes)
    for n in sorted(needed, key=order.__getitem__):
        if n.op == "placeholder":
            raise PassError(f"it reads the graph input {n.name!r}")
        if n in positions:
            env[n] = packed_positions(cu, total, dtype=n.kwargs.get("dtype") or torch.long)
            continue
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
        args, kwargs = fx.node.map_aggregate((args, kwargs), _on_cpu)
        if n.op == "get_attr":
            value = _fetch_attr(gm, n.target)
            if value.device.type == "meta":
                raise PassError(f"it reads {n.target!r}, which holds no values here")
            env[n] = value.cpu()
        elif n.op == "call_function":
            env[n] = n.target(*args, **kwargs)
        elif n.op == "call_method":
            env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
        else:
            raise PassError(f"it calls {n.op} {n.target!r}")
    return env[target]


def _on_cpu(value: Any) -> Any:
    return torch.device("cpu") if isinstance(value, torch.device) else value


def _fetch_attr(gm: fx.GraphModule, name: str) -> torch.Tensor:
    obj: Any = gm
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _index_aranges(gm: fx.GraphModule, total: int) -> list[fx.Node]:
    """Aranges of 0..total-1 whose every use, through shape-only ops and scalar shifts, indexes a tensor."""
    out = []
    for node in find_position_aranges(gm, total):
        frontier, ok, seen = list(node.users), True, set()
        while frontier and ok:
            user = frontier.pop()
            if user in seen:
                continue
            seen.add(user)
            if user.op == "call_function" and user.target is operator.getitem:
                if _mentions(user.args[1], seen | {node}):
                    continue
                frontier.extend(user.users)  # a slice of the arange is an arange still
            elif user.op == "call_function" and user.target in (operator.add, operator.sub) and \
                    sum(isinstance(a, fx.Node) for a in user.args) == 1:
                frontier.extend(user.users)
            elif user.op == "call_method" and user.target in ("unsqueeze", "view", "reshape", "expand"):
                frontier.extend(user.users)
            elif user.op == "call_method" and user.target in _METADATA_METHODS:
                continue  # reads the arange's dtype or device, not its values
            else:
                ok = False
        if ok:
            out.append(node)
    return out


_METADATA_METHODS = ("new_ones", "new_zeros", "new_full", "new_empty", "size", "dim")


def _mentions(index: Any, nodes: set) -> bool:
    found = []
    fx.node.map_arg(index, lambda a: found.append(a) or a)
    return any(a in nodes for a in found)


def find_position_aranges(gm: fx.GraphModule, total: int) -> list[fx.Node]:
    """``torch.arange`` nodes that build positions 0..total-1 (the token axis of a batch-1 graph)."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.arange:
            continue
        args = list(node.args)
        start, end, step = (0, args[0], 1) if len(args) == 1 else (args + [1])[:3]
        start, step = node.kwargs.get("start", start), node.kwargs.get("step", step)
        if start == 0 and step == 1 and end == total:
            found.append(node)
    return found


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
            raise PassError(f"packed attention: {_where(node)} slices a position table to the sequence length "
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


def _rewrite_counted_positions(graph: fx.Graph, cu_seqlens: fx.Node, total: int) -> int:
    """Positions counted by a cumulative sum of ones (1..T) restart at every packed sequence too."""
    counted = [n for n in graph.nodes if _counted_ones(n, total)]
    for node in counted:
        ones = node.args[0]
        dtype = node.kwargs.get("dtype") or ones.kwargs.get("dtype") or torch.get_default_dtype()
        with graph.inserting_before(node):
            pos = graph.call_function(packed_positions, (cu_seqlens, total), {"dtype": dtype})
            one_based = graph.call_function(operator.add, (pos, 1))
            shaped = graph.call_method("view", (one_based, *_val(node).shape)) if _val(node) is not None else \
                one_based
        node.replace_all_uses_with(shaped)
        graph.erase_node(node)
    return len(counted)


def _to_packed(graph: fx.Graph, x: fx.Node) -> fx.Node:
    return graph.call_method("transpose", (graph.call_method("squeeze", (x, 0)), 0, 1))  # (1,H,T,D) -> (T,H,D)


def _rewrite_sdpa(graph: fx.Graph, node: fx.Node, cu_seqlens: fx.Node, max_seqlen: fx.Node, kernel: str) -> None:
    q, k, v = node.args[:3]
    scale = _sdpa_arg(node, "scale")
    softcap = node.kwargs.get("softcap") or None  # codegen.reference.softcapped_attention's cap
    with graph.inserting_before(node):
        q3, k3, v3 = (_to_packed(graph, x) for x in (q, k, v))
        out = graph.call_function(codegen.packed_attention, (q3, k3, v3, cu_seqlens, max_seqlen),
                                  {"causal": True, "softmax_scale": scale, "kernel": kernel, "validate": False,
                                   **({"softcap": softcap} if softcap else {})})
        out4 = graph.call_method("unsqueeze", (graph.call_method("transpose", (out, 0, 1)), 0))  # (T,H,D)->(1,H,T,D)
    out.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
    node.replace_all_uses_with(out4)
    graph.erase_node(node)


def rewrite_packed_attention_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """SDPA -> ``codegen.packed_attention`` and arange positions -> per-sequence positions."""
    graph = gm.graph
    sdpa = [n for n in graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]
    already = [n for n in graph.nodes if n.op == "call_function" and n.target is codegen.packed_attention]
    if not sdpa:
        if already:
            return PassResult(graph_module=gm, modified=False)
        raise PassError(f"packed attention: no scaled_dot_product_attention call found in {type(gm).__name__}; "
                        "the model's attention must call F.scaled_dot_product_attention")
    total = int(_val(sdpa[0].args[0]).shape[2])
    for node in sdpa:
        _check_sdpa(gm, node, total)
    _check_no_sliced_positions(gm, total)
    index_aranges = set(_index_aranges(gm, total))
    device = _val(sdpa[0].args[0]).device
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]):
        max_seqlen = graph.placeholder("max_seqlen", type_expr=int)
    with graph.inserting_after(placeholders[-1]):
        cu_seqlens = graph.placeholder("cu_seqlens", type_expr=torch.Tensor)
    for node in sdpa:
        _rewrite_sdpa(graph, node, cu_seqlens, max_seqlen, ctx.option("rewrite_packed_attention_pass.kernel", "auto"))
    graph.eliminate_dead_code()  # the masks the attention no longer reads
    aranges = [n for n in find_position_aranges(gm, total) if n not in index_aranges]
    for node in aranges:
        dtype = node.kwargs.get("dtype") or torch.long
        with graph.inserting_before(node):
            pos = graph.call_function(packed_positions, (cu_seqlens, total), {"dtype": dtype})
        node.replace_all_uses_with(pos)
        graph.erase_node(node)
    counted = _rewrite_counted_positions(graph, cu_seqlens, total)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    inputs = [n.meta.get("val") for n in placeholders]
    propagate_vals(gm, inputs + [torch.tensor([0, total], dtype=torch.int32, device=device), total])
    return PassResult(graph_module=gm, modified=True,
                      info={"attention_sites": len(sdpa), "positions": len(aranges) + counted, "tokens": total})
