"""Checkpoints of the fixed layout: safe to load, atomic, verified, and resumable on another number of ranks.

A checkpoint is a folder. ``LATEST`` names its current version, a subfolder ``v<step>-<time>`` holding
``meta.json``, a marker file (``.hydraulis-version``) and one ``rank{r}.safetensors`` per rank that wrote it.
Each rank's file holds, per range: for every parameter with elements in its shard, ``param/<name>/<lo>`` (the
master values of elements [lo, hi) of the parameter in the layout's storage order) and the same range of
every per-element optimiser state (``<state>/<name>/<lo>``), plus its scalar optimiser state and its torch RNG
state. ``meta.json`` holds the step, the data position, the layout (shapes, storage order), where each
parameter's ranges are, the sha256 and size of every rank file, the optimiser's class and param groups, and
what the trainer adds (its strategy pool, the cost-model calibration).

Saving refuses a data position JSON would not give back exactly and non-finite master weights or optimiser
state, takes the folder's lock (``.hydraulis-lock``: an exclusive ``flock`` held by rank 0 for the whole save,
the file naming its host and pid; a save into a folder another save holds is refused, a lock whose owner is
gone is taken over), writes a new version beside the current one, flushes every file to disk, agrees that
every rank succeeded, and only then points ``LATEST`` at it (written under a name of its own save, then an
atomic rename) and removes older versions beyond the last ``keep``: only folders it recognises as its own
versions, by name and by its marker inside; nothing else in the folder is ever touched. A crash at any moment
leaves ``LATEST`` naming a complete checkpoint. A version is removed by renaming it to ``.<version>.del`` and
then emptying it, its marker last, so a clean-up killed at any moment leaves a folder the next save recognises
and finishes removing. Every file a save writes or removes is opened without following links (``O_NOFOLLOW``,
``lstat``): a symbolic link where its own file goes (the lock, ``LATEST``, a temporary) is refused by name, the
link and its target left as they are.
Loading reads safetensors and JSON only (no pickle, so a crafted file runs no code); every rank checks the
metadata's types, the checksum of every file it reads, every piece's dtype (float32) and element count
against the layout and that the values are finite, reads what it needs for its shard (any number of ranks,
any strategy pool) into memory, the ranks agree that all of them succeeded, and only then is anything
changed. Every rank reads the version rank 0 finds in ``LATEST``, holding a shared ``flock`` on its marker
while it reads; a save's clean-up takes an exclusive one before it removes a version and leaves a version a load
holds to the next save. A load that still loses a race with a concurrent save's clean-up (``LATEST`` moved before
it held the marker, or no ``flock`` on the file system) reads the newer one, on every rank alike, a bounded
number of times.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import time
from pathlib import Path
from typing import Any, Callable, Collection, Iterator

import torch

from runtime import distributed as comm
from runtime.checkpoint_meta import group_problem, json_problem, meta_problem
from runtime.fixed_layout import FixedLayout
from runtime.own_files import NO_FLOCK, create_new, pid_runs, read_own, write_new

__all__ = ["save_checkpoint", "load_checkpoint", "folder_lock", "CheckpointError", "FORMAT", "MARKER", "LOCK",
           "DEFAULT_KEEP"]

FORMAT = 3
"""Version of the on-disk format (3: rank files' checksums in ``meta.json``, a marker in every version)."""
MARKER = ".hydraulis-version"
"""The file every version folder a save writes holds; clean-up removes only folders that have it."""
DEFAULT_KEEP = 1
"""Versions a save keeps by default: the one it wrote."""
LOCK = ".hydraulis-lock"
"""The lock file a save holds in the checkpoint folder (removed when the save ends)."""
_VERSION = re.compile(r"v\d{8,}-[0-9a-f]+")
_STALE = re.compile(r"\.v\d{8,}-[0-9a-f]+\.tmp")
_STALE_LATEST = re.compile(r"\.LATEST\.v\d{8,}-[0-9a-f]+\.tmp")
_DELETING = re.compile(r"\.v\d{8,}-[0-9a-f]+\.del")
"""An old version being removed: renamed to ``.<version>.del`` (marker inside) before anything in it is removed."""
_LINK = "is a symbolic link; hydraulis does not write through links"
_LOAD_TRIES = 8
"""Versions a load tries when a concurrent save's clean-up removes the version it is reading."""
_SMALL = 1 << 16
"""The most of a lock file that is read (its owner's host, pid and start)."""


class CheckpointError(RuntimeError):
    """A checkpoint that could not be written, or does not exist, is damaged or does not match this job; the
    same on every rank."""


def _agree(error: str | None, action: str, payload: Any = None) -> list:
    """Every rank's error (None: it succeeded); the first one is raised on every rank. Returns every rank's
    ``payload`` when none failed."""
    gathered = comm.all_gather_object((error, payload))
    for rank, (message, _) in enumerate(gathered):
        if message is not None:
            raise CheckpointError(f"{action} failed on rank {rank}: {message}")
    return [p for _, p in gathered]


def _fsync(path: Path, follow: bool = False) -> None:
    """Flush ``path`` to disk; opened without following a link unless ``follow`` (the checkpoint folder)."""
    fd = os.open(path, os.O_RDONLY | (0 if follow else os.O_NOFOLLOW))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _refuse_link(file: Path) -> None:
    """A CheckpointError naming ``file`` when it is a symbolic link (the link and its target stay as they are)."""
    if file.is_symlink():
        raise CheckpointError(f"{str(file)!r} {_LINK}: not saved (remove the link, or save into another folder)")


def _taken(entry: Path) -> CheckpointError:
    """The refusal of a save whose own new file or folder ``entry`` is already there (a link planted there is
    named as one); the entry is left as it is."""
    _refuse_link(entry)
    return CheckpointError(f"{str(entry)!r} already exists: not saved")


def _create(file: Path) -> int:
    """``file`` created and opened for writing, never through a link (``own_files.create_new``): an entry
    already there is refused by name and left as it is."""
    try:
        return create_new(file)
    except FileExistsError:
        raise _taken(file) from None


def _write_new(file: Path, text: str) -> None:
    """Write and flush a new file ``file`` (``own_files.write_new``); an entry already there is refused by
    name and left as it is."""
    try:
        write_new(file, text)
    except FileExistsError:
        raise _taken(file) from None


def _mkdir_new(folder: Path) -> None:
    """Create the folder ``folder``; an entry already there (a link, ...) is refused by name, left as it is."""
    try:
        folder.mkdir()
    except FileExistsError:
        raise _taken(folder) from None


def _pieces(layout: FixedLayout, owner: int) -> list[tuple[str, int, int, int]]:
    """(parameter, first, end, position in the owner's shard) of the parameter elements (storage order) that
    rank ``owner`` holds."""
    out = []
    for lo, hi, pos in layout.owned(owner):
        for name, spec in layout.specs.items():
            a, b = max(lo, spec.offset), min(hi, spec.offset + spec.numel)
            if b > a:
                out.append((name, a - spec.offset, b - spec.offset, pos + a - lo))
    return out


def _not_finite(layout: FixedLayout, values: torch.Tensor, what: str) -> str | None:
    """Which parameter's part of this rank's shard ``values`` holds a NaN or an infinity (None: none does)."""
    bad = (~torch.isfinite(values)).nonzero()
    if bad.numel() == 0:
        return None
    at = layout.flat_index(int(bad[0]))
    name = "padding" if at is None else next(n for n, s in layout.specs.items() if s.offset <= at < s.offset + s.numel)
    return f"{what} of {name!r} holds {values[int(bad[0])].item()} ({bad.numel()} non-finite values in this shard)"


def _optimizer_state(optimizer: torch.optim.Optimizer, numel: int) -> tuple[dict, dict]:
    """(per-element states, scalar states) of the optimiser's one parameter, the shard."""
    state = optimizer.state_dict()["state"]
    entries = state.get(0, {}) if state else {}
    per_element = {k: v for k, v in entries.items() if isinstance(v, torch.Tensor) and v.numel() == numel}
    scalars = {k: v for k, v in entries.items() if k not in per_element}
    for k, v in scalars.items():
        if not (isinstance(v, torch.Tensor) and v.numel() == 1) and not isinstance(v, (int, float)):
            raise CheckpointError(f"optimizer state {k!r} is neither per element nor a scalar")
    return per_element, scalars


def _save_problem(step: Any, data_position: Any, keep: Any) -> str | None:
    if type(step) is not int or step < 0:
        return f"step must be a non-negative integer, got {step!r}"
    if type(keep) is not int or keep < 1:
        return f"keep must be a positive integer (versions kept), got {keep!r}"
    problem = json_problem(data_position, "data_position")
    return None if problem is None else f"{problem}: it would not be read back as saved"


def save_checkpoint(path: str | Path, layout: FixedLayout, optimizer: torch.optim.Optimizer, step: int,
                    data_position: Any, extra: dict | None = None, keep: int = DEFAULT_KEEP) -> None:
    """Collective: write a new version of the checkpoint at ``path``, make it the current one, and remove this
    checkpoint's versions older than the last ``keep`` (nothing else in ``path`` is touched). A folder another
    save holds (its lock, ``.hydraulis-lock``, names the host and pid) is refused on every rank, unchanged; so
    is a symbolic link where one of the save's own files goes (the lock, ``LATEST``): nothing is written
    through a link."""
    _agree(_save_problem(step, data_position, keep), "saving the checkpoint")
    path = Path(path)
    version = comm.broadcast_object(f"v{step:08d}-{time.time_ns():x}")  # rank 0's name, everywhere
    with contextlib.ExitStack() as held:
        error = None
        try:
            if layout.rank == 0:
                if path.exists() and not path.is_dir():
                    raise CheckpointError(f"{str(path)!r} is a file, expected a checkpoint folder")
                path.mkdir(parents=True, exist_ok=True)
                held.enter_context(folder_lock(path))
                _refuse_link(path / "LATEST")
                tmp = path / f".{version}.tmp"
                _mkdir_new(tmp)
                _write_new(tmp / MARKER, json.dumps({"format": FORMAT, "version": version}) + "\n")
        except (OSError, CheckpointError) as exc:
            error = str(exc)
        _agree(error, "creating the checkpoint folder")
        error = _write_and_publish(path, version, layout, optimizer, step, data_position, extra, keep)
    _agree(error, "publishing the checkpoint")  # the lock is released: a save that returned holds none


def _write_and_publish(path: Path, version: str, layout: FixedLayout, optimizer: torch.optim.Optimizer, step: int,
                       data_position: Any, extra: dict | None, keep: int) -> str | None:
    """Every rank writes its file into the new version; once all did, rank 0 writes ``meta.json``, makes the
    version current and removes old ones (rank 0 holds the folder's lock). Returns rank 0's publishing error
    (None: published), for every rank to agree on."""
    tmp = path / f".{version}.tmp"
    error, digest = None, None
    try:
        digest = _write_rank_file(tmp, layout, optimizer)
    except Exception as exc:  # noqa: BLE001 - every failure is reported to every rank
        error = f"{type(exc).__name__}: {exc}"
    try:
        digests = _agree(error, "writing the checkpoint", digest)
    except CheckpointError:
        if layout.rank == 0:
            _remove_quietly(tmp)
        raise
    error = None
    try:
        if layout.rank == 0:
            files = {f"rank{r}.safetensors": d for r, d in enumerate(digests)}
            _write_meta(tmp, layout, optimizer, step, data_position, extra, files)
            _publish(path, tmp, version)
            _remove_old_versions(path, version, keep)
    except Exception as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {exc}"
        _remove_quietly(tmp)
    return error


@contextlib.contextmanager
def folder_lock(path: Path) -> Iterator[None]:
    """Hold ``path``'s save lock: an exclusive ``flock`` on ``path/.hydraulis-lock``, which names this host and
    pid, removed on exit. Held by another process: a CheckpointError naming its owner. A lock file whose owner
    is gone holds no ``flock`` (the kernel drops it with the process) and is taken over. On a file system
    without ``flock`` the file alone decides: one naming a live process (or one on another host) refuses. The
    file is never opened through a link: a symbolic link (or anything but a file) there is refused by name,
    left as it is, and so is its target."""
    file = path / LOCK
    for _ in range(8):  # another save may remove the file between our open and our flock: open it again
        fd = _open_lock(file)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in NO_FLOCK and not _held_elsewhere(file):
                break
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, *NO_FLOCK):
                raise CheckpointError(f"cannot lock {str(file)!r}: {exc}") from None
            raise CheckpointError(f"{str(path)!r} is being saved by {_owner(file)} (lock file {str(file)!r}): not "
                                  f"saved; save again once that save has ended, or into another folder") from None
        try:
            if _same_file(fd, file):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    else:
        raise CheckpointError(f"cannot lock {str(file)!r}: it is replaced as fast as it is opened")
    try:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}).encode())
        os.fsync(fd)
        yield
    finally:
        with contextlib.suppress(OSError):
            if _same_file(fd, file):  # ours still (never another entry put there since)
                file.unlink()  # while still held: a save waiting on this file opens it again
        os.close(fd)


