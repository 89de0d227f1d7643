"""Local multi-rank jobs for the profiler and the compile-and-run harness: spawn N processes on this machine,
each joined to a gloo (or NCCL) process group through a file:// store in a fresh temporary directory (no port
races), with one thread per rank, a hard timeout, and each rank's result or traceback passed back through a
file. A failed or hung rank ends the job with a clear error, never a hang."""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from runtime.launch import max_local_ranks

__all__ = ["RankError", "max_local_ranks", "run_local_ranks"]


class RankError(RuntimeError):
    """A rank of a local job failed or the job ran past its timeout."""


def _entry(rank: int, world: int, tmp: str, fn: Callable, args: tuple, timeout_s: float, dist_backend: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    from runtime import distributed as comm

    torch.set_num_threads(1)  # per-rank busy time means "one core per rank"
    out = Path(tmp) / f"rank{rank}.pkl"
    try:
        if dist_backend == "nccl":
            os.environ["LOCAL_RANK"] = str(rank)  # rank r on GPU r
        comm.init_distributed(init_method=f"file://{tmp}/store", rank=rank, world_size=world, timeout_s=timeout_s,
                              dist_backend=dist_backend)
        result = fn(rank, world, *args)
        comm.barrier()
        comm.shutdown()
        out.write_bytes(pickle.dumps(("ok", result)))
    except BaseException:
        out.write_bytes(pickle.dumps(("error", traceback.format_exc())))
        raise SystemExit(1) from None


def run_local_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 600.0,
                    dist_backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world, *args)`` (a module-level function) on ``world`` local ranks joined with
    ``dist_backend`` (``gloo``: CPU tensors; ``nccl``: rank r on GPU r); each rank's return value, in rank order.
    Raises RankError naming the first failed rank, or when ``timeout_s`` passes."""
    if dist_backend not in ("gloo", "nccl"):
        raise RankError(f"dist_backend must be 'gloo' or 'nccl', got {dist_backend!r}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise RankError(f"the number of ranks must be a positive integer, got {world!r}")
    if world > max_local_ranks():
        raise RankError(f"{world} ranks are more than this machine can start (at most {max_local_ranks()})")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="hcompile-ranks-") as tmp:
        ctx = mp.start_processes(_entry, args=(world, tmp, fn, args, timeout_s, dist_backend), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise RankError(f"the {world}-rank job did not finish within {timeout_s:.0f} s")
        except mp.ProcessRaisedException as exc:  # pragma: no cover - _entry converts exceptions
            raise RankError(str(exc)) from None
        except mp.ProcessExitedException:
            pass  # the rank's file says why
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return _collect(world, Path(tmp))


def _collect(world: int, tmp: Path) -> list[Any]:
    results, errors = [], []
    for rank in range(world):
        path = tmp / f"rank{rank}.pkl"
        if not path.exists():
            errors.append((rank, "exited without a result (killed, or out of memory)"))
            continue
        status, value = pickle.loads(path.read_bytes())
        if status != "ok":
            errors.append((rank, value))
        results.append(value)
    if errors:
        # prefer a rank that failed on its own over ranks killed, or whose collectives failed, because it died
        raised = [e for e in errors if "Traceback" in e[1]]
        own = [e for e in raised if not any(w in e[1].splitlines()[-1] for w in ("ProcessGroup", "gloo", "Connection"))]
        rank, text = (own or raised or errors)[0]
        raise RankError(f"rank {rank} failed:\n{text}")
    return results
