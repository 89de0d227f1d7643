"""Multi-process gloo test harness for the compiler tests: ranks that assert inside, through
``hcompile.tools.spawn.run_local_ranks`` (file:// store, hard timeout, a failing rank named)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from hcompile.tools.spawn import run_local_ranks


def run_ranks(fn: Callable, world: int, tmp_path: Path, *args, timeout: float = 150.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; any rank's error or a timeout fails."""
    run_local_ranks(world, fn, *args, timeout_s=timeout)
