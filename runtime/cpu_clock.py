"""A rank's busy time on the CPU, as "one core per rank" would see it.

A step's work on a rank is not all on its computing thread: gloo runs every collective and point-to-point
transfer (copies, reductions, socket I/O) on its own worker threads, so the computing thread's CPU clock
misses the communication a tensor-parallel replica pays for.  :class:`RankCpuClock` reads the CPU time of the
whole process instead, less the CPU time of background threads that do no step work (the planning thread,
registered through :meth:`RankCpuClock.background`), so that a busy window counts the compute and the
communication of the step and nothing else.  Blocked waits (for a slower peer) cost no CPU time.  Linux and
macOS (per-thread CPU clocks); elsewhere background threads are not subtracted.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

__all__ = ["RankCpuClock"]


def _thread_cpu_s(ident: int) -> float:
    """CPU seconds of the running thread ``ident`` (a ``threading`` ident), 0 where the platform cannot say."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (AttributeError, OSError):
        return 0.0


class RankCpuClock:
    """Process CPU time less the CPU time of registered background threads, in seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._finished_s = 0.0
        self._live: set[int] = set()

    def background(self, target: Callable[[], None]) -> Callable[[], None]:
        """``target`` wrapped so that the thread running it is left out of :meth:`seconds`."""

        def run() -> None:
            ident = threading.get_ident()
            with self._lock:
                self._live.add(ident)
            try:
                target()
            finally:
                with self._lock:  # thread_time() here is this thread's whole CPU time, from its start
                    self._finished_s += time.thread_time()
                    self._live.discard(ident)

        return run

    def background_s(self) -> float:
        """CPU seconds used so far by background threads, finished or running."""
        with self._lock:
            return self._finished_s + sum(_thread_cpu_s(ident) for ident in self._live)

    def seconds(self) -> float:
        """CPU seconds of the step work of this process so far (a difference of two readings is a busy time)."""
        return time.process_time() - self.background_s()
