"""Online calibration of the planner's cost model from measured steps.

A profile is taken once, but the speed of a machine drifts (on a shared host the same kernel measured 10-30%
slower a few minutes later) and not every scheme drifts alike, so a plan balanced on the profile comes out
unbalanced. After each step, ``OnlineCalibration.observe`` compares every replica's measured busy time (its
slowest rank) with what the *base* cost model predicts for the micro-batches it ran (their sum: one
pipeline stage's compute, the bubble being idle, not busy, time); per scheme, the factor
is the median of the last ``window`` steps' measured-over-predicted ratios (a median, so that one step hit
by background load does not move it). ``model()`` is the base model with each scheme's ``a``, ``b`` and
``c`` multiplied by its factor; a scheme not run yet takes the geometric mean of the factors of those that
have (a whole-machine drift moves every scheme). Owns only this bookkeeping: the trainer feeds it and hands
the model to the planning service.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import replace
from typing import Sequence

from passes.plan.ir import CostModel, ParallelScheme, PlanError, StepPlan

__all__ = ["OnlineCalibration", "scaled_cost_model"]


def scaled_cost_model(model: CostModel, factors: dict[ParallelScheme, float]) -> CostModel:
    """``model`` with every listed scheme's time coefficients (``a``, ``b``, ``c``) times its factor."""
    for scheme, factor in factors.items():
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            raise PlanError(f"calibration factor of {scheme.describe()} must be a finite number > 0, got {factor!r}")
    entries = tuple(replace(e, a=e.a * f, b=e.b * f, c=e.c * f) if (f := factors.get(e.scheme)) else e
                    for e in model.entries)
    return replace(model, entries=entries, name=model.name if model.name.endswith(" (calibrated)")
                   else f"{model.name} (calibrated)")


class OnlineCalibration:
    """Per-scheme measured-over-predicted factors of the last ``window`` steps, applied to ``base``."""

    def __init__(self, base: CostModel, window: int = 8):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise PlanError(f"calibration window must be a positive integer, got {window!r}")
        self.base, self.window = base, window
        self._ratios: dict[ParallelScheme, deque[float]] = {}

    def observe(self, plan: StepPlan, busy_ms: Sequence[float]) -> None:
        """Record one executed step: ``busy_ms`` per rank (``StepStats.busy_ms``). A regrouped step is left out:
        a rank's busy time there spans groups of several schemes, which it cannot be split between."""
        if plan.regrouped:
            return
        measured: dict[ParallelScheme, float] = {}
        predicted: dict[ParallelScheme, float] = {}
        for replica in plan.replicas:
            if not replica.micro_batches:
                continue
            if max(replica.ranks) >= len(busy_ms):
                raise PlanError(f"busy times of {len(busy_ms)} ranks do not cover replica ranks {list(replica.ranks)}")
            # A rank's busy time is its compute: a pipeline stage blocked in the bubble costs no CPU, so the
            # comparison is with the sum of the micro-batch times (one stage's), not the 1F1B span.
            compute = sum(self.base.micro_batch_times(replica, plan.seq_lens))
            measured[replica.scheme] = measured.get(replica.scheme, 0.0) + max(busy_ms[r] for r in replica.ranks)
            predicted[replica.scheme] = predicted.get(replica.scheme, 0.0) + compute
        for scheme, pred in predicted.items():
            if pred > 0 and measured[scheme] > 0:
                self._ratios.setdefault(scheme, deque(maxlen=self.window)).append(measured[scheme] / pred)

    @property
    def factors(self) -> dict[ParallelScheme, float]:
        """Every scheme of the base model and its current factor."""
        seen = {s: statistics.median(r) for s, r in self._ratios.items()}
        fallback = math.exp(statistics.fmean(math.log(f) for f in seen.values())) if seen else 1.0
        return {e.scheme: seen.get(e.scheme, fallback) for e in self.base.entries}

    def state_dict(self) -> dict:
        """The ratios seen so far, per scheme (JSON), for a checkpoint."""
        return {scheme.describe(): list(ratios) for scheme, ratios in self._ratios.items()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict``'s ratios."""
        self._ratios = {ParallelScheme.parse(k): deque(map(float, v), maxlen=self.window) for k, v in state.items()}

    def model(self) -> CostModel:
        """The base cost model scaled by the current factors."""
        return scaled_cost_model(self.base, self.factors)
