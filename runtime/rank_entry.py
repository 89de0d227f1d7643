"""How ``hcompile launch`` runs a script on each rank: ``python -m runtime.rank_entry script.py [args]``, which
runs the script as ``python script.py [args]`` would (``__main__``, its folder first on ``sys.path``, its own
``sys.argv``) and owns how the rank ends.

A rank that ends with a non-zero status (``sys.exit(3)``, an uncaught exception) while its peers are still in
a collective must not tear down its process groups: a gloo pair receiving a peer's data while it is destroyed,
or finalised with the interpreter, can abort the process ("terminate called without an active exception"),
which turns the rank's own exit code into SIGABRT and the launcher's report into a wrong one. Such a rank
writes what Python would (the traceback, or the ``sys.exit`` message), flushes its streams and leaves with
``os._exit`` and its own code.

A rank that ends cleanly goes through Python's exit up to the interpreter's finalization, and no further: it
waits for the script's non-daemon threads, runs every ``atexit`` handler (the runtime's destroys the process
groups, ``logging`` flushes its handlers, ``weakref.finalize`` callbacks run), flushes every open file, and
leaves with ``os._exit(0)``, as ``multiprocessing`` ends a forked child. Finalization is where a thread still
inside C++ (a gloo worker releasing the tensors of a collective it just finished, or a daemon thread in a
torch op) that wants the GIL back is unwound through a ``noexcept`` frame, which aborts the process
("terminate called without an active exception", exit 134) after the job has finished; a gloo group's worker
threads are joined only when the group is freed, and a group is referenced from places its destruction cannot
reach (compiled graphs' guards, the user's objects), so skipping finalization is what removes that abort.
What finalization would add is ``__del__`` of objects still alive, which Python does not promise."""

from __future__ import annotations

import atexit
import gc
import io
import os
import runpy
import sys
import threading
import time
import traceback
from typing import NoReturn

__all__ = ["main", "exit_code"]


def exit_code(exc: SystemExit) -> tuple[int, str | None]:
    """The status ``sys.exit(value)`` gives, and the message Python writes for it: None and 0 are 0, an
    integer is itself, anything else is written to stderr and gives 1."""
    if exc.code is None:
        return 0, None
    if isinstance(exc.code, int) and not isinstance(exc.code, bool):
        return exc.code, None
    return 1, str(exc.code)


def main(argv: list[str] | None = None) -> int:
    """Run the script named by ``argv[0]`` with the rest as its arguments, and end the process with its status
    (module docstring); returns only the usage error's 2."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m runtime.rank_entry script.py [args]", file=sys.stderr)
        return 2
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code, message = 0, None
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code, message = exit_code(exc)
    except BaseException:  # what the interpreter would print for an uncaught exception
        traceback.print_exc()
        code = 1
    if code == 0:
        _leave_cleanly()
    _note_exit_time()
    if message is not None:
        print(message, file=sys.stderr)
    _flush_streams()
    os._exit(code)


def _leave_cleanly() -> NoReturn:
    """Python's exit without its finalization (module docstring): wait for non-daemon threads, run the ``atexit``
    handlers, flush every open file, ``os._exit(0)``."""
    shutdown_threads = getattr(threading, "_shutdown", None)  # what the interpreter calls: joins non-daemon
    if shutdown_threads is not None:  # threads and stops idle executors (their ``_register_atexit`` hooks)
        shutdown_threads()
    atexit._run_exitfuncs()
    for obj in gc.get_objects():  # what finalization would flush: files the script left open
        try:  # type(), not isinstance(): a dead weak proxy or a deprecated alias must not raise or warn here
            if issubclass(type(obj), io.IOBase) and not obj.closed:
                obj.flush()
        except Exception:  # a file that cannot flush loses what finalization would have lost too
            pass
    _flush_streams()
    os._exit(0)


def _flush_streams() -> None:
    """Flush stdout and stderr before ``os._exit`` (a closed or missing stream is left as it is)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


def _note_exit_time() -> None:
    """Write when this rank failed where the launcher reads it (``runtime.launch``), to tell the rank that
    failed first from peers whose collectives it broke a moment later."""
    folder = os.environ.get("HCOMPILE_LAUNCH_EXIT_TIMES")
    if not folder:
        return
    try:
        with open(os.path.join(folder, f"exit.{os.getpid()}"), "w") as f:
            f.write(repr(time.time()))
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
