"""Context parallelism (CP) as a heterogeneous axis of the planner: which CP schemes exist and what they cost.

A replica ``(tp, pp, cp)`` splits every sequence over ``cp`` groups of ``tp`` GPUs per stage (the causal
load-balanced layout: each CP rank holds two mirrored chunks, so every rank gets the same attention work). Its
cost per stage is derived from the profiled ``(tp, pp)`` scheme as the runtime computes it
(``passes.graph.context_parallel.cp_attention``): the attention (``a``) and linear (``b``) terms divided by
``cp``, the fixed term ``c`` kept (every rank pays it), and the K/V exchange: per layer and micro-batch each
rank all-gathers the K/V of the other ``cp - 1`` ranks' shares before its attention and reduce-scatters their
gradients after its backward (two passes of ``(cp - 1) / cp`` of the micro-batch's K/V, the rank's ``1/tp`` of
the kv heads, bf16), over the slowest link of the group (inside a node when ``tp * cp`` fits in one, else one
network port per GPU), ``cp - 1`` message start-ups per pass (a ring collective). The runtime pipelines the
exchange over :func:`kv_splits` groups of the rank's kv heads (``passes.graph.kv_exchange``): a group's
attention waits only for its own K/V, so the first group's exchange is exposed and the rest runs beside the
attention. The exposed share (``1/splits`` of the bytes, one group's start-ups) is charged in ``b`` and ``c``;
the rest is :attr:`SchemeCost.exchange`, which costs a sequence ``max(a s^2, exchange s)`` with its attention
(what stays exposed when the exchange is longer than the attention), plus ``Links.overlap_slowdown`` of it in
``b`` (the attention slowed by the transfers beside it). The model keeps forward and backward together: the
forward's gather runs beside a third of the attention, so where the exchange is more than two thirds of the
attention this under-counts what the forward exposes. A rank with one kv head (GQA at high TP) cannot split:
its exchange is charged in full. A profile that measured a CP scheme (``hcompile profile --cp``) gives
its cost directly and is used as it is. The memory model already divides the activations per token by ``cp``
(``cost_model.max_tokens_for``); the gathered K/V of one layer are not counted.

Which CP schemes the planner considers (``cp_schemes``): profiled schemes without pipeline stages as the
base, ``cp`` a power of two, the ``tp * cp`` ranks of a stage inside one node or on whole nodes, up to the
least ``cp`` that holds the data's longest sequence. ``mode`` ``auto`` (the default) adds them only when
some sequence is longer than every scheme without CP holds, so data that fits plans exactly as before.
"""

from __future__ import annotations

from dataclasses import replace

from passes.plan.cost_model import Profile, RuntimeMemory, max_tokens_for
from passes.plan.ir import CostModel, ParallelScheme, PlanError, SchemeCost, Strategy
from passes.plan.links import Links
from passes.plan.placement import group_aligns

__all__ = ["CP_MODES", "KV_BYTES", "KV_SPLITS", "kv_splits", "ceil_pow2", "cp_cost", "cp_schemes", "needs_cp",
           "with_context_parallel"]

CP_MODES = ("auto", "on", "off")
"""``auto``: CP schemes only when a sequence is longer than every other scheme holds; ``on``: always; ``off``:
never."""
KV_BYTES = 2
"""Bytes of one K or V element in the exchange (bf16)."""
_EXCHANGE_PASSES = 2
"""The K/V all-gathered in the forward, their gradients reduce-scattered in the backward."""
KV_SPLITS = 4
"""Head groups the runtime pipelines the K/V exchange over, at most (``passes.graph.kv_exchange``; fewer where
a rank's kv heads do not divide so)."""


def kv_splits(kv_heads: int, wanted: int = KV_SPLITS) -> int:
    """The head groups a rank with ``kv_heads`` key/value heads pipelines its exchange over: the largest divisor
    of ``kv_heads`` that is at most ``wanted`` (1: one all-gather, nothing pipelined)."""
    if kv_heads < 1 or wanted < 1:
        raise ValueError(f"kv_heads={kv_heads} and wanted={wanted} must be >= 1")
    return max(d for d in range(1, min(kv_heads, wanted) + 1) if kv_heads % d == 0)


def ceil_pow2(x: float) -> int:
    """The least power of two >= ``x`` (1 for ``x <= 1``)."""
    n = 1
    while n < x:
        n *= 2
    return n


def _kv_width(profile: Profile) -> float:
    """K (or V) elements per token per layer: the hidden size times kv heads over heads (as many kv heads as
    heads where the profile does not say)."""
    if profile.heads is None or profile.kv_heads is None:
        return float(profile.hidden)
    return profile.hidden * profile.kv_heads / profile.heads


