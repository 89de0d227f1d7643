"""Lower bounds on a step's time: numbers no plan of a batch on a cluster can beat, whatever its strategy,
dispatch or packing (docs/design.md, section 6.2).

Every bound relaxes the same facts about a replica of scheme k (``g`` GPUs, ``pp`` stages, per-stage
coefficients ``a, b, c``, at most ``mt`` tokens per micro-batch) that runs v micro-batches of per-stage
times ``t_j = work_j + c``: its time is ``sum_j t_j + (pp - 1) max_j t_j``, with ``v >= tokens / mt``.

- ``area``: each sequence pays at least its cheapest GPU-ms ``g (a s^2 + b s + c s / mt)``; all GPUs share
  the sum. ``latency``: one sequence alone crosses every stage, ``pp (a s^2 + b s + c)``.
- ``pipeline``: the area bound with the 1F1B bubble. A pipelined replica with per-stage work W takes at least
  ``W + (pp-1) c + 2 sqrt((pp-1) c W)`` (the best real v), so within M it does at most
  ``Wcap(M) = (sqrt(M) - sqrt((pp-1) c))^2`` of work; a sequence then uses at least
  ``g w / Wcap(M)`` GPUs of such replicas. The bound is the least M at which the cheapest uses fit in N GPUs.
- ``long``: for every scheme cap t, the sequences longer than t need replicas of schemes that hold more than
  t tokens, each of at least g_t GPUs. Those replicas number at least the pigeonhole count (sequences whose
  additive time exceeds M / 2 cannot share one) and the total additive time over M; their GPUs are busy or
  idle for all of M, and the short sequences they take instead of cheaper schemes are counted at their best
  ratio (a fractional knapsack). The bound is the least M at which the rest fits.

``area`` and ``latency`` hold for every schedule, also one that regroups ranks within the step
(``Bounds.any_schedule``); ``pipeline`` and ``long`` hold for plans with one strategy per step, the plans the
runtime runs. ``lower_bound_ms`` is the largest; ``bound_terms`` gives each (for diagnostics). Each is checked against
exhaustive optima of small instances in ``tests/test_bounds.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from passes.plan.ir import CostModel, ParallelScheme
from passes.plan.placement import too_long_error

__all__ = ["Bounds", "bound_terms", "lower_bound_ms", "area_latency", "cheapest_area"]

_ITERATIONS = 50  # bisection steps: a relative precision far below the planner's estimates' own


@dataclass(frozen=True, slots=True, kw_only=True)
class Bounds:
    """The lower bounds of one batch, in ms."""

    area: float
    """All GPUs share every sequence's cheapest GPU-ms."""
    latency: float
    """The longest single sequence across its replica's stages."""
    pipeline: float
    """The area bound with each pipelined scheme's least 1F1B bubble."""
    long: float
    """The GPUs that replicas holding the long sequences occupy for the whole step."""

    @property
    def best(self) -> float:
        """The tightest: the step's lower bound."""
        return max(self.area, self.latency, self.pipeline, self.long)

    @property
    def any_schedule(self) -> float:
        """The area and latency bounds only: these two hold for any schedule of the batch, also one whose ranks
        regroup within the step (``dynamic-cp``'s), where ``pipeline`` and ``long`` assume one strategy for the
        whole step."""
        return max(self.area, self.latency)

    @property
    def binding(self) -> str:
        """Which bound is the tightest."""
        return max(("area", "latency", "pipeline", "long"), key=lambda n: (getattr(self, n), n == "area"))

    def to_dict(self) -> dict:
        return {n: round(getattr(self, n), 3) for n in ("area", "latency", "pipeline", "long")}


