"""The ``dynamic-cp`` baseline: Megatron-Core's dynamic (hybrid) context parallelism, on the planner's cost model.

One TP scheme for the whole job (``base``: tp GPUs, no pipeline) makes ``gpus / tp`` DP x CP slots. Each
sequence gets its own CP size, ``ceil_pow2(length / cap)`` with ``cap`` the base scheme's per-rank token cap
(Megatron's ``max_seqlen_per_dp_cp_rank``), and runs on an aligned block of that many slots (a CP group of
``tp * cp`` ranks, inside a node or on whole nodes); sequences that fit one slot are packed on single slots.
Groups form per sequence, so ranks regroup during the step (``StepPlan.regrouped``). The schedule balances
estimated time: the CP sequences longest first, each on the aligned block that is free earliest (it starts
when all its slots are free: the group waits for its slowest member); then the one-slot sequences, longest
first, onto the slot that finishes earliest (their time with the per-micro-batch cost shared by tokens), each
slot's share packed into micro-batches by the planner's own packing (``assign.pack_replica``). A group's time
is the cost model's micro-batch of its scheme ``(tp, 1, cp)``, the exposed K/V exchange included.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from passes.plan.assign import Kind, pack_replica
from passes.plan.context_parallel import ceil_pow2
from passes.plan.ir import CostModel, ParallelScheme, PlanError, ReplicaPlan, Strategy
from passes.plan.placement import group_aligns

__all__ = ["RegroupedSchedule", "cp_bases", "cp_size", "dynamic_cp_schedule", "homogeneous_cp_strategy"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RegroupedSchedule:
    """A dynamic-cp step: its groups in the order they start, and its makespan."""

    replicas: tuple[ReplicaPlan, ...]
    """One per CP group (one sequence each), one per slot that runs one-slot sequences and one per slot left
    idle; ranks repeat, each rank's groups in the order it runs them."""
    makespan_ms: float
    """When the last slot finishes."""


def cp_size(cost_model: CostModel, base: ParallelScheme, seq_len: int) -> int:
    """The CP size of one sequence: ``ceil_pow2(seq_len / cap)``, doubled while the cost model's cap of
    ``(tp, 1, cp)`` is below ``seq_len`` (the caps are rounded to 128 tokens)."""
    cp = ceil_pow2(seq_len / cost_model.max_tokens(base))
    while cp > 1 and cost_model.max_tokens(_with_cp(base, cp)) < seq_len:
        cp *= 2
    return cp


def _with_cp(base: ParallelScheme, cp: int) -> ParallelScheme:
    return base if cp == 1 else ParallelScheme(tp=base.tp, pp=base.pp, cp=cp)


def _check_base(cost_model: CostModel, base: ParallelScheme, gpus: int) -> int:
    if base.cp != 1 or base.pp != 1:
        raise PlanError(f"dynamic-cp needs a base scheme without CP or pipeline, got {base.describe()}")
    if cost_model.max_tokens(base) <= 0:
        raise PlanError(f"dynamic-cp base {base.describe()} holds no token")
    if gpus % base.gpus:
        raise PlanError(f"{gpus} GPUs cannot be cut into slots of {base.describe()} ({base.gpus} GPUs each)")
    return gpus // base.gpus


def dynamic_cp_schedule(cost_model: CostModel, gpus: int, base: ParallelScheme,
                        seq_lens: list[int]) -> RegroupedSchedule:
    """The dynamic-cp schedule of one batch (module docstring); a sequence whose CP size needs more slots
    than the cluster has, or a CP scheme the cost model lacks, is a PlanError naming it."""
    slots = _check_base(cost_model, base, gpus)
    sizes = [cp_size(cost_model, base, s) for s in seq_lens]
    if max(sizes) > slots:
        i = int(np.argmax(sizes))
        raise PlanError(f"dynamic-cp: a sequence of {seq_lens[i]} tokens needs cp={sizes[i]} groups of "
                        f"{base.describe()}, the cluster has {slots}")
    free = np.zeros(slots)
    groups: list[ReplicaPlan] = []
    long_ones = [i for i, cp in enumerate(sizes) if cp > 1]
    times = {i: cost_model.micro_batch_ms(_with_cp(base, sizes[i]), [seq_lens[i]]) for i in long_ones}
    for i in sorted(long_ones, key=lambda j: (-times[j], j)):
        cp = sizes[i]
        blocks = free[:slots - slots % cp].reshape(-1, cp).max(axis=1)
        b = int(np.argmin(blocks))
        end = float(blocks[b]) + times[i]
        free[b * cp:(b + 1) * cp] = end
        scheme = _with_cp(base, cp)
        ranks = tuple(range(b * cp * base.tp, (b + 1) * cp * base.tp))
        groups.append(ReplicaPlan(scheme=scheme, ranks=ranks, micro_batches=((i,),), est_ms=times[i],
                                  max_tokens=cost_model.max_tokens(scheme)))
    kind = Kind.of(cost_model, base)
    share: list[list[int]] = [[] for _ in range(slots)]
    load = free.copy()
    short = [i for i, cp in enumerate(sizes) if cp == 1]
    additive = {i: kind.seq_ms(seq_lens[i]) + kind.c * seq_lens[i] / kind.max_tokens for i in short}
    for i in sorted(short, key=lambda j: (-additive[j], j)):
        k = int(np.argmin(load))
        share[k].append(i)
        load[k] += additive[i]
    finish = free.copy()
    for k, members in enumerate(share):
        if members:
            bins, ms = pack_replica(kind, seq_lens, members)
            finish[k] += ms
            groups.append(ReplicaPlan(scheme=base, ranks=tuple(range(k * base.tp, (k + 1) * base.tp)), est_ms=ms,
                                      micro_batches=tuple(tuple(sorted(b)) for b in bins), max_tokens=kind.max_tokens))
    busy = {r for g in groups for r in g.ranks}
    for k in range(slots):  # a slot left without work still takes part in the step (its parameters, its push)
        ranks = tuple(range(k * base.tp, (k + 1) * base.tp))
        if ranks[0] not in busy:
            groups.append(ReplicaPlan(scheme=base, ranks=ranks, est_ms=0.0, micro_batches=(),
                                      max_tokens=kind.max_tokens))
    return RegroupedSchedule(replicas=tuple(groups), makespan_ms=float(finish.max()))


def cp_bases(cost_model: CostModel, gpus: int, longest: int) -> list[ParallelScheme]:
    """The TP schemes (no pipeline, no CP, TP groups tiling the nodes) the CP baselines can use on ``gpus``:
    those whose CP size for ``longest`` fits in the cluster, the cost model knowing that CP scheme."""
    out = []
    gpn = cost_model.gpus_per_node
    for base in cost_model.schemes:
        if base.cp != 1 or base.pp != 1 or gpus % base.gpus or not group_aligns(base.tp, gpn):
            continue
        try:
            cp = cp_size(cost_model, base, longest)
        except PlanError:  # the cost model lacks a CP scheme of the size this needs
            continue
        if cp * base.gpus <= gpus and gpus % (cp * base.gpus) == 0:
            out.append(base)
    return out


def homogeneous_cp_strategy(cost_model: CostModel, gpus: int, base: ParallelScheme, longest: int) -> Strategy:
    """The ``homogeneous-cp`` baseline's fixed strategy on ``base``: every replica ``(tp, 1, cp)`` with the CP
    size the dataset's longest sequence needs (what a user sets statically today)."""
    return Strategy.homogeneous(_with_cp(base, cp_size(cost_model, base, longest)), gpus)
