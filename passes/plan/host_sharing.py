"""Replicas whose ranks share one host's cores: the processor-sharing model of their step.

Where every rank computes on its own device (GPUs) the replicas of a step do not slow each other, and the step
is its slowest replica. Where several ranks share a host's cores (local CPU ranks: ``Links.compute_slots``
below the ranks of a node), they do: while ``n`` ranks of a node are busy and the node can run ``slots`` of
them at full speed, each runs at ``min(1, slots / n)`` of it. A replica that ends early then gives the others
its cores, and one whose movement keeps its ranks busy longer takes them; the per-replica model of
``passes.plan.movement.MovementCost.step_ms`` sees neither.

Owns :func:`shared_work` (the work, in core-milliseconds per rank, that gives each replica its compute time
when the replicas start together and share the node), :func:`shared_finish` (when each replica ends, given its
work) and :func:`host_shared_ms` (each replica's end once its movement's extra time is added: the extra time
is work at the mean rate the replica computed at, so it ends at ``compute + extra`` where nothing else
changes, and later where the others keep the cores longer). Plain numbers, no torch: the planner's side."""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["shared_work", "shared_finish", "host_shared_ms"]


def _check(ranks: Sequence[int], slots: float) -> None:
    if not (isinstance(slots, (int, float)) and math.isfinite(slots) and slots > 0):
        raise ValueError(f"slots must be a finite number > 0, got {slots!r}")
    if any(r < 0 for r in ranks):
        raise ValueError(f"ranks per replica must be >= 0, got {list(ranks)!r}")


def shared_work(ms: Sequence[float], ranks: Sequence[int], slots: float) -> list[float]:
    """Per replica, the work (ms at full speed) of each of its ``ranks`` that ends it at ``ms`` when every
    replica starts at 0 and the node runs ``slots`` ranks at full speed (a replica with no ranks here: 0)."""
    _check(ranks, slots)
    order = sorted(range(len(ms)), key=lambda i: ms[i])
    busy = sum(ranks)
    work, now, done = [0.0] * len(ms), 0.0, 0.0
    for i in order:
        if busy > 0:
            done += (ms[i] - now) * min(1.0, slots / busy)
        now = max(now, ms[i])
        work[i] = done if ranks[i] else 0.0
        busy -= ranks[i]
    return work


def shared_finish(work: Sequence[float], ranks: Sequence[int], slots: float) -> list[float]:
    """Per replica, when it ends: every replica starts at 0 with ``work`` ms at full speed on each of its
    ``ranks``, and while ``n`` ranks are busy each runs at ``min(1, slots / n)`` (a replica with no ranks here or
    no work ends at 0)."""
    _check(ranks, slots)
    left = [w if r else 0.0 for w, r in zip(work, ranks)]
    end = [0.0] * len(left)
    active = [i for i, w in enumerate(left) if w > 0]
    now = 0.0
    while active:
        rate = min(1.0, slots / sum(ranks[i] for i in active))
        first = min(left[i] for i in active)
        now += first / rate
        for i in active:
            left[i] -= first
        for i in [i for i in active if left[i] <= 1e-12 * max(1.0, work[i])]:
            end[i] = now
        active = [i for i in active if end[i] == 0.0]
    return end


def host_shared_ms(compute_ms: Sequence[float], alone_ms: Sequence[float], ranks: Sequence[int],
                   slots: float) -> list[float]:
    """Per replica, when it ends on a node of ``slots`` that its ``ranks`` share: ``compute_ms`` is each
    replica's compute as it runs beside the others with its movement free, ``alone_ms`` its end in the
    per-replica model (compute plus what its movement adds, >= ``compute_ms``). The extra time is work at
    the mean rate the replica computed at (its work over ``compute_ms``; a replica that computes nothing, at
    the rate of all the node's ranks at once)."""
    if len(compute_ms) != len(alone_ms) or len(compute_ms) != len(ranks):
        raise ValueError(f"need one compute, one end and one rank count per replica, got {len(compute_ms)}, "
                         f"{len(alone_ms)} and {len(ranks)}")
    work = shared_work(compute_ms, ranks, slots)
    everyone = min(1.0, slots / max(1, sum(ranks)))
    grown = [w + max(0.0, a - c) * (w / c if c > 0 else everyone) for w, a, c in zip(work, alone_ms, compute_ms)]
    return shared_finish(grown, ranks, slots)
