"""The way back out: trained parameters written as a Hugging Face model folder.

Owns :func:`save_pretrained` (what ``Trainer.save_pretrained`` calls). Collective: every parameter of the fixed
layout is gathered to rank 0 one at a time (``FixedLayout.gather_to_rank0``; no rank ever holds more than one
parameter beyond the shard being written), and rank 0 writes it under the model's own name (a tied weight once,
as the layout holds it) into safetensors shards of at most ``max_shard_size`` bytes, named as Hugging Face
names them: ``model.safetensors`` when one shard is enough, else ``model-0000i-of-0000n.safetensors`` with a
``model.safetensors.index.json``. The model's config goes beside them (``config.json`` with the saved dtype,
``generation_config.json`` when the model has one), so ``AutoModelForCausalLM.from_pretrained(path)`` loads
it. Everything is written into a new folder beside ``path`` and moved in only once complete; files of
``path`` that the export does not write are left alone.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from runtime import distributed as comm
from runtime.fixed_layout import FixedLayout

__all__ = ["save_pretrained", "parse_size"]

_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20,
          "GIB": 2 ** 30}


def parse_size(size: int | str) -> int:
    """Bytes of ``5GB``, ``500MiB``, ``20KB`` or an integer; a bad value is a ValueError naming it."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(size).upper())
    if isinstance(size, bool) or match is None or float(match.group(1)) <= 0:
        raise ValueError(f"max_shard_size must be a positive byte count such as 5GB or 500MiB, got {size!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def _check_destination(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise ValueError(f"cannot write a model folder at {str(path)!r}: it is a file")
    if not path.parent.is_dir():
        raise ValueError(f"cannot write a model folder at {str(path)!r}: {str(path.parent)!r} does not exist")


def save_pretrained(model: nn.Module, layout: FixedLayout, path: str | os.PathLike, *,
                    dtype: torch.dtype = torch.float32, max_shard_size: int | str = "5GB") -> list[str] | None:
    """Write ``layout``'s parameters under ``model``'s names (with its config when it has one) as a Hugging
    Face folder at ``path``; collective, rank 0 writes. Returns the written file names on rank 0."""
    limit = parse_size(max_shard_size)
    target = Path(path)
    rank = layout.rank
    error = None
    if rank == 0:
        try:
            _check_destination(target)
        except ValueError as e:
            error = str(e)
    _agree(error, layout.world_size)
    staging = target.parent / f".{target.name}.export-{os.getpid()}" if rank == 0 else None
    if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    try:
        files = _write_shards(layout, staging, dtype, limit)
        if rank == 0:
            _write_config(model, staging, dtype)
            target.mkdir(exist_ok=True)
            for stale in target.glob("model*.safetensors*"):  # an earlier export's shards would shadow these
                stale.unlink()
            for f in sorted(staging.iterdir()):
                os.replace(f, target / f.name)
            return sorted(files + [f for f in ("config.json", "generation_config.json") if (target / f).exists()])
        return None
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def _agree(error: str | None, world: int) -> None:
    error = comm.broadcast_object(error)  # rank 0 checked the destination
    if error:
        raise ValueError(error)


def _write_shards(layout: FixedLayout, folder: Path | None, dtype: torch.dtype, limit: int) -> list[str]:
    """Gather every parameter to rank 0 in layout order and write it into shards there; the file names."""
    parts: list[tuple[str, list[str], int]] = []  # (file, tensor names, bytes)
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name in layout.specs:
        full = layout.gather_to_rank0(name)
        if full is None:
            continue
        tensor = full.to(dtype).cpu()
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > limit:
            parts.append(_flush(shard, folder, len(parts), size))
            shard, size = {}, 0
        shard[name] = tensor
        size += nbytes
    if folder is None:
        return []
    parts.append(_flush(shard, folder, len(parts), size))
    return _name_shards(folder, parts)


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


def _write_config(model: nn.Module, folder: Path, dtype: torch.dtype) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return  # not a Hugging Face model: the weights alone, under the module's names
    config = copy.deepcopy(config)
    config.dtype = dtype
    config.save_pretrained(str(folder))
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(str(folder))
