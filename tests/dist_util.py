"""Multi-process gloo tests: ``hcompile.tools.spawn.run_local_ranks`` (file:// store, one thread per rank, a hard
timeout, results or tracebacks back through files) with the call shape the tests use."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from hcompile.tools.spawn import run_local_ranks


def run_ranks(world: int, tmp_path: Path, fn: Callable, *args, timeout_s: float = 240.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; each rank's result, or a failure naming the rank.
    ``tmp_path`` is kept for symmetry with pytest fixtures; the store lives in its own temporary folder."""
    return run_local_ranks(world, fn, *args, timeout_s=timeout_s)


class LateOwner:
    """A phase hook: rank 0 posts its pull ``seconds`` after the others, so that a rank computing before its
    parameters arrived (overlapped movement without its waits) would compute with an uninitialised buffer."""

    def __init__(self, seconds: float = 0.3):
        self.seconds = seconds

    def __call__(self, phase: str, step) -> None:
        import time

        from runtime import distributed as comm
        if phase == "pull" and comm.rank() == 0:
            time.sleep(self.seconds)
