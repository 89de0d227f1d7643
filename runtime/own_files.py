"""The project's own small files in folders a user shares (a checkpoint's lock, marker, meta and ``LATEST``; an
export's record, journal and lock), read and written without ever following a symbolic link, and what the
no-``flock`` fallbacks of both ask of a lock file's owner.

Owns :func:`read_own`, :func:`create_new`, :func:`write_new`, :func:`pid_runs` and :data:`NO_FLOCK`; used by
``runtime.checkpoint`` and ``hcompile.export``, which each say what a refusal means to their caller.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["NO_FLOCK", "read_own", "create_new", "write_new", "pid_runs"]

NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)
"""What ``flock`` raises on a file system without it (Lustre mounted without ``flock``, some FUSE ones)."""


def read_own(file: Path, limit: int | None = None) -> str:
    """The text of the regular file ``file`` (its first ``limit`` bytes; None: all of it), never read through a
    link: a link there is an OSError (``ELOOP``), and so is anything but a regular file."""
    fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IsADirectoryError(errno.EISDIR, "not a regular file", str(file))
        if limit is not None:
            return os.read(fd, limit).decode(errors="replace")
        with os.fdopen(os.dup(fd), encoding="utf-8") as handle:
            return handle.read()
    finally:
        os.close(fd)


def create_new(file: Path) -> int:
    """``file`` created and opened for writing, never through a link: an entry already there (a link planted
    where the project's own file goes, ...) is a FileExistsError, and is left as it is."""
    return os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


def write_new(file: Path, text: str) -> None:
    """Write and flush a new file ``file`` (:func:`create_new`); removed again if writing it fails."""
    fd = create_new(file)
    try:
        data = text.encode()
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    except BaseException:
        file.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def pid_runs(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (one this process may not signal counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
