"""Checkpoints of the fixed layout: each rank's parameter shard and optimiser state, the step and the data
position, so that a resumed run continues exactly as an uninterrupted one. Written to a temporary folder
and renamed into place by rank 0 once every rank has written, so a crash never leaves half a checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runtime.fixed_layout import FixedLayout

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint that does not exist or does not match this job."""


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_checkpoint(path: str | Path, layout: FixedLayout, optimizer: torch.optim.Optimizer, step: int,
                    data_position: Any, extra: dict | None = None) -> None:
    """Collective: every rank writes its shard; rank 0 publishes the folder."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if layout.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    torch.save({"shard": layout.shard.detach().clone(), "optimizer": optimizer.state_dict()},
               tmp / f"rank{layout.rank}.pt")
    _barrier()
    if layout.rank == 0:
        meta = {"world_size": layout.world_size, "numel": layout.numel, "step": step,
                "data_position": data_position, "names": list(layout.shapes), "extra": extra or {}}
        (tmp / "meta.json").write_text(json.dumps(meta))
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    _barrier()


def load_checkpoint(path: str | Path, layout: FixedLayout, optimizer: torch.optim.Optimizer) -> dict:
    """Load this rank's shard and optimiser state; returns the metadata (step, data position)."""
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.exists():
        raise CheckpointError(f"no checkpoint at {str(path)!r} (missing meta.json)")
    meta = json.loads(meta_file.read_text())
    if meta["world_size"] != layout.world_size or meta["numel"] != layout.numel or meta["names"] != list(layout.shapes):
        raise CheckpointError(f"checkpoint {str(path)!r} was written by {meta['world_size']} ranks for "
                              f"{meta['numel']} parameters; this job has {layout.world_size} ranks and "
                              f"{layout.numel} parameters")
    state = torch.load(path / f"rank{layout.rank}.pt", weights_only=False)
    with torch.no_grad():
        layout.shard.copy_(state["shard"])
    optimizer.load_state_dict(state["optimizer"])
    return meta
