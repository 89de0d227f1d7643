"""The way back out: trained parameters written as a Hugging Face model folder.

Owns :func:`save_pretrained` (what ``Trainer.save_pretrained`` calls) and :class:`ExportError`. Collective:
every parameter of the fixed layout is gathered to rank 0 one at a time (``FixedLayout.gather_to_rank0``; no
rank ever holds more than one parameter beyond the shard being written), and rank 0 writes it under the
model's own name (a tied weight once, as the layout holds it) into safetensors shards of at most
``max_shard_size`` bytes, named as Hugging Face names them: ``model.safetensors`` when one shard is enough,
else ``model-0000i-of-0000n.safetensors`` with a ``model.safetensors.index.json``. The model's config goes
beside them (``config.json`` with the saved dtype, ``generation_config.json`` when the model has one), so
``AutoModelForCausalLM.from_pretrained(path)`` loads it.

What is touched: everything is written into a new folder beside ``path`` and moved in only once complete (a
rename of the whole folder when ``path`` does not exist yet; otherwise the files it replaces are set aside
first and put back if a move fails), with ``.hydraulis-export.json``, the list of the files this export
wrote. Besides the files it writes, an export removes only the files an earlier export listed there (and
still of the size it wrote): a user's ``model_backup.safetensors``, ``notes.txt`` or a ``config.json`` the
model has none of are never touched. Refused, with the target unchanged and the same error on every rank: a
target that is a file or whose parent does not exist (``ValueError``), a ``model.safetensors`` this export did
not write beside the shards of a sharded one (it would be loaded instead of them, ``ExportError``), a
parameter holding a NaN or an infinity (``NonFiniteError``), and any failure to write or move
(``ExportError``: a full disk, a read-only folder). Refused before anything is written: a ``dtype`` that is not
a floating one (``ValueError``; names such as ``"bfloat16"`` are accepted), and a symbolic link where a file
this export writes or reads would be (``ExportError`` naming it; the project's own files are never reached
through a link). Beside the parameters, the model's persistent buffers are written (what ``state_dict()`` holds
beyond its parameters; floating ones in ``dtype``), non-persistent ones are not.

Kills: the staging folder ``.<name>.export-<pid>-<ns>`` is claimed by an ``flock`` on its sidecar
``.<name>.export-<pid>-<ns>.lock`` (which also names the host, pid and process start time, for file systems
without ``flock``). Staged files and folders are ``fsync``-ed before the move; a move over an existing target
first writes a journal (``.hydraulis-move.json`` in the staging folder: the files it sets aside into
``.replaced``, then the files it moves in, in order) and removes it once every file is in. :func:`recover` (run
by every export first, and callable before a load) takes over the staging folders of ``path`` whose owner is
gone: with a journal it finishes the move (or puts back what was set aside when a staged file is missing),
without one it removes the folder (the target was then either untouched or complete), and it removes their
lock files.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import stat
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from runtime import distributed as comm
from runtime.executor import NonFiniteError
from runtime.fixed_layout import FixedLayout
from runtime.own_files import NO_FLOCK, pid_runs, read_own, write_new

__all__ = ["save_pretrained", "parse_size", "export_dtype", "recover", "ExportError", "RECORD"]

RECORD = ".hydraulis-export.json"
"""The file listing what an export wrote into its folder (name: bytes); the next export removes only those."""
_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20,
          "GIB": 2 ** 30}


class ExportError(RuntimeError):
    """An export that could not be written or moved into place; the same on every rank, the target unchanged."""


def parse_size(size: int | str) -> int:
    """Bytes of ``5GB``, ``500MiB``, ``20KB`` or an integer; a bad value is a ValueError naming it."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(size).upper())
    if isinstance(size, bool) or match is None or float(match.group(1)) <= 0:
        raise ValueError(f"max_shard_size must be a positive byte count such as 5GB or 500MiB, got {size!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def _destination_problem(path: Path) -> str | None:
    if path.exists() and not path.is_dir():
        return f"cannot write a model folder at {str(path)!r}: it is a file"
    if not path.parent.is_dir():
        return f"cannot write a model folder at {str(path)!r}: {str(path.parent)!r} does not exist"
    return None


_FLOATING = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "f32": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
             "half": torch.float16, "f16": torch.float16, "float64": torch.float64, "fp64": torch.float64,
             "double": torch.float64, "f64": torch.float64}


