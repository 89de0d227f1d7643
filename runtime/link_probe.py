"""What a message between two ranks of this job costs, measured with the movement's own pattern.

Owns :func:`probe_links` (collective): every rank sends a message of n bytes to rank + d and receives one from rank
- d at once, for every d, as ``runtime.redistribute`` moves parameters and gradients, timed per round for a few
sizes; a least-squares line ``round = latency + n / bandwidth`` over the sizes gives the latency per message and
the bandwidth one way. The busiest rank's time counts (a round ends when its slowest pair does). It also times how
fast every rank at once writes freshly allocated memory (a zeroed buffer of 64 MiB) and frees it: the movement
phases' own buffers (the compute copy, its gradient, the shard's gradient, one staging and one receive buffer) are
new each step, and on a CPU their first touch costs about as much as the transfer; and how fast every rank at once
adds one 64 MiB buffer into another it wrote before (the movement's gathers and sums). And it times one pair alone
(ranks 0 and 1 exchanging while the others wait), the fastest of ``PAIR_PROBES`` tries: where ranks share a host's
cores, a transfer runs faster when fewer run beside it, and where there are fewer cores than ranks a short exchange
of two of them sometimes runs with both on one core, at half the speed, until the scheduler spreads them (on 4
ranks and 2 cores one try gave 0.9 GB/s and the next 1.7-2.1); the movement's phases last long enough to be spread.
And it times how much slower compute runs while transfers run beside it (``overlap_slowdown``, what the overlapped
runtime's compute pays for the movement it hides): every rank multiplies matrices for about
``SLOWDOWN_COMPUTE_MS`` alone, then again while a thread of its own (on a GPU, a stream of its own) runs rounds of
pairs lasting about half that; the slowdown is the compute's extra time over the transfers' time alone (0: the
transfers cost the compute nothing, as copy engines and NICs nearly do; 1: every transfer millisecond is a compute
millisecond lost, as where ranks share a host's cores). And how many ranks compute at full speed at once
(:func:`compute_slots`: one rank's matrix products alone against every rank's at once), below the ranks where
they share a host's cores: the replicas of a step then slow each other (``passes.plan.host_sharing``).
What it measures is whatever the backend uses between these ranks: gloo over local sockets on a CPU machine, NCCL
over NVLink between the GPUs of one node.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from passes.plan.links import Links
from runtime import distributed as comm
from runtime.overlap import movement_stream

__all__ = ["LinkProbe", "probe_links", "overlap_slowdown", "compute_slots", "DEFAULT_PROBE_BYTES",
           "PAIR_PROBES"]

DEFAULT_PROBE_BYTES = (1 << 16, 1 << 20, 1 << 22, 1 << 24)
"""Message sizes probed: 64 KiB to 16 MiB."""
PAIR_PROBES = 3
"""Tries of the pair-alone probe; its speed is the fastest (module docstring)."""
FRESH_PROBE_BYTES = 1 << 26
"""Size of the freshly allocated buffer the probe writes: 64 MiB, above the C allocator's largest threshold for
serving a block from memory it already holds (32 MiB), so every repeat writes new pages, as the movement's
buffers of a model of any size do (a smaller buffer is served from reused memory after the first repeat, and
its rate is that of warm memory)."""
WARM_PASSES = 4
"""Adds per timing of the written-memory probe (``FRESH_PROBE_BYTES`` each)."""
SLOWDOWN_COMPUTE_MS = 200.0
"""About how long the slowdown probe's compute runs alone, ms."""
SLOWDOWN_MESSAGE_BYTES = 1 << 22
"""Message size of the slowdown probe's transfers (4 MiB)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkProbe:
    """The fitted cost of one message, and the measurements behind it."""

    gbps: float
    """Bandwidth one way, GB/s (10^9 bytes per second)."""
    latency_us: float
    """Start-up of one message, microseconds (0 when the fit's intercept is negative)."""
    fresh_gbps: float
    """GB/s at which every rank at once writes newly allocated memory (the busiest rank's median)."""
    freed_gbps: float
    """GB/s at which every rank at once frees such memory (the busiest rank's median)."""
    warm_gbps: float
    """GB/s at which every rank at once adds a buffer it wrote before into another (the busiest rank's
    median; bytes of one operand)."""
    pair_gbps: float
    """Bandwidth one way, GB/s, of one pair exchanging while every other rank waits (the fastest of
    ``PAIR_PROBES`` tries)."""
    round_ms: tuple[tuple[int, float], ...]
    """(message bytes, median ms of one round on the busiest rank) per size."""
    overlap_slowdown: float = 0.0
    """Extra compute time per millisecond of transfers running beside it (module docstring; 0: not probed)."""
    compute_slots: float | None = None
    """How many ranks compute at full speed at once (:func:`compute_slots`: about the host's cores over each
    rank's threads where the ranks share them; None: not probed)."""

    def host_links(self, world: int) -> Links:
        """The links of ``world`` ranks sharing this host (the probe's ranks: gloo on one CPU machine): each
        transfer at most the pair's speed, all at once sharing ``world`` times the every-rank speed, the
        probed latency and fresh-memory rate, and the compute slots where fewer than ``world`` ranks compute at
        full speed at once."""
        slots = self.compute_slots if self.compute_slots is not None and self.compute_slots < world else None
        return Links(gpus_per_node=world, intra_gbps=self.pair_gbps, inter_gbps=self.pair_gbps,
                     latency_us=self.latency_us, fresh_gbps=self.fresh_gbps, freed_gbps=self.freed_gbps,
                     warm_gbps=self.warm_gbps, host_gbps=world * self.gbps,
                     overlap_slowdown=self.overlap_slowdown, compute_slots=slots)

    def to_dict(self) -> dict:
        return {"gbps": self.gbps, "latency_us": self.latency_us, "fresh_gbps": self.fresh_gbps,
                "freed_gbps": self.freed_gbps,
                "warm_gbps": self.warm_gbps,
                "pair_gbps": self.pair_gbps, "overlap_slowdown": self.overlap_slowdown,
                "compute_slots": self.compute_slots,
                "round_ms": [[n, round(ms, 4)] for n, ms in self.round_ms]}


def probe_links(sizes: tuple[int, ...] = DEFAULT_PROBE_BYTES, repeats: int = 5,
                device: torch.device | str = "cpu") -> LinkProbe:
    """Collective over every rank of the job (two at least): time the rounds of pairs for each message size
    in ``sizes`` (bytes, a multiple of 4), ``repeats`` times each after one warm-up, and fit the line."""
    world, rank = comm.world_size(), comm.rank()
    if world < 2:
        raise ValueError("probing links needs at least two ranks")
    if len(sizes) < 2 or any(n < 4 or n % 4 for n in sizes):
        raise ValueError(f"need two or more message sizes, positive multiples of 4 bytes, got {sizes!r}")

    def all_rounds(out: torch.Tensor, into: torch.Tensor) -> None:
        for d in range(1, world):
            comm.exchange([(out, (rank + d) % world)], [(into, (rank - d) % world)])

    def pair_alone(out: torch.Tensor, into: torch.Tensor) -> None:
        if rank < 2:
            comm.exchange([(out, 1 - rank)], [(into, 1 - rank)])

    rows = [(nbytes, _busiest_median_ms(nbytes, repeats, device, all_rounds) / (world - 1)) for nbytes in sizes]
    fresh, freed = _fresh_write_ms(FRESH_PROBE_BYTES, repeats, device)
    # WARM_PASSES adds per timing: one alone is shorter than a time slice of a core the ranks share
    warm = _busiest_median_ms(FRESH_PROBE_BYTES, repeats, device, _add_passes) / WARM_PASSES
    slope, intercept = _fit(rows)
    pair_slope = min(_fit([(nbytes, _busiest_median_ms(nbytes, repeats, device, pair_alone)) for nbytes in sizes])[0]
                     for _ in range(PAIR_PROBES))
    return LinkProbe(gbps=float(1 / (slope * 1e6)), latency_us=max(0.0, float(intercept) * 1e3),
                     fresh_gbps=FRESH_PROBE_BYTES / (fresh * 1e6),
                     freed_gbps=FRESH_PROBE_BYTES / (max(freed, 1e-6) * 1e6),
                     warm_gbps=FRESH_PROBE_BYTES / (warm * 1e6), pair_gbps=float(1 / (pair_slope * 1e6)),
                     round_ms=tuple(rows), overlap_slowdown=overlap_slowdown(all_rounds, repeats, device),
                     compute_slots=compute_slots(repeats, device))


def _busiest(*ms: float) -> list[float]:
    """Collective: each figure's largest value over every rank."""
    return [float(x) for x in comm.all_reduce(torch.tensor(ms, dtype=torch.float64), op="max")]


def _timed(work: Callable[[], None]) -> float:
    """Collective: ms of ``work`` on this rank, every rank starting together after a barrier."""
    comm.barrier()
    started = time.perf_counter()
    work()
    return (time.perf_counter() - started) * 1e3


def _matmuls(device: torch.device) -> Callable[[int], None]:
    """The probes' compute: ``n`` products of a 256 x 256 matrix (synchronised on a GPU)."""
    a = torch.randn(256, 256, device=device) / 16
    out = torch.empty_like(a)

    def compute(n: int) -> None:
        for _ in range(n):
            torch.mm(a, a, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return compute


def overlap_slowdown(transfers: Callable[[torch.Tensor, torch.Tensor], None], repeats: int,
                     device: torch.device | str) -> float:
    """Collective: extra ms of compute per ms of ``transfers`` (one call moves one message each way per pair)
    running beside it on a thread of their own, the busiest rank's medians over ``repeats`` timings
    (module docstring)."""
    device = torch.device(device)
    compute = _matmuls(device)
    send = torch.ones(SLOWDOWN_MESSAGE_BYTES // 4, device=device)
    recv = torch.empty_like(send)

    stream = movement_stream(device)  # one for the whole probe, as the executor keeps one (runtime.overlap)

    def move(n: int) -> None:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for _ in range(n):
                transfers(send, recv)
            if stream is not None:
                stream.synchronize()

    compute(4)  # warm-up
    [per_mm] = _busiest(_timed(lambda: compute(20)) / 20)
    mms = max(1, int(SLOWDOWN_COMPUTE_MS / max(per_mm, 1e-3)))
    [per_round] = _busiest(_timed(lambda: move(1)))
    rounds = max(1, int(SLOWDOWN_COMPUTE_MS / 2 / max(per_round, 1e-3)))
    alone, beside, moving = [], [], []
    for _ in range(repeats):
        alone.append(_timed(lambda: compute(mms)))
        moving.append(_timed(lambda: move(rounds)))
        thread = threading.Thread(target=move, args=(rounds,), name="hydraulis-slowdown-probe")
        comm.barrier()
        started = time.perf_counter()
        thread.start()
        compute(mms)
        beside.append((time.perf_counter() - started) * 1e3)
        thread.join()
    c, m, b = _busiest(statistics.median(alone), statistics.median(moving), statistics.median(beside))
    return max(0.0, (b - c) / min(m, c))


def compute_slots(repeats: int, device: torch.device | str) -> float:
    """Collective: how many ranks compute at full speed at once. Rank 0 multiplies matrices for about
    ``SLOWDOWN_COMPUTE_MS`` while the others wait, then every rank does the same work at once; the slots are
    ``world`` times the first time over the second (the busiest rank's medians over ``repeats`` timings),
    between 1 and ``world``: about ``world`` where each rank has a device of its own, the host's cores over each
    rank's threads where they share it (2 for 4 ranks of one thread on 2 cores)."""
    world, first = comm.world_size(), comm.rank() == 0
    compute = _matmuls(torch.device(device))

    def timed(n: int, me: bool) -> float:
        ms = _timed(lambda: compute(n) if me else None)
        comm.barrier()  # the others wait until it is done
        return ms

    compute(4)  # warm-up
    [per_mm] = _busiest(timed(20, first) / 20)
    n = max(1, int(SLOWDOWN_COMPUTE_MS / max(per_mm, 1e-3)))
    alone, every = _busiest(statistics.median(timed(n, first) for _ in range(repeats)),
                            statistics.median(timed(n, True) for _ in range(repeats)))
    return min(float(world), max(1.0, world * alone / max(every, 1e-6)))


def _add_passes(source: torch.Tensor, into: torch.Tensor) -> None:
    """``WARM_PASSES`` times, add ``source`` into ``into`` (the written-memory probe's timed work)."""
    for _ in range(WARM_PASSES):
        into.add_(source)


def _fit(rows: list[tuple[int, float]]) -> tuple[float, float]:
    """(ms per byte, ms) of the least-squares line through (bytes, ms)."""
    n = np.array([r[0] for r in rows], dtype=np.float64)
    ms = np.array([r[1] for r in rows])
    slope, intercept = np.polyfit(n, ms, 1)
    if slope <= 0:
        raise RuntimeError(f"the round times {rows} do not grow with the message size: no bandwidth to fit")
    return float(slope), float(intercept)


def _busiest_median_ms(nbytes: int, repeats: int, device: torch.device | str,
                       move: Callable[[torch.Tensor, torch.Tensor], None]) -> float:
    """The busiest rank's median ms of ``move(out, into)`` on ``nbytes`` messages, every rank starting together
    after a barrier, ``repeats`` times after one warm-up (collective)."""
    out = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    into = torch.empty_like(out)
    times = []
    for i in range(repeats + 1):
        comm.barrier()
        started = time.perf_counter()
        move(out, into)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append((time.perf_counter() - started) * 1e3)
    [busiest] = _busiest(statistics.median(times))
    return busiest


def _fresh_write_ms(nbytes: int, repeats: int, device: torch.device | str) -> tuple[float, float]:
    """The busiest rank's median ms to allocate and zero ``nbytes``, and to free them, every rank at once."""
    written, freed = [], []
    for _ in range(repeats):
        comm.barrier()
        started = time.perf_counter()
        buffer = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        written.append((time.perf_counter() - started) * 1e3)
        comm.barrier()
        started = time.perf_counter()
        del buffer
        freed.append((time.perf_counter() - started) * 1e3)
    written_ms, freed_ms = _busiest(statistics.median(written), statistics.median(freed))
    return written_ms, freed_ms
