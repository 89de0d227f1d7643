"""Regrouped plans for hydraulis: heterogeneous TP replicas across the cluster, and inside each group of
same-scheme replicas (slots) context-parallel groups that re-form sequence by sequence within the step.

A *slot layout* is a strategy without CP (pp = 1): its replicas are slots, placed as the planner places any
strategy (``placement.assign_ranks``). A slot holds one TP slice of the weights for the whole step; an aligned
block of ``c`` slots of one scheme ``(tp)`` forms, for one sequence, a CP group ``(tp, cp=c)`` over their ranks
(slot after slot, so each CP rank's TP group is one slot and nothing moves between groups:
``StepPlan.slot_problem``). The schedule (:func:`regrouped_schedule`), by estimated time:

1. the sequences no slot holds alone, longest first: each on the option that finishes earliest, over every
   scheme of the layout that has enough slots, with the least power-of-two CP size that holds it
   (:func:`cp_size`), and, where the slots do not recompute and the cost model knows their recomputing twin,
   with the least that holds it recomputing (a group of one slot included), on that scheme's aligned block that
   is free earliest (a group starts when all of its slots are free). Recomputation is so chosen group by
   group: a slot's parameter slice is the same either way, and its own micro-batches stay plain. The
   *thrifty* variant instead gives each such sequence its option of least GPU time (the group's time by its
   GPUs), the widest groups first: the earliest finish alone often takes a narrower recomputing group that
   starts sooner and spends a quarter more GPU time than the plain group twice its width;
2. the rest, longest first, onto the slot (of a scheme that holds it) that finishes it earliest, each charged its
   additive time on that slot's scheme; then each slot's share packed into micro-batches by the planner's own
   packing (``assign.pack_replica``).

Each slot runs its CP groups first, in the order they were placed, then its own micro-batches: the plan lists
the groups in that order (``StepPlan.regrouped``), which every rank follows. ``dynamic-cp`` is this schedule on
one homogeneous layout (its recomputing slots offer one option per sequence, as Megatron-Core's dynamic CP
takes the least CP size that holds it); hydraulis takes the best over the slot layouts of its pool
(``slot_layout``) and the variants of the schedule (:data:`VARIANTS`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from passes.plan.assign import Kind, pack_replica
from passes.plan.context_parallel import ceil_pow2
from passes.plan.ir import CostModel, ParallelScheme, PlanError, ReplicaPlan, Strategy
from passes.plan.placement import assign_ranks

__all__ = ["RegroupedPlan", "regrouped_schedule", "slot_layout", "cp_size", "with_cp", "VARIANTS"]

VARIANTS = ((False, False), (True, False), (False, True))
"""The (``widen``, ``thrifty``) variants of :func:`regrouped_schedule` hydraulis plans each slot layout with (both
at once never gave a shorter step on the long-context preset at 64, 128 and 1024 GPUs)."""

Option = tuple[ParallelScheme, int, float, ParallelScheme]
"""(slot scheme, CP size, time of the sequence on the group, the group's scheme: the slot scheme with that CP
size, recomputing or not)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RegroupedPlan:
    """One step's regrouped schedule on a slot layout."""

    layout: Strategy
    """The slots (a strategy without CP)."""
    replicas: tuple[ReplicaPlan, ...]
    """Every group in the order the ranks run them: the CP groups, then one per slot with its own micro-batches
    (an empty one for a slot left idle)."""
    slot_ms: tuple[float, ...]
    """Per slot (``layout.replicas()`` order), when it finishes: its waits for its groups' other slots
    included."""
    edges: tuple[tuple[float, float], ...]
    """Per slot, the estimated time of its first and of its last micro-batch (0, 0 for an idle slot)."""

    @property
    def makespan_ms(self) -> float:
        """When the last slot finishes."""
        return max(self.slot_ms, default=0.0)


def cp_size(cost_model: CostModel, base: ParallelScheme, seq_len: int) -> int:
    """The least CP size of one sequence on slots of ``base``: ``ceil_pow2(seq_len / cap)``, doubled while the
    cost model's cap of ``(tp, pp, cp)`` is below ``seq_len`` (the caps are rounded to 128 tokens); a CP scheme
    the cost model lacks is a PlanError."""
    cp = ceil_pow2(seq_len / cost_model.max_tokens(base))
    while cp > 1 and cost_model.max_tokens(with_cp(base, cp)) < seq_len:
        cp *= 2
    return cp


def with_cp(base: ParallelScheme, cp: int) -> ParallelScheme:
    """``base`` with CP size ``cp`` (``base`` itself for 1)."""
    return base if cp == 1 else replace(base, cp=cp)


