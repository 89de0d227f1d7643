"""Two-stage data assignment for one strategy (docs/design.md, sections 6.3-6.4).

Stage 1, dispatch: sequences to replicas, each only to replicas that can hold it, minimising the slowest
replica (1F1B warm-up included): longest-first greedy onto the replica that finishes earliest, then local
search on the bottleneck with estimated costs, then with exact packed costs; a batch of at most 12 sequences
is then searched by branch and bound within a node budget. Stage 2, packing: a replica's sequences into
micro-batches of at most ``max_tokens`` tokens that minimise its true 1F1B time
``sum_j t_j + (pp-1) max_j t_j`` (for pp = 1: the fewest micro-batches, exactly for up to 24 sequences within
a node budget). Everything is deterministic: node and iteration caps, no clocks, no randomness.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from passes.plan.ir import AttentionShape, CostModel, ParallelScheme, PlanError, bucket_padding

__all__ = ["Kind", "pack_replica", "dispatch", "first_fit", "pack_fewest_bins", "estimate_replica_ms"]

_EPS = 1e-9
_SEARCH_SEQS = 12  # batches of at most this many sequences are searched for their best assignment...
_SEARCH_NODES = 5_000  # ...within this many nodes
_EXACT_BINS_SEQS = 24  # the exact fewest-bins search runs for at most this many sequences...
_EXACT_BINS_NODES = 2000  # ...and visits at most this many nodes, else first-fit decreasing stands
_EVERY_COUNT_UP_TO = 12  # a pipelined replica of at most this many sequences tries every micro-batch count


@dataclass(frozen=True, slots=True)
class Kind:
    """One scheme's numbers, flattened for the inner loops."""

    scheme: ParallelScheme
    a: float
    b: float
    c: float
    max_tokens: int
    buckets: tuple[int, ...] = ()
    exchange: float = 0.0
    shape: AttentionShape = AttentionShape()

    @classmethod
    def of(cls, cost_model: CostModel, scheme: ParallelScheme) -> "Kind":
        e = cost_model.cost(scheme)
        return cls(scheme, e.a, e.b, e.c, e.max_tokens, cost_model.buckets, e.exchange, e.shape)

    @property
    def pp(self) -> int:
        return self.scheme.pp

    def seq_ms(self, seq_len: int) -> float:
        if self.exchange:
            return self.b * seq_len + max(self.a * self.shape.quadratic(seq_len), self.exchange * seq_len)
        return self.a * self.shape.quadratic(seq_len) + self.b * seq_len

    def seq_ms_array(self, seq_lens: np.ndarray) -> np.ndarray:
        """:meth:`seq_ms` of every length of a float array."""
        if self.exchange:
            return self.b * seq_lens + np.maximum(self.a * self.shape.quadratic(seq_lens), self.exchange * seq_lens)
        return self.a * self.shape.quadratic(seq_lens) + self.b * seq_lens

    def micro_ms(self, work: float, tokens: int) -> float:
        """A micro-batch of ``tokens`` whose sequences sum to ``work`` ms: plus ``c`` and its bucket padding."""
        return work + self.c + self.seq_ms(bucket_padding(self.buckets, tokens))


