"""Where a step plan loses against its lower bound.

The plan's makespan M on N GPUs, minus the area bound (every sequence at its cheapest GPU-ms, all GPUs
sharing the sum), splits exactly into three parts, each in ms of step time (GPU-ms over N):

- ``strategy``: the step's strategy lacks the cheapest scheme of some sequences (their cheapest GPU-ms among
  the strategy's schemes, minus their cheapest among all);
- ``dispatch``: sequences on a costlier scheme of the strategy than their cheapest there, plus the GPUs that
  idle before the slowest replica ends (imbalance);
- ``packing``: each replica's time beyond its sequences' additive GPU-ms: per-micro-batch costs above the
  fractional share, bucket padding and pipeline bubbles.

The three add up to ``M - area``, M the compute makespan. A plan charged for parameter and gradient movement
(``StepPlan.est_move_ms``) has a fourth part, ``movement``: its exposed movement above the floor no strategy
avoids (``Planner.movement_floor_ms``), which the bound then includes. Part of that no plan can close:
``unavoidable = compute bound - area``, where the step's tightest bound (``passes.plan.bounds``) proves it. It is
taken off the part its binding bound is about (latency: the GPUs that idle while one long sequence runs, a
dispatch part; pipeline and long: schemes the batch cannot use at their area cost, a strategy part), any rest
from the other parts in proportion; the step's ``costliest`` is the largest of what remains: where a better plan
could still gain.
"""

from __future__ import annotations

from dataclasses import dataclass

from passes.plan.assign import Kind
from passes.plan.bounds import Bounds, bound_terms, cheapest_area
from passes.plan.ir import CostModel, StepPlan

__all__ = ["PARTS", "ReplicaDiagnosis", "StepDiagnosis", "diagnose"]

PARTS = ("strategy", "dispatch", "packing", "movement")
_EXPLAINED_BY = {"area": None, "latency": "dispatch", "pipeline": "strategy", "long": "strategy"}


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaDiagnosis:
    """One replica: its estimate and how much earlier than the step's makespan it finishes."""

    scheme: str
    """The replica's scheme, e.g. ``(tp4,pp1)``."""
    est_ms: float
    """Its estimated 1F1B time."""
    slack_ms: float
    """Makespan minus ``est_ms``: how long its GPUs idle."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepDiagnosis:
    """One step plan against its bounds."""

    est_step_ms: float
    """The plan's estimate: compute makespan plus exposed movement."""
    bounds: Bounds
    """Every lower bound of the batch."""
    strategy_ms: float
    """Gap from the strategy's missing schemes."""
    dispatch_ms: float
    """Gap from sequences on costlier replicas and from idle GPUs."""
    packing_ms: float
    """Gap from micro-batch overheads, bucket padding and pipeline bubbles."""
    replicas: tuple[ReplicaDiagnosis, ...]
    """Per replica, in the plan's order."""
    movement_ms: float = 0.0
    """Exposed movement above the floor (0 when movement is not charged)."""
    movement_floor_ms: float = 0.0
    """Movement no strategy avoids, part of the step's bound."""
    regrouped: bool = False
    """Whether the plan regroups its ranks within the step: then only the any-schedule terms bound it."""

    @property
    def lower_bound_ms(self) -> float:
        """The tightest compute bound that holds for the plan (the any-schedule one for a regrouped plan) plus
        the movement floor."""
        return (self.bounds.any_schedule if self.regrouped else self.bounds.best) + self.movement_floor_ms

    @property
    def vs_bound(self) -> float:
        """Estimate over the step's lower bound."""
        return self.est_step_ms / self.lower_bound_ms

    @property
    def unavoidable_ms(self) -> float:
        """The part of the gap to the area bound that the tightest bound proves no plan can close."""
        return self.bounds.best - self.bounds.area

    def avoidable(self) -> dict[str, float]:
        """Each part less its share of the unavoidable: first the part the binding bound explains, any rest
        from the other parts in proportion to their size. They add up to makespan minus the bound."""
        parts = {p: max(0.0, getattr(self, f"{p}_ms")) for p in PARTS}
        left = self.unavoidable_ms
        part = _EXPLAINED_BY[self.bounds.binding]
        if part is not None:
            taken = min(parts[part], left)
            parts[part] -= taken
            left -= taken
        total = sum(parts.values())
        if left > 0 and total > 0:
            scale = max(0.0, 1 - left / total)
            parts = {p: v * scale for p, v in parts.items()}
        return parts

    @property
    def costliest(self) -> str:
        """Which of strategy, dispatch or packing costs the most beyond what the bound proves unavoidable."""
        parts = self.avoidable()
        return max(PARTS, key=lambda p: parts[p])

    def to_dict(self) -> dict:
        """The JSON form (``hcompile plan --json`` and ``--plans-out``)."""
        return {
            "est_step_ms": round(self.est_step_ms, 3),
            "est_move_ms": round(self.movement_ms + self.movement_floor_ms, 3),
            "lower_bound_ms": round(self.lower_bound_ms, 3),
            "vs_bound": round(self.vs_bound, 4),
            "bounds": {**self.bounds.to_dict(), "binding": self.bounds.binding},
            "gap_ms": {p: round(getattr(self, f"{p}_ms"), 3) for p in PARTS},
            "unavoidable_ms": round(self.unavoidable_ms, 3),
            "costliest": self.costliest,
            "replicas": [{"scheme": r.scheme, "est_ms": round(r.est_ms, 3), "slack_ms": round(r.slack_ms, 3)}
                         for r in self.replicas],
        }


def diagnose(cost_model: CostModel, gpus: int, plan: StepPlan, bounds: Bounds | None = None,
             movement_floor_ms: float = 0.0) -> StepDiagnosis:
    """Split ``plan``'s gap to the area bound into strategy, dispatch, packing and movement (above
    ``movement_floor_ms``), per replica its slack."""
    lens = plan.seq_lens
    bounds = bounds if bounds is not None else bound_terms(cost_model, gpus, lens)
    overall = cheapest_area(cost_model, [s for s in cost_model.schemes if s.gpus <= gpus], lens)
    in_strategy = cheapest_area(cost_model, sorted({r.scheme for r in plan.replicas}), lens)
    makespan = plan.est_step_ms - plan.est_move_ms
    placed = idle = packing = 0.0
    replicas = []
    for replica in plan.replicas:
        kind = Kind.of(cost_model, replica.scheme)
        members = [i for mb in replica.micro_batches for i in mb]
        g = replica.scheme.gpus
        additive = sum(kind.seq_ms(lens[i]) + kind.c * lens[i] / kind.max_tokens for i in members)
        placed += g * additive - float(in_strategy[members].sum())
        packing += g * (replica.est_ms - additive)
        idle += g * (makespan - replica.est_ms)
        replicas.append(ReplicaDiagnosis(scheme=replica.scheme.describe(), est_ms=replica.est_ms,
                                         slack_ms=makespan - replica.est_ms))
    if plan.regrouped:  # groups share ranks one after another: the idle GPU-ms is what they leave of the step
        idle = gpus * makespan - sum(r.scheme.gpus * r.est_ms for r in plan.replicas)
    strategy = float((in_strategy - overall).sum())
    return StepDiagnosis(est_step_ms=plan.est_step_ms, bounds=bounds, strategy_ms=strategy / gpus,
                         dispatch_ms=(placed + idle) / gpus, packing_ms=packing / gpus, replicas=tuple(replicas),
                         movement_ms=plan.est_move_ms - movement_floor_ms, movement_floor_ms=movement_floor_ms,
                         regrouped=plan.regrouped)
