"""runtime.cpu_clock: a rank's busy time counts its communication threads and leaves background work out."""

from __future__ import annotations

import threading
import time

from spawn_targets import all_reduce_cpu_ms

from hcompile.tools.spawn import run_local_ranks
from runtime.cpu_clock import RankCpuClock


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_finished_background_thread_is_left_out():
    clock = RankCpuClock()
    started, process_started = clock.seconds(), time.process_time()
    worker = threading.Thread(target=clock.background(lambda: _burn(0.3)))
    worker.start()
    worker.join()
    _burn(0.1)
    assert time.process_time() - process_started >= 0.39
    assert 0.09 <= clock.seconds() - started <= 0.2
    assert clock.background_s() >= 0.29


def test_a_running_background_thread_is_left_out():
    clock = RankCpuClock()
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            _burn(0.01)

    worker = threading.Thread(target=clock.background(spin))
    worker.start()
    try:
        started = clock.seconds()
        time.sleep(0.3)  # the main thread idles while the background thread burns CPU
        assert clock.seconds() - started < 0.1
    finally:
        stop.set()
        worker.join()


def test_gloo_communication_threads_are_counted():
    """gloo reduces on its own threads: the computing thread's clock misses most of it, the rank clock not."""
    results = run_local_ranks(2, all_reduce_cpu_ms, timeout_s=120)
    for rank_ms, thread_ms in results:
        assert rank_ms > 3 * thread_ms, (rank_ms, thread_ms)
