"""Planner policies, side by side (docs/design.md, sections 6.2 and 6.5), and the per-step lower bound.

- ``padding``: the fixed homogeneous strategy; sequences in arrival order grouped into micro-batches padded
  to their longest member, dealt round-robin to replicas.
- ``fixed-packing``: the fixed strategy; arrival order, first-fit into micro-batches of the token budget,
  dealt round-robin.
- ``homogeneous-token``: the fixed strategy (what a Megatron user configures: one homogeneous strategy sized
  for the dataset's longest sequence); sequences balanced by tokens over replicas, then packed into the
  fewest micro-batches balanced by tokens.
- ``homogeneous-per-step``: each step the best homogeneous strategy that holds the batch, with the
  quadratic-aware two-stage assignment.
- ``hydraulis``: each step the best strategy of the data-aware pool, or of the mixes of the pool's schemes
  that a hill climb from the pool's best reaches (``refine=True``), with the two-stage assignment; with
  ``regroup=True`` (where CP schemes are planned) also a regrouped plan (``regrouped.py``: CP groups re-forming
  per sequence inside the groups of same-scheme slots of the pool's slot layouts) where it is better.

Two context-parallel baselines (``CP_POLICIES``; dynamic-cp's plans regroup ranks within a step, which the
runtime runs as it runs hydraulis' regrouped plans), given the planner's ``cp_fixed`` / ``cp_base``:

- ``homogeneous-cp``: one fixed strategy, every replica the same TP and the CP size the dataset's longest
  sequence needs (``dynamic_cp.homogeneous_cp_strategy``), with the two-stage assignment.
- ``dynamic-cp``: Megatron-Core's dynamic CP (``dynamic_cp.py``): fixed TP, each sequence its own CP size
  over the DP x CP slots, ranks regrouping per sequence (``StepPlan.regrouped``).

With a :class:`~passes.plan.movement.MovementCost`, every policy's estimate is its compute makespan plus the exposed
parameter and gradient movement of its plan (``StepPlan.est_move_ms``): under the plain runtime all of the
strategy's movement, under the overlapped one what its micro-batches do not cover (``MovementCost.step_ms``; a
regrouped plan's, dynamic-cp's as hydraulis's, with every slot a replica busy until it finishes, covering with its
first and last micro-batch); the strategies are chosen and ranked by that sum, and the lower bound adds the movement
floor (no plan exposes less); without one, estimates and bounds are compute only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from passes.plan.assign import Kind, dispatch, first_fit
from passes.plan.bounds import Bounds, bound_terms, lower_bound_ms
from passes.plan.datasets import check_batch
from passes.plan.dynamic_cp import cp_bases, dynamic_cp_schedule, homogeneous_cp_strategy
from passes.plan.ir import CostModel, ParallelScheme, PlanError, ReplicaPlan, StepPlan, Strategy
from passes.plan.movement import MovementCost
from passes.plan.placement import assign_ranks, too_long_error, usable_schemes
from passes.plan.pool import fluid_scores
from passes.plan.refine import refine_strategy
from passes.plan.regrouped import VARIANTS, RegroupedPlan, regrouped_schedule, slot_layout

__all__ = ["POLICIES", "CP_POLICIES", "ALL_POLICIES", "Planner", "homogeneous_strategies", "sized_homogeneous"]

POLICIES = ("padding", "fixed-packing", "homogeneous-token", "homogeneous-per-step", "hydraulis")
CP_POLICIES = ("dynamic-cp", "homogeneous-cp")
"""The context-parallel baselines (they need the planner's ``cp_base`` and ``cp_fixed``)."""
ALL_POLICIES = POLICIES + CP_POLICIES


def homogeneous_strategies(cost_model: CostModel, gpus: int) -> list[Strategy]:
    """Every homogeneous strategy of usable schemes that fills ``gpus`` exactly."""
    return [Strategy.homogeneous(s, gpus) for s in usable_schemes(cost_model, gpus) if gpus % s.gpus == 0]


def sized_homogeneous(cost_model: CostModel, gpus: int, longest: int) -> Strategy:
    """The baselines' fixed strategy: homogeneous, fewest GPUs per replica (then fewest stages) that holds
    ``longest``; what a user of a homogeneous system configures for the whole run."""
    options = [s for s in homogeneous_strategies(cost_model, gpus) if cost_model.max_tokens(s.schemes[0]) >= longest]
    if not options:
        supported = max((cost_model.max_tokens(s.schemes[0]) for s in homogeneous_strategies(cost_model, gpus)),
                        default=0)
        raise PlanError(f"a sequence of {longest} tokens fits no homogeneous strategy on {gpus} GPUs "
                        f"(longest supported: {supported} tokens)")
    return min(options, key=lambda s: (s.schemes[0].gpus, s.schemes[0].pp, s.describe()))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Assignment:
    strategy: Strategy
    replicas: tuple[ReplicaPlan, ...]
    est_ms: float
    """Compute makespan plus ``move_ms``."""
    move_ms: float = 0.0


class Planner:
    """Plans steps for one cost model and cluster with any policy of ``POLICIES``."""

    def __init__(self, cost_model: CostModel, gpus: int, pool: list[Strategy], fixed: Strategy,
                 rounds: int = 64, prune_above: float = 1.02, refine: bool = True, refine_starts: int = 2,
                 full_at_least: int = 2, full_at_most: int = 16, allow: Callable[[Strategy], bool] | None = None,
                 movement: MovementCost | None = None, cp_fixed: Strategy | None = None,
                 cp_base: ParallelScheme | None = None, regroup: bool = False):
        self.cost_model, self.gpus, self.rounds, self.prune_above = cost_model, gpus, rounds, prune_above
        for name, value in (("refine_starts", refine_starts), ("full_at_least", full_at_least),
                            ("full_at_most", full_at_most)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name} must be a positive integer, got {value!r}")
        for strategy in [*pool, fixed]:
            self._check_strategy(strategy)
        self.pool, self.fixed = list(pool), fixed
        if cp_fixed is not None:
            self._check_strategy(cp_fixed)
        self.cp_fixed = cp_fixed
        """The ``homogeneous-cp`` baseline's strategy (None: that policy is refused)."""
        self.cp_base = cp_base
        """The ``dynamic-cp`` baseline's TP scheme (None: that policy is refused)."""
        self.homogeneous = homogeneous_strategies(cost_model, gpus)
        self.refine = refine
        """Whether ``hydraulis`` also considers other mixes of the pool's schemes (off: the pool's strategies only)."""
        self.pool_schemes = tuple(sorted({s for strategy in self.pool for s in strategy.schemes}))
        self.allow = allow
        """Which strategies outside the pool a step may use (None: any); the runtime allows those whose every
        replica sits where a compiled one already does."""
        self.refine_starts = refine_starts
        """Hill climbs per step, from the pool's best strategies by the fluid estimate."""
        self._last_bounds: tuple[tuple[int, ...], Bounds] | None = None
        self.full_at_least = full_at_least
        """Strategies planned in full per step, the best by the fluid estimate (more while within ``prune_above``)."""
        self.full_at_most = full_at_most
        """At most this many planned in full per step besides those ``full_at_least`` asks for (a bound on the
        solve time where the ranking's movement is the loose bound: above ``MovementCost.exact_up_to`` ranks)."""
        self.planned_in_full = 0
        """How many strategies the last step planned in full."""
        self.movement = movement
        """The movement charged to each strategy (None: estimates are compute only)."""
        self.movement_floor_ms = (0.0 if movement is None
                                  else movement.floor_ms(usable_schemes(cost_model, gpus), gpus))
        """Movement no strategy of this cluster avoids: added to every step's lower bound."""
        self.regroup = regroup
        """Whether ``hydraulis`` also plans regrouped steps (``passes.plan.regrouped``): CP groups re-forming
        sequence by sequence inside the groups of same-scheme slots of its pool's slot layouts, taken where
        their estimate is lower."""
        self.layouts = self._slot_layouts() if regroup else []
        """The slot layouts a regrouped step may use."""

    def move_ms(self, strategy: Strategy) -> float:
        """The exposed movement charged to ``strategy`` (0 without a movement cost)."""
        return 0.0 if self.movement is None else self.movement.exposed_ms(strategy)

    def _move_floor_ms(self, strategy: Strategy) -> float:
        """A bound under :meth:`move_ms` (for pruning: cheaper when the strategy was never planned)."""
        return 0.0 if self.movement is None else self.movement.quick_ms(strategy)

    def _move_rank_ms(self, strategy: Strategy) -> float:
        """The movement candidates are ranked by (``MovementCost.ranking_ms``)."""
        return 0.0 if self.movement is None else self.movement.ranking_ms(strategy)

    def _check_strategy(self, strategy: Strategy) -> None:
        if strategy.gpus != self.gpus:
            raise PlanError(f"strategy {strategy.describe()} uses {strategy.gpus} GPUs, the cluster has {self.gpus}")
        bad = self.cost_model.fits(strategy)
        if bad:
            raise PlanError(f"strategy {strategy.describe()} has schemes the cost model cannot run: "
                            f"{', '.join(s.describe() for s in bad)}")
        assign_ranks(strategy, self.cost_model.gpus_per_node)

    def plan(self, seq_lens: list[int], policy: str = "hydraulis", strategy: Strategy | None = None) -> StepPlan:
        """One step's plan under ``policy`` (or, with ``strategy`` given, that strategy with the two-stage
        assignment); raises PlanError for a bad batch, policy or strategy."""
        if policy not in ALL_POLICIES:
            raise PlanError(f"unknown policy {policy!r}; known: {', '.join(ALL_POLICIES)}")
        seq_lens = check_batch(list(seq_lens))
        bounds = self.bounds(seq_lens)
        # a regrouped plan is one schedule of many per step: only the any-schedule terms bound it
        regrouping = bool(self.layouts) and policy == "hydraulis"
        bound = (bounds.any_schedule if regrouping else bounds.best) + self.movement_floor_ms
        started = time.perf_counter()
        regrouped = False
        if strategy is None and policy in CP_POLICIES:
            best, regrouped = self._cp_baseline(policy, seq_lens), policy == "dynamic-cp"
        elif strategy is not None:
            self._check_strategy(strategy)
            if not self._holds(strategy, max(seq_lens)):
                raise PlanError(f"strategy {strategy.describe()} cannot hold a sequence of {max(seq_lens)} tokens")
            best, policy = self._two_stage(strategy, seq_lens), "forced"
        elif policy in ("padding", "fixed-packing", "homogeneous-token"):
            best = self._baseline(policy, seq_lens)
        else:
            best, regrouped = self._best_step(policy, seq_lens, regrouping)
        solve_ms = (time.perf_counter() - started) * 1e3
        return StepPlan(strategy=best.strategy, seq_lens=tuple(seq_lens), replicas=best.replicas,
                        est_step_ms=best.est_ms, lower_bound_ms=bound, policy=policy, solve_ms=solve_ms,
                        est_move_ms=best.move_ms, regrouped=regrouped)

    def _best_step(self, policy: str, seq_lens: list[int], regrouping: bool) -> tuple[_Assignment, bool]:
        """``hydraulis`` or ``homogeneous-per-step``: the best strategy for the whole step and, with
        ``regrouping``, the best regrouped plan where it is better (or where no strategy holds the batch);
        whether the plan is regrouped."""
        candidates = self.pool if policy == "hydraulis" else self.homogeneous
        try:
            best = self._best_of(candidates, seq_lens, refine=self.refine and policy == "hydraulis")
        except PlanError:
            if not regrouping:
                raise
            best = None  # no strategy holds the batch for the whole step: regrouped CP groups may
        regrouped = self._best_regrouped(seq_lens) if regrouping else None
        if regrouped is not None and (best is None or regrouped.est_ms < best.est_ms - 1e-9):
            return regrouped, True
        if best is None:
            raise too_long_error(self.cost_model, self.gpus, max(seq_lens))
        return best, False

    def _cp_baseline(self, policy: str, seq_lens: list[int]) -> _Assignment:
        """``homogeneous-cp`` or ``dynamic-cp`` (module docstring)."""
        if policy == "homogeneous-cp":
            if self.cp_fixed is None:
                raise PlanError("policy homogeneous-cp needs the planner's cp_fixed strategy; none was given")
            if not self._holds(self.cp_fixed, max(seq_lens)):
                raise PlanError(f"policy homogeneous-cp: a sequence of {max(seq_lens)} tokens does not fit its "
                                f"strategy {self.cp_fixed.describe()}")
            return self._two_stage(self.cp_fixed, seq_lens)
        if self.cp_base is None:
            raise PlanError("policy dynamic-cp needs the planner's cp_base TP scheme; none was given")
        schedule = dynamic_cp_schedule(self.cost_model, self.gpus, self.cp_base, seq_lens)
        est, move = self._regrouped_charge(schedule)  # CP ranks compute with the slots' TP slices
        return _Assignment(strategy=schedule.layout, replicas=schedule.replicas, est_ms=est, move_ms=move)

    def _regrouped_charge(self, schedule: RegroupedPlan) -> tuple[float, float]:
        """(step ms, movement ms) of a regrouped schedule: plain, its makespan plus the layout's movement;
        overlapped, each slot a replica, busy until it finishes (its waits included), covering with its first
        and last micro-batch (``MovementCost.step_ms``)."""
        layout = schedule.layout
        if self.movement is None or self.movement.mode == "plain":
            move = self.move_ms(layout)
            return schedule.makespan_ms + move, move
        est = self.movement.step_ms(layout, list(schedule.slot_ms), list(schedule.edges))
        return est, est - schedule.makespan_ms

    def choose_cp_baselines(self, longest: int, trial: list[list[int]]) -> None:
        """Give this planner its CP baselines at their best: of the TP schemes that can hold ``longest``
        (``dynamic_cp.cp_bases``), for each baseline the one whose plans of the ``trial`` batches are fastest on
        average (as a user would tune the TP of a static configuration); none when no scheme can."""
        bases = cp_bases(self.cost_model, self.gpus, longest)
        if not bases:
            return

        def mean_ms(policy: str) -> float:
            return float(np.mean([self.plan(batch, policy).est_step_ms for batch in trial]))

        timed: dict[str, list[tuple[float, str, ParallelScheme]]] = {p: [] for p in CP_POLICIES}
        for base in bases:
            self.cp_base = base
            self.cp_fixed = homogeneous_cp_strategy(self.cost_model, self.gpus, base, longest)
            for policy in CP_POLICIES:
                timed[policy].append((mean_ms(policy), base.describe(), base))
        self.cp_base = min(timed["dynamic-cp"])[2]
        self.cp_fixed = homogeneous_cp_strategy(self.cost_model, self.gpus, min(timed["homogeneous-cp"])[2], longest)

    def _slot_layouts(self) -> list[Strategy]:
        """The slot layouts of the pool's strategies (``regrouped.slot_layout``), the same with slots that do not
        recompute (which recompute group by group where a sequence needs it), and the homogeneous layouts of
        their TP schemes, each once."""
        layouts: dict[Strategy, None] = {}
        for strategy in self.pool:
            layout, plain = slot_layout(strategy), slot_layout(strategy, recompute=False)
            if layout is None or plain is None:
                continue
            for each in dict.fromkeys((layout, plain)):
                layouts.setdefault(each)
                for scheme in each.schemes:
                    if self.gpus % scheme.gpus == 0:
                        layouts.setdefault(Strategy.homogeneous(scheme, self.gpus))
        return [s for s in layouts if not self.cost_model.fits(s)]

    def _best_regrouped(self, seq_lens: list[int]) -> _Assignment | None:
        """The best regrouped plan over the slot layouts and the schedule's variants (``regrouped.VARIANTS``:
        least CP groups, widened ones, thrifty ones; None: no layout holds the batch); movement is charged in
        order of the makespans, until a makespan alone is no better."""
        layouts = list(self.layouts)
        if self.cp_base is not None and (base := Strategy.homogeneous(self.cp_base, self.gpus)) not in layouts:
            layouts.append(base)  # the homogeneous layout dynamic-cp regroups on, where one was chosen
        memo: dict = {}
        schedules = []
        longest = max(seq_lens)
        for layout, (widen, thrifty) in ((layout, variant) for layout in layouts for variant in VARIANTS):
            if (widen or thrifty) and longest <= max(self.cost_model.max_tokens(s) for s in layout.schemes):
                continue  # no CP group on this layout: every variant is the same schedule
            try:
                schedules.append(regrouped_schedule(self.cost_model, layout, seq_lens, widen, memo, thrifty))
            except PlanError:
                continue
        best = None
        for schedule in sorted(schedules, key=lambda s: s.makespan_ms):
            if best is not None and schedule.makespan_ms >= best.est_ms:
                break  # movement only adds: none of the rest is better
            est, move = self._regrouped_charge(schedule)
            if best is None or est < best.est_ms - 1e-9:
                best = _Assignment(strategy=schedule.layout, replicas=schedule.replicas, est_ms=est, move_ms=move)
        return best

    def bounds(self, seq_lens: Sequence[int]) -> Bounds:
        """Every lower bound of the batch (``bounds.bound_terms``), kept for the last batch: the policies
        planned side by side on one batch compute them once."""
        key = tuple(seq_lens)
        if self._last_bounds is None or self._last_bounds[0] != key:
            self._last_bounds = (key, bound_terms(self.cost_model, self.gpus, key))
        return self._last_bounds[1]

    def _holds(self, strategy: Strategy, longest: int) -> bool:
        return max(self.cost_model.max_tokens(s) for s in strategy.schemes) >= longest

    def _ranked(self, candidates: list[Strategy], seq_lens: list[int],
                refine: bool) -> list[tuple[float, str, Strategy]]:
        """The candidates that hold the batch (and, with ``refine``, the mixes of the pool's schemes that hill
        climbs from the best of them reach), as (fluid estimate plus movement, name, strategy), the best
        estimate first."""
        longest = max(seq_lens)
        usable = [s for s in candidates if self._holds(s, longest)]
        if not usable:  # the pool was built for shorter data: fall back to every homogeneous strategy
            usable = [s for s in self.homogeneous if self._holds(s, longest)]
        if not usable:
            raise too_long_error(self.cost_model, self.gpus, longest)
        fluid_ms = fluid_scores(self.cost_model, usable, np.asarray(seq_lens, dtype=np.int64))
        scores = [float(f) + self._move_rank_ms(s) for f, s in zip(fluid_ms, usable)]
        ranked = sorted(zip(scores, (s.describe() for s in usable), usable), key=lambda x: x[:2])
        if not refine:
            return ranked
        scored = {s: f for f, _, s in ranked}
        for fluid, _, start in ranked[:self.refine_starts]:
            for score, strategy in refine_strategy(self.cost_model, start, self.pool_schemes, seq_lens, fluid,
                                                   extra=None if self.movement is None else self._move_rank_ms):
                if strategy in scored or self.allow is None or self.allow(strategy):
                    scored.setdefault(strategy, score)
        return sorted(((f, s.describe(), s) for s, f in scored.items()), key=lambda x: x[:2])

    def _best_of(self, candidates: list[Strategy], seq_lens: list[int], refine: bool = False) -> _Assignment:
        """Plan in full, in order of the fluid estimate: the first ``full_at_least`` candidates, the best
        candidate of ``candidates`` themselves and the fixed strategy where it is one of them (so a step is never
        planned worse than the baselines' strategy with this dispatch, whatever the ranking's movement bound
        misjudges), then every other one predicted within ``prune_above`` of the best plan found and not
        excluded by its schemes' bound, ``full_at_most`` in all."""
        ranked = self._ranked(candidates, seq_lens, refine)
        first_own = next((s for _, _, s in ranked if s in candidates), ranked[0][2])
        best = None
        self.planned_in_full = 0
        for planned, (fluid, _, strategy) in enumerate(ranked):
            must = planned < self.full_at_least or strategy == first_own or strategy == self.fixed
            if best is not None and not must and self.planned_in_full >= self.full_at_most:
                continue
            # predicted clearly slower than the best plan found: the margin is a share of its compute (the fluid
            # estimate's error), not of the movement both sides carry
            if best is not None and not must and fluid > best.est_ms + (self.prune_above - 1) * (best.est_ms -
                                                                                                 best.move_ms):
                continue
            bound = lower_bound_ms(self.cost_model, self.gpus, seq_lens, list(strategy.schemes))
            bound += self._move_floor_ms(strategy)
            if best is not None and bound >= best.est_ms:
                continue  # provably no better
            candidate = self._two_stage(strategy, seq_lens)
            self.planned_in_full += 1
            if best is None or candidate.est_ms < best.est_ms - 1e-9:
                best = candidate
        assert best is not None  # the first usable strategy is always planned
        return best

    def _kinds(self, strategy: Strategy) -> list[Kind]:
        return [Kind.of(self.cost_model, s) for s in strategy.replicas()]

    def _two_stage(self, strategy: Strategy, seq_lens: list[int]) -> _Assignment:
        kinds = self._kinds(strategy)
        packed = dispatch(kinds, seq_lens, rounds=self.rounds)
        return self._assemble(strategy, kinds, [bins for bins, _ in packed], [ms for _, ms in packed], seq_lens)

    def _assemble(self, strategy: Strategy, kinds: list[Kind], bins_per_replica: list[list[list[int]]],
                  ms_per_replica: list[float], seq_lens: list[int], padded: bool = False) -> _Assignment:
        ranks = assign_ranks(strategy, self.cost_model.gpus_per_node)
        replicas = tuple(
            ReplicaPlan(scheme=k.scheme, ranks=rk, max_tokens=k.max_tokens, est_ms=ms,
                        micro_batches=tuple(tuple(sorted(b)) for b in bins))
            for k, rk, bins, ms in zip(kinds, ranks, bins_per_replica, ms_per_replica)
        )
        if self.movement is None or self.movement.mode == "plain":
            move = self.move_ms(strategy)
            return _Assignment(strategy=strategy, replicas=replicas, est_ms=max(ms_per_replica) + move,
                               move_ms=move)
        micro = _padded_micro_ms if padded else _micro_ms
        edges = [(micro(k, seq_lens, bins[0]), micro(k, seq_lens, bins[-1])) if bins else (0.0, 0.0)
                 for k, bins in zip(kinds, bins_per_replica)]
        step = self.movement.step_ms(strategy, list(ms_per_replica), edges)
        return _Assignment(strategy=strategy, replicas=replicas, est_ms=step, move_ms=step - max(ms_per_replica))

    def _baseline(self, policy: str, seq_lens: list[int]) -> _Assignment:
        strategy = self.fixed
        if not self._holds(strategy, max(seq_lens)):
            raise PlanError(f"policy {policy}: a sequence of {max(seq_lens)} tokens does not fit the fixed strategy "
                            f"{strategy.describe()} (holds {self.cost_model.max_tokens(strategy.schemes[0])})")
        kinds = self._kinds(strategy)
        kind = kinds[0]
        if policy == "homogeneous-token":
            bins = _token_balanced(seq_lens, len(kinds), kind.max_tokens)
            return self._assemble(strategy, kinds, bins, [_replica_ms(kind, seq_lens, b) for b in bins], seq_lens)
        if policy == "fixed-packing":
            micro = first_fit(seq_lens, list(range(len(seq_lens))), kind.max_tokens)
            bins = [micro[r::len(kinds)] for r in range(len(kinds))]
            return self._assemble(strategy, kinds, bins, [_replica_ms(kind, seq_lens, b) for b in bins], seq_lens)
        micro = _padded_in_order(seq_lens, kind.max_tokens)
        bins = [micro[r::len(kinds)] for r in range(len(kinds))]
        return self._assemble(strategy, kinds, bins, [_padded_replica_ms(kind, seq_lens, b) for b in bins], seq_lens,
                              padded=True)


def _micro_ms(kind: Kind, seq_lens: list[int], micro: list[int]) -> float:
    return kind.micro_ms(sum(kind.seq_ms(seq_lens[i]) for i in micro), sum(seq_lens[i] for i in micro))


def _replica_ms(kind: Kind, seq_lens: list[int], micro_batches: list[list[int]]) -> float:
    return CostModel.replica_ms(kind.scheme, [_micro_ms(kind, seq_lens, m) for m in micro_batches])


def _padded_micro_ms(kind: Kind, seq_lens: list[int], micro: list[int]) -> float:
    """Without varlen attention every member pays for the micro-batch's longest length."""
    longest = max(seq_lens[i] for i in micro)
    return kind.micro_ms(len(micro) * kind.seq_ms(longest), len(micro) * longest)


def _padded_replica_ms(kind: Kind, seq_lens: list[int], micro_batches: list[list[int]]) -> float:
    return CostModel.replica_ms(kind.scheme, [_padded_micro_ms(kind, seq_lens, m) for m in micro_batches])


def _token_balanced(seq_lens: list[int], replicas: int, cap: int) -> list[list[list[int]]]:
    """Megatron-style: sequences to the replica with the fewest tokens, then the fewest micro-batches per
    replica, each sequence onto the micro-batch with the fewest tokens that has room."""
    shares: list[list[int]] = [[] for _ in range(replicas)]
    tokens = [0] * replicas
    for i in sorted(range(len(seq_lens)), key=lambda j: (-seq_lens[j], j)):
        r = min(range(replicas), key=lambda q: (tokens[q], q))
        shares[r].append(i)
        tokens[r] += seq_lens[i]
    return [_token_bins(seq_lens, share, cap) for share in shares]


def _token_bins(seq_lens: list[int], share: list[int], cap: int) -> list[list[int]]:
    if not share:
        return []
    v = max(1, -(-sum(seq_lens[i] for i in share) // cap))
    while True:
        bins: list[list[int]] = [[] for _ in range(v)]
        fill = [0] * v
        for i in share:  # already longest first
            options = [b for b in range(v) if fill[b] + seq_lens[i] <= cap]
            if not options:
                break
            b = min(options, key=lambda k: (fill[k], k))
            bins[b].append(i)
            fill[b] += seq_lens[i]
        else:
            return bins
        v += 1


def _padded_in_order(seq_lens: list[int], cap: int) -> list[list[int]]:
    """Consecutive sequences while ``count * longest <= cap``."""
    micro: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, s in enumerate(seq_lens):
        if current and (len(current) + 1) * max(longest, s) > cap:
            micro.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, s)
    if current:
        micro.append(current)
    return micro