def slot_layout(strategy: Strategy, recompute: bool = True) -> Strategy | None:
    """The slots of ``strategy``: every ``(tp, cp)`` replica as ``cp`` replicas of ``(tp)`` (None when a replica
    is pipelined: regrouped CP groups are formed of pp = 1 slots here); with ``recompute=False``, slots that do
    not recompute (a recomputing replica's slots as plain ones)."""
    if any(s.pp != 1 for s in strategy.schemes):
        return None
    counts: dict[ParallelScheme, int] = {}
    for scheme in strategy.replicas():
        base = replace(scheme, cp=1) if recompute else replace(scheme, cp=1, rc=False)
        counts[base] = counts.get(base, 0) + scheme.cp
    return Strategy.of(counts)


def regrouped_schedule(cost_model: CostModel, layout: Strategy, seq_lens: list[int], widen: bool = False,
                       memo: dict | None = None, thrifty: bool = False) -> RegroupedPlan:
    """The regrouped schedule of one batch on the slot ``layout`` (module docstring); a sequence no option
    holds is a PlanError naming it and the layout. ``widen``: a sequence whose least CP group would take longer
    than the step's average slot time (every sequence's GPU time over the GPUs) gets, per scheme, the narrowest
    wider group that does not (the widest when none): the longest sequence no longer sets the step alone.
    ``thrifty``: each sequence no slot holds alone goes to its option of least GPU time, the widest groups
    first (longest first among equals). ``memo``: a dict kept across the layouts of one batch (its CP options by
    scheme and length)."""
    if any(s.pp != 1 or s.cp != 1 for s in layout.schemes):
        raise PlanError(f"a slot layout has neither pipeline nor CP replicas, got {layout.describe()}")
    if bad := cost_model.fits(layout):
        raise PlanError(f"slot layout {layout.describe()} has schemes the cost model cannot run: "
                        f"{', '.join(s.describe() for s in bad)}")
    slots = layout.replicas()
    ranks = assign_ranks(layout, cost_model.gpus_per_node)
    kinds = {s: Kind.of(cost_model, s) for s in layout.schemes}
    of_scheme = {s: np.asarray([k for k, t in enumerate(slots) if t == s]) for s in layout.schemes}
    caps = np.asarray([kinds[s].max_tokens for s in slots])
    free = np.zeros(len(slots))
    groups: list[ReplicaPlan] = []
    first = np.zeros(len(slots))
    last = np.zeros(len(slots))
    long_ones = [i for i, n in enumerate(seq_lens) if n > caps.max()]
    known = set(cost_model.schemes)
    options = {i: [o for o in _cp_options(cost_model, known, layout.schemes, seq_lens[i], memo)
                   if o[1] <= len(of_scheme[o[0]])] for i in long_ones}
    target = _average_ms(kinds, options, seq_lens, caps.max(), layout.gpus) if widen else 0.0
    options = {i: _chosen(opts, target, widen) for i, opts in options.items()}
    for i in long_ones:
        if not options[i]:
            raise PlanError(f"a sequence of {seq_lens[i]} tokens fits no CP group of the slots of "
                            f"{layout.describe()}")
    if thrifty:  # one option each, the least GPU time; aligned blocks stay full when the widest go first
        options = {i: [min(opts, key=_gpu_ms)] for i, opts in options.items()}
    order = sorted(long_ones, key=lambda j: (-options[j][0][1] * options[j][0][0].tp if thrifty else 0,
                                             -min(o[2] for o in options[j]), j))
    for i in order:
        best: tuple | None = None
        for scheme, cp, ms, group in options[i]:
            members = of_scheme[scheme]
            blocks = free[members[:len(members) - len(members) % cp]].reshape(-1, cp).max(axis=1)
            b = int(np.argmin(blocks))
            end = float(blocks[b]) + ms
            if best is None or end < best[0] - 1e-9:
                best = (end, group, cp, ms, members[b * cp:(b + 1) * cp])
        assert best is not None  # options[i] is not empty
        end, group, cp, ms, block = best
        first[block] = np.where(first[block] == 0.0, ms, first[block])
        free[block], last[block] = end, ms
        groups.append(ReplicaPlan(scheme=group, ranks=tuple(r for k in block for r in ranks[k]),
                                  micro_batches=((i,),), est_ms=ms, max_tokens=cost_model.max_tokens(group)))
    short = [i for i, n in enumerate(seq_lens) if n <= caps.max()]
    additive = {s: {i: k.seq_ms(seq_lens[i]) + k.c * seq_lens[i] / k.max_tokens for i in short}
                for s, k in kinds.items()}
    share: list[list[int]] = [[] for _ in slots]
    load = free.copy()
    fastest = min(kinds, key=lambda s: (kinds[s].b, s.tp))
    for i in sorted(short, key=lambda j: (-additive[fastest][j], j)):
        best_end, k = np.inf, -1
        for scheme, members in of_scheme.items():  # a scheme's slots cost it alike: its least loaded one
            if kinds[scheme].max_tokens >= seq_lens[i]:
                at = int(members[np.argmin(load[members])])
                end = load[at] + additive[scheme][i]
                if end < best_end - 1e-12 or (abs(end - best_end) <= 1e-12 and at < k):
                    best_end, k = end, at
        share[k].append(i)
        load[k] = best_end
    finish = free.copy()
    for k, mine in enumerate(share):
        kind = kinds[slots[k]]
        bins, ms = pack_replica(kind, seq_lens, mine)
        finish[k] += ms
        if bins:
            times = [kind.micro_ms(sum(kind.seq_ms(seq_lens[i]) for i in b), sum(seq_lens[i] for i in b))
                     for b in bins]
            first[k] = times[0] if first[k] == 0.0 else first[k]
            last[k] = times[-1]
        if bins or free[k] == 0.0:  # its own micro-batches, or an idle slot that still takes part in the step
            groups.append(ReplicaPlan(scheme=slots[k], ranks=ranks[k], est_ms=ms, max_tokens=kind.max_tokens,
                                      micro_batches=tuple(tuple(sorted(b)) for b in bins)))
    return RegroupedPlan(layout=layout, replicas=tuple(groups), slot_ms=tuple(float(f) for f in finish),
                         edges=tuple((float(f), float(b)) for f, b in zip(first, last)))


