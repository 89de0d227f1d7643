"""Output files the command line writes: checked before any work starts (a folder, or a file in a folder that
does not exist, is a one-line error), then written atomically (a temporary file beside the target, flushed to
disk, renamed over it), so an interrupted run never leaves half a file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from passes.plan.ir import PlanError

__all__ = ["check_output_path", "write_text_atomically"]


def check_output_path(path: str | Path, what: str) -> Path:
    """``path`` as a file this process may create or replace; else a PlanError naming it and ``what`` it is."""
    target = Path(path)
    if target.is_dir():
        raise PlanError(f"{what} {str(path)!r} is a folder, expected a file")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise PlanError(f"{what} {str(path)!r}: folder {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise PlanError(f"{what} {str(path)!r}: folder {str(parent)!r} is not writable")
    return target


def write_text_atomically(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text``: written to a temporary file in the same folder, fsynced, renamed."""
    target = check_output_path(path, "output file")
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
