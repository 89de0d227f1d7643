"""The fixed optimiser layout (DESIGN.md section 7): fp32 master parameters and optimiser state sharded
ZeRO-1 style over all ranks for the whole run, whatever each step's strategy.

Each step every rank gathers the parameters and takes the slices its compute layout needs; after backward
every rank scatters its gradient slices into a flat buffer that is summed over all ranks (reduce-scatter on
NCCL, all-reduce on gloo, which has no reduce-scatter) so each rank holds the summed gradient of its shard.
Switching strategy therefore moves no optimiser state. Bytes moved are counted per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ParamSlice", "FixedLayout", "FULL"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamSlice:
    """The part of a parameter a compute layout holds, and how its gradient counts."""

    dim: int | None = None
    """The dim cut into blocks; None: the whole parameter."""
    index: int = 0
    """Which block this rank holds."""
    parts: int = 1
    """Into how many equal blocks ``dim`` is cut."""
    grad_weight: float = 1.0
    """Factor on this rank's gradient before summing over ranks: 1/k when k ranks of one replica hold
    identical copies with identical gradients (a TP-replicated norm weight), 1 for partial gradients that
    must add up (tied embeddings on two pipeline stages, TP shards)."""

    def __post_init__(self) -> None:
        if self.parts < 1 or not 0 <= self.index < self.parts:
            raise ValueError(f"slice block {self.index} of {self.parts} is out of range")
        if self.dim is None and self.parts != 1:
            raise ValueError(f"a whole-parameter slice has 1 part, got {self.parts}")

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This slice of ``full`` (a view)."""
        if self.dim is None:
            return full
        size = full.shape[self.dim]
        if size % self.parts:
            raise ValueError(f"dim {self.dim} of size {size} does not split into {self.parts} blocks")
        block = size // self.parts
        return full.narrow(self.dim, self.index * block, block)


FULL = ParamSlice()

# torch renamed the flat-tensor collectives; use the new names where they exist.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class FixedLayout:
    """Parameters flattened in a fixed order into one fp32 vector, sharded equally over ``world_size``."""

    def __init__(self, named_params: dict[str, torch.Tensor], rank: int, world_size: int,
                 device: torch.device | str = "cpu"):
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.shapes = {name: tuple(p.shape) for name, p in named_params.items()}
        self.offsets: dict[str, int] = {}
        total = 0
        for name, shape in self.shapes.items():
            self.offsets[name] = total
            total += math.prod(shape)
        self.numel = total
        self.shard_numel = -(-total // world_size)
        full = torch.zeros(self.shard_numel * world_size, dtype=torch.float32, device=self.device)
        for name, p in named_params.items():
            self._view(full, name).copy_(p.detach().to(torch.float32))
        lo = rank * self.shard_numel
        self.shard = nn.Parameter(full[lo:lo + self.shard_numel].clone())
        self.param_bytes_moved = 0
        self.grad_bytes_moved = 0

    def _view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        start = self.offsets[name]
        return flat[start:start + math.prod(self.shapes[name])].view(self.shapes[name])

    def gather(self) -> dict[str, torch.Tensor]:
        """Every parameter, full size, gathered from all shards (views into one flat buffer)."""
        flat = torch.empty(self.shard_numel * self.world_size, dtype=torch.float32, device=self.device)
        if self.world_size == 1:
            flat.copy_(self.shard.detach())
        else:
            _all_gather(flat, self.shard.detach().contiguous())
            self.param_bytes_moved += (self.world_size - 1) * self.shard_numel * 4
        return {name: self._view(flat, name) for name in self.shapes}

    def reduce_gradients(self, grads: dict[str, tuple[ParamSlice, torch.Tensor]]) -> None:
        """Sum every rank's gradient slices (times their weights) into this rank's shard gradient."""
        flat = torch.zeros(self.shard_numel * self.world_size, dtype=torch.float32, device=self.device)
        for name, (slc, grad) in grads.items():
            if name not in self.offsets:
                raise KeyError(f"gradient for unknown parameter {name!r}")
            slc.take(self._view(flat, name)).add_(grad.detach().to(torch.float32), alpha=slc.grad_weight)
        lo = self.rank * self.shard_numel
        if self.world_size == 1:
            shard_grad = flat
        elif dist.get_backend() == "nccl":
            shard_grad = torch.empty(self.shard_numel, dtype=torch.float32, device=self.device)
            _reduce_scatter(shard_grad, flat)
            self.grad_bytes_moved += (self.world_size - 1) * self.shard_numel * 4
        else:
            dist.all_reduce(flat)
            self.grad_bytes_moved += 2 * (self.world_size - 1) * self.shard_numel * 4
            shard_grad = flat[lo:lo + self.shard_numel]
        self.shard.grad = shard_grad.clone() if self.shard.grad is None else self.shard.grad.copy_(shard_grad)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Gathered parameters under their original names, cloned (collective: every rank calls it)."""
        before = self.param_bytes_moved
        full = {name: t.clone() for name, t in self.gather().items()}
        self.param_bytes_moved = before
        return full