def _gpu_ms(option: Option) -> float:
    """An option's GPU time: its time by the GPUs of its group."""
    scheme, cp, ms, _ = option
    return ms * cp * scheme.tp


def _chosen(options: list[Option], target: float, widen: bool) -> list[Option]:
    """Per slot scheme, recomputing or not, one option: the least CP size, or with ``widen`` the narrowest within
    ``target`` (else the widest)."""
    out: dict[tuple[ParallelScheme, bool], Option] = {}
    for option in options:  # per slot scheme and recomputation, narrowest first
        key = (option[0], option[3].rc)
        if key not in out or (widen and out[key][2] > target):
            out[key] = option
    return list(out.values())


def _average_ms(kinds: dict, options: dict, seq_lens: list[int], cap: int, gpus: int) -> float:
    """The step's average GPU time: every sequence at its cheapest GPU-ms (least CP groups for the long ones,
    alone on a slot for the others), over the GPUs."""
    area = sum(min((ms * cp * scheme.tp for scheme, cp, ms, _ in opts), default=0.0) for opts in options.values())
    area += sum(min(k.scheme.tp * (k.seq_ms(n) + k.c * n / k.max_tokens) for k in kinds.values()
                    if k.max_tokens >= n) for n in seq_lens if n <= cap)
    return area / gpus


def _cp_options(cost_model: CostModel, known: set, schemes: tuple[ParallelScheme, ...], seq_len: int,
                memo: dict | None) -> list[Option]:
    """(slot scheme, CP size, time, group scheme) of every group of ``layout``'s slots that holds ``seq_len``
    tokens: per scheme the least power-of-two CP size that does (:func:`cp_size`) and each wider one the cost
    model knows; for a slot that does not recompute, the same of its recomputing twin where the cost model knows
    it, from a group of one slot up (its parameter slice is the slot's: recomputation is chosen group by group).
    ``memo``: the options already found, by scheme and length."""
    out = []
    for scheme in schemes:
        key = (scheme, seq_len)
        if memo is not None and key in memo:
            out.extend(memo[key])
            continue
        found = []
        twin = replace(scheme, rc=True)
        for base in (scheme, twin) if not scheme.rc and twin in known else (scheme,):
            try:
                cp = cp_size(cost_model, base, seq_len)
            except PlanError:  # the cost model lacks the CP scheme this needs
                cp = 0
            while cp >= (1 if base is twin else 2):  # the least that holds it, and wider ones (a shorter latency)
                group = with_cp(base, cp)
                if group not in known or cost_model.max_tokens(group) < seq_len:
                    break
                found.append((scheme, cp, cost_model.micro_batch_ms(group, [seq_len]), group))
                cp *= 2
        if memo is not None:
            memo[key] = found
        out.extend(found)
    return out
