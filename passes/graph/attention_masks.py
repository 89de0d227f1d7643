"""Attention masks: what a mask built from positions keeps, found by evaluating it, and whether the packed op can
compute the same for every sequence the run trains.

Owns :class:`MaskLimits` (causal within each sequence, plus an optional left window and chunk: what the packed
kernels take), the evaluation of a mask subgraph on the CPU for chosen packed positions
(:func:`evaluate_mask`), the fit of an evaluated mask to limits (:func:`fit_limits`, exact or an explanation of
what else the mask does), :func:`classify_mask` (one attention's mask in one capture) and
:func:`decide_attention_limits` (every attention's limits, decided once on the captures of every token bucket a
run compiles, checked for the longest sequence it trains), and the position helpers the packed rewrite shares
(:func:`packed_positions`, :func:`find_position_aranges`, :func:`index_aranges`).

A capture of T tokens holds the mask for T tokens. Evaluated on one sequence of all T tokens it shows, for every
query, the keys it keeps; evaluated on several packed sequences (positions restarting at 0) it shows that each
sequence's block is the same mask again. Limits fit when every row keeps a contiguous run of keys that ends at
itself and starts where a window ``W`` (keys i - W .. i) and chunks of ``C`` (keys of i's chunk) say. A window
or chunk no shorter than the capture cannot show in it: the limits are decided on the largest bucket, every
smaller bucket must agree with them, and where a sequence can be longer than the bucket (context parallelism)
an integer the mask compares positions with that lies between the two is a refusal, since the capture cannot
show what it does.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import fx

from passes.graph.analyze import SDPA_TARGETS, attention_sites
from passes.graph.pass_runner import PassError
from passes.graph.sharding import where
from passes.plan.ir import AttentionShape

__all__ = ["MaskLimits", "packed_positions", "find_position_aranges", "index_aranges", "evaluate_mask", "fit_limits",
           "limits_mismatch", "classify_mask", "decide_attention_limits", "attention_shape", "sdpa_arg", "where"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MaskLimits:
    """What an attention keeps of each sequence: causal, within a left window and within chunks."""

    window: int | None = None
    """Keys i - window .. i stay visible to query i (None: no window). Hugging Face's ``sliding_window`` S is
    window S - 1."""
    chunk: int | None = None
    """Only the keys of query i's chunk of ``chunk`` positions (i // chunk) stay visible (None: no chunks)."""

    def __post_init__(self) -> None:
        if self.window is not None and (not isinstance(self.window, int) or self.window < 0):
            raise ValueError(f"window must be None or an int >= 0, got {self.window!r}")
        if self.chunk is not None and (not isinstance(self.chunk, int) or self.chunk < 1):
            raise ValueError(f"chunk must be None or an int >= 1, got {self.chunk!r}")

    @property
    def longest(self) -> int:
        """The largest window or chunk, 0 when neither: a sequence longer than this shows both."""
        return max(self.window or 0, self.chunk or 0)

    def first_keys(self, positions: torch.Tensor) -> torch.Tensor:
        """The first visible key of each query position (the last is the position itself)."""
        lo = torch.zeros_like(positions)
        if self.window is not None:
            lo = torch.maximum(lo, positions - self.window)
        if self.chunk is not None:
            lo = torch.maximum(lo, torch.div(positions, self.chunk, rounding_mode="floor") * self.chunk)
        return lo

    def describe(self) -> str:
        """``causal``, ``causal, window 4095``, ``causal, chunks of 8192``, ..."""
        parts = ["causal"]
        if self.window is not None:
            parts.append(f"window {self.window}")
        if self.chunk is not None:
            parts.append(f"chunks of {self.chunk}")
        return ", ".join(parts)


def sdpa_arg(node: fx.Node, name: str, default: Any = None) -> Any:
    """An argument of an SDPA-form call by name (positional or keyword)."""
    position = {"attn_mask": 3, "dropout_p": 4, "is_causal": 5, "scale": 6}[name]
    return node.kwargs.get(name, node.args[position] if len(node.args) > position else default)