def _same_file(fd: int, file: Path) -> bool:
    """Whether the entry ``file`` (not what a link there points to) is the file open as ``fd``."""
    here, mine = os.lstat(file), os.fstat(fd)
    return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)


def _open_lock(file: Path) -> int:
    """The lock file opened (created if missing) for writing, never through a link."""
    try:
        fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP or file.is_symlink():
            raise CheckpointError(f"{str(file)!r} {_LINK}: not saved (remove the link)") from None
        raise CheckpointError(f"cannot lock {str(file)!r}: {exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{str(file)!r} is not a file (hydraulis's lock file goes there): not saved")
    return fd


def _held_elsewhere(file: Path) -> bool:
    """Without ``flock``: whether the lock file names another process that may still run (one on this host
    that is gone does not hold it; one on another host cannot be asked, so it does)."""
    try:
        owner = json.loads(read_own(file, _SMALL) or "null")
    except (OSError, ValueError):
        return True
    if not isinstance(owner, dict):
        return False  # empty: a lock file its owner never wrote, or ours
    if owner.get("host") != socket.gethostname():
        return True
    pid = owner.get("pid")
    if type(pid) is not int:
        return True
    return pid != os.getpid() and pid_runs(pid)


def _owner(file: Path) -> str:
    """Who holds the lock, as its file says."""
    try:
        owner = json.loads(read_own(file, _SMALL))
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(owner["since"])))
        return f"another process (host {owner['host']}, pid {owner['pid']}, since {since})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (its lock file is being written)"