def export_dtype(dtype: Any) -> torch.dtype:
    """The floating dtype an export writes: ``torch.float32``, ``torch.bfloat16``, ``torch.float16`` or
    ``torch.float64``, or one of their names (``"bfloat16"``, ``"torch.bfloat16"``, ``"bf16"``, ``"fp32"``,
    ``"half"``...). Anything else (an integer or boolean dtype, a float8 one, an unknown name) is a ValueError
    naming it."""
    if isinstance(dtype, torch.dtype) and dtype in _FLOATING.values():
        return dtype
    if isinstance(dtype, str) and dtype.strip().lower().removeprefix("torch.") in _FLOATING:
        return _FLOATING[dtype.strip().lower().removeprefix("torch.")]
    raise ValueError(f"save_pretrained's dtype must be a floating dtype: torch.float32, torch.bfloat16, "
                     f"torch.float16 or torch.float64, or its name such as 'bfloat16' or 'fp32'; got {dtype!r}")


def save_pretrained(model: nn.Module, layout: FixedLayout, path: str | os.PathLike, *,
                    dtype: torch.dtype | str = torch.float32,
                    max_shard_size: int | str = "5GB") -> list[str] | None:
    """Write ``layout``'s parameters under ``model``'s names (with its persistent buffers and its config when
    it has one) as a Hugging Face folder at ``path``; collective, rank 0 writes. Returns the names of the files
    written, on rank 0 (None elsewhere). Any failure is the same error on every rank with ``path`` as it was
    (module docstring); first, what killed exports into ``path`` left is settled (:func:`recover`)."""
    dtype = export_dtype(dtype)
    limit = parse_size(max_shard_size)
    target = Path(path)
    _agree(_destination_problem(target) if layout.rank == 0 else None, ValueError)
    staging, claim, failure, outcome = None, None, None, "nothing in it was changed"
    buffers: dict[str, torch.Tensor] = {}
    if layout.rank == 0:
        try:
            recover(target)
        except (OSError, ExportError) as exc:
            failure = (ExportError, f"settling what a killed export left beside it failed: {exc}")
        try:
            buffers = _persistent_buffers(model) if failure is None else {}
        except Exception as exc:  # noqa: BLE001 - a state_dict hook failing: every rank is told
            failure = (ExportError, f"reading the model's buffers failed: {type(exc).__name__}: {exc}")
        try:  # a name of this export's own, beside the target (the same file system: moves are renames)
            claim = _Claim(target) if failure is None else None
            staging = claim.folder if claim is not None else None
        except OSError as exc:
            failure = (ExportError, f"cannot write beside it: {exc}")
    try:
        files, failure = _write_shards(layout, staging, dtype, limit, failure, buffers)
        if staging is not None and failure is None:
            try:
                files += _write_config(model, staging, dtype)
                _move_into_place(staging, target, files)
            except _NotRestored as exc:
                failure, outcome, staging = (ExportError, str(exc.__cause__)), str(exc), None  # keep what it holds
            except Exception as exc:  # noqa: BLE001 - every rank is told
                failure = (ExportError, f"{type(exc).__name__}: {exc}")
    finally:
        if claim is not None:
            claim.release(remove=staging is not None)
    if failure is not None:
        failure = (failure[0], f"exporting to {str(target)!r} failed on rank 0: {failure[1]}; {outcome}")
    _agree(failure[1] if failure else None, failure[0] if failure else ExportError)
    return sorted(files) if layout.rank == 0 else None


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """What ``model.state_dict()`` holds beyond its parameters: its persistent buffers (non-persistent ones are
    not in it), by name. A buffer without values (on the meta device) is an ExportError naming it."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    buffers = {name: t for name, t in model.state_dict(keep_vars=True).items()
               if name not in params and isinstance(t, torch.Tensor)}
    empty = sorted(name for name, t in buffers.items() if t.is_meta)
    if empty:
        raise ExportError(f"the model's persistent buffers {empty} hold no values (they are on the meta device); "
                          f"give them values, or register them with persistent=False")
    return buffers


class _NotRestored(Exception):
    """A move into place failed and so did putting the replaced files back: they are named, and kept."""


def _agree(error: str | None, kind: type[Exception]) -> None:
    """Raise rank 0's error (None: it succeeded), as ``kind``, on every rank."""
    error, name = comm.broadcast_object((error, kind.__name__))
    if error:
        raise {c.__name__: c for c in (ValueError, ExportError, NonFiniteError)}[name](error)