def packed_positions(cu_seqlens: torch.Tensor, total: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """(total,) index of every token inside its own sequence; ``cu_seqlens[-1]`` must equal ``total``."""
    offsets = cu_seqlens.to(torch.long)
    token = torch.arange(total, device=cu_seqlens.device)  # (T,)
    seq = torch.searchsorted(offsets[1:], token, right=True)  # (T,) sequence of each token
    return (token - offsets[seq]).to(dtype)


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


_METADATA_METHODS = ("new_ones", "new_zeros", "new_full", "new_empty", "size", "dim")


def index_aranges(gm: fx.GraphModule, total: int) -> list[fx.Node]:
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


def _mentions(index: Any, nodes: set) -> bool:
    found = []
    fx.node.map_arg(index, lambda a: found.append(a) or a)
    return any(a in nodes for a in found)


def _fetch_attr(gm: fx.GraphModule, name: str) -> torch.Tensor:
    obj: Any = gm
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _on_cpu(value: Any) -> Any:
    return torch.device("cpu") if isinstance(value, torch.device) else value


def _subgraph(target: fx.Node, stop: set[fx.Node]) -> list[fx.Node]:
    """The nodes ``target`` is computed from (not looking past ``stop``), in graph order."""
    needed, stack = set(), [target]
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            if n not in stop:
                stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(target.graph.nodes)}
    return sorted(needed, key=order.__getitem__)


def evaluate_from_positions(gm: fx.GraphModule, target: fx.Node, total: int, offsets: Sequence[int]) -> Any:
    """``target`` computed on the CPU for a packed batch with boundaries ``offsets``: position aranges give
    each token's index in its sequence, index aranges stay plain; a graph input on the way is a PassError."""
    cu = torch.tensor(list(offsets), dtype=torch.int32)
    positions = set(find_position_aranges(gm, total)) - set(index_aranges(gm, total))
    env: dict[fx.Node, Any] = {}
    for n in _subgraph(target, positions):
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


def evaluate_mask(gm: fx.GraphModule, sdpa: fx.Node, total: int, offsets: Sequence[int]) -> torch.Tensor:
    """The (T, T) boolean of the keys ``sdpa``'s mask keeps (True: visible) for packed sequences with boundaries
    ``offsets``, as the model computes it; a PassError says why the mask is none the packed op can take (read
    from the inputs, a bias rather than a mask, different per head or batch row)."""
    mask = sdpa_arg(sdpa, "attn_mask")
    if not isinstance(mask, fx.Node):
        raise PassError(f"packed attention: {where(sdpa)} passes a constant attention mask; only masks built from "
                        "positions are supported")
    try:
        value = evaluate_from_positions(gm, mask, total, offsets)
    except PassError as exc:
        raise PassError(f"packed attention: {where(sdpa)} passes an attention mask that is not built from "
                        f"positions alone ({exc}); only masks built from positions are supported") from None
    if value.dtype == torch.bool:
        keep = value
    else:
        hidden = value <= torch.finfo(value.dtype).min / 2  # -inf, or the dtype's lowest (eager masks)
        if bool((~hidden & (value != 0)).any()):
            raise PassError(f"packed attention: {where(sdpa)} adds a bias to the scores (values other than 0 and "
                            f"-inf, e.g. {_a_bias(value, hidden)}), as ALiBi does: a position bias is not supported "
                            "(use a model with rotary or learned positions)")
        keep = ~hidden
    keep = keep.reshape(-1, total, total)
    if keep.shape[0] > 1 and not bool((keep == keep[:1]).all()):
        raise PassError(f"packed attention: {where(sdpa)} passes a mask that differs between heads or batch rows; "
                        "not supported")
    return keep[0]


def _a_bias(value: torch.Tensor, hidden: torch.Tensor) -> str:
    shown = value[~hidden & (value != 0)]
    return f"{float(shown.flatten()[0]):.4g}"


