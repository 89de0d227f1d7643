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
is the cost model's micro-batch of its scheme ``(tp, 1, cp)``, the exposed K/V exchange included. That is
``regrouped.regrouped_schedule`` on the homogeneous layout of ``base`` (hydraulis' regrouped plans use it on
its pool's layouts too).
"""

from __future__ import annotations

import numpy as np

from passes.plan.ir import CostModel, ParallelScheme, PlanError, Strategy
from passes.plan.placement import group_aligns
from passes.plan.regrouped import RegroupedPlan, cp_size, regrouped_schedule, with_cp

__all__ = ["cp_bases", "cp_size", "dynamic_cp_schedule", "homogeneous_cp_strategy"]


def _check_base(cost_model: CostModel, base: ParallelScheme, gpus: int) -> int:
    if base.cp != 1 or base.pp != 1:
        raise PlanError(f"dynamic-cp needs a base scheme without CP or pipeline, got {base.describe()}")
    if cost_model.max_tokens(base) <= 0:
        raise PlanError(f"dynamic-cp base {base.describe()} holds no token")
    if gpus % base.gpus:
        raise PlanError(f"{gpus} GPUs cannot be cut into slots of {base.describe()} ({base.gpus} GPUs each)")
    return gpus // base.gpus


def dynamic_cp_schedule(cost_model: CostModel, gpus: int, base: ParallelScheme,
                        seq_lens: list[int]) -> RegroupedPlan:
    """The dynamic-cp schedule of one batch (module docstring): ``regrouped.regrouped_schedule`` on the
    homogeneous layout of ``base``, each sequence its least CP size. A sequence whose CP size needs more slots
    than the cluster has, or a CP scheme the cost model lacks, is a PlanError naming it."""
    slots = _check_base(cost_model, base, gpus)
    sizes = [cp_size(cost_model, base, s) for s in seq_lens]
    if max(sizes) > slots:
        i = int(np.argmax(sizes))
        raise PlanError(f"dynamic-cp: a sequence of {seq_lens[i]} tokens needs cp={sizes[i]} groups of "
                        f"{base.describe()}, the cluster has {slots}")
    return regrouped_schedule(cost_model, Strategy.homogeneous(base, gpus), seq_lens)


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
    return Strategy.homogeneous(with_cp(base, cp_size(cost_model, base, longest)), gpus)
