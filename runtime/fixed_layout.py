"""The fixed optimiser layout (DESIGN.md section 7): fp32 master parameters and optimiser state sharded
ZeRO-1 style over all ranks for the whole run, whatever each step's strategy.

Each step every rank gathers the parameters and takes the slices its compute layout needs; after backward
every rank scatters its gradient slices into a flat buffer that is summed over all ranks (reduce-scatter on
NCCL, all-reduce on gloo, which has no reduce-scatter) so each rank holds the summed gradient of its shard.
Switching strategy therefore moves no optimiser state. Bytes moved are counted per step.
"""

from __future__ import annotations

import math
import torch
import torch.distributed as dist
from torch import nn

from passes.tensor_parallel import ParamSlice

__all__ = ["ParamSlice", "FixedLayout", "full_slice", "grad_weight", "scatter_add_"]


def full_slice(name: str, shape: tuple[int, ...]) -> ParamSlice:
    """The whole parameter (what a tensor-parallel degree of 1 holds)."""
    return ParamSlice(name=name, full_shape=tuple(shape))


def grad_weight(slc: ParamSlice, tp: int) -> float:
    """Factor on a rank's gradient slice before summing over all ranks. A tensor-parallel rewrite leaves
    identical gradients on every rank that holds the same elements (replicated weights on all ``tp`` ranks;
    replicated key/value blocks on ``shared_by`` ranks), so those count once; partial gradients of one
    weight on different pipeline stages (tied embeddings) and different replicas add up."""
    return 1.0 / tp if slc.dim is None else 1.0 / slc.shared_by


def scatter_add_(full: torch.Tensor, slc: ParamSlice, grad: torch.Tensor, weight: float) -> None:
    """``full[slice] += weight * grad`` for a slice made of blocks of one dim."""
    if slc.dim is None:
        full.add_(grad, alpha=weight)
        return
    offset = 0
    for start, stop in slc.ranges:
        full.narrow(slc.dim, start, stop - start).add_(grad.narrow(slc.dim, offset, stop - start), alpha=weight)
        offset += stop - start


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

    def reduce_gradients(self, grads: dict[str, tuple[ParamSlice, torch.Tensor, float]]) -> None:
        """Sum every rank's gradient slices (times their weights) into this rank's shard gradient."""
        flat = torch.zeros(self.shard_numel * self.world_size, dtype=torch.float32, device=self.device)
        for name, (slc, grad, weight) in grads.items():
            if name not in self.offsets:
                raise KeyError(f"gradient for unknown parameter {name!r}")
            scatter_add_(self._view(flat, name), slc, grad.detach().to(torch.float32), weight)
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