def fit_limits(visible: torch.Tensor) -> MaskLimits | str:
    """The limits a (T, T) mask of one sequence keeps, or what it does instead (a sentence). Exact: the mask must
    be causal, keep each query itself and one run of keys ending there, starting where the limits say."""
    total = visible.shape[0]
    if total == 0:
        return MaskLimits()
    later = visible.triu(1)
    if bool(later.any()):
        row, col = (int(x) for x in later.nonzero()[0])
        return f"is not causal: query {row} sees the later key {col}"
    diagonal = visible.diagonal()
    if not bool(diagonal.all()):
        row = int((~diagonal).nonzero()[0])
        return f"hides query {row} from itself"
    positions = torch.arange(total)
    first = visible.to(torch.uint8).argmax(dim=1)  # each row's first visible key
    if not bool((visible.sum(dim=1) == positions - first + 1).all()):
        row = int((visible.sum(dim=1) != positions - first + 1).nonzero()[0])
        return f"keeps keys of query {row} that are not one run ending at it ({_keys(visible[row])})"
    seen = positions - first  # keys before each query
    widest = int(seen.max())
    window_only = MaskLimits(window=widest if widest < total - 1 else None)
    if bool((window_only.first_keys(positions) == first).all()):
        return window_only
    restarts = ((seen == 0) & (positions > 0)).nonzero()
    if restarts.numel():
        chunk = int(restarts[0])
        limits = MaskLimits(window=widest if widest < chunk - 1 else None, chunk=chunk)
        if bool((limits.first_keys(positions) == first).all()):
            return limits
    row = int((window_only.first_keys(positions) != first).nonzero()[0])
    return f"keeps for query {row} the keys {_keys(visible[row])}, which no window or chunk gives"


def _keys(row: torch.Tensor) -> str:
    """The visible keys of one row as ranges, e.g. ``0-3, 8-11``."""
    idx = row.nonzero().flatten().tolist()
    runs: list[list[int]] = []
    for i in idx:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs[:4])
    return text + (", ..." if len(runs) > 4 else "")


def limits_mismatch(visible: torch.Tensor, limits: MaskLimits) -> str | None:
    """None when a (L, L) mask of one sequence is exactly ``limits`` on it, else the first query that differs."""
    fitted = fit_limits(visible)
    if isinstance(fitted, str):
        return fitted
    positions = torch.arange(visible.shape[0])
    differ = (fitted.first_keys(positions) != limits.first_keys(positions)).nonzero()
    if differ.numel() == 0:
        return None
    row = int(differ[0])
    return f"keeps for query {row} the keys {_keys(visible[row])}, where {limits.describe()} keeps from " \
           f"{int(limits.first_keys(positions[row:row + 1])[0])}"


