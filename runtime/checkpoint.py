"""Checkpoints of the fixed layout: safe to load, atomic, and resumable on another number of ranks.

A checkpoint is a folder. ``LATEST`` names its current version, a subfolder holding ``meta.json`` and one
``rank{r}.safetensors`` per rank that wrote it. Each rank's file holds, per range: for every parameter with
elements in its shard, ``param/<name>/<lo>`` (the master values of elements [lo, hi) of the parameter in the
layout's storage order) and the same range of every per-element optimiser state (``<state>/<name>/<lo>``),
plus its scalar optimiser state and its torch RNG state. ``meta.json`` holds the step, the data position, the
layout (shapes, storage order), where each parameter's ranges are, the optimiser's class and param groups, and
what the trainer adds (its strategy pool, the cost-model calibration).

Saving writes a new version beside the current one, flushes every file to disk, agrees that every rank
succeeded, and only then points ``LATEST`` at it (an atomic rename) and removes the old version: a crash at any
moment leaves ``LATEST`` naming a complete checkpoint. Loading reads safetensors and JSON only (no pickle, so a
crafted file runs no code); every rank reads and checks what it needs for its shard (any number of ranks,
any strategy pool) into memory, the ranks agree that all of them succeeded, and only then is anything changed.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runtime.fixed_layout import FixedLayout

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError", "FORMAT"]

FORMAT = 2
"""Version of the on-disk format."""


class CheckpointError(RuntimeError):
    """A checkpoint that could not be written, or does not exist, is damaged or does not match this job; the
    same on every rank."""


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _gather(obj: Any) -> list:
    if _world() == 1:
        return [obj]
    out: list = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def _agree(error: str | None, action: str) -> None:
    """Every rank's error (None: it succeeded); the first one is raised on every rank."""
    for rank, message in enumerate(_gather(error)):
        if message is not None:
            raise CheckpointError(f"{action} failed on rank {rank}: {message}")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pieces(layout: FixedLayout, lo: int, hi: int) -> list[tuple[str, int, int]]:
    """(parameter, first, end) of the parameter elements (storage order) inside flat range [lo, hi)."""
    out = []
    for name, spec in layout.specs.items():
        a, b = max(lo, spec.offset), min(hi, spec.offset + spec.numel)
        if b > a:
            out.append((name, a - spec.offset, b - spec.offset))
    return out


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


def save_checkpoint(path: str | Path, layout: FixedLayout, optimizer: torch.optim.Optimizer, step: int,
                    data_position: Any, extra: dict | None = None) -> None:
    """Collective: write a new version of the checkpoint at ``path`` and make it the current one."""
    from safetensors.torch import save_file

    path = Path(path)
    version = [f"v{step:08d}-{time.time_ns():x}"]
    if _world() > 1:
        dist.broadcast_object_list(version, src=0)
    tmp = path / f".{version[0]}.tmp"
    error = None
    try:
        if layout.rank == 0:
            if path.exists() and not path.is_dir():
                raise CheckpointError(f"{str(path)!r} is a file, expected a checkpoint folder")
            path.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
    except (OSError, CheckpointError) as exc:
        error = str(exc)
    _agree(error, "creating the checkpoint folder")
    error = None
    try:
        lo = layout.shard_lo
        shard = layout.shard.detach().cpu()
        per_element, scalars = _optimizer_state(optimizer, layout.shard_numel)
        tensors: dict[str, torch.Tensor] = {"rng": torch.get_rng_state()}
        for name, a, b in _pieces(layout, lo, lo + layout.shard_numel):
            start = layout.specs[name].offset + a - lo
            tensors[f"param/{name}/{a}"] = shard[start:start + b - a].clone()
            for key, value in per_element.items():
                tensors[f"{key}/{name}/{a}"] = value.detach().cpu()[start:start + b - a].clone()
        for key, value in scalars.items():
            tensors[f"scalar/{key}"] = torch.as_tensor(value).detach().cpu().reshape(())
        file = tmp / f"rank{layout.rank}.safetensors"
        save_file(tensors, str(file))
        _fsync(file)
    except Exception as exc:  # noqa: BLE001 - every failure is reported to every rank
        error = f"{type(exc).__name__}: {exc}"
    _agree(error, "writing the checkpoint")
    error = None
    try:
        if layout.rank == 0:
            _write_meta(tmp, layout, optimizer, step, data_position, extra)
            final = path / version[0]
            tmp.rename(final)
            _fsync(path)
            latest = path / ".LATEST.tmp"
            latest.write_text(version[0] + "\n")
            _fsync(latest)
            os.replace(latest, path / "LATEST")
            _fsync(path)
            for old in path.iterdir():
                if old.is_dir() and old.name != version[0]:
                    shutil.rmtree(old, ignore_errors=True)
    except Exception as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {exc}"
        shutil.rmtree(tmp, ignore_errors=True)
    _agree(error, "publishing the checkpoint")


