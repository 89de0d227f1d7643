"""Rank placement of a strategy's replicas: contiguous ranks, larger replicas first, so that every TP group
stays inside one node or spans whole nodes. The runtime's topology-aware placement refines this; the
planner needs only a valid, deterministic assignment."""

from __future__ import annotations

from passes.plan.ir import CostModel, ParallelScheme, PlanError, ReplicaPlan, Strategy

__all__ = ["assign_ranks", "placed_replicas", "group_aligns", "placeable", "too_long_error", "tp_group_fits",
           "usable_schemes"]


def tp_group_fits(first_rank: int, group_size: int, gpus_per_node: int) -> bool:
    """True when ranks ``first_rank .. first_rank+group_size-1`` lie in one node or cover whole nodes."""
    if group_size <= gpus_per_node:
        return first_rank // gpus_per_node == (first_rank + group_size - 1) // gpus_per_node
    return first_rank % gpus_per_node == 0 and group_size % gpus_per_node == 0


def assign_ranks(strategy: Strategy, gpus_per_node: int) -> tuple[tuple[int, ...], ...]:
    """Global ranks of each replica in ``strategy.replicas()`` order, stage-major within a replica."""
    placed: list[tuple[int, ...]] = []
    start = 0
    for scheme in strategy.replicas():
        _check_replica(scheme, start, gpus_per_node, strategy)
        placed.append(tuple(range(start, start + scheme.gpus)))
        start += scheme.gpus
    return tuple(placed)


def placed_replicas(strategy: Strategy, gpus_per_node: int,
                    micro_batches: tuple[tuple[tuple[int, ...], ...], ...] | None = None,
                    max_tokens: tuple[int, ...] | None = None) -> tuple[ReplicaPlan, ...]:
    """The replicas of ``strategy`` where :func:`assign_ranks` puts them, with the given micro-batches and caps
    (none and 1 token by default): the placement of a plan, before (or without) its data."""
    n = len(strategy.replicas())
    micro_batches = micro_batches or ((),) * n
    max_tokens = max_tokens or (1,) * n
    return tuple(ReplicaPlan(scheme=s, ranks=r, micro_batches=mb, max_tokens=m, est_ms=0.0) for s, r, mb, m in
                 zip(strategy.replicas(), assign_ranks(strategy, gpus_per_node), micro_batches, max_tokens))


def _check_replica(scheme: ParallelScheme, start: int, gpus_per_node: int, strategy: Strategy) -> None:
    group = scheme.tp * scheme.cp
    for stage in range(scheme.pp):
        first = start + stage * group
        if not tp_group_fits(first, group, gpus_per_node):
            raise PlanError(
                f"strategy {strategy.describe()} cannot be placed on nodes of {gpus_per_node} GPUs: the TP group "
                f"of {group} GPUs of a {scheme.describe()} replica would sit on ranks {first}..{first + group - 1}"
            )



def group_aligns(group: int, gpus_per_node: int) -> bool:
    """A TP group of ``group`` GPUs tiles nodes: it divides a node, or spans whole nodes."""
    return (group <= gpus_per_node and gpus_per_node % group == 0) or group % gpus_per_node == 0


def usable_schemes(cost_model: CostModel, gpus: int) -> list[ParallelScheme]:
    """Schemes that hold a token, fit in ``gpus`` and whose TP groups tile the nodes."""
    gpn = cost_model.gpus_per_node
    return [s for s in cost_model.schemes if s.gpus <= gpus and group_aligns(s.tp * s.cp, gpn)]


def placeable(strategy: Strategy, gpus_per_node: int) -> bool:
    """Whether ``assign_ranks`` succeeds, checked in time independent of the replica count: placement
    repeats with period ``gpus_per_node`` within a run of equal replicas."""
    start = 0
    for scheme, count in strategy.parts:
        group = scheme.tp * scheme.cp
        for j in range(min(count, gpus_per_node)):
            first = start + j * scheme.gpus
            if not all(tp_group_fits(first + k * group, group, gpus_per_node) for k in range(scheme.pp)):
                return False
        start += count * scheme.gpus
    return True


def too_long_error(cost_model: CostModel, gpus: int, seq_len: int) -> PlanError:
    """The error for a sequence no usable scheme holds, naming its length and the longest supported."""
    supported = max((cost_model.max_tokens(s) for s in usable_schemes(cost_model, gpus)), default=0)
    return PlanError(f"a sequence of {seq_len} tokens is longer than every scheme can hold on {gpus} GPUs "
                     f"(longest supported: {supported} tokens)")