class _Table:
    """Per (scheme, sequence): whether it fits, the per-stage work ``a s^2 + b s``, GPU-ms and additive time."""

    def __init__(self, cost_model: CostModel, schemes: Sequence[ParallelScheme], seq_lens: np.ndarray):
        s = seq_lens.astype(np.float64)
        self.schemes = list(schemes)
        costs = [cost_model.cost(k) for k in self.schemes]
        self.gpus = np.array([k.gpus for k in self.schemes], dtype=np.float64)[:, None]
        self.pp = np.array([k.pp for k in self.schemes], dtype=np.float64)[:, None]
        self.c = np.array([e.c for e in costs])[:, None]
        self.mt = np.array([e.max_tokens for e in costs], dtype=np.float64)[:, None]
        self.fits = seq_lens[None, :] <= self.mt
        a, b = np.array([e.a for e in costs])[:, None], np.array([e.b for e in costs])[:, None]
        x = np.array([e.exchange for e in costs])[:, None]
        quad = np.stack([e.shape.quadratic(s) for e in costs]) if costs else np.zeros((0, s.size))
        self.work = np.where(x > 0, b * s + np.maximum(a * quad, x * s), a * quad + b * s)
        """Per-stage work of each sequence: ``SchemeCost.seq_ms``."""
        self.additive = self.work + self.c * s / self.mt
        """Per-stage time a sequence adds to its replica (its share of the per-micro-batch cost included)."""
        self.area = np.where(self.fits, self.gpus * self.additive, np.inf)
        self.latency = np.where(self.fits, self.pp * (self.work + self.c), np.inf)

    def cheapest(self, values: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """Per sequence, the least of ``values`` over the schemes (``rows``: a mask of schemes) that hold it."""
        v = np.where(self.fits, values, np.inf)
        if rows is not None:
            v = np.where(rows[:, None], v, np.inf)
        return v.min(axis=0)


def _least_feasible(low: float, feasible: Callable[[float], bool]) -> float:
    """The least M >= ``low`` with ``feasible(M)`` (monotone), to bisection precision."""
    if feasible(low):
        return low
    high = max(low, 1.0) * 2
    while not feasible(high):
        high *= 2
    for _ in range(_ITERATIONS):
        mid = (low + high) / 2
        if feasible(mid):
            high = mid
        else:
            low = mid
    return high


def _pipeline_bound(t: _Table, gpus: int, low: float) -> float:
    bubble = (t.pp - 1) * t.c
    piped = t.pp[:, 0] > 1

    def feasible(m: float) -> bool:
        room = math.sqrt(m) - np.sqrt(bubble)
        cap = np.where(m > bubble, room * room, 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            piped_use = np.where(cap > 0, t.gpus * t.work / cap, np.inf)
        use = np.where(piped[:, None], piped_use, t.gpus * t.additive / m)
        return float(t.cheapest(use).sum()) <= gpus * (1 + 1e-12)

    return _least_feasible(low, feasible)


def _long_feasible(t: _Table, gpus: int, seq_lens: np.ndarray, cheap_area: np.ndarray,
                   cap: float) -> Callable[[float], bool]:
    """Whether a makespan M leaves room for the sequences longer than ``cap`` and the rest (``long`` bound)."""
    big = t.mt[:, 0] > cap
    g_big = float(t.gpus[big, 0].min())
    long_ = seq_lens > cap
    tau = t.cheapest(t.additive, big)[long_]
    tau_sum = float(tau.sum())
    long_area = float(t.cheapest(t.area, big)[long_].sum())
    short_area = cheap_area[~long_]
    short_big = t.cheapest(t.area, big)[~long_]
    order = np.argsort(-(short_area / short_big), kind="stable")  # best ratio first
    absorb_cost = np.concatenate(([0.0], np.cumsum(short_big[order])))
    absorb_gain = np.concatenate(([0.0], np.cumsum(short_area[order])))
    total_short = float(absorb_gain[-1])  # the same summation as the gains: all absorbed is exactly 0 left

    def feasible(m: float) -> bool:
        replicas = max(1, math.ceil(tau_sum / m - 1e-12), int((tau > m / 2 + 1e-9).sum()))
        occupied = max(g_big * replicas, long_area / m)  # more GPUs there only make the rest harder
        if occupied > gpus * (1 + 1e-12):
            return False
        room = max(0.0, occupied * m - long_area)
        j = int(np.searchsorted(absorb_cost, room, side="right")) - 1  # whole sequences absorbed
        gain = absorb_gain[j]
        if j < len(order):  # and a fraction of the next
            gain += (room - absorb_cost[j]) * short_area[order[j]] / short_big[order[j]]
        return (gpus - occupied) * m >= (total_short - gain) - 1e-9 * total_short

    return feasible


def _long_bound(t: _Table, gpus: int, seq_lens: np.ndarray, cheap_area: np.ndarray, low: float) -> float:
    caps = np.unique(t.mt[:, 0])
    return max([low, *(_least_feasible(low, _long_feasible(t, gpus, seq_lens, cheap_area, float(cap)))
                       for cap in caps[caps < seq_lens.max()])])


def cheapest_area(cost_model: CostModel, schemes: Sequence[ParallelScheme], seq_lens: Sequence[int]) -> np.ndarray:
    """Per sequence, its least GPU-ms ``g (a s^2 + b s + c s / mt)`` over ``schemes`` (inf where none holds it)."""
    t = _Table(cost_model, schemes, np.asarray(seq_lens, dtype=np.int64))
    return t.cheapest(t.area)


def _table(cost_model: CostModel, gpus: int, seq_lens: Sequence[int],
           schemes: Sequence[ParallelScheme] | None) -> tuple[_Table, np.ndarray, np.ndarray]:
    """The table over ``schemes`` (default: every scheme that fits in ``gpus``), the lengths, and each
    sequence's cheapest GPU-ms; a sequence no scheme holds is the planner's too-long error."""
    if schemes is None:
        schemes = [s for s in cost_model.schemes if s.gpus <= gpus]
    lens = np.asarray(seq_lens, dtype=np.int64)
    t = _Table(cost_model, schemes, lens)
    cheap_area = t.cheapest(t.area)
    if not np.isfinite(cheap_area).all():
        raise too_long_error(cost_model, gpus, int(lens[~np.isfinite(cheap_area)].max()))
    return t, lens, cheap_area


def area_latency(cost_model: CostModel, gpus: int, seq_lens: Sequence[int],
                 schemes: Sequence[ParallelScheme] | None = None) -> tuple[float, float]:
    """The area and latency bounds only (cheap; the planner prunes strategies with them)."""
    t, _, cheap_area = _table(cost_model, gpus, seq_lens, schemes)
    return float(cheap_area.sum() / gpus), float(t.cheapest(t.latency).max())


def bound_terms(cost_model: CostModel, gpus: int, seq_lens: Sequence[int]) -> Bounds:
    """Every bound of the batch over every scheme that fits in ``gpus``."""
    t, lens, cheap_area = _table(cost_model, gpus, seq_lens, None)
    area, latency = float(cheap_area.sum() / gpus), float(t.cheapest(t.latency).max())
    low = max(area, latency) * 0.999  # the bisections start below both simple bounds
    return Bounds(area=area, latency=latency, pipeline=_pipeline_bound(t, gpus, low),
                  long=_long_bound(t, gpus, lens, cheap_area, low))


def lower_bound_ms(cost_model: CostModel, gpus: int, seq_lens: Sequence[int],
                   schemes: Sequence[ParallelScheme] | None = None) -> float:
    """The step's lower bound: the tightest of ``bound_terms``. With ``schemes`` given, the area and latency
    bounds over those schemes only (a quick bound for strategies made of them)."""
    if schemes is not None:
        return max(area_latency(cost_model, gpus, seq_lens, schemes))
    return bound_terms(cost_model, gpus, seq_lens).best