def _probe_offsets(total: int) -> list[int]:
    """Boundaries of a few uneven sequences filling ``total`` tokens (one sequence when total < 4)."""
    cuts = sorted({max(1, total // 3), max(1, total // 3 + total // 4), max(1, total - total // 6)} - {total})
    return [0, *[c for c in cuts if 0 < c < total], total]


def classify_mask(gm: fx.GraphModule, sdpa: fx.Node, total: int) -> MaskLimits:
    """The limits of ``sdpa`` (an SDPA-form call on a batch-1 capture of ``total`` tokens): causal without a mask,
    else its mask evaluated on one sequence of all ``total`` tokens, and checked on a probe of several packed
    sequences to keep the same limits in each. A PassError names the attention and what its mask does."""
    if sdpa_arg(sdpa, "attn_mask") is None:
        if sdpa_arg(sdpa, "is_causal") is not True:
            raise PassError(f"packed attention: {where(sdpa)} is not causal; only causal attention is supported")
        return MaskLimits()
    whole = evaluate_mask(gm, sdpa, total, [0, total])
    fitted = fit_limits(whole)
    if isinstance(fitted, str):
        raise PassError(f"packed attention: {where(sdpa)} passes an attention mask that {fitted}; only causal "
                        "masks, within a window or chunks, are supported")
    offsets = _probe_offsets(total)
    packed = evaluate_mask(gm, sdpa, total, offsets)
    for a, b in zip(offsets[:-1], offsets[1:]):
        differs = limits_mismatch(packed[a:b, a:b], fitted)
        if differs:
            raise PassError(f"packed attention: {where(sdpa)} passes an attention mask that, on a sequence of "
                            f"{b - a} tokens packed at token {a} of {total}, {differs} (alone: {fitted.describe()}); "
                            "the mask must depend on positions within each sequence only")
    return fitted


_COMPARED = (operator.add, operator.sub, operator.lt, operator.le, operator.gt, operator.ge, operator.floordiv,
             operator.mod, torch.add, torch.sub, torch.lt, torch.le, torch.gt, torch.ge, torch.floor_divide,
             torch.remainder, torch.div)
_COMPARED_METHODS = ("add", "sub", "lt", "le", "gt", "ge", "floor_divide", "remainder", "div", "__floordiv__")


def _mask_constants(sdpa: fx.Node) -> set[int]:
    """Integers the mask's arithmetic and comparisons use (window and chunk sizes), sizes and shapes left out."""
    mask = sdpa_arg(sdpa, "attn_mask")
    if not isinstance(mask, fx.Node):
        return set()
    found: set[int] = set()
    for n in _subgraph(mask, set()):
        if (n.op == "call_function" and n.target in _COMPARED) or \
                (n.op == "call_method" and n.target in _COMPARED_METHODS):
            found.update(abs(a) for a in (*n.args, *n.kwargs.values())
                         if isinstance(a, int) and not isinstance(a, bool) and abs(a) >= 2)
    return found


def decide_attention_limits(captures: Sequence[fx.GraphModule], longest: int) -> dict[str, MaskLimits]:
    """Every attention's limits (by node name), decided on the last (largest) of ``captures`` (canonical batch-1
    graphs of the model at each token bucket a run compiles, ascending) and checked against each of them; a
    PassError when a bucket's mask disagrees, when a mask is none the packed op takes, or when sequences of up to
    ``longest`` tokens (longer than the largest capture under context parallelism) could meet a limit no capture
    shows."""
    if not captures:
        raise ValueError("decide_attention_limits needs at least one capture")
    decided: dict[str, MaskLimits] = {}
    largest = captures[-1]
    total = _tokens(largest)
    for node in _attention_nodes(largest):
        limits = classify_mask(largest, node, total)
        if longest > total and (limits.window is None or limits.chunk is None):
            unseen = sorted(c for c in _mask_constants(node) if total - 1 <= c < longest)
            if unseen:
                raise PassError(f"packed attention: {where(node)} compares positions with {unseen[0]} in its mask, "
                                f"which could limit attention beyond the {total} tokens it was checked at; "
                                f"sequences of up to {longest} tokens train here (context parallelism): compile a "
                                f"largest token bucket of more than {unseen[0] + 1} tokens or train without it")
        decided[node.name] = limits
    for gm in captures[:-1]:
        _check_agrees(gm, decided)
    return decided


def _check_agrees(gm: fx.GraphModule, decided: Mapping[str, MaskLimits]) -> None:
    """Each attention of a smaller bucket's capture keeps what the decided limits keep at its length."""
    total = _tokens(gm)
    for node in _attention_nodes(gm):
        if node.name not in decided:
            raise PassError(f"packed attention: {where(node)} is in the capture of {total} tokens but not in the "
                            "largest bucket's; the captures differ")
        local = classify_mask(gm, node, total)
        positions = torch.arange(total)
        if not bool((local.first_keys(positions) == decided[node.name].first_keys(positions)).all()):
            raise PassError(f"packed attention: {where(node)} keeps {local.describe()} in the capture of {total} "
                            f"tokens but {decided[node.name].describe()} in the largest bucket's; the mask depends "
                            "on the micro-batch's size, which packing changes: not supported")


def _attention_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]


def _tokens(gm: fx.GraphModule) -> int:
    """The capture's tokens: the query length of its attention (its input's last dim without one)."""
    sites = _attention_nodes(gm)
    if sites:
        return int(sites[0].args[0].meta["val"].shape[-2])
    return int(next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"].shape[-1])


def attention_shape(canonical: fx.GraphModule, limits: Mapping[str, MaskLimits]) -> AttentionShape:
    """How the model's attention work grows with a sequence's length: each attention site of ``canonical``
    weighs its heads times head dim, and the sites ``limits`` gives a window or chunk are that share of the
    work, grouped by their limits (what the cost model charges, ``passes.plan.ir.AttentionShape``)."""
    sites = attention_sites(canonical)
    total = sum(site.heads * site.head_dim for site in sites)
    shares: dict[tuple[int | None, int | None], float] = {}
    for site in sites:
        found = limits.get(site.node)
        if found is not None and (found.window is not None or found.chunk is not None):
            key = (found.window, found.chunk)
            shares[key] = shares.get(key, 0.0) + site.heads * site.head_dim / total
    return AttentionShape(limited=tuple((share, w, c) for (w, c), share in sorted(
        shares.items(), key=lambda kv: (kv[0][0] is None, kv[0][0] or 0, kv[0][1] or 0))))