def _local_kv_heads(profile: Profile, tp: int) -> int:
    """Key/value heads on one rank of a TP group of ``tp`` (at least one: kv heads fewer than ``tp`` are
    replicated); 1 where the profile gives no head counts, so that nothing is assumed pipelined."""
    if profile.heads is None:
        return 1
    return max(1, (profile.kv_heads or profile.heads) // tp)


def cp_cost(profile: Profile, base: SchemeCost, cp: int, links: Links, layout: Strategy,
            runtime: RuntimeMemory | None = None) -> SchemeCost:
    """The cost of ``base``'s scheme with ``cp`` CP ranks per TP rank (module docstring): ``a/cp``; ``b/cp`` plus
    the exposed share of the K/V exchange per token from ``links`` (one of the rank's :func:`kv_splits` head
    groups) and the slowdown the rest costs the attention it runs beside (``Links.overlap_slowdown``); the rest
    as :attr:`SchemeCost.exchange`; ``c`` plus one head group's start-ups; ``max_tokens`` from the memory model
    under ``layout`` (``runtime`` as in ``cost_model.state_bytes``). A recomputing base (``rc``, already charged for
    it): the forward's gather runs again in the recomputation (three passes of the exchange, not two)."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 2:
        raise PlanError(f"a CP degree must be an integer >= 2, got {cp!r}")
    b = base.scheme
    if b.cp != 1:
        raise PlanError(f"the base of a CP scheme must have cp=1, got {b.describe()}")
    scheme = replace(b, cp=cp)
    layers = profile.layers / b.pp
    same_node = b.tp * cp <= links.gpus_per_node
    gbps = links.intra_gbps if same_node else links.inter_gbps
    exchange_passes = _EXCHANGE_PASSES + (1 if b.rc else 0)
    per_token = exchange_passes * (cp - 1) / cp * 2 * _kv_width(profile) / b.tp * KV_BYTES  # bytes per layer
    exchange = layers * per_token / (gbps * 1e6)
    splits = kv_splits(_local_kv_heads(profile, b.tp))
    hidden = exchange * (splits - 1) / splits
    startups = layers * exchange_passes * (cp - 1) * links.latency_us * 1e-3
    return SchemeCost(scheme=scheme, a=base.a / cp,
                      b=base.b / cp + exchange / splits + links.overlap_slowdown * hidden, c=base.c + startups,
                      max_tokens=max_tokens_for(profile, scheme, layout, runtime), exchange=hidden, shape=base.shape)


def _no_cp_caps(cost_model: CostModel, gpus: int) -> list[int]:
    return [cost_model.max_tokens(s) for s in cost_model.schemes
            if s.cp == 1 and s.gpus <= gpus and group_aligns(s.tp, cost_model.gpus_per_node)]


def needs_cp(cost_model: CostModel, gpus: int, longest: int) -> bool:
    """Whether a sequence of ``longest`` tokens is longer than every usable scheme without CP holds."""
    return longest > max(_no_cp_caps(cost_model, gpus), default=0)


def cp_schemes(cost_model: CostModel, gpus: int, longest: int) -> list[tuple[ParallelScheme, int]]:
    """(base scheme, cp) of every CP scheme to consider (module docstring); ``cp`` goes up to the least
    power of two that holds ``longest`` on that base (at least 2)."""
    gpn = cost_model.gpus_per_node
    out = []
    for base in cost_model.schemes:
        cap = cost_model.max_tokens(base)
        if base.cp != 1 or base.pp != 1 or cap <= 0 or not group_aligns(base.tp, gpn):
            continue
        top = max(2, ceil_pow2(longest / cap))
        cp = 2
        while cp <= top and base.tp * cp <= gpus:
            if group_aligns(base.tp * cp, gpn):
                out.append((base, cp))
            cp *= 2
    return out


def with_context_parallel(cost_model: CostModel, profile: Profile, links: Links | None, gpus: int, longest: int,
                          layout: Strategy, runtime: RuntimeMemory | None = None, mode: str = "auto") -> CostModel:
    """``cost_model`` with the CP schemes of :func:`cp_schemes` added (``mode`` of :data:`CP_MODES`; ``auto``
    adds them only when :func:`needs_cp`; ``links`` None is an error only then); schemes it already knows are
    kept as they are (a recomputing base gives a recomputing CP scheme)."""
    if mode not in CP_MODES:
        raise PlanError(f"unknown context-parallel mode {mode!r}; expected one of {', '.join(CP_MODES)}")
    if mode == "off" or (mode == "auto" and not needs_cp(cost_model, gpus, longest)):
        return cost_model
    if links is None:
        raise PlanError(f"context parallelism needs the links of {profile.name} (its profile gives none and its "
                        f"hardware has no preset); plan with --context-parallel off")
    known = {e.scheme for e in cost_model.entries}
    added = []
    for base, cp in cp_schemes(cost_model, gpus, longest):
        entry = cp_cost(profile, cost_model.cost(base), cp, links, layout, runtime)
        if entry.scheme not in known:
            added.append(entry)
    return replace(cost_model, name=f"{cost_model.name} with CP", entries=(*cost_model.entries, *added))
