"""Multi-process gloo test harness: spawn ranks over a file:// store and join with a hard timeout."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable, world: int, init_file: str, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, tmp_path: Path, *args, timeout: float = 150.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; any rank's error or a timeout fails."""
    init_file = str(tmp_path / f"store-{world}")
    ctx = mp.start_processes(_entry, args=(fn, world, init_file, args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise TimeoutError(f"{world} ranks did not finish within {timeout} s")
