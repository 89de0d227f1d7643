"""Local launch: ``hcompile launch --nproc N script.py [args]`` starts N ranks of a script on this machine
through torch's elastic launcher (the same environment torchrun gives), so the script's
``init_distributed()`` works unchanged under plain ``torchrun`` on a cluster. Each rank's stderr is shown
(lines prefixed with its local rank) and kept in a temporary folder, so that when a rank fails the launch
exits with that rank's own exit code and names the rank and the last line it wrote to stderr. The launcher
notes which ranks it stopped itself (once one fails it ends the others with SIGTERM), so a rank ended by a
signal from elsewhere (``kill`` from a shell, a scheduler, the OOM killer) is the one named, never a rank it
stopped. Each rank runs the script through ``runtime.rank_entry``, so a rank that exits with its own non-zero
code keeps that code (its process groups are not torn down under peers still in a collective)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

__all__ = ["launch", "LaunchError", "max_local_ranks", "EXIT_TIMES_ENV"]

EXIT_TIMES_ENV = "HCOMPILE_LAUNCH_EXIT_TIMES"
"""The folder where each rank that fails writes when it did (``runtime.rank_entry``), set by :func:`launch`."""


class LaunchError(ValueError):
    """Bad launch arguments."""


def max_local_ranks() -> int:
    """The most ranks one machine is asked to start: 8 per core, at least 64."""
    return max(64, 8 * (os.cpu_count() or 1))


def launch(nproc: int, script: str, script_args: list[str], max_nproc: int | None = None) -> int:
    """Run ``script`` on ``nproc`` local ranks; returns 0 when every rank succeeded, else the exit code of
    the rank that failed first (128 + the signal for a rank a signal ended), after one line on stderr naming
    it and the last line it wrote to stderr."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise LaunchError(f"--nproc must be a positive integer, got {nproc!r}")
    limit = max_nproc if max_nproc is not None else max_local_ranks()
    if nproc > limit:
        raise LaunchError(f"--nproc {nproc} is more ranks than this machine can start (at most {limit})")
    if not Path(script).is_file():
        raise LaunchError(f"script {script!r} does not exist")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    with tempfile.TemporaryDirectory(prefix="hcompile-launch-") as logs, _stopped_by_launcher() as stopped, \
            _environ(EXIT_TIMES_ENV, logs):
        try:
            torchrun_main(["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0", "--log-dir", logs,
                           "--tee", "2", "-m", "runtime.rank_entry", script, *script_args])
        except ChildFailedError as exc:
            rank, failure = _first_failure(exc.failures, stopped, _exit_times(logs))
            code = failure.exitcode if failure.exitcode > 0 else 128 + (-failure.exitcode or 1)
            how = f"exit code {failure.exitcode}" if failure.exitcode > 0 else _signal_name(-failure.exitcode)
            if failure.exitcode < 0 and stopped is not None and failure.pid not in stopped:
                how += ", not sent by the launcher"
            print(f"hcompile launch: rank {rank} failed ({how}): {_last_stderr_line(logs, failure.local_rank)}",
                  file=sys.stderr)
            return code
    return 0


@contextlib.contextmanager
def _stopped_by_launcher() -> Iterator[set[int] | None]:
    """The pids of the ranks torch's launcher sent a signal to while this is open (None: this torch has no
    ``SubprocessHandler.close`` to note it in, and the launcher's SIGTERMs are told apart by their signal)."""
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import (
            SubprocessHandler,
        )
        close = SubprocessHandler.close
    except (ImportError, AttributeError):
        yield None
        return
    stopped: set[int] = set()

    def noted(self: Any, *args: Any, **kwargs: Any) -> Any:
        stopped.add(self.proc.pid)
        return close(self, *args, **kwargs)

    SubprocessHandler.close = noted
    try:
        yield stopped
    finally:
        SubprocessHandler.close = close


def _first_failure(failures: dict[int, Any], stopped: set[int] | None = None,
                   exit_times: dict[int, float] | None = None) -> tuple[int, Any]:
    """(global rank, failure) of the rank that failed on its own first: the ranks the launcher stopped once one
    had failed (``stopped``: their pids; without it, those that a SIGTERM ended) come last; then by when each
    failed: the time a rank wrote as it left (``exit_times``, by pid, ``runtime.rank_entry``), else the
    launcher's whole-second timestamp (a rank whose peer left a moment before it, its collective broken, fails
    in the same second)."""
    exit_times = exit_times or {}

    def order(item: tuple[int, Any]) -> tuple[bool, float, int]:
        rank, failure = item
        by_launcher = failure.pid in stopped if stopped is not None else failure.exitcode == -signal.SIGTERM
        return by_launcher, exit_times.get(failure.pid, float(failure.timestamp)), rank

    return min(failures.items(), key=order)


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` while the block runs (the ranks inherit it)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _exit_times(folder: str) -> dict[int, float]:
    """The times ranks wrote as they failed (``runtime.rank_entry``), by pid."""
    times = {}
    for file in Path(folder).glob("exit.*"):
        try:
            times[int(file.suffix[1:])] = float(file.read_text())
        except (OSError, ValueError):
            continue
    return times


def _signal_name(number: int) -> str:
    try:
        return f"signal {signal.Signals(number).name}"
    except ValueError:
        return f"signal {number}"


def _last_stderr_line(logs: str, local_rank: int) -> str:
    """The last non-empty line the rank wrote to stderr (its tee'd log), or a note that there is none."""
    for log in sorted(Path(logs).glob(f"*/attempt_*/{local_rank}/stderr.log"), reverse=True):
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
        if lines:
            return lines[-1][:500]
    return "(nothing on its stderr)"
