"""``runtime.link_probe.overlap_slowdown`` on 2 gloo ranks: transfers that take no CPU (a sleep) cost the compute
beside them almost nothing; transfers that hold the interpreter (a busy Python loop, as gloo's copies hold cores
here) cost it about their own time. The figure the planner's overlapped model stretches compute by. And
``compute_slots`` on 4 ranks of one thread each: about the host's cores (at most 4), what
``passes.plan.host_sharing`` shares among the replicas of a step."""

from __future__ import annotations

import os
import time

from dist_util import run_ranks


def _sleeping(send, recv) -> None:
    time.sleep(0.004)


def _busy(send, recv) -> None:
    until = time.perf_counter() + 0.004
    while time.perf_counter() < until:  # holds the GIL the compute thread needs between its kernels
        pass


def _slowdowns(rank, world):
    from runtime.link_probe import overlap_slowdown

    return overlap_slowdown(_sleeping, 3, "cpu"), overlap_slowdown(_busy, 3, "cpu")


ATTEMPTS = 3
"""Probes tried before the test fails: a timing on 2 shared cores is sometimes taken while other work runs (one CI
run measured 0.35 for the busy transfers, against 0.8-1.1 on a quiet machine); noise only narrows the gap
between the two kinds of transfers, so one clean probe that shows it is the evidence."""


def _separated(probes: list[tuple[float, float]]) -> bool:
    return all(idle < 0.3 and busy > 0.5 and busy > idle + 0.3 for idle, busy in probes)


def test_the_slowdown_is_what_transfers_take_from_the_compute(tmp_path):
    tries = []
    for _ in range(ATTEMPTS):
        tries.append(run_ranks(2, tmp_path, _slowdowns, timeout_s=240))
        if _separated(tries[-1]):
            break
    assert _separated(tries[-1]), f"(idle, busy) slowdowns per rank, per try: {tries}"


def _slots(rank, world):
    from runtime.link_probe import compute_slots

    return compute_slots(3, "cpu")


def test_the_compute_slots_are_the_cores_the_ranks_share(tmp_path):
    """4 ranks of one thread: 4 where the host has 4 cores or more, its cores where it has fewer (2 here). A
    timing taken while other work runs reads fewer slots, so the closest of up to ``ATTEMPTS`` probes counts."""
    want = min(4, len(os.sched_getaffinity(0)))
    tries = []
    for _ in range(ATTEMPTS):
        slots = run_ranks(4, tmp_path, _slots, timeout_s=240)
        assert len(set(slots)) == 1 and 1.0 <= slots[0] <= 4.0, slots  # every rank reads the same figure
        tries.append(slots[0])
        if abs(slots[0] - want) <= 0.3 * want:
            break
    assert abs(tries[-1] - want) <= 0.3 * want, f"slots per try {tries}, expected about {want}"
