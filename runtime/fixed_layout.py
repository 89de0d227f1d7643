"""The fixed optimiser layout: fp32 master parameters (and the optimiser state on them) in one flat vector,
sharded ZeRO-1 style in equal contiguous ranges over all ranks for the whole run, whatever each step's
strategy.

Owns the flat order. Parameters follow the model's order; each is stored with its tensor-parallel split dim
outermost (a row-parallel weight (out, in), split along ``in``, is stored as its transpose), so that the
slice any TP degree takes of it is one contiguous range per block (:meth:`FixedLayout.slice_ranges`). The
shard is filled one parameter at a time, from the model's tensors, from a deterministic per-parameter
initialiser, or from a state dict streamed from rank 0: no rank ever holds a tensor of the full parameter
count, except :meth:`FixedLayout.full_state_dict`, which gathers everything on purpose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch
from torch import nn

from passes.graph.tensor_parallel import ParamSlice
from runtime import distributed as comm

__all__ = ["ParamSpec", "FixedLayout", "Init", "fill_layout"]

Init = Callable[[str, torch.Tensor], None]
"""Fills the full fp32 tensor of one named parameter in place; must give every rank the same values."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamSpec:
    """One parameter of the flat vector."""

    name: str
    """Fully qualified name in the model."""
    shape: tuple[int, ...]
    """Shape of the whole parameter."""
    split_dim: int | None = None
    """The dim tensor parallelism splits (stored outermost); None: stored as is."""
    offset: int = 0
    """First element in the flat vector."""

    @property
    def numel(self) -> int:
        """Elements of the whole parameter."""
        return math.prod(self.shape)

    @property
    def order(self) -> tuple[int, ...]:
        """The parameter's dims in storage order: the split dim first, the others as they are."""
        if self.split_dim is None:
            return tuple(range(len(self.shape)))
        return (self.split_dim, *(d for d in range(len(self.shape)) if d != self.split_dim))

    def stored(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` (the parameter's own shape) as a contiguous tensor in storage order."""
        return full.permute(self.order).contiguous() if self.split_dim else full.contiguous()

    def unstore(self, flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """A view with the parameter's dim order of ``flat``, the storage-order elements of a tensor of
        ``shape`` (the parameter's dims)."""
        order = self.order
        view = flat.view([shape[d] for d in order])
        return view.permute([order.index(d) for d in range(len(shape))]) if self.split_dim else view


class FixedLayout:
    """Parameters in a fixed flat order, fp32, sharded in equal contiguous ranges over ``world_size``."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], rank: int, world_size: int,
                 device: torch.device | str = "cpu", split_dims: Mapping[str, int] | None = None):
        """An all-zero shard; fill it with :meth:`fill_from`, :meth:`initialise` or :meth:`stream_from_rank0`.
        ``split_dims``: per parameter, the dim tensor parallelism splits (stored outermost)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        split_dims = dict(split_dims or {})
        unknown = sorted(set(split_dims) - set(shapes))
        if unknown:
            raise KeyError(f"split dims given for unknown parameters {unknown}")
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.specs: dict[str, ParamSpec] = {}
        total = 0
        for name, shape in shapes.items():
            dim = split_dims.get(name)
            if dim is not None and not 0 <= dim < len(shape):
                raise ValueError(f"split dim {dim!r} of {name!r} is not a dim of its shape {tuple(shape)}")
            self.specs[name] = ParamSpec(name=name, shape=tuple(shape), split_dim=dim or None, offset=total)
            total += math.prod(shape)
        self.numel = total
        self.shard_numel = max(1, -(-total // world_size))
        self.shard_lo = rank * self.shard_numel
        """First flat element of this rank's shard (the shard ends ``shard_numel`` later; padding past
        ``numel`` stays zero)."""
        self.shard = nn.Parameter(torch.zeros(self.shard_numel, dtype=torch.float32, device=self.device))

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], rank: int, world_size: int,
                     device: torch.device | str = "cpu", split_dims: Mapping[str, int] | None = None) -> "FixedLayout":
        """The layout of these parameters (their order and shapes), its shard filled from them."""
        layout = cls({n: tuple(t.shape) for n, t in tensors.items()}, rank, world_size, device, split_dims)
        layout.fill_from(tensors)
        return layout

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's full shape, in flat order."""
        return {name: spec.shape for name, spec in self.specs.items()}

    def owner_range(self, owner: int) -> tuple[int, int]:
        """The flat range [lo, hi) that rank ``owner`` holds."""
        return owner * self.shard_numel, (owner + 1) * self.shard_numel

    def slice_ranges(self, slc: ParamSlice) -> list[tuple[int, int]]:
        """The flat ranges [lo, hi) holding the elements of ``slc``, in flat order. In storage order a slice
        along the split dim is one range per block; along another dim, one per block per outer index."""
        spec = self._spec(slc.name)
        if tuple(slc.full_shape) != spec.shape:
            raise ValueError(f"slice of {slc.name!r} has shape {slc.full_shape}, the layout {spec.shape}")
        if slc.dim is None:
            return [(spec.offset, spec.offset + spec.numel)]
        stored_shape = [spec.shape[d] for d in spec.order]
        pos = spec.order.index(slc.dim)
        outer, inner = math.prod(stored_shape[:pos]), math.prod(stored_shape[pos + 1:])
        row = stored_shape[pos] * inner
        return [(spec.offset + o * row + a * inner, spec.offset + o * row + b * inner)
                for o in range(outer) for a, b in slc.ranges]

    def _spec(self, name: str) -> ParamSpec:
        if name not in self.specs:
            raise KeyError(f"unknown parameter {name!r} (the layout holds {len(self.specs)} parameters)")
        return self.specs[name]

    def _own_part(self, spec: ParamSpec) -> tuple[int, int] | None:
        """(first element within the parameter, count) of the part of ``spec`` in this rank's shard."""
        lo = max(spec.offset, self.shard_lo)
        hi = min(spec.offset + spec.numel, self.shard_lo + self.shard_numel)
        return (lo - spec.offset, hi - lo) if hi > lo else None

    def _copy_own_part(self, spec: ParamSpec, full: torch.Tensor) -> None:
        part = self._own_part(spec)
        if part is not None:
            start, count = part
            dst = spec.offset + start - self.shard_lo
            with torch.no_grad():
                self.shard[dst:dst + count].copy_(spec.stored(full.detach()).view(-1)[start:start + count])

    def fill_from(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """This rank's shard from full tensors of every parameter (by name), one parameter at a time."""
        missing = [n for n in self.specs if n not in tensors]
        if missing:
            raise KeyError(f"no value for parameters {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        for name, spec in self.specs.items():
            full = tensors[name]
            if tuple(full.shape) != spec.shape:
                raise ValueError(f"parameter {name!r}: expected shape {spec.shape}, got {tuple(full.shape)}")
            if full.device.type == "meta":
                raise ValueError(f"parameter {name!r} is on the meta device: pass an initialiser or a state dict")
            self._copy_own_part(spec, full)

    def initialise(self, init: Init) -> None:
        """This rank's shard from ``init(name, tensor)``, called for each parameter that has elements in it,
        on a full fp32 tensor of that parameter alone (so memory never holds more than one full parameter)."""
        for name, spec in self.specs.items():
            if self._own_part(spec) is None:
                continue
            full = torch.empty(spec.shape, dtype=torch.float32, device=self.device)
            init(name, full)
            self._copy_own_part(spec, full)

    def stream_from_rank0(self, state: Mapping[str, torch.Tensor] | None) -> None:
        """Collective: rank 0 holds every parameter in ``state`` (other ranks pass None) and sends each
        owner its part, one parameter at a time."""
        if self.rank == 0:
            self.fill_from(state or {})  # checks names and shapes before anything is sent
        for name, spec in self.specs.items():
            for owner in range(1, self.world_size):
                lo, hi = self.owner_range(owner)
                lo, hi = max(lo, spec.offset), min(hi, spec.offset + spec.numel)
                if hi <= lo:
                    continue
                if self.rank == 0:
                    stored = spec.stored(state[name].detach().to(torch.float32)).view(-1)
                    piece = stored[lo - spec.offset:hi - spec.offset]
                    comm.send(piece, owner)
                elif self.rank == owner:
                    buf = torch.empty(hi - lo, dtype=torch.float32, device=self.device)
                    comm.recv(buf, 0)
                    with torch.no_grad():
                        self.shard[lo - self.shard_lo:hi - self.shard_lo].copy_(buf)

    def gather_to_rank0(self, name: str) -> torch.Tensor | None:
        """Collective: parameter ``name`` whole (fp32) on rank 0, from the parts its owners send; None on the
        other ranks. The inverse of :meth:`stream_from_rank0`, one parameter at a time."""
        spec = self._spec(name)
        stored = torch.empty(spec.numel, dtype=torch.float32, device=self.device) if self.rank == 0 else None
        for owner in range(self.world_size):
            lo, hi = self.owner_range(owner)
            lo, hi = max(lo, spec.offset), min(hi, spec.offset + spec.numel)
            if hi <= lo:
                continue
            piece = self.shard.detach()[lo - self.shard_lo:hi - self.shard_lo] if self.rank == owner else None
            if self.rank == 0:
                target = stored[lo - spec.offset:hi - spec.offset]
                if owner == 0:
                    target.copy_(piece)
                else:
                    comm.recv(target, owner)  # a contiguous slice of the buffer: received in place
            elif self.rank == owner:
                comm.send(piece, 0)
        return None if stored is None else spec.unstore(stored, spec.shape).contiguous()

    def views(self, flat: torch.Tensor, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Each parameter, in its own shape, as a view of a full flat vector ``flat``."""
        out = {}
        for name in (self.specs if names is None else names):
            spec = self._spec(name)
            out[name] = spec.unstore(flat[spec.offset:spec.offset + spec.numel], spec.shape)
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter under its original name, gathered from all shards (collective; the one call that
        holds the whole model on each rank)."""
        flat = torch.empty(self.shard_numel * self.world_size, dtype=torch.float32, device=self.device)
        comm.all_gather_into(flat, self.shard.detach())
        return {name: torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)  # contiguous, not a view
                for name, t in self.views(flat).items()}


def fill_layout(layout: FixedLayout, *, init: Init | None, state_dict: Mapping[str, torch.Tensor] | None,
                named: Mapping[str, torch.Tensor]) -> None:
    """Fill ``layout`` once from what rank 0 was given (collective): a state dict (streamed from rank 0 to the
    owners), an initialiser (run on every rank for its shard), or else ``named``, the model's own values (every
    rank must then hold the same). Rank 0's choice is every rank's; a rank without the initialiser rank 0
    uses is a ValueError."""
    if init is not None and state_dict is not None:
        raise ValueError("pass an initialiser or a state dict, not both")
    source = comm.broadcast_object("state_dict" if state_dict is not None else "init" if init is not None else "model")
    if source == "state_dict":
        layout.stream_from_rank0(state_dict if layout.rank == 0 else None)
    elif source == "init":
        if init is None:
            raise ValueError(f"rank 0 initialises the parameters with an initialiser, rank {layout.rank} has none")
        layout.initialise(init)
    else:
        layout.fill_from(named)