def estimate_replica_ms(kind: Kind, work: float, tokens: int, longest: float, count: int) -> float:
    """Fast estimate of a replica's 1F1B time from its totals, before packing: ``work`` (sum of per-sequence
    ms), ``tokens``, the largest single sequence's ms and the sequence count. Exact for pp = 1 when the
    sequences fit into ``ceil(tokens / max_tokens)`` micro-batches."""
    if count == 0:
        return 0.0
    v_min = max(1, -(-tokens // kind.max_tokens))
    if kind.pp == 1:
        return work + v_min * kind.c
    stages = kind.pp - 1
    best = math.inf
    v_opt = math.sqrt(stages * work / kind.c) if kind.c > 0 else float(count)
    v_cap = count if longest <= 0 else max(v_min, min(count, int(work / longest) + 1))
    for v in {v_min, min(count, max(v_min, math.floor(v_opt))), min(count, max(v_min, math.ceil(v_opt))), v_cap}:
        largest = max(work / v, longest) + kind.c
        best = min(best, work + v * kind.c + stages * largest)
    return best


def first_fit(seq_lens: list[int], order: list[int], cap: int) -> list[list[int]]:
    """Each sequence, in ``order``, into the first micro-batch with room for it (at most ``cap`` tokens)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        s = seq_lens[i]
        for b, left in enumerate(room):
            if s <= left:
                bins[b].append(i)
                room[b] -= s
                break
        else:
            bins.append([i])
            room.append(cap - s)
    return bins


def _fewest_bins_floor(sizes: list[int], cap: int) -> int:
    """A count no packing of ``sizes`` into bins of ``cap`` beats: the tokens over the cap, and the sizes
    above half the cap (no two share a bin)."""
    return max(-(-sum(sizes) // cap), sum(1 for s in sizes if 2 * s > cap))


def _fit_into(seq_lens: list[int], order: list[int], cap: int, bins: int,
              budget: list[int]) -> list[list[int]] | None:
    """A packing of ``order`` (longest first) into ``bins`` bins of ``cap`` tokens by depth-first search: each
    sequence tried in every bin with room, bins of equal room once; a branch is cut when the room that the
    shortest sequence still fits in is less than the tokens left. None when there is none, or when the
    search spends ``budget[0]`` (decremented per node; negative afterwards when it ran out)."""
    sizes = [seq_lens[i] for i in order]
    left = list(itertools.accumulate(reversed(sizes)))[::-1] + [0]
    smallest = sizes[-1]
    room = [cap] * bins
    members: list[list[int]] = [[] for _ in range(bins)]

    def place(k: int) -> bool:
        if k == len(order):
            return True
        budget[0] -= 1
        if budget[0] < 0 or sum(r for r in room if r >= smallest) < left[k]:
            return False
        tried = set()
        for b in range(bins):
            if room[b] >= sizes[k] and room[b] not in tried:
                tried.add(room[b])
                room[b] -= sizes[k]
                members[b].append(order[k])
                if place(k + 1):
                    return True
                room[b] += sizes[k]
                members[b].pop()
        return False

    return members if place(0) else None


def pack_fewest_bins(seq_lens: list[int], indices: list[int], cap: int) -> list[list[int]]:
    """The fewest micro-batches of at most ``cap`` tokens: first-fit decreasing, and when that uses more than
    the floor (tokens over the cap, sequences over half the cap), for at most ``_EXACT_BINS_SEQS`` sequences
    an exact search for fewer within ``_EXACT_BINS_NODES`` nodes; first-fit decreasing stands when the
    search runs out."""
    order = sorted(indices, key=lambda j: (-seq_lens[j], j))
    packed = first_fit(seq_lens, order, cap)
    floor = _fewest_bins_floor([seq_lens[i] for i in indices], cap)
    if len(packed) == floor or len(order) > _EXACT_BINS_SEQS:
        return packed
    budget = [_EXACT_BINS_NODES]
    for bins in range(floor, len(packed)):
        fewer = _fit_into(seq_lens, order, cap, bins, budget)
        if fewer is not None:
            return fewer
        if budget[0] < 0:
            break
    return packed


def _balance_time(kind: Kind, order: list[int], seq_lens: list[int], ms: Mapping[int, float],
                  v: int) -> list[list[int]] | None:
    """Longest-time-first onto the least-loaded micro-batch with token room; None when it does not fit."""
    bins: list[list[int]] = [[] for _ in range(v)]
    load = [kind.c] * v
    room = [kind.max_tokens] * v
    for i in order:
        s, best = seq_lens[i], -1
        for b in range(v):
            if s <= room[b] and (best < 0 or load[b] < load[best]):
                best = b
        if best < 0:
            return None
        bins[best].append(i)
        load[best] += ms[i]
        room[best] -= s
    return [b for b in bins if b]


def _one_f_one_b(pp: int, times: list[float]) -> float:
    return (sum(times) + (pp - 1) * max(times)) if times else 0.0


def _micro_batch_counts(kind: Kind, ms: Mapping[int, float], tokens: int) -> list[int]:
    """Micro-batch counts worth trying for a pipelined replica, all in ``[v_min, sequences]`` (a sequence is
    never split, so no count above the sequence count exists): every one for few sequences, else the counts
    near ``sqrt((pp-1) W / c)`` (the best for equal micro-batches) and near ``W / longest`` (past which the
    longest sequence alone sets the largest micro-batch), clamped into that range."""
    count = len(ms)
    v_min = max(1, -(-tokens // kind.max_tokens))
    if count <= _EVERY_COUNT_UP_TO:
        return list(range(v_min, count + 1))
    work, longest = sum(ms.values()), max(ms.values())
    v_opt = math.sqrt((kind.pp - 1) * work / kind.c) if kind.c > 0 else count
    v_long = work / longest if longest > 0 else count
    near = {v for centre in (v_opt, v_long) for v in range(math.floor(centre) - 1, math.ceil(centre) + 2)}
    return sorted({v_min, *(min(count, max(v_min, v)) for v in near)})


def pack_replica(kind: Kind, seq_lens: list[int], indices: list[int]) -> tuple[list[list[int]], float]:
    """Stage 2: micro-batches for one replica and its exact 1F1B time."""
    if not indices:
        return [], 0.0
    if any(seq_lens[i] > kind.max_tokens for i in indices):
        raise PlanError(f"a sequence longer than {kind.max_tokens} tokens was given to {kind.scheme.describe()}")
    ms = {i: kind.seq_ms(seq_lens[i]) for i in indices}

    def times(bins: list[list[int]]) -> list[float]:
        return [kind.micro_ms(sum(ms[i] for i in b), sum(seq_lens[i] for i in b)) for b in bins]

    best_bins = pack_fewest_bins(seq_lens, indices, kind.max_tokens)
    best_ms = _one_f_one_b(kind.pp, times(best_bins))
    if kind.pp == 1:
        return best_bins, best_ms
    order = sorted(indices, key=lambda j: (-seq_lens[j], j))
    for v in _micro_batch_counts(kind, ms, sum(seq_lens[i] for i in indices)):
        packed = _balance_time(kind, order, seq_lens, ms, v)
        if packed is None:
            continue
        total = _one_f_one_b(kind.pp, times(packed))
        if total < best_ms - _EPS:
            best_bins, best_ms = packed, total
    return best_bins, best_ms


class _Loads:
    """Per-replica totals that make the pre-packing estimate O(1) to update."""

    def __init__(self, kinds: list[Kind], seq_lens: list[int]):
        self.kinds, self.seq_lens = kinds, seq_lens
        tables: dict[ParallelScheme, list[float]] = {}
        for kind in kinds:
            if kind.scheme not in tables:
                tables[kind.scheme] = [kind.seq_ms(s) for s in seq_lens]
        self.w = [tables[k.scheme] for k in kinds]
        self.members: list[list[int]] = [[] for _ in kinds]
        self.work = [0.0] * len(kinds)
        self.tokens = [0] * len(kinds)
        self.longest = [0.0] * len(kinds)
        self.est = [0.0] * len(kinds)

    def longest_without(self, r: int, i: int) -> float:
        """The largest member ms of ``r`` once ``i`` is gone."""
        w = self.w[r]
        if w[i] < self.longest[r]:
            return self.longest[r]
        return max((w[j] for j in self.members[r] if j != i), default=0.0)

    def est_replace(self, r: int, out: int, into: int, longest_without_out: float | None = None) -> float:
        """Estimate of ``r`` with member ``out`` replaced by ``into`` (either may be -1: none)."""
        w, work, tokens, count = self.w[r], self.work[r], self.tokens[r], len(self.members[r])
        longest = self.longest[r]
        if out >= 0:
            work, tokens, count = work - w[out], tokens - self.seq_lens[out], count - 1
            longest = self.longest_without(r, out) if longest_without_out is None else longest_without_out
        if into >= 0:
            work, tokens, count = work + w[into], tokens + self.seq_lens[into], count + 1
            longest = max(longest, w[into])
        return estimate_replica_ms(self.kinds[r], work, tokens, longest, count)

    def est_with(self, r: int, i: int) -> float:
        return self.est_replace(r, -1, i)

    def est_without(self, r: int, i: int) -> float:
        return self.est_replace(r, i, -1)

    def add(self, r: int, i: int) -> None:
        self.est[r] = self.est_with(r, i)
        self.members[r].append(i)
        self.work[r] += self.w[r][i]
        self.tokens[r] += self.seq_lens[i]
        self.longest[r] = max(self.longest[r], self.w[r][i])

    def remove(self, r: int, i: int) -> None:
        self.est[r] = self.est_without(r, i)
        self.longest[r] = self.longest_without(r, i)
        self.members[r].remove(i)
        self.work[r] -= self.w[r][i]
        self.tokens[r] -= self.seq_lens[i]


def _groups(kinds: list[Kind]) -> list[list[int]]:
    """Replica indices grouped by scheme, in first-seen order."""
    by_scheme: dict[ParallelScheme, list[int]] = {}
    for r, kind in enumerate(kinds):
        by_scheme.setdefault(kind.scheme, []).append(r)
    return list(by_scheme.values())


def _greedy(loads: _Loads, groups: list[list[int]]) -> None:
    """Longest first, each onto the replica (the least loaded of each scheme) that finishes earliest."""
    seq_lens = loads.seq_lens
    heaps = [[(0.0, r) for r in g] for g in groups]
    for i in sorted(range(len(seq_lens)), key=lambda j: (-seq_lens[j], j)):
        best: tuple[float, int, int] | None = None
        for g, heap in enumerate(heaps):
            if seq_lens[i] > loads.kinds[groups[g][0]].max_tokens:
                continue
            while heap[0][0] != loads.est[heap[0][1]]:
                heapq.heappop(heap)
            r = heap[0][1]
            new = loads.est_with(r, i)
            if best is None or new < best[0] - _EPS:
                best = (new, r, g)
        if best is None:
            raise PlanError(f"sequence {i} of {seq_lens[i]} tokens fits no replica of this strategy")
        _, r, g = best
        loads.add(r, i)
        heapq.heappush(heaps[g], (loads.est[r], r))


def _receivers(cost: list[float], groups: list[list[int]], exclude: int, per_group: int) -> list[int]:
    out = []
    for g in groups:
        out.extend(sorted((r for r in g if r != exclude), key=lambda r: (cost[r], r))[:per_group])
    return out


def _best_move(loads: _Loads, r: int, receivers: list[int]) -> tuple[float, int, int, int] | None:
    """The move or swap off bottleneck ``r`` that lowers max(r, receiver) the most: (new max, i, q, j|-1)."""
    target, seq_lens, kinds = loads.est[r], loads.seq_lens, loads.kinds
    best = None
    for i in sorted(loads.members[r], key=lambda j: (-seq_lens[j], j)):
        c_r = loads.est_without(r, i)
        for q in receivers:
            if seq_lens[i] > kinds[q].max_tokens:
                continue
            m = max(c_r, loads.est_with(q, i))
            if m < target - _EPS and (best is None or m < best[0] - _EPS):
                best = (m, i, q, -1)
    if best is not None:
        return best
    for i in sorted(loads.members[r], key=lambda j: (-seq_lens[j], j))[:8]:
        r_longest = loads.longest_without(r, i)
        for q in receivers:
            if seq_lens[i] > kinds[q].max_tokens:
                continue
            for j in loads.members[q]:
                if seq_lens[j] >= seq_lens[i] or seq_lens[j] > kinds[r].max_tokens:
                    continue
                m = max(loads.est_replace(r, i, j, r_longest), loads.est_replace(q, j, i))
                if m < target - _EPS and (best is None or m < best[0] - _EPS):
                    best = (m, i, q, j)
    return best


def _improve_estimates(loads: _Loads, groups: list[list[int]], rounds: int) -> None:
    """Local search on the bottleneck replica with the pre-packing estimate."""
    for _ in range(rounds):
        r = max(range(len(loads.kinds)), key=lambda q: (loads.est[q], -q))
        found = _best_move(loads, r, _receivers(loads.est, groups, r, per_group=2))
        if found is None:
            return
        _, i, q, j = found
        loads.remove(r, i)
        loads.add(q, i)
        if j >= 0:
            loads.remove(q, j)
            loads.add(r, j)


class _Exact:
    """Exact packed cost of a member set, cached."""

    def __init__(self, kinds: list[Kind], seq_lens: list[int]):
        self.kinds, self.seq_lens = kinds, seq_lens
        self.cache: dict[tuple[ParallelScheme, tuple[int, ...]], tuple[list[list[int]], float]] = {}

    def pack(self, r: int, members: list[int]) -> tuple[list[list[int]], float]:
        key = (self.kinds[r].scheme, tuple(sorted(members)))
        if key not in self.cache:
            self.cache[key] = pack_replica(self.kinds[r], self.seq_lens, list(key[1]))
        return self.cache[key]

    def ms(self, r: int, members: list[int]) -> float:
        return self.pack(r, members)[1]


def _improve_exact(exact: _Exact, members: list[list[int]], groups: list[list[int]], rounds: int) -> None:
    """Local search with exact packed costs: moves off the bottleneck replica."""
    seq_lens, kinds = exact.seq_lens, exact.kinds
    cost = [exact.ms(r, m) for r, m in enumerate(members)]
    for _ in range(rounds):
        r = max(range(len(kinds)), key=lambda q: (cost[q], -q))
        best = None
        by_length = sorted(members[r], key=lambda j: (-seq_lens[j], j))
        tried = by_length if len(by_length) <= 16 else by_length[:8] + by_length[-8:]
        for i in tried:
            rest = [j for j in members[r] if j != i]
            c_r = exact.ms(r, rest)
            for q in _receivers(cost, groups, r, per_group=1):
                if seq_lens[i] > kinds[q].max_tokens:
                    continue
                m = max(c_r, exact.ms(q, members[q] + [i]))
                if m < cost[r] - _EPS and (best is None or m < best[0] - _EPS):
                    best = (m, i, q, rest)
        if best is None:
            return
        _, i, q, rest = best
        members[r], members[q] = rest, members[q] + [i]
        cost[r], cost[q] = exact.ms(r, rest), exact.ms(q, members[q])


@dataclass(frozen=True, slots=True)
class _Tally:
    """A replica's sequences during the search, as totals."""

    work: float = 0.0
    tokens: int = 0
    longest: float = 0.0
    """The longest sequence's ms."""
    over_half: int = 0
    """Sequences of more than half the cap: no two share a micro-batch."""
    count: int = 0

    def plus(self, kind: Kind, ms: float, tokens: int) -> "_Tally":
        return _Tally(self.work + ms, self.tokens + tokens, max(self.longest, ms),
                      self.over_half + (2 * tokens > kind.max_tokens), self.count + 1)


def _replica_floor(kind: Kind, tally: _Tally) -> float:
    """A time no packing of a replica's sequences beats: with ``v`` micro-batches (at least the tokens over
    the cap and the sequences over half of it, at most the sequences) it takes at least
    ``W + v c + (pp-1) (max(W / v, longest) + c)``, convex in ``v`` and least at
    ``min(sqrt((pp-1) W / c), W / longest)``."""
    if tally.count == 0:
        return 0.0
    work, longest = tally.work, tally.longest
    v_min = max(1, -(-tally.tokens // kind.max_tokens), tally.over_half)
    if kind.pp == 1:
        return work + v_min * kind.c
    stages = kind.pp - 1
    centre = min(math.sqrt(stages * work / kind.c) if kind.c > 0 else math.inf,
                 work / longest if longest > 0 else math.inf)
    if not math.isfinite(centre):
        centre = v_min
    counts = {min(tally.count, max(v_min, v)) for v in (math.floor(centre), math.ceil(centre))}
    return min(work + v * kind.c + stages * (max(work / v, longest) + kind.c) for v in counts)


class _Search:
    """Branch and bound over the assignments of a small batch: sequences longest first, each onto a replica
    that holds it (of a scheme's empty replicas only the first), a branch cut when a replica's floor
    (``_replica_floor``) reaches the best max exact time found; within a node budget (each placement and
    each replica packed at a leaf costs one)."""

    def __init__(self, exact: _Exact, groups: list[list[int]]):
        self.exact, self.groups = exact, groups
        kinds, seq_lens = exact.kinds, exact.seq_lens
        self.order = sorted(range(len(seq_lens)), key=lambda j: (-seq_lens[j], j))
        self.ms = [[kinds[g[0]].seq_ms(s) for s in seq_lens] for g in groups]
        self.members: list[list[int]] = [[] for _ in kinds]
        self.tallies = [_Tally()] * len(kinds)
        self.floors = [0.0] * len(kinds)
        self.used = [0] * len(groups)  # each group's replicas in use: its first ones
        self.best: list[list[int]] = []
        self.best_ms = math.inf
        self.nodes = 0

    def run(self, incumbent: list[list[int]], nodes: int) -> list[list[int]]:
        """The best assignment found from ``incumbent`` within ``nodes`` nodes."""
        self.best = [list(m) for m in incumbent]
        self.best_ms = max(self.exact.ms(r, m) for r, m in enumerate(incumbent))
        self.nodes = nodes
        self._place(0, 0.0)
        return self.best

    def _options(self, i: int) -> list[tuple[float, int, int, _Tally]]:
        """(floor, replica, group, tally) with ``i`` added, for each replica that may take sequence ``i``,
        the least floor first."""
        kinds, s = self.exact.kinds, self.exact.seq_lens[i]
        out = []
        for g, replicas in enumerate(self.groups):
            kind = kinds[replicas[0]]
            if s > kind.max_tokens:
                continue
            for r in replicas[:self.used[g] + 1]:
                tally = self.tallies[r].plus(kind, self.ms[g][i], s)
                out.append((_replica_floor(kind, tally), r, g, tally))
        return sorted(out, key=lambda o: o[:3])

    def _complete(self) -> None:
        """Keep the full assignment if its max exact time is the best yet; packing stops at the first replica
        that reaches the best, the highest floors first."""
        worst = 0.0
        for r in sorted((r for r, m in enumerate(self.members) if m), key=lambda r: (-self.floors[r], r)):
            self.nodes -= 1
            worst = max(worst, self.exact.ms(r, self.members[r]))
            if worst >= self.best_ms - _EPS:
                return
        self.best, self.best_ms = [list(m) for m in self.members], worst

    def _place(self, k: int, floor: float) -> None:
        self.nodes -= 1
        if self.nodes < 0:
            return
        if k == len(self.order):
            self._complete()
            return
        i = self.order[k]
        for replica_floor, r, g, tally in self._options(i):
            if max(floor, replica_floor) >= self.best_ms - _EPS:
                break
            saved = self.tallies[r], self.floors[r], self.used[g]
            self.members[r].append(i)
            self.tallies[r], self.floors[r] = tally, replica_floor
            self.used[g] = max(saved[2], self.groups[g].index(r) + 1)
            self._place(k + 1, max(floor, replica_floor))
            self.members[r].pop()
            self.tallies[r], self.floors[r], self.used[g] = saved


def dispatch(kinds: list[Kind], seq_lens: list[int], rounds: int = 64) -> list[tuple[list[list[int]], float]]:
    """Stages 1 and 2 for one strategy: per replica (in ``kinds`` order), its micro-batches and exact ms."""
    longest = max(seq_lens)
    if longest > max(k.max_tokens for k in kinds):
        raise PlanError(f"a sequence of {longest} tokens fits no replica of this strategy")
    groups = _groups(kinds)
    exact = _Exact(kinds, seq_lens)
    loads = _Loads(kinds, seq_lens)
    _greedy(loads, groups)
    _improve_estimates(loads, groups, rounds)
    members = loads.members
    _improve_exact(exact, members, groups, rounds=max(4, rounds // 8))
    if len(seq_lens) <= _SEARCH_SEQS:
        members = _Search(exact, groups).run(members, _SEARCH_NODES)
    return [exact.pack(r, m) for r, m in enumerate(members)]
