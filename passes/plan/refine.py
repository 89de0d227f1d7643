"""Per-step strategy refinement: the pool's strategies are chosen offline for typical batches; a batch that
is not typical is better served by another mix of the same schemes (the schemes, not the mixes, are what
the runtime compiles, so any mix of them runs without a new compilation).

From a start strategy, a hill climb on the fluid makespan estimate (``pool.fluid_scores``) over moves that
trade the GPUs of some replicas of one scheme for replicas of another scheme of the set: the smallest trade
both GPU counts divide, and 2, 4, 8... times it. Every candidate fills the cluster, tiles the nodes, holds
the batch's longest sequence and has at most three schemes. Deterministic: ties go to the described name.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from passes.plan.ir import CostModel, ParallelScheme, Strategy
from passes.plan.placement import placeable
from passes.plan.pool import fluid_scores

__all__ = ["neighbours", "refine_strategy"]

_MAX_SCHEMES = 3  # mixes of at most three schemes: the fluid estimate's grid coarsens beyond three


def neighbours(strategy: Strategy, schemes: Sequence[ParallelScheme], gpus_per_node: int) -> list[Strategy]:
    """Strategies one trade away from ``strategy``: replicas of one of its schemes given up for replicas of
    another scheme of ``schemes`` on the same GPUs."""
    counts = dict(strategy.parts)
    out: dict[Strategy, None] = {}
    for give in counts:
        for take in schemes:
            if take == give:
                continue
            unit = math.lcm(give.gpus, take.gpus)
            step = unit
            while step <= counts[give] * give.gpus:
                new = dict(counts)
                new[give] -= step // give.gpus
                new[take] = new.get(take, 0) + step // take.gpus
                parts = {k: v for k, v in new.items() if v > 0}
                if len(parts) <= _MAX_SCHEMES:
                    candidate = Strategy.of(parts)
                    if placeable(candidate, gpus_per_node):
                        out[candidate] = None
                step *= 2
    return list(out)


def refine_strategy(cost_model: CostModel, start: Strategy, schemes: Sequence[ParallelScheme],
                    seq_lens: Sequence[int], start_score: float | None = None,
                    rounds: int = 8, extra: Callable[[Strategy], float] | None = None) -> list[tuple[float, Strategy]]:
    """A hill climb from ``start`` on the fluid estimate plus ``extra(strategy)`` (the planner's movement
    charge; ``start_score`` includes it): every strategy it scored (the neighbours of each point it passed),
    as (estimate, strategy), the best first; the last point of the climb is the first."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    longest = int(lens.max())
    def scores(strategies: list[Strategy]) -> list[float]:
        fluid = fluid_scores(cost_model, strategies, lens)
        return [float(f) + (extra(s) if extra is not None else 0.0) for f, s in zip(fluid, strategies)]

    best_score = start_score if start_score is not None else scores([start])[0]
    seen: dict[Strategy, float] = {start: best_score}
    best = start
    for _ in range(rounds):
        options = [s for s in neighbours(best, schemes, cost_model.gpus_per_node)
                   if s not in seen and max(cost_model.max_tokens(t) for t in s.schemes) >= longest]
        if not options:
            break
        seen.update(zip(options, scores(options)))
        score, _, strategy = min((seen[s], s.describe(), s) for s in options)
        if score >= best_score * (1 - 1e-6):
            break
        best, best_score = strategy, score
    return [(score, s) for score, _, s in sorted((v, s.describe(), s) for s, v in seen.items())]