def _write_rank_file(tmp: Path, layout: FixedLayout, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's file (refused when a master weight or a per-element state is not finite): its checksum."""
    from safetensors.torch import save_file

    shard = layout.shard.detach().cpu()
    per_element, scalars = _optimizer_state(optimizer, layout.shard_numel)
    for what, values in (("the master weight", shard), *((f"optimizer state {k!r}", v.detach().cpu())
                                                         for k, v in per_element.items())):
        if (problem := _not_finite(layout, values, what)) is not None:
            raise CheckpointError(f"{problem}: not saved (the current version stays current)")
    tensors: dict[str, torch.Tensor] = {"rng": torch.get_rng_state()}
    for name, a, b, start in _pieces(layout, layout.rank):
        tensors[f"param/{name}/{a}"] = shard[start:start + b - a].clone()
        for key, value in per_element.items():
            tensors[f"{key}/{name}/{a}"] = value.detach().cpu()[start:start + b - a].clone()
    for key, value in scalars.items():
        tensors[f"scalar/{key}"] = torch.as_tensor(value).detach().cpu().reshape(())
    file = tmp / f"rank{layout.rank}.safetensors"
    os.close(_create(file))  # this save's own, new file: safetensors then writes into it, never through a link
    save_file(tensors, str(file))
    _fsync(file)
    return {"sha256": _sha256(file), "bytes": file.lstat().st_size}


def _publish(path: Path, tmp: Path, version: str) -> None:
    """Rename the flushed version into place and point ``LATEST`` at it (an atomic rename). An entry where the
    version or ``LATEST``'s temporary goes, or a link as ``LATEST``, is refused by name, left as it is."""
    target, latest = path / version, path / f".LATEST.{version}.tmp"  # this save's own names
    _write_new(latest, version + "\n")  # first: a link there is refused before the version moves
    try:
        _refuse_link(path / "LATEST")
        if os.path.lexists(target):
            _refuse_link(target)
            raise CheckpointError(f"{str(target)!r} already exists: not saved")
        tmp.rename(target)
        _fsync(path, follow=True)
        os.replace(latest, path / "LATEST")  # replaces the entry LATEST, never writes through it
    except BaseException:
        latest.unlink(missing_ok=True)
        raise
    _fsync(path, follow=True)


def _own_version(folder: Path, pattern: re.Pattern) -> bool:
    """Whether ``folder`` is a version a save wrote: its name, a folder (not a link) and the marker inside (a
    file, not a link)."""
    try:
        return (pattern.fullmatch(folder.name) is not None and stat.S_ISDIR(os.lstat(folder).st_mode)
                and stat.S_ISREG(os.lstat(folder / MARKER).st_mode))
    except OSError:
        return False


def _marker_lock(folder: Path, how: int) -> int | None:
    """An open descriptor of ``folder``'s marker holding ``flock`` ``how`` (non-blocking), never through a link;
    None where the file system has no ``flock`` (nothing is held, a load then relies on its retries). Raises
    BlockingIOError when the other kind of lock is held, and OSError when the marker is not there."""
    fd = os.open(folder / MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in NO_FLOCK:
            return None
        raise
    return fd


@contextlib.contextmanager
def _not_read(folder: Path) -> Iterator[bool]:
    """Within the block, whether ``folder`` (a version) may be removed: True while this holds an exclusive
    ``flock`` on its marker (no load holds its shared one, and none can take it until the block ends), False
    when a load is reading it."""
    try:
        fd = _marker_lock(folder, fcntl.LOCK_EX)
    except BlockingIOError:
        yield False
        return
    try:
        yield True
    finally:
        if fd is not None:
            os.close(fd)


@contextlib.contextmanager
def _reading(folder: Path) -> Iterator[None]:
    """Hold a shared ``flock`` on version ``folder``'s marker while a load reads it: a save's clean-up does not
    remove a version a load holds (it leaves it to the next save), so a load racing a saving process is not
    left without its files. A marker that is gone, or held for removal, is the version gone (:class:`_Gone`)."""
    try:
        fd = _marker_lock(folder, fcntl.LOCK_SH)
    except BlockingIOError:
        raise _Gone(f"reading {str(folder)!r}: a concurrent save is removing this version") from None
    except OSError as exc:
        raise _Gone(f"checkpoint {str(folder)!r}: its marker {MARKER} cannot be opened ({type(exc).__name__}: "
                    f"{exc.strerror}): the version is damaged or not one a save wrote") from None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _remove_own(folder: Path) -> None:
    """Remove ``folder``, one a save wrote (its marker inside), never through a link, in an order that a kill
    at any moment leaves it recognisable: everything but the marker, then the marker, then the empty folder."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for name in sorted(os.listdir(fd)):
            if name == MARKER:
                continue
            if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                shutil.rmtree(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(MARKER, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(folder)


def _remove_quietly(folder: Path) -> None:
    """:func:`_remove_own`, leaving whatever it cannot remove to a later save."""
    with contextlib.suppress(OSError):
        _remove_own(folder)


def _remove_old_versions(path: Path, current: str, keep: int) -> None:
    """Remove this checkpoint's versions but ``current`` and the newest ``keep - 1`` others, the unfinished
    versions of saves that crashed and what a killed clean-up left; never a folder without the marker (but an
    empty one of a name only a save gives, ``.<version>.tmp`` or ``.del``), never a file but a crashed save's
    ``LATEST`` temporary, never through a link. A version is first renamed to ``.<version>.del`` (the marker
    inside), then emptied, the marker last: a clean-up killed at any moment leaves a folder the next save
    recognises and finishes removing. Best effort: what cannot be removed is left to a later save."""
    versions = sorted((n for n in os.listdir(path) if n != current and _own_version(path / n, _VERSION)),
                      key=lambda n: int(n.rsplit("-", 1)[1], 16), reverse=True)
    for name in versions[keep - 1:]:
        deleting = path / f".{name}.del"
        with contextlib.suppress(OSError), _not_read(path / name) as free:
            if not free:  # a load is reading it: the next save removes it
                continue
            os.rename(path / name, deleting)  # refused (kept) when an entry that is not an empty folder is there
            if not _own_version(deleting, _DELETING):  # replaced by something else since it was checked: put back
                os.rename(deleting, path / name)
                continue
            _remove_quietly(deleting)  # still holding the marker's lock: no load starts reading it meanwhile
    for name in sorted(os.listdir(path)):
        entry = path / name
        if _DELETING.fullmatch(name) or _STALE.fullmatch(name):
            if _own_version(entry, _DELETING) or _own_version(entry, _STALE):
                _remove_quietly(entry)
            else:  # a killed clean-up's empty folder (rmdir removes only an empty folder, never a link)
                with contextlib.suppress(OSError):
                    os.rmdir(entry)
        elif _STALE_LATEST.fullmatch(name):  # a LATEST a crashed save wrote and did not rename
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.lstat(entry).st_mode):
                    entry.unlink()


def _write_meta(folder: Path, layout: FixedLayout, optimizer: torch.optim.Optimizer, step: int,
                data_position: Any, extra: dict | None, files: dict) -> None:
    pieces: dict[str, list[list[int]]] = {name: [] for name in layout.specs}
    for rank in range(layout.world_size):
        for name, a, b, _ in _pieces(layout, rank):
            pieces[name].append([rank, a, b])
    per_element, _ = _optimizer_state(optimizer, layout.shard_numel)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]
    meta = {
        "format": FORMAT, "step": step, "data_position": data_position, "world_size": layout.world_size,
        "numel": layout.numel,
        "params": {n: {"shape": list(s.shape), "split_dim": s.split_dim} for n, s in layout.specs.items()},
        "pieces": pieces, "files": files,
        "optimizer": {"class": type(optimizer).__name__, "param_groups": groups, "per_element": sorted(per_element)},
        "extra": extra or {},
    }
    _write_new(folder / "meta.json", json.dumps(meta, allow_nan=False))


class _Gone(CheckpointError):
    """A file of the version being loaded is not there (a concurrent save's clean-up may have removed it)."""


def _latest(path: Path) -> str:
    """The version ``LATEST`` names (read without following a link)."""
    latest = path / "LATEST"
    try:
        text = read_own(latest, 4096)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {str(path)!r} (no LATEST file)") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointError(f"{str(latest)!r} is a symbolic link; hydraulis does not read LATEST through "
                                  f"links") from None
        raise CheckpointError(f"no checkpoint at {str(path)!r} (LATEST is not a readable file: {exc})") from None
    name = text.strip()
    if _VERSION.fullmatch(name) is None:
        raise CheckpointError(f"{str(latest)!r} names {name[:80]!r}, not a checkpoint version")
    return name


def _read_meta(folder: Path) -> dict:
    """The checked ``meta.json`` of the version ``folder``."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except FileNotFoundError as exc:
        raise _Gone(f"checkpoint {str(folder)!r} has no readable meta.json: {exc}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {str(folder)!r} has no readable meta.json: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"checkpoint {str(folder)!r} is of format {found!r}, this version reads {FORMAT}")
    if (problem := meta_problem(meta)) is not None:
        raise CheckpointError(f"checkpoint {str(folder)!r}: meta.json is damaged: {problem}")
    return meta


def _check_layout(meta: dict, layout: FixedLayout, optimizer: torch.optim.Optimizer, where: str) -> None:
    params = meta["params"]
    if set(params) != set(layout.specs):  # pieces are named, so a checkpoint of another flat order reads alike
        missing = sorted(set(layout.specs) - set(params))[:3]
        extra = sorted(set(params) - set(layout.specs))[:3]
        raise CheckpointError(f"checkpoint {where} holds other parameters (missing {missing}, unknown {extra})")
    for name, spec in layout.specs.items():
        saved = params[name]
        if tuple(saved["shape"]) != spec.shape or saved["split_dim"] != spec.split_dim:
            raise CheckpointError(f"checkpoint {where}: parameter {name!r} is {tuple(saved['shape'])} stored along "
                                  f"dim {saved['split_dim']}, this job has {spec.shape} along {spec.split_dim}")
    saved_class = meta["optimizer"]["class"]
    if saved_class != type(optimizer).__name__:
        raise CheckpointError(f"checkpoint {where} was written with {saved_class}, this job uses "
                              f"{type(optimizer).__name__}")


def _open_rank_file(folder: Path, meta: dict, rank: int) -> Any:
    """Rank ``rank``'s file, open (a concurrent save's clean-up removing it afterwards changes nothing)."""
    name = f"rank{rank}.safetensors"
    if meta["files"].get(name) is None:
        raise CheckpointError(f"meta.json lists no checksum for {name}")
    return open(folder / name, "rb")  # noqa: SIM115 - closed by the caller


def _verified(handle: Any, meta: dict, rank: int) -> Any:
    """Rank ``rank``'s file, open as ``handle``, read once its size and sha256 are those ``meta.json`` lists
    (the very file checked is the one read)."""
    from safetensors import safe_open

    name = f"rank{rank}.safetensors"
    expected = meta["files"][name]
    size = os.fstat(handle.fileno()).st_size
    if size != expected["bytes"]:
        raise CheckpointError(f"{name} is damaged: {size} bytes, meta.json says {expected['bytes']}")
    digest = hashlib.file_digest(handle, "sha256").hexdigest()
    if digest != expected["sha256"]:
        raise CheckpointError(f"{name} is damaged: its sha256 is {digest[:16]}..., meta.json says "
                              f"{expected['sha256'][:16]}...")
    same = f"/proc/self/fd/{handle.fileno()}"  # the open file, even once removed (Linux)
    return safe_open(same if os.path.exists(same) else handle.name, framework="pt")


def _piece(file: Any, key: str, numel: int, rank: int) -> Any:
    """The slice of tensor ``key`` in rank ``rank``'s file, once it is a float32 vector of the ``numel``
    elements the layout gives that piece (no cast, no cut)."""
    try:
        piece = file.get_slice(key)
    except Exception:  # noqa: BLE001 - safetensors names a missing tensor in its own error types
        raise CheckpointError(f"rank{rank}.safetensors has no tensor {key!r}") from None
    dtype, shape = piece.get_dtype(), list(piece.get_shape())
    if dtype != "F32" or shape != [numel]:
        raise CheckpointError(f"rank{rank}.safetensors: {key!r} is {dtype} of shape {shape}, the layout expects "
                              f"F32 of shape [{numel}]")
    return piece


def _read_shard(folder: Path, meta: dict, layout: FixedLayout) -> tuple:
    """This rank's new shard, its per-element and scalar optimiser states, and its RNG state (or None), from
    files whose checksums match, with every value finite."""
    shard = torch.zeros(layout.shard_numel, dtype=torch.float32)
    states = {k: torch.zeros(layout.shard_numel, dtype=torch.float32) for k in meta["optimizer"]["per_element"]}
    own = layout.rank if layout.rank < meta["world_size"] else 0
    needed = {own} | {r for name, a, b, _ in _pieces(layout, layout.rank) for r, pa, pb in meta["pieces"][name]
                      if min(b, pb) > max(a, pa)}
    handles: dict[int, Any] = {}
    try:  # every file opened before any is read: the window a concurrent save's clean-up can hit is short
        for rank in sorted(needed):
            handles[rank] = _open_rank_file(folder, meta, rank)
        files = {rank: _verified(handle, meta, rank) for rank, handle in handles.items()}
    finally:
        for handle in handles.values():
            handle.close()

    def opened(rank: int) -> Any:
        return files[rank]

    for name, a, b, start in _pieces(layout, layout.rank):
        for rank, pa, pb in meta["pieces"][name]:
            x, y = max(a, pa), min(b, pb)
            if y <= x:
                continue
            dst = start + x - a
            shard[dst:dst + y - x] = _piece(opened(rank), f"param/{name}/{pa}", pb - pa, rank)[x - pa:y - pa]
            for key, value in states.items():
                value[dst:dst + y - x] = _piece(opened(rank), f"{key}/{name}/{pa}", pb - pa, rank)[x - pa:y - pa]
    keys = [k for k in opened(own).keys() if k.startswith("scalar/")]
    scalars = {k.split("/", 1)[1]: opened(own).get_tensor(k) for k in keys}
    rng = opened(layout.rank).get_tensor("rng") if meta["world_size"] == layout.world_size else None
    for what, values in (("the master weight", shard), *((f"optimizer state {k!r}", v) for k, v in states.items())):
        if (problem := _not_finite(layout, values, what)) is not None:
            raise CheckpointError(problem)
    for key, value in scalars.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"optimizer state {key!r} is {value.item()}")
    return shard, states, scalars, rng


def _named(path: Path) -> tuple[str | None, str | None]:
    """(the version ``LATEST`` names, None) or (None, why there is none)."""
    try:
        return _latest(path), None
    except CheckpointError as exc:
        return None, str(exc)


def _load_version(path: Path, name: str, layout: FixedLayout, optimizer: torch.optim.Optimizer,
                  override: Collection[str], check_extra: Callable[[dict], str | None] | None) -> tuple:
    """(error or None, whether a file was gone, what this rank loads from version ``name``), nothing changed."""
    folder = path / name
    try:
        with _reading(folder):
            meta = _read_meta(folder)
            _check_layout(meta, layout, optimizer, repr(str(folder)))
            if check_extra is not None and (problem := check_extra(meta["extra"])) is not None:
                raise CheckpointError(f"checkpoint {str(folder)!r}: meta.json is damaged: {problem}")
            groups = _restored_groups(meta, optimizer, override)
            return None, False, (meta, groups, *_read_shard(folder, meta, layout))
    except _Gone as exc:
        return str(exc), True, None
    except CheckpointError as exc:
        return str(exc), False, None
    except FileNotFoundError as exc:
        return f"reading {str(path)!r}: {type(exc).__name__}: {exc}", True, None
    except Exception as exc:  # noqa: BLE001 - a truncated or damaged file, whatever the reader raises
        return f"reading {str(path)!r}: {type(exc).__name__}: {exc}", False, None


def _restored_groups(meta: dict, optimizer: torch.optim.Optimizer, override: Collection[str]) -> list[dict]:
    """The optimiser's param groups with the checkpoint's values, but for the entries in ``override``."""
    groups, saved = optimizer.state_dict()["param_groups"], meta["optimizer"]["param_groups"]
    if len(saved) != len(groups):
        raise CheckpointError(f"the checkpoint has {len(saved)} param groups, this optimiser {len(groups)}")
    for i, (s, g) in enumerate(zip(saved, groups)):
        if (problem := group_problem(i, s, g)) is not None:
            raise CheckpointError(f"meta.json: {problem}")
    return [{**g, **{k: (tuple(v) if isinstance(g.get(k), tuple) else v) for k, v in s.items() if k not in override}}
            for g, s in zip(groups, saved)]


def load_checkpoint(path: str | Path, layout: FixedLayout, optimizer: torch.optim.Optimizer,
                    override: Collection[str] = (), check_extra: Callable[[dict], str | None] | None = None) -> dict:
    """Collective: load the current version at ``path`` into this rank's shard and optimiser state (any world
    size); returns the metadata (``step``, ``data_position``, ``extra``, the saved ``optimizer`` param groups,
    ...). ``override``: param-group entries (``lr``, ``weight_decay``, ...) the caller set explicitly, which
    keep their current values. ``check_extra``: what is wrong with the caller's ``extra`` (None: nothing),
    asked before anything changes. On any rank's failure every rank raises the same :class:`CheckpointError`
    and nothing has changed. Every rank reads the version rank 0 finds in ``LATEST``; when a file of it is gone
    and ``LATEST`` meanwhile names another version (a concurrent save's clean-up removed the one being read),
    every rank reads that one instead, up to ``_LOAD_TRIES`` versions; a file gone while ``LATEST`` still
    names its version is reported as it is."""
    path = Path(path)
    gone: tuple[str, str] | None = None  # (version, every rank's error) of the last try, when files were gone
    for _ in range(_LOAD_TRIES):
        name, problem = comm.broadcast_object(_named(path) if layout.rank == 0 else None)
        if problem is None and gone is not None and name == gone[0]:
            raise CheckpointError(gone[1])  # still current, a file missing: damage, not a race
        if problem is not None:
            raise CheckpointError(f"loading the checkpoint failed on rank 0: {problem}")
        error, vanished, loaded = _load_version(path, name, layout, optimizer, override, check_extra)
        failed = [(r, e, v) for r, (e, v) in enumerate(comm.all_gather_object((error, vanished))) if e is not None]
        if not failed:
            break
        rank, message, _ = next((f for f in failed if not f[2]), failed[0])
        message = f"loading the checkpoint failed on rank {rank}: {message}"
        if not all(v for _, _, v in failed):
            raise CheckpointError(message)
        gone = (name, message)
    else:
        raise CheckpointError(f"loading the checkpoint at {str(path)!r} failed: {_LOAD_TRIES} versions in a row "
                              f"were removed by concurrent saves while being read; load again, or save with "
                              f"keep=2 or more")
    meta, groups, shard, states, scalars, rng = loaded
    with torch.no_grad():
        layout.shard.copy_(shard.to(layout.shard.device))
    state = {k: v.to(layout.shard.device) for k, v in states.items()}
    state.update({k: v for k, v in scalars.items()})
    optimizer.load_state_dict({"state": {0: state} if state else {}, "param_groups": groups})
    if rng is not None:
        torch.set_rng_state(rng)
    return meta