def _write_shards(layout: FixedLayout, folder: Path | None, dtype: torch.dtype, limit: int,
                  failure: tuple | None, buffers: dict[str, torch.Tensor]) -> tuple[list[str], tuple | None]:
    """Gather every parameter to rank 0 in layout order and write it into shards there, then rank 0's
    ``buffers`` (floating ones in ``dtype``, others as they are): (the file names, rank 0's failure or None).
    After a failure rank 0 still takes part in every gather, writing nothing, so that every rank reaches the
    agreement."""
    parts: list[tuple[str, list[str], int]] = []  # (file, tensor names, bytes)
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def add(name: str, tensor: torch.Tensor) -> None:
        nonlocal shard, size
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > limit:
            parts.append(_flush(shard, folder, len(parts), size))
            shard, size = {}, 0
        shard[name] = tensor
        size += nbytes

    for name in layout.specs:
        full = layout.gather_to_rank0(name)
        if full is None or failure is not None:
            continue
        try:
            tensor = full.to(dtype).cpu()
            if not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).sum())
                failure = (NonFiniteError, f"parameter {name!r} holds {bad} non-finite values (NaN or infinity) "
                                           f"in {dtype}")
                continue
            add(name, tensor)
        except Exception as exc:  # noqa: BLE001 - a full disk, a write error: every rank is told
            failure = (ExportError, f"{type(exc).__name__}: {exc}")
    for name, buffer in buffers.items():  # rank 0's alone; a copy each (two names may share one tensor)
        if failure is not None:
            break
        try:
            add(name, buffer.detach().to("cpu", dtype if buffer.is_floating_point() else buffer.dtype,
                                         copy=True).contiguous())
        except Exception as exc:  # noqa: BLE001
            failure = (ExportError, f"{type(exc).__name__}: {exc}")
    if folder is None or failure is not None:
        return [], failure
    try:
        parts.append(_flush(shard, folder, len(parts), size))
        return _name_shards(folder, parts), None
    except Exception as exc:  # noqa: BLE001
        return [], (ExportError, f"{type(exc).__name__}: {exc}")


def _flush(tensors: dict[str, torch.Tensor], folder: Path, index: int, nbytes: int) -> tuple[str, list[str], int]:
    name = f"part-{index:05d}.safetensors"
    save_file(tensors, str(folder / name), metadata={"format": "pt"})
    return name, list(tensors), nbytes


