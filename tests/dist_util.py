"""Helpers for multi-process gloo tests: spawn ranks with a file:// store under the test's tmp dir, a hard
timeout, and results passed back through files."""

from __future__ import annotations

import os
import pickle
import time
import traceback
from pathlib import Path
from typing import Callable

import torch.multiprocessing as mp


def _entry(rank: int, world: int, tmp: str, fn: Callable, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    out = Path(tmp) / f"rank{rank}.pkl"
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                                timeout=__import__("datetime").timedelta(seconds=60))
        result = fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        out.write_bytes(pickle.dumps(("ok", result)))
    except BaseException:
        out.write_bytes(pickle.dumps(("error", traceback.format_exc())))
        raise


def run_ranks(world: int, tmp_path: Path, fn: Callable, *args, timeout_s: float = 240.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return each rank's result or fail clearly."""
    tmp = tmp_path / "dist"
    tmp.mkdir()
    ctx = mp.start_processes(_entry, args=(world, str(tmp), fn, args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"distributed test did not finish within {timeout_s}s")
    results = []
    for rank in range(world):
        status, value = pickle.loads((tmp / f"rank{rank}.pkl").read_bytes())
        if status != "ok":
            raise AssertionError(f"rank {rank} failed:\n{value}")
        results.append(value)
    return results
