"""The fixed optimiser layout: fp32 master parameters (and the optimiser state on them) in one flat vector,
sharded ZeRO-1 style over all ranks for the whole run, whatever each step's strategy.

Owns the flat order and who owns what. The parameters that tensor parallelism never splits (embeddings, norms,
a head it does not split: every TP rank computes with them whole) come first, then the split ones, each group
in the model's order; each parameter is stored with its tensor-parallel split dim outermost (a row-parallel
weight (out, in), split along ``in``, is stored as its transpose), so that the slice any TP degree takes of
it is one contiguous range per block (:meth:`FixedLayout.slice_ranges`). The two groups are the layout's
regions, and every rank owns an equal contiguous share of each (:meth:`FixedLayout.owned`): a replicated
parameter that every rank pulls is spread over all owners instead of sitting on the few whose one contiguous
shard would hold it (the hot spot of equal contiguous shards of the whole vector). A rank's shard is its
shares, one after the other. The shard is filled one parameter at a time, from the model's tensors, from a
deterministic per-parameter initialiser, or from a state dict streamed from rank 0: no rank ever holds a
tensor of the full parameter count, except :meth:`FixedLayout.full_state_dict`, which gathers everything on
purpose. Frozen parameters (:meth:`FixedLayout.freeze`: those of the model that do not require a gradient) stay in
the shard, so checkpoints and exports hold them, and training keeps them as they are.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from passes.graph.tensor_parallel import ParamSlice
from passes.plan.movement import owned_ranges, region_shares
from runtime import distributed as comm

__all__ = ["ParamSpec", "FixedLayout", "Init", "fill_layout", "intersect", "STREAM_CHUNK_NUMEL"]

STREAM_CHUNK_NUMEL = 1 << 26
"""Elements (256 MiB in fp32) that one batch of :meth:`FixedLayout.stream_from_rank0` or
:meth:`FixedLayout.gather_to_rank0` moves at most: beyond the one parameter it holds whole, what rank 0 has in
flight (under NCCL, on its device) at once."""

Init = Callable[[str, torch.Tensor], None]
"""Fills the full fp32 tensor of one named parameter in place; must give every rank the same values."""


def intersect(ranges: Iterable[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of sorted ``ranges`` inside [lo, hi)."""
    out = []
    for a, b in ranges:
        a, b = max(a, lo), min(b, hi)
        if b > a:
            out.append((a, b))
    return out


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
    """Parameters in a fixed flat order, fp32, every rank owning an equal contiguous share of each region
    (module docstring) of ``world_size``."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], rank: int, world_size: int,
                 device: torch.device | str = "cpu", split_dims: Mapping[str, int] | None = None):
        """An all-zero shard; fill it with :meth:`fill_from`, :meth:`initialise` or :meth:`stream_from_rank0`.
        ``split_dims``: per parameter, the dim tensor parallelism splits (stored outermost); the parameters
        without one come first in the flat order."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        split_dims = dict(split_dims or {})
        unknown = sorted(set(split_dims) - set(shapes))
        if unknown:
            raise KeyError(f"split dims given for unknown parameters {unknown}")
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.specs: dict[str, ParamSpec] = {}
        """Every parameter, in flat order."""
        total = 0
        bounds = [0]
        for group in ([n for n in shapes if n not in split_dims], [n for n in shapes if n in split_dims]):
            for name in group:
                shape = shapes[name]
                dim = split_dims.get(name)
                if dim is not None and not 0 <= dim < len(shape):
                    raise ValueError(f"split dim {dim!r} of {name!r} is not a dim of its shape {tuple(shape)}")
                self.specs[name] = ParamSpec(name=name, shape=tuple(shape), split_dim=dim or None, offset=total)
                total += math.prod(shape)
            bounds.append(total)
        self.numel = total
        """Elements of all the parameters (the flat vector has no padding: the shards do)."""
        self.regions = [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo] or [(0, 0)]
        """The flat ranges every rank owns an equal share of: the parameters TP never splits, then the others."""
        self.shard_numel = max(1, sum(region_shares(self.regions, world_size)))
        """Elements of every rank's shard (its shares, each padded to the region's share; the padding is zero)."""
        self.shard = nn.Parameter(torch.zeros(self.shard_numel, dtype=torch.float32, device=self.device))
        self.frozen: frozenset[str] = frozenset()
        """The parameters training keeps as they are (``requires_grad=False`` in the model): :meth:`freeze`."""
        self._frozen_in_shard: list[tuple[int, int]] = []

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], rank: int, world_size: int,
                     device: torch.device | str = "cpu", split_dims: Mapping[str, int] | None = None) -> "FixedLayout":
        """The layout of these parameters (their order and shapes), its shard filled from them."""
        layout = cls({n: tuple(t.shape) for n, t in tensors.items()}, rank, world_size, device, split_dims)
        layout.fill_from(tensors)
        return layout

    def freeze(self, names: Iterable[str]) -> None:
        """Keep the parameters ``names`` (and only those) fixed in training: :meth:`drop_frozen_grads` zeroes
        their gradients before the optimiser reads them and :meth:`keep_frozen` restores their values, bit for
        bit, and zeroes their optimiser state after it stepped (weight decay and momentum change nothing)."""
        names = frozenset(names)
        unknown = sorted(names - set(self.specs))
        if unknown:
            raise KeyError(f"cannot freeze unknown parameters {unknown[:5]}")
        self.frozen = names
        parts = [self._own_part(self.specs[n]) for n in self.specs if n in names]
        self._frozen_in_shard = [(pos, pos + count) for _, count, pos in filter(None, parts)]

    def drop_frozen_grads(self) -> None:
        """Zero this rank's part of the frozen parameters' gradient in the shard's ``.grad`` (they then count in
        no gradient norm and give the optimiser nothing)."""
        grad = self.shard.grad
        if grad is not None:
            for a, b in self._frozen_in_shard:
                grad[a:b].zero_()

    @contextlib.contextmanager
    def keep_frozen(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Within the block ``optimizer`` may step the shard; afterwards this rank's part of the frozen
        parameters holds the values it had before, bit for bit, and their per-element optimiser state is zero
        (a weight decay or a momentum would otherwise move them)."""
        kept = [self.shard.detach()[a:b].clone() for a, b in self._frozen_in_shard]
        try:
            yield
        finally:
            if kept:
                states = [v for v in optimizer.state.get(self.shard, {}).values()
                          if isinstance(v, torch.Tensor) and v.shape == self.shard.shape]
                with torch.no_grad():
                    for (a, b), values in zip(self._frozen_in_shard, kept):
                        self.shard[a:b].copy_(values)
                        for state in states:
                            state[a:b].zero_()

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's full shape, in flat order."""
        return {name: spec.shape for name, spec in self.specs.items()}

    def owned(self, owner: int) -> list[tuple[int, int, int]]:
        """(flat lo, flat hi, position in the owner's shard) of each flat range rank ``owner`` holds, in flat
        order: its share of each region (the last ranks' shares may be short or empty)."""
        return owned_ranges(self.regions, owner, self.world_size)

    def owner_ranges(self, owner: int) -> list[tuple[int, int]]:
        """The flat ranges [lo, hi) that rank ``owner`` holds, in flat order."""
        return [(a, b) for a, b, _ in self.owned(owner)]

    def in_shard(self, ranges: Iterable[tuple[int, int]], owner: int) -> list[tuple[int, int]]:
        """The parts of sorted flat ``ranges`` that rank ``owner`` holds, as ranges of its shard, in flat order."""
        ranges = list(ranges)
        return [(a - lo + pos, b - lo + pos) for lo, hi, pos in self.owned(owner) for a, b in intersect(ranges, lo, hi)]

    def flat_index(self, position: int) -> int | None:
        """The flat element at ``position`` of this rank's shard (None: padding)."""
        for lo, hi, pos in self.owned(self.rank):
            if pos <= position < pos + hi - lo:
                return lo + position - pos
        return None

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

    def _own_part(self, spec: ParamSpec) -> tuple[int, int, int] | None:
        """(first element within the parameter, count, position in this rank's shard) of the part of ``spec``
        this rank holds (a parameter lies in one region, so in at most one of the rank's ranges)."""
        for lo, hi, pos in self.owned(self.rank):
            a, b = max(lo, spec.offset), min(hi, spec.offset + spec.numel)
            if b > a:
                return a - spec.offset, b - a, pos + a - lo
        return None

    def _copy_own_part(self, spec: ParamSpec, full: torch.Tensor) -> None:
        part = self._own_part(spec)
        if part is not None:
            start, count, dst = part
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

    def stream_from_rank0(self, state: Mapping[str, torch.Tensor] | None,
                          chunk_numel: int = STREAM_CHUNK_NUMEL) -> None:
        """Collective: rank 0 holds every parameter in ``state`` (other ranks pass None) and sends each
        owner its part, one parameter at a time, in batches of at most ``chunk_numel`` elements
        (:meth:`rank0_batches`: batched point-to-point on the default group, never a lone send, which under NCCL
        would make a communicator of its own for each pair of rank 0 and an owner); an owner receives straight
        into its shard."""
        if self.rank == 0:
            self.fill_from(state or {})  # checks names and shapes before anything is sent
        shard = self.shard.detach()
        for name, spec in self.specs.items():
            batches = self.rank0_batches(spec, chunk_numel)
            if not batches:
                continue
            if self.rank == 0:
                stored = spec.stored(state[name].detach().to(torch.float32)).view(-1)
                for batch in batches:
                    comm.exchange([(stored[at:at + n], owner) for owner, at, n, _ in batch], [])
            else:
                for batch in batches:
                    mine = [(shard[pos:pos + n], 0) for owner, _, n, pos in batch if owner == self.rank]
                    if mine:
                        comm.exchange([], mine)

    def gather_to_rank0(self, name: str, chunk_numel: int = STREAM_CHUNK_NUMEL) -> torch.Tensor | None:
        """Collective: parameter ``name`` whole (fp32) on rank 0, from the parts its owners send; None on the
        other ranks. The inverse of :meth:`stream_from_rank0`, one parameter at a time, in the same batches
        (received in place into the parameter's buffer on rank 0)."""
        spec = self._spec(name)
        shard = self.shard.detach()
        batches = self.rank0_batches(spec, chunk_numel)
        if self.rank != 0:
            for batch in batches:
                mine = [(shard[pos:pos + n], 0) for owner, _, n, pos in batch if owner == self.rank]
                if mine:
                    comm.exchange(mine, [])
            return None
        stored = torch.empty(spec.numel, dtype=torch.float32, device=self.device)
        own = self._own_part(spec)
        if own is not None:
            start, count, pos = own
            stored[start:start + count].copy_(shard[pos:pos + count])
        for batch in batches:
            comm.exchange([], [(stored[at:at + n], owner) for owner, at, n, _ in batch])
        return spec.unstore(stored, spec.shape).contiguous()

    def rank0_batches(self, spec: ParamSpec, chunk_numel: int = STREAM_CHUNK_NUMEL
                      ) -> list[list[tuple[int, int, int, int]]]:
        """The messages between rank 0 and the other owners of ``spec`` (:meth:`stream_from_rank0`,
        :meth:`gather_to_rank0`), each (owner, first element in the parameter's storage order, elements,
        position in the owner's shard), cut to at most ``chunk_numel`` elements and grouped, owners ascending,
        into consecutive batches of at most ``chunk_numel`` elements together: the same on every rank, so that
        rank 0's batch i pairs with batch i of each owner in it (an owner posts only the batches it is in)."""
        if isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel < 1:
            raise ValueError(f"chunk_numel must be a positive integer, got {chunk_numel!r}")
        batches: list[list[tuple[int, int, int, int]]] = []
        batch: list[tuple[int, int, int, int]] = []
        held = 0
        for owner in range(1, self.world_size):
            for lo, hi, pos in self.owned(owner):
                a, b = max(lo, spec.offset), min(hi, spec.offset + spec.numel)
                for c in range(a, b, chunk_numel):
                    n = min(chunk_numel, b - c)
                    if batch and held + n > chunk_numel:
                        batches.append(batch)
                        batch, held = [], 0
                    batch.append((owner, c - spec.offset, n, pos + c - lo))
                    held += n
        if batch:
            batches.append(batch)
        return batches

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
        shards = torch.empty(self.shard_numel * self.world_size, dtype=torch.float32, device=self.device)
        comm.all_gather_into(shards, self.shard.detach())
        flat = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        for owner in range(self.world_size):
            base = owner * self.shard_numel
            for lo, hi, pos in self.owned(owner):
                flat[lo:hi] = shards[base + pos:base + pos + hi - lo]
        del shards
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
