"""The data-aware strategy pool (docs/design.md, section 6.1), built offline from a length histogram.

Batch maxima are split into tiers at the schemes' ``max_tokens``; a batch whose longest sequence falls in
tier t needs a replica that holds up to tier t's cap. For each tier we draw batches conditioned on their
maximum falling in it and pick the strategy with the least expected makespan among the homogeneous ones and
every two-scheme mix (a "big" scheme that holds the tier, replicas of a smaller scheme for the bulk), GPU
counts filling the cluster and TP groups tiling the nodes. The makespan of a mix is estimated in the fluid
limit: the big replicas take the sequences relatively cheapest for them (the ones only they hold first),
with the 1F1B warm-up and the per-micro-batch cost included. The pool is the tiers' winners plus the fixed
homogeneous strategy sized for the dataset's longest sequence. Given ``extra(strategy)`` (the planner's
movement charge), every mix is scored by its expected makespan plus that.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Sequence

import numpy as np

from passes.plan.assign import Kind
from passes.plan.datasets import LengthDataset
from passes.plan.ir import CostModel, ParallelScheme, PlanError, Strategy
from passes.plan.placement import placeable, too_long_error, usable_schemes

__all__ = ["build_pool", "tier_caps", "conditional_batches", "fluid_makespan", "fluid_estimate", "fluid_scores",
           "mixes_of"]

_SPLIT_POINTS = 257  # evenly spaced boundary candidates at most
_GRID_ROWS = 1225  # boundary rows at most from them: three segments' 49 points


def tier_caps(cost_model: CostModel, gpus: int, longest: int) -> list[int]:
    """Distinct ``max_tokens`` of usable schemes, ascending, up to the first that holds ``longest``."""
    caps = sorted({cost_model.max_tokens(s) for s in usable_schemes(cost_model, gpus)})
    covering = [c for c in caps if c >= longest]
    if not covering:
        raise too_long_error(cost_model, gpus, longest)
    return [c for c in caps if c <= covering[0]]


def conditional_batches(dataset: LengthDataset, global_tokens: int, low: int, high: int, count: int,
                        rng: np.random.Generator) -> list[np.ndarray]:
    """Batches of ``global_tokens`` whose longest sequence lies in ``(low, high]``: one sequence drawn from
    that range, the rest from lengths ``<= high``, the last truncated. Empty when the range holds no data."""
    lengths = np.asarray(dataset.lengths, dtype=np.int64)
    weights = np.asarray(dataset.counts, dtype=np.float64)
    top = (lengths > low) & (lengths <= high)
    body = lengths <= high
    if not top.any():
        return []
    top_p, body_p = weights * top / weights[top].sum(), weights * body / weights[body].sum()
    mean = float(np.dot(lengths, body_p))
    batches = []
    for _ in range(count):
        first = int(rng.choice(lengths, p=top_p))
        rest = rng.choice(lengths, size=int(2 * global_tokens / mean) + 16, p=body_p)
        seqs = np.concatenate(([first], rest))
        ends = np.cumsum(seqs)
        n = int(np.searchsorted(ends, global_tokens)) + 1
        seqs = seqs[:n].copy()
        seqs[-1] -= int(ends[n - 1] - global_tokens)
        batches.append(seqs[seqs > 0])
    return batches


def _type_ms(k: Kind, work: np.ndarray, tokens: np.ndarray, longest: np.ndarray, seqs: np.ndarray,
             n: np.ndarray) -> np.ndarray:
    """Fluid 1F1B time of one of ``n`` equal replicas sharing ``work`` ms over ``tokens`` and ``seqs`` sequences,
    the longest of ``longest`` ms. A pipelined replica runs ``sqrt((pp-1) w / c)`` micro-batches, fewer where
    the longest sequence alone sets the largest (``w / longest``) or the replica has fewer sequences."""
    w, t = work / n, tokens / n
    busy = np.where(work > 0, 1.0, 0.0)
    v_min = np.maximum(1.0, t / k.max_tokens)
    if k.pp == 1:
        return busy * np.maximum(w + k.c * v_min, longest + k.c)
    with np.errstate(divide="ignore", invalid="ignore"):
        v_long = np.where(longest > 0, w / longest, np.inf)
    v_opt = np.sqrt((k.pp - 1) * w / k.c) if k.c > 0 else np.full_like(w, np.inf)
    v = np.maximum(v_min, np.minimum(np.minimum(v_opt, v_long), np.maximum(1.0, seqs / n)))
    return busy * (w + v * k.c + (k.pp - 1) * (np.maximum(w / v, longest) + k.c))


def _even_points(parts: int) -> int:
    """Evenly spaced boundary candidates for ``parts`` segments: the most (up to ``_SPLIT_POINTS``) that keep the
    grid within ``_GRID_ROWS`` rows (257 for two segments, 49 for three, 18 for four, 11 for five)."""
    points = _SPLIT_POINTS
    while points > 2 and math.comb(points + parts - 2, parts - 1) > _GRID_ROWS:
        points -= 1
    return points


def _split_grid(seqs_desc: np.ndarray, caps: list[int], parts: int) -> np.ndarray:
    """Candidate segment boundaries (rows of ``parts - 1`` ascending indices) over the sorted batch: every
    non-decreasing choice from evenly spaced points and the points where a scheme stops holding the sequences."""
    n = len(seqs_desc)
    points = set(np.linspace(0, n, min(n + 1, _even_points(parts))).astype(int).tolist())
    points.update(int(np.sum(seqs_desc > c)) for c in caps)
    grid = np.array(sorted(points))
    rows = np.zeros((1, 0), dtype=int)
    for _ in range(parts - 1):  # each row extended by every point at or after its last
        last = rows[:, -1] if rows.shape[1] else np.zeros(1, dtype=int)
        row, point = np.nonzero(grid[None, :] >= last[:, None])
        rows = np.concatenate((rows[row], grid[point][:, None]), axis=1)
    return rows


def fluid_makespan(types: list[Kind], counts: np.ndarray, seqs: np.ndarray) -> np.ndarray:
    """Estimated makespan on one batch of strategies made of ``types`` (largest capacity first), one row of
    replica counts per strategy in ``counts`` (shape C x K). Type k takes the k-th segment of the batch
    sorted longest first; the best segment boundaries are searched on a grid."""
    s = np.sort(seqs.astype(np.float64))[::-1]
    n = len(s)
    tokens = np.concatenate(([0.0], np.cumsum(s)))
    bounds = _split_grid(s, [t.max_tokens for t in types], len(types))
    starts = np.concatenate((np.zeros((len(bounds), 1), dtype=int), bounds), axis=1)
    ends = np.concatenate((bounds, np.full((len(bounds), 1), n)), axis=1)
    worst = np.zeros((counts.shape[0], len(bounds)))
    for k, t in enumerate(types):
        w = t.seq_ms_array(s)
        prefix = np.concatenate(([0.0], np.cumsum(w)))
        lo, hi = starts[:, k], ends[:, k]
        empty = hi <= lo
        head = np.minimum(lo, n - 1)
        feasible = empty | (s[head] <= t.max_tokens)
        longest = np.where(empty, 0.0, w[head])
        ms = _type_ms(t, prefix[hi] - prefix[lo], tokens[hi] - tokens[lo], longest, (hi - lo).astype(np.float64),
                      counts[:, k:k + 1].astype(np.float64))
        worst = np.maximum(worst, np.where(feasible, ms, np.inf))
    return worst.min(axis=1)


def fluid_scores(cost_model: CostModel, strategies: Sequence[Strategy], seq_lens: np.ndarray) -> list[float]:
    """The fluid makespan estimate of each strategy on one batch (inf where it cannot hold the batch), one
    vectorised ``fluid_makespan`` per set of schemes."""
    mt = cost_model.max_tokens
    by_types: dict[tuple[ParallelScheme, ...], list[int]] = {}
    for i, s in enumerate(strategies):
        types = tuple(sorted(s.schemes, key=lambda t: (-mt(t), -t.gpus)))
        by_types.setdefault(types, []).append(i)
    scores = [math.inf] * len(strategies)
    lens = np.asarray(seq_lens, dtype=np.int64)
    for types, members in by_types.items():
        coeffs = [Kind.of(cost_model, t) for t in types]
        counts = np.array([[dict(strategies[i].parts)[t] for t in types] for i in members])
        for i, value in zip(members, fluid_makespan(coeffs, counts, lens)):
            scores[i] = float(value)
    return scores


def fluid_estimate(cost_model: CostModel, strategy: Strategy, seq_lens: list[int]) -> float:
    """The fluid makespan estimate of one strategy on one batch (inf when it cannot hold the batch)."""
    return fluid_scores(cost_model, [strategy], np.asarray(seq_lens, dtype=np.int64))[0]


def mixes_of(cost_model: CostModel, gpus: int, types: list[ParallelScheme],
           limits: list[int] | None = None) -> list[Strategy]:
    """Every placeable strategy with at least one replica of each of ``types`` that fills ``gpus`` exactly:
    the leading types take 1..limit replicas each, the last type takes the GPUs that remain."""
    *head, last = types
    limits = limits or [gpus // t.gpus for t in head]
    out = []
    for counts in itertools.product(*(range(1, n + 1) for n in limits)):
        rest = gpus - sum(n * t.gpus for n, t in zip(counts, head))
        if rest <= 0 or rest % last.gpus:
            continue
        strategy = Strategy.of(list(zip(head, counts)) + [(last, rest // last.gpus)])
        if placeable(strategy, cost_model.gpus_per_node):
            out.append(strategy)
    return out


Extra = Callable[[Strategy], float]
"""What a strategy costs besides its compute, added to its score (the planner's movement charge)."""


def _score(cost_model: CostModel, types: list[ParallelScheme], mixes: list[Strategy],
           batches: list[np.ndarray], extra: Extra | None = None) -> list[tuple[float, str, Strategy]]:
    coeffs = [Kind.of(cost_model, t) for t in types]
    counts = np.array([[dict(m.parts).get(t, 0) for t in types] for m in mixes])
    mean = np.asarray(sum(fluid_makespan(coeffs, counts, b) for b in batches)) / len(batches)
    return [(float(score) + (extra(m) if extra is not None else 0.0), m.describe(), m)
            for score, m in zip(mean, mixes)]


def _tier_winners(cost_model: CostModel, gpus: int, cap: int, batches: list[np.ndarray],
                  keep: int, extra: Extra | None = None) -> list[Strategy]:
    """The ``keep`` best one- or two-scheme strategies for the tier, the best first, after replacing the
    best by its best three-scheme refinement when that is better still."""
    schemes = usable_schemes(cost_model, gpus)
    mt = cost_model.max_tokens
    scored: list[tuple[float, str, Strategy]] = []
    for big in (s for s in schemes if mt(s) >= cap):
        for small in [None, *(s for s in schemes if mt(s) < mt(big))]:
            types = [big] if small is None else [big, small]
            mixes = mixes_of(cost_model, gpus, types, limits=None if small is not None else [])
            if mixes:
                scored.extend(_score(cost_model, types, mixes, batches, extra))
    if not scored:
        raise PlanError(f"no strategy fills {gpus} GPUs with a replica that holds {cap} tokens")
    scored.sort(key=lambda x: x[:2])
    best = scored[0]
    if len(best[2].parts) == 2:
        (big, _), (small, _) = best[2].parts
        for middle in (s for s in schemes if mt(small) < mt(s) < mt(big)):
            types = [big, middle, small]
            mixes = mixes_of(cost_model, gpus, types, limits=[dict(best[2].parts)[big], 4])
            if mixes:
                best = min([best, *_score(cost_model, types, mixes, batches, extra)], key=lambda x: x[:2])
    return [best[2]] + [x[2] for x in scored[:keep] if x[2] != best[2]][: keep - 1]


def build_pool(cost_model: CostModel, gpus: int, dataset: LengthDataset, global_tokens: int, fixed: Strategy,
               seed: int = 0, batches_per_tier: int | None = None, per_tier: int = 2,
               progress: Callable[[int, int], None] | None = None, extra: Extra | None = None) -> list[Strategy]:
    """The pool: the ``per_tier`` best strategies of each length tier that the data reaches, plus ``fixed``;
    deterministic per seed. ``progress(done, total)`` is called as each tier is done; ``extra(strategy)`` is
    added to every mix's score."""
    caps = tier_caps(cost_model, gpus, dataset.max_len)
    if batches_per_tier is None:  # fewer draws when each batch is large: the estimate averages more sequences
        per_batch = max(1.0, global_tokens / dataset.mean_len)
        batches_per_tier = int(np.clip(4000 / per_batch, 4, 24))
    rng = np.random.default_rng(seed)
    pool: list[Strategy] = []
    low = 0
    for done, cap in enumerate(caps, 1):
        batches = conditional_batches(dataset, global_tokens, low, cap, batches_per_tier, rng)
        if batches:
            for winner in _tier_winners(cost_model, gpus, cap, batches, per_tier, extra):
                if winner not in pool:
                    pool.append(winner)
        low = cap
        if progress is not None:
            progress(done, len(caps))
    if fixed not in pool:
        pool.append(fixed)
    return pool
