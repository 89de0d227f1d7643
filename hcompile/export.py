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
(``ExportError``: a full disk, a read-only folder).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from runtime import distributed as comm
from runtime.executor import NonFiniteError
from runtime.fixed_layout import FixedLayout

__all__ = ["save_pretrained", "parse_size", "ExportError", "RECORD"]

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


def save_pretrained(model: nn.Module, layout: FixedLayout, path: str | os.PathLike, *,
                    dtype: torch.dtype = torch.float32, max_shard_size: int | str = "5GB") -> list[str] | None:
    """Write ``layout``'s parameters under ``model``'s names (with its config when it has one) as a Hugging
    Face folder at ``path``; collective, rank 0 writes. Returns the names of the files written, on rank 0
    (None elsewhere). Any failure is the same error on every rank with ``path`` as it was (module docstring)."""
    limit = parse_size(max_shard_size)
    target = Path(path)
    _agree(_destination_problem(target) if layout.rank == 0 else None, ValueError)
    staging, failure, outcome = None, None, "nothing in it was changed"
    if layout.rank == 0:
        folder = target.parent / f".{target.name}.export-{os.getpid()}-{time.time_ns():x}"
        try:  # a name of this export's own, beside the target (the same file system: moves are renames)
            folder.mkdir()
            staging = folder
        except OSError as exc:
            failure = (ExportError, f"cannot write beside it: {exc}")
    try:
        files, failure = _write_shards(layout, staging, dtype, limit, failure)
        if staging is not None and failure is None:
            try:
                files += _write_config(model, staging, dtype)
                _move_into_place(staging, target, files)
            except _NotRestored as exc:
                failure, outcome, staging = (ExportError, str(exc.__cause__)), str(exc), None  # keep what it holds
            except Exception as exc:  # noqa: BLE001 - every rank is told
                failure = (ExportError, f"{type(exc).__name__}: {exc}")
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    if failure is not None:
        failure = (failure[0], f"exporting to {str(target)!r} failed on rank 0: {failure[1]}; {outcome}")
    _agree(failure[1] if failure else None, failure[0] if failure else ExportError)
    return sorted(files) if layout.rank == 0 else None


class _NotRestored(Exception):
    """A move into place failed and so did putting the replaced files back: they are named, and kept."""


def _agree(error: str | None, kind: type[Exception]) -> None:
    """Raise rank 0's error (None: it succeeded), as ``kind``, on every rank."""
    error, name = comm.broadcast_object((error, kind.__name__))
    if error:
        raise {c.__name__: c for c in (ValueError, ExportError, NonFiniteError)}[name](error)


def _write_shards(layout: FixedLayout, folder: Path | None, dtype: torch.dtype, limit: int,
                  failure: tuple | None) -> tuple[list[str], tuple | None]:
    """Gather every parameter to rank 0 in layout order and write it into shards there: (the file names,
    rank 0's failure or None). After a failure rank 0 still takes part in every gather, writing nothing, so
    that every rank reaches the agreement."""
    parts: list[tuple[str, list[str], int]] = []  # (file, tensor names, bytes)
    shard: dict[str, torch.Tensor] = {}
    size = 0
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
            nbytes = tensor.numel() * tensor.element_size()
            if shard and size + nbytes > limit:
                parts.append(_flush(shard, folder, len(parts), size))
                shard, size = {}, 0
            shard[name] = tensor
            size += nbytes
        except Exception as exc:  # noqa: BLE001 - a full disk, a write error: every rank is told
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
        record = json.loads((target / RECORD).read_text())
        files = record["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if not isinstance(files, dict):
        return []
    own = []
    for name, nbytes in files.items():
        file = target / str(name)
        if (isinstance(name, str) and "/" not in name and name not in ("", ".", "..") and file.is_file()
                and not file.is_symlink() and file.stat().st_size == nbytes):
            own.append(name)
    return own


def _move_into_place(staging: Path, target: Path, files: list[str]) -> None:
    """Make ``target`` hold the staged files (and the record of them): one rename of the staged folder when
    ``target`` does not exist; otherwise the files replaced or left over from an earlier export are set aside,
    the new ones moved in, and on any failure everything is put back."""
    (staging / RECORD).write_text(json.dumps({"files": {f: (staging / f).stat().st_size for f in files}},
                                             indent=2, sort_keys=True) + "\n")
    if not target.exists():
        os.rename(staging, target)
        return
    earlier = set(_earlier_export(target))
    if "model.safetensors.index.json" in files and (target / "model.safetensors").exists() \
            and "model.safetensors" not in earlier:
        raise ExportError(f"{str(target / 'model.safetensors')!r} was not written by an export and would be loaded "
                          f"instead of the shards of this one; remove it, or export into another folder")
    aside = staging / ".replaced"
    aside.mkdir()
    moved_aside: list[str] = []
    moved_in: list[str] = []
    try:
        for name in sorted(earlier | {f for f in (*files, RECORD) if (target / f).exists()}):
            os.rename(target / name, aside / name)
            moved_aside.append(name)
        for name in [*files, RECORD]:
            os.rename(staging / name, target / name)
            moved_in.append(name)
    except OSError as exc:
        try:
            for name in reversed(moved_in):
                os.rename(target / name, staging / name)
            for name in reversed(moved_aside):
                os.rename(aside / name, target / name)
        except OSError as again:
            raise _NotRestored(f"putting back what it replaced failed too ({again}): the replaced files are in "
                               f"{str(aside)!r}") from exc
        raise
