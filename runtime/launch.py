"""Local launch: ``hcompile launch --nproc N script.py [args]`` starts N ranks of a script on this machine
through torch's elastic launcher (the same environment torchrun gives), so the script's
``init_distributed()`` works unchanged under plain ``torchrun`` on a cluster."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["launch", "LaunchError", "max_local_ranks"]


class LaunchError(ValueError):
    """Bad launch arguments."""


def max_local_ranks() -> int:
    """The most ranks one machine is asked to start: 8 per core, at least 64."""
    return max(64, 8 * (os.cpu_count() or 1))


def launch(nproc: int, script: str, script_args: list[str], max_nproc: int | None = None) -> int:
    """Run ``script`` on ``nproc`` local ranks; returns 0 when every rank succeeded, 1 otherwise."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise LaunchError(f"--nproc must be a positive integer, got {nproc!r}")
    limit = max_nproc if max_nproc is not None else max_local_ranks()
    if nproc > limit:
        raise LaunchError(f"--nproc {nproc} is more ranks than this machine can start (at most {limit})")
    if not Path(script).is_file():
        raise LaunchError(f"script {script!r} does not exist")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0", script, *script_args])
    except ChildFailedError as exc:
        first = next(iter(exc.failures.values()), None)
        print(f"hcompile launch: a rank failed: {first.message if first else exc}")
        return 1
    return 0