def _name_shards(folder: Path, parts: list[tuple[str, list[str], int]]) -> list[str]:
    """Rename the parts as Hugging Face names shards, and write the index when there are several."""
    if len(parts) == 1:
        os.replace(folder / parts[0][0], folder / "model.safetensors")
        return ["model.safetensors"]
    weight_map, names = {}, []
    for i, (part, tensors, _) in enumerate(parts, start=1):
        name = f"model-{i:05d}-of-{len(parts):05d}.safetensors"
        os.replace(folder / part, folder / name)
        weight_map.update({t: name for t in tensors})
        names.append(name)
    index = {"metadata": {"total_size": sum(p[2] for p in parts)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*names, "model.safetensors.index.json"]


def _write_config(model: nn.Module, folder: Path, dtype: torch.dtype) -> list[str]:
    """The model's config (and generation config) in ``folder``: the names written (none for a model that is
    not a Hugging Face one)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return []  # not a Hugging Face model: the weights alone, under the module's names
    before = set(os.listdir(folder))
    config = copy.deepcopy(config)
    config.dtype = dtype
    config.save_pretrained(str(folder))
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(str(folder))
    return sorted(set(os.listdir(folder)) - before)


def _earlier_export(target: Path) -> list[str]:
    """The files an earlier export listed in ``target`` that are still there as it wrote them (same size)."""
    try:
        record = json.loads(read_own(target / RECORD))
        files = record["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if not isinstance(files, dict):
        return []
    return [name for name, nbytes in files.items() if _plain_name(name) and _is_file(target / name, nbytes)]


def _plain_name(name: Any) -> bool:
    return isinstance(name, str) and "/" not in name and name not in ("", ".", "..") and "\0" not in name


def _is_file(path: Path, nbytes: int | None = None) -> bool:
    """Whether ``path`` itself (not what a link points to) is a regular file, of ``nbytes`` when given."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and (nbytes is None or st.st_size == nbytes)


def _sync(path: Path, directory: bool = False) -> None:
    """``fsync`` a file or a folder (without following a link); a folder a file system cannot sync is let be."""
    fd = os.open(path, (os.O_RDONLY | os.O_DIRECTORY if directory else os.O_RDONLY) | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    except OSError as exc:
        if not directory or exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _no_links(target: Path, names: list[str]) -> None:
    """Refuse, by name, a symbolic link where one of the export's own files would be."""
    links = [str(target / n) for n in names if (target / n).is_symlink()]
    if links:
        kind = "is a symbolic link" if len(links) == 1 else "are symbolic links"
        raise ExportError(f"{', '.join(repr(n) for n in links)} {kind} where the export writes its own file: not "
                          f"followed or replaced; remove it, or export into another folder")


def _move_into_place(staging: Path, target: Path, files: list[str]) -> None:
    """Make ``target`` hold the staged files (and the record of them), all synced first: one rename of the
    staged folder when ``target`` does not exist; otherwise, under a journal, the files replaced or left over
    from an earlier export are set aside, the new ones moved in, and on any failure everything is put back."""
    write_new(staging / RECORD, json.dumps({"files": {f: os.lstat(staging / f).st_size for f in files}},
                                            indent=2, sort_keys=True) + "\n")
    new = [*files, RECORD]
    for name in new:
        _sync(staging / name)
    _sync(staging, directory=True)
    if not os.path.lexists(target):
        os.rename(staging, target)
        _sync(target.parent, directory=True)
        return
    _no_links(target, new)
    earlier = set(_earlier_export(target))
    if "model.safetensors.index.json" in files and os.path.lexists(target / "model.safetensors") \
            and "model.safetensors" not in earlier:
        raise ExportError(f"{str(target / 'model.safetensors')!r} was not written by an export and would be loaded "
                          f"instead of the shards of this one; remove it, or export into another folder")
    aside = staging / _ASIDE
    aside.mkdir()
    replaced = sorted(earlier | {f for f in new if os.path.lexists(target / f)})
    write_new(staging / _JOURNAL, json.dumps({"target": target.name, "aside": replaced,
                                               "files": {f: os.lstat(staging / f).st_size for f in new}}) + "\n")
    _sync(staging, directory=True)
    moved_aside: list[str] = []
    moved_in: list[str] = []
    try:
        for name in replaced:
            os.rename(target / name, aside / name)
            moved_aside.append(name)
        for name in new:
            os.rename(staging / name, target / name)
            moved_in.append(name)
        _sync(target, directory=True)
        os.unlink(staging / _JOURNAL)  # the move is done: without the journal nothing is rolled forward
    except OSError as exc:
        try:
            for name in reversed(moved_in):
                os.rename(target / name, staging / name)
            for name in reversed(moved_aside):
                os.rename(aside / name, target / name)
        except OSError as again:
            raise _NotRestored(f"putting back what it replaced failed too ({again}): the replaced files are in "
                               f"{str(aside)!r}, and the next export into it (or hcompile.export.recover) finishes "
                               f"the move") from exc
        raise


_ASIDE = ".replaced"
"""The folder, inside the staging one, that holds what a move over an existing target set aside."""
_JOURNAL = ".hydraulis-move.json"
"""The journal of a move over an existing target, in the staging folder: present from before the first file is
set aside until every new file is in (``{"target": name, "aside": [names], "files": {name: bytes}}``)."""
_ACTIVE: set[str] = set()
"""The lock files this process holds now (for the no-``flock`` fallback: one of ours that is not here is stale)."""


def _staging_pattern(target: Path) -> re.Pattern:
    return re.compile(rf"\.{re.escape(target.name)}\.export-(\d+)-[0-9a-f]+(\.lock|\.lock-new)?")


class _Claim:
    """This export's staging folder ``.<name>.export-<pid>-<ns>`` beside the target, claimed by an exclusive
    ``flock`` on the sidecar lock file created before it (and removed after it): the lock names this host, pid
    and process start time, and appears under its name already locked and written (``<stem>.lock-new`` renamed)."""

    def __init__(self, target: Path):
        stem = f".{target.name}.export-{os.getpid()}-{time.time_ns():x}"
        self.folder, self.lock = target.parent / stem, target.parent / (stem + ".lock")
        fresh = target.parent / (stem + ".lock-new")
        self.fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        _ACTIVE.add(os.path.abspath(self.lock))
        try:
            with contextlib.suppress(OSError):  # no flock on this file system: the owner it names decides
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(self.fd, json.dumps(_owner()).encode())
            os.fsync(self.fd)
            os.rename(fresh, self.lock)
            self.folder.mkdir()
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(fresh)
            self.release(remove=True)
            raise

    def release(self, remove: bool) -> None:
        """Give the claim up: with ``remove``, the staging folder and the lock file go; without, both stay for
        :func:`recover` to settle (the flock goes with the file descriptor)."""
        if remove:
            if os.path.isdir(self.folder) and not os.path.islink(self.folder):
                shutil.rmtree(self.folder, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.unlink(self.lock)
        _ACTIVE.discard(os.path.abspath(self.lock))
        os.close(self.fd)


def _owner() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (boot id and clock ticks since boot, from /proc), None where unknown."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return f"{boot}:{fields[19]}"
    except (OSError, IndexError):
        return None


def _owner_alive(owner: Any) -> bool:
    """Without ``flock``: whether the owner a lock file names may still run. One on another host cannot be
    asked (it may); on this host: its pid runs and started when the lock file says."""
    if not isinstance(owner, dict) or type(owner.get("pid")) is not int:
        return False
    if owner.get("host") != socket.gethostname():
        return True
    pid = owner["pid"]
    if pid == os.getpid():
        return False  # this process's live claims are found by _ACTIVE before
    if not pid_runs(pid):
        return False
    started = _start_time(pid)
    return started is None or owner.get("start") is None or started == owner.get("start")


def _take_over(lock: Path) -> int | None:
    """An open descriptor on ``lock`` with its ``flock`` held; None while its owner is alive; -1 when the file
    is gone (its export has just ended, or renamed it into place)."""
    if os.path.abspath(lock).removesuffix("-new") in _ACTIVE:
        return None
    try:
        fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return -1
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ExportError(f"{str(lock)!r} is a symbolic link where an export's lock file would be: not "
                              f"followed; remove it") from None
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        alive = True
        if exc.errno in NO_FLOCK:
            text = os.pread(fd, 1 << 16, 0)
            try:
                alive = _owner_alive(json.loads(text))
            except ValueError:  # one its owner is writing now, or never finished writing (killed at once)
                alive = time.time() - os.fstat(fd).st_mtime < 60
        if alive:
            os.close(fd)
            return None
    return fd


def recover(path: str | os.PathLike) -> list[str]:
    """Settle what exports into ``path`` that were killed left beside it, and return what was done (one line per
    staging folder). Each ``.<name>.export-*`` staging folder whose export is gone (its lock file's ``flock`` is
    free; without one, its owner no longer runs): with a move journal, the move is finished (every new file
    moved in, the replaced ones removed; or, if a staged file is missing, what was set aside is put back),
    without one the folder is removed; then its lock file. Folders of live exports are left alone. Run by every
    export first; call it before loading ``path`` to see the export whole. A symbolic link in the place of a
    staging folder, journal or lock file is refused by name (``ExportError``); nothing else is touched."""
    target = Path(path)
    pattern = _staging_pattern(target)
    try:
        names = os.listdir(target.parent)
    except OSError:
        return []
    done = []
    for stem in sorted({n.removesuffix("-new").removesuffix(".lock") for n in names if pattern.fullmatch(n)}):
        folder, lock = target.parent / stem, target.parent / (stem + ".lock")
        fresh = target.parent / (stem + ".lock-new")
        if os.path.islink(folder):
            _settle(folder, target)  # refused by name: an export makes its folder, never a link
        if os.path.lexists(fresh):  # a lock file its export was killed before renaming into place
            fd = _take_over(fresh)
            if fd is None:
                continue
            if fd >= 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(fresh)
                os.close(fd)
        fd = _take_over(lock) if os.path.lexists(lock) else -1
        if fd is None:
            continue
        if fd < 0 and int(pattern.fullmatch(stem).group(1)) != os.getpid() and \
                _owner_alive({"host": socket.gethostname(), "pid": int(pattern.fullmatch(stem).group(1))}):
            continue  # a folder without a lock file (an earlier version's export) whose process still runs
        try:
            if os.path.lexists(folder):
                done.append(f"{stem}: {_settle(folder, target)}")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)
        finally:
            if fd >= 0:
                os.close(fd)
    return done


def _settle(folder: Path, target: Path) -> str:
    """Finish (or undo) the move a killed export left in its staging ``folder``, then remove the folder."""
    if os.path.islink(folder) or not os.path.isdir(folder):
        raise ExportError(f"{str(folder)!r} is not a folder an export made (a symbolic link or a file): not "
                          f"followed or removed; remove it")
    outcome = "removed (the move into place had not begun, or had ended)"
    if os.path.lexists(folder / _JOURNAL):
        try:
            journal = json.loads(read_own(folder / _JOURNAL))
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ExportError(f"{str(folder / _JOURNAL)!r} is a symbolic link where an export's journal "
                                  f"would be: not followed; remove it") from None
            raise
        except ValueError:
            journal = None  # torn while written (before any move): nothing was moved
        if _valid_journal(journal, target) and os.path.isdir(target):
            outcome = _finish_move(folder, target, journal["aside"], journal["files"])
    shutil.rmtree(folder)
    _sync(target.parent, directory=True)
    return outcome


def _valid_journal(journal: Any, target: Path) -> bool:
    return (isinstance(journal, dict) and journal.get("target") == target.name
            and isinstance(journal.get("aside"), list) and all(_plain_name(n) for n in journal["aside"])
            and isinstance(journal.get("files"), dict) and all(_plain_name(n) and type(b) is int
                                                               for n, b in journal["files"].items()))


def _finish_move(folder: Path, target: Path, aside: list[str], files: dict[str, int]) -> str:
    """Roll a journalled move forward: what was still to be set aside is, what was still to be moved in is.
    The moves run in the journal's order (every set-aside before any move-in; a failed move undone in reverse),
    so a file is still to move exactly when it is still where it started. When a staged file is missing (or a
    new file's name is taken again in the target) it rolls back instead: the new files out, the replaced in."""
    replaced = folder / _ASIDE
    pending = [f for f in files if os.path.lexists(folder / f)]
    forward = all(_is_file(folder / f, files[f]) for f in pending) and not any(
        os.path.lexists(target / f) and (f not in aside or os.path.lexists(replaced / f)) for f in pending)
    if forward:
        for name in aside:
            if not os.path.lexists(replaced / name) and os.path.lexists(target / name) \
                    and (name not in files or os.path.lexists(folder / name)):
                os.rename(target / name, replaced / name)
        for name in pending:
            os.rename(folder / name, target / name)
        _sync(target, directory=True)
        return "the interrupted move was finished (the target holds that export)"
    for name in reversed(list(files)):  # moved in: no longer staged, and not the replaced file still in place
        if not os.path.lexists(folder / name) and (name not in aside or os.path.lexists(replaced / name)) \
                and _is_file(target / name, files[name]):
            os.rename(target / name, folder / name)
    for name in reversed(aside):
        if os.path.lexists(replaced / name) and not os.path.lexists(target / name):
            os.rename(replaced / name, target / name)
    _sync(target, directory=True)
    return "the interrupted move was undone (a staged file was missing; the target holds the export before it)"