def _write_meta(folder: Path, layout: FixedLayout, optimizer: torch.optim.Optimizer, step: int,
                data_position: Any, extra: dict | None) -> None:
    pieces: dict[str, list[list[int]]] = {name: [] for name in layout.specs}
    for rank in range(layout.world_size):
        lo, hi = layout.owner_range(rank)
        for name, a, b in _pieces(layout, lo, hi):
            pieces[name].append([rank, a, b])
    per_element, _ = _optimizer_state(optimizer, layout.shard_numel)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]
    meta = {
        "format": FORMAT, "step": step, "data_position": data_position, "world_size": layout.world_size,
        "numel": layout.numel,
        "params": {n: {"shape": list(s.shape), "split_dim": s.split_dim} for n, s in layout.specs.items()},
        "pieces": pieces,
        "optimizer": {"class": type(optimizer).__name__, "param_groups": groups, "per_element": sorted(per_element)},
        "extra": extra or {},
    }
    file = folder / "meta.json"
    file.write_text(json.dumps(meta))
    _fsync(file)


def _read_meta(path: Path) -> tuple[Path, dict]:
    latest = path / "LATEST"
    if not latest.is_file():
        raise CheckpointError(f"no checkpoint at {str(path)!r} (no LATEST file)")
    folder = path / latest.read_text().strip()
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {str(folder)!r} has no readable meta.json: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {str(folder)!r} is not of format {FORMAT}")
    return folder, meta


def _check_layout(meta: dict, layout: FixedLayout, optimizer: torch.optim.Optimizer, where: str) -> None:
    params = meta["params"]
    if list(params) != list(layout.specs):
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


def _read_shard(folder: Path, meta: dict, layout: FixedLayout, optimizer: torch.optim.Optimizer) -> tuple:
    """This rank's new shard, its per-element and scalar optimiser states, and its RNG state (or None)."""
    from safetensors import safe_open

    lo = layout.shard_lo
    shard = torch.zeros(layout.shard_numel, dtype=torch.float32)
    states = {k: torch.zeros(layout.shard_numel, dtype=torch.float32) for k in meta["optimizer"]["per_element"]}
    files: dict[int, Any] = {}

    def opened(rank: int) -> Any:
        if rank not in files:
            files[rank] = safe_open(str(folder / f"rank{rank}.safetensors"), framework="pt")
        return files[rank]

    for name, a, b in _pieces(layout, lo, lo + layout.shard_numel):
        for rank, pa, pb in meta["pieces"][name]:
            x, y = max(a, pa), min(b, pb)
            if y <= x:
                continue
            dst = layout.specs[name].offset + x - lo
            shard[dst:dst + y - x] = opened(rank).get_slice(f"param/{name}/{pa}")[x - pa:y - pa]
            for key, value in states.items():
                value[dst:dst + y - x] = opened(rank).get_slice(f"{key}/{name}/{pa}")[x - pa:y - pa]
    own = layout.rank if layout.rank < meta["world_size"] else 0
    keys = [k for k in opened(own).keys() if k.startswith("scalar/")]
    scalars = {k.split("/", 1)[1]: opened(own).get_tensor(k) for k in keys}
    rng = opened(layout.rank).get_tensor("rng") if meta["world_size"] == layout.world_size else None
    return shard, states, scalars, rng


def load_checkpoint(path: str | Path, layout: FixedLayout, optimizer: torch.optim.Optimizer) -> dict:
    """Collective: load the current version at ``path`` into this rank's shard and optimiser state (any world
    size); returns the metadata (``step``, ``data_position``, ``extra``, ...). On any rank's failure every
    rank raises the same :class:`CheckpointError` and nothing has changed."""
    path = Path(path)
    error, loaded = None, None
    try:
        folder, meta = _read_meta(path)
        _check_layout(meta, layout, optimizer, repr(str(folder)))
        loaded = (meta, *_read_shard(folder, meta, layout, optimizer))
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - a truncated or damaged file, whatever the reader raises
        error = f"reading {str(path)!r}: {type(exc).__name__}: {exc}"
    _agree(error, "loading the checkpoint")
    meta, shard, states, scalars, rng = loaded
    with torch.no_grad():
        layout.shard.copy_(shard.to(layout.shard.device))
    groups = optimizer.state_dict()["param_groups"]
    saved_groups = meta["optimizer"]["param_groups"]
    restored = [{**g, **{k: (tuple(v) if isinstance(g.get(k), tuple) else v) for k, v in s.items()}}
                for g, s in zip(groups, saved_groups)]
    state = {k: v.to(layout.shard.device) for k, v in states.items()}
    state.update({k: v for k, v in scalars.items()})
    optimizer.load_state_dict({"state": {0: state} if state else {}, "param_groups": restored})
    if rng is not None:
        torch.set_rng_state(rng)
    return meta
