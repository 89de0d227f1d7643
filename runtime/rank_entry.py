"""How ``hcompile launch`` runs a script on each rank: ``python -m runtime.rank_entry script.py [args]``, which
runs the script as ``python script.py [args]`` would (``__main__``, its folder first on ``sys.path``, its own
``sys.argv``) and owns how the rank ends.

A rank that ends with a non-zero status (``sys.exit(3)``, an uncaught exception) while its peers are still in
a collective must not tear down its process groups: a gloo pair receiving a peer's data while it is destroyed,
or finalised with the interpreter, can abort the process ("terminate called without an active exception"),
which turns the rank's own exit code into SIGABRT and the launcher's report into a wrong one. Such a rank
writes what Python would (the traceback, or the ``sys.exit`` message), flushes its streams and leaves with
``os._exit`` and its own code; a rank that ends cleanly goes through the normal exit, which destroys its
groups (``runtime.distributed``)."""

from __future__ import annotations

import os
import runpy
import sys
import time
import traceback

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
    """Run the script named by ``argv[0]`` with the rest as its arguments; returns its status when it is 0
    (a non-zero one leaves the process at once, see the module's docstring)."""
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
        return 0
    _note_exit_time()
    if message is not None:
        print(message, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


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
