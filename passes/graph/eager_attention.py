"""Eager attention: attention written out with matmuls and a softmax becomes one SDPA-form call.

Owns ``fold_eager_attention_pass`` (one of the canonical-form passes). It recognises

    softmax(q @ k.transpose(-2, -1) * scale [capped] [+ mask]) [dropout] @ v

with Gemma 2's score cap ``c * tanh(s / c)`` before the mask, a mask added or applied with ``masked_fill`` (MPT,
whose added ALiBi bias becomes part of the mask, which the packed pass then refuses by name), casts anywhere
on the way, and two ways of writing learned attention sinks, one logit per head that joins every row's softmax
denominator without a value:

- GPT-OSS: ``softmax(cat([scores, sinks.reshape(1, -1, 1, 1).expand(...)], -1) [- its max])[..., :-1] @ v``;
- GraniteMoE-SWA: ``(softmax(scores) @ v) * sigmoid(logsumexp(scores, -1) - sinks.view(1, -1, 1))[..., None]``.

The result is ``F.scaled_dot_product_attention`` or, with a cap or sinks, ``codegen.reference.extended_attention``
(SDPA's signature plus ``softcap`` and ``sinks``: the sinks a (heads,) tensor), which tensor parallelism and the
packed-attention pass know. A softmax that is none of these is left alone (the packed pass then names it).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from codegen.reference import extended_attention
from passes.graph.pass_runner import PassContext, PassResult, folded_result

__all__ = ["fold_eager_attention_pass", "unrecognised_softmaxes"]

_SOFTMAX = (F.softmax, torch.softmax)
_SCALE_OPS = {operator.mul, operator.truediv, torch.mul, torch.div}
_CASTS = ("to", "type_as", "float", "half", "bfloat16", "contiguous")
_RESHAPES = ("reshape", "view", "expand", "unsqueeze", "to", "float")


def _is_call(node: Any, functions: tuple = (), methods: tuple = ()) -> bool:
    return isinstance(node, fx.Node) and ((node.op == "call_function" and node.target in functions)
                                          or (node.op == "call_method" and node.target in methods))


def _shape(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


def _strip_casts(node: Any) -> Any:
    while _is_call(node, (), _CASTS) and len(node.args) >= 1:
        node = node.args[0]
    return node


def _scalar_operand(node: fx.Node) -> tuple[fx.Node, float, bool] | None:
    """(tensor, number, divides) when ``node`` multiplies or divides a tensor by a Python number."""
    if not _is_call(node, tuple(_SCALE_OPS), ("mul", "div")) or len(node.args) != 2:
        return None
    a, b = node.args
    divides = node.target in (operator.truediv, torch.div, "div")
    if isinstance(a, fx.Node) and isinstance(b, (int, float)):
        return a, float(b), divides
    if isinstance(b, fx.Node) and isinstance(a, (int, float)) and not divides:
        return b, float(a), False
    return None


@dataclass(frozen=True, slots=True)
class _Scores:
    """What a softmax's input is made of: ``q @ k^T * scale``, capped, plus an additive mask or bias, with keys
    hidden by ``masked_fill``."""

    q: fx.Node
    k: fx.Node
    scale: float
    softcap: float
    added: fx.Node | None
    """Added to the scores (a float mask, or a bias)."""
    hidden: fx.Node | None
    """A boolean, True where ``masked_fill`` hides a key."""


def _scores_source(scores: Any) -> _Scores | None:
    """Walk back from the softmax input: the scores' parts when it is ``q @ k^T`` times a scale, optionally
    capped, plus an optional additive mask and an optional ``masked_fill`` of very negative scores; else None."""
    scores = _strip_casts(scores)
    hidden = None
    if _is_call(scores, (torch.masked_fill,), ("masked_fill",)) and len(scores.args) == 3 and \
            isinstance(scores.args[2], (int, float)) and scores.args[2] <= -1e30:
        scores, hidden = _strip_casts(scores.args[0]), scores.args[1]
    added = None
    if _is_call(scores, (operator.add, torch.add), ("add",)) and len(scores.args) == 2:
        scores, added = scores.args
    softcap = 0.0
    capped = _scalar_operand(scores)  # softcap * tanh(s / softcap)
    if capped and not capped[2] and _is_call(capped[0], (torch.tanh,), ("tanh",)):
        inner = _scalar_operand(capped[0].args[0])
        if inner and inner[2] and inner[1] == capped[1]:
            softcap, scores = capped[1], inner[0]
    scale = 1.0
    scaled = _scalar_operand(scores)
    if scaled:
        scores, scale = scaled[0], (1.0 / scaled[1] if scaled[2] else scaled[1])
    if not _is_call(scores, (torch.matmul, operator.matmul), ("matmul",)) or len(scores.args) != 2:
        return None
    q, kt = scores.args
    if not _is_call(kt, (torch.transpose,), ("transpose",)) or \
            sorted(d % 4 for d in kt.args[1:3]) != [2, 3] or q.meta["val"].dim() != 4:
        return None
    return _Scores(q, kt.args[0], scale, softcap, added, hidden)


def _probs_consumer(node: fx.Node) -> tuple[fx.Node, float] | None:
    """(``probs @ v``, dropout p) after a softmax, through dtype casts and a dropout."""
    dropout = 0.0
    while len(node.users) == 1:
        user = next(iter(node.users))
        if _is_call(user, (), _CASTS):
            node = user
        elif _is_call(user, (F.dropout,)):
            dropout = user.kwargs.get("p", user.args[1] if len(user.args) > 1 else 0.5)
            training = user.kwargs.get("training", user.args[2] if len(user.args) > 2 else True)
            dropout, node = (dropout if training else 0.0), user
        elif _is_call(user, (torch.matmul, operator.matmul), ("matmul",)) and user.args[0] is node:
            return user, dropout
        else:
            return None
    return None


def _sinks_vector(node: Any, heads: int) -> fx.Node | None:
    """The (heads,) tensor that ``node`` reshapes or expands (the sinks parameter), if it is one."""
    while isinstance(node, fx.Node):
        if _shape(node) == (heads,):
            return node
        if not _is_call(node, (torch.reshape,), _RESHAPES):
            return None
        node = node.args[0]
    return None


def _concatenated_sinks(softmax: fx.Node) -> tuple[Any, fx.Node, fx.Node] | None:
    """GPT-OSS's sinks: (scores, sinks vector, the ``[..., :-1]`` of the probabilities) when the softmax input is
    ``cat([scores, sinks], -1)``, perhaps less its max, and only the slice without the sink column is used."""
    combined = _strip_casts(softmax.args[0])
    if _is_call(combined, (operator.sub, torch.sub), ("sub",)) and len(combined.args) == 2:
        top = combined.args[1]
        if _is_call(top, (operator.getitem,)) and _is_call(top.args[0], (torch.max, torch.amax), ("max", "amax")):
            combined = combined.args[0]
    if not (_is_call(combined, (torch.cat, torch.concat)) and len(combined.args[0]) == 2):
        return None
    dim = combined.kwargs.get("dim", combined.args[1] if len(combined.args) > 1 else 0)
    scores, sink = combined.args[0]
    shape = _shape(scores)
    if shape is None or len(shape) != 4 or dim % 4 != 3 or len(softmax.users) != 1:
        return None
    vector = _sinks_vector(sink, shape[1])
    dropped = next(iter(softmax.users))
    index = dropped.args[1] if _is_call(dropped, (operator.getitem,)) else None
    if vector is None or index not in ((Ellipsis, slice(None, -1, None)), (Ellipsis, slice(None, shape[3], None))):
        return None
    return scores, vector, dropped


def _scaled_by_sinks(scores: fx.Node, out: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """GraniteMoE-SWA's sinks: (the product that ends the attention, sinks vector) when ``out`` (``probs @ v``)
    is multiplied by ``sigmoid(logsumexp(scores, -1) - sinks)`` with a new last axis."""
    heads = (_shape(scores) or (0, 0))[1]
    for lse in scores.users:
        if not _is_call(lse, (torch.logsumexp,), ("logsumexp",)):
            continue
        node: Any = lse
        vector, squashed = None, False
        while len(node.users) == 1:
            user = next(iter(node.users))
            if _is_call(user, (operator.sub, torch.sub), ("sub",)) and user.args[0] is node and vector is None:
                vector = _sinks_vector(user.args[1], heads)
                if vector is None:
                    return None
                node = user
            elif _is_call(user, (torch.sigmoid,), ("sigmoid",)) and vector is not None and not squashed:
                node, squashed = user, True
            elif _is_call(user, (), ("unsqueeze", *_CASTS)):
                node = user
            elif _is_call(user, (operator.mul, torch.mul), ("mul",)) and squashed and \
                    out in (_strip_casts(a) for a in user.args):
                return user, vector
            else:
                return None
    return None


def fold_eager_attention_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """``softmax(q @ k^T * scale [capped] [+ mask]) [dropout] @ v`` (with or without sinks) -> one SDPA-form
    attention call."""
    folded = 0
    for node in list(gm.graph.nodes):
        if not _is_call(node, _SOFTMAX, ("softmax",)):
            continue
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        sinks, probs, end = None, node, None
        concatenated = _concatenated_sinks(node)
        if concatenated is not None:
            scores_node, sinks, probs = concatenated
        else:
            scores_node = node.args[0]
        source = _scores_source(scores_node)
        consumer = _probs_consumer(probs)
        if dim not in (-1, 3) or source is None or consumer is None:
            continue
        out, dropout = consumer
        if sinks is None:
            scaled = _scaled_by_sinks(_strip_casts(node.args[0]), out)
            if scaled is not None:
                end, sinks = scaled
        _fold(gm, source, out, end or out, float(dropout), sinks)
        folded += 1
    return folded_result(gm, folded)


def _fold(gm: fx.GraphModule, source: _Scores, out: fx.Node, end: fx.Node, dropout: float,
          sinks: fx.Node | None) -> None:
    """Replace ``end`` (the attention's output) with one SDPA-form call over ``source``'s q, k and ``out``'s v."""
    graph = gm.graph
    with graph.inserting_before(end):
        mask = source.added
        if source.hidden is not None:  # masked_fill(hidden): keys hidden, with or without an added bias
            mask = graph.call_function(torch.logical_not, (source.hidden,)) if mask is None else \
                graph.call_function(torch.where, (source.hidden, -math.inf, mask))
        kwargs: dict[str, Any] = {"attn_mask": mask, "dropout_p": dropout, "is_causal": False,
                                  "scale": source.scale}
        target: Any = F.scaled_dot_product_attention
        if source.softcap or sinks is not None:
            target = extended_attention
            kwargs.update({"softcap": source.softcap} if source.softcap else {})
            kwargs.update({"sinks": sinks} if sinks is not None else {})
        attention = graph.call_function(target, (source.q, source.k, out.args[1]), kwargs)
    attention.meta.update(out.meta)
    end.replace_all_uses_with(attention)


def unrecognised_softmaxes(gm: fx.GraphModule) -> list[fx.Node]:
    """Softmaxes over the last dim of a 4-D tensor that no fold turned into attention (a form the passes do not
    know), for the packed pass's error message."""
    return [n for n in gm.graph.nodes if _is_call(n, _SOFTMAX, ("softmax",)) and len(_shape(n) or ()) == 4]
