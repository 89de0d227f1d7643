"""All of this project's communication between ranks: the one module of the runtime (and of ``hcompile``) that
calls ``torch.distributed`` (``tests/test_layering.py`` keeps every other module off it; the graph's own
tensor-parallel collectives are ops in ``passes.graph.collectives``).

Owns the default process group (``cpu:gloo,cuda:nccl`` on GPUs: device tensors travel over NCCL, host metadata
over gloo; gloo on CPU) with a timeout on every collective, destroyed at exit while the interpreter is still
whole; the sub-groups a strategy needs (``GroupCache``: its tensor-parallel groups, created once, in the same
order on every rank); and every collective and point-to-point call the runtime makes. Tensors are moved to
where their group works (``group_device``) before a call, so no caller hands a host tensor to NCCL: metadata
the callers build on the host (digests, counts, flags) is placed here. Objects (strings, plans) travel as
pickles over the CPU side of the group.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from passes.plan.ir import ReplicaPlan

__all__ = ["DistContext", "init_distributed", "GroupCache", "DEFAULT_TIMEOUT_S", "ProcessGroup", "Work",
           "is_initialized", "world_size", "rank", "backend", "group_device", "all_gather_object",
           "broadcast_object", "agree_errors", "all_reduce", "all_gather", "all_gather_into", "barrier", "send",
           "recv", "isend", "irecv", "exchange", "post", "movement_group", "group_name", "world_group", "shutdown"]

ProcessGroup = dist.ProcessGroup
"""A process group (what ``GroupCache.get`` returns; None stands for a group of one rank)."""
Work = dist.Work
"""A pending point-to-point operation; ``wait()`` it."""

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True, kw_only=True)
class DistContext:
    """This process's place in the job."""

    rank: int
    """Global rank."""
    world_size: int
    """Ranks in the job."""
    dist_backend: str
    """``nccl`` or ``gloo``."""
    device: torch.device
    """Where this rank computes."""


def init_distributed(init_method: str | None = None, rank: int | None = None, world_size: int | None = None,
                     timeout_s: float | None = None, dist_backend: str | None = None) -> DistContext:
    """Join the job (reading ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` from torchrun when not given); a process
    started without a launcher (no ``WORLD_SIZE``, no ``MASTER_ADDR``) is a world of one. Collectives time out
    after ``timeout_s`` (env ``HCOMPILE_TIMEOUT_S``), so a dead rank ends the job."""
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    timeout_s = float(os.environ.get("HCOMPILE_TIMEOUT_S", DEFAULT_TIMEOUT_S)) if timeout_s is None else timeout_s
    if dist_backend is None:
        dist_backend = "nccl" if torch.cuda.is_available() else "gloo"
    if dist_backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        atexit.register(_destroy_at_exit)
        timeout = datetime.timedelta(seconds=timeout_s)
        # on GPUs the default group has both sides: device tensors over NCCL, host metadata and objects over gloo
        backends = "cpu:gloo,cuda:nccl" if dist_backend == "nccl" else dist_backend
        if world_size == 1 and init_method is None and "MASTER_ADDR" not in os.environ:
            # a plain `python train.py`: a world of one, its store in memory (no launcher, no rendezvous)
            dist.init_process_group(backend=backends, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend=backends, init_method=init_method or "env://", rank=rank,
                                    world_size=world_size, timeout=timeout)
    return DistContext(rank=rank, world_size=world_size, dist_backend=dist_backend, device=device)


def _destroy_at_exit() -> None:
    """Destroy every process group before the interpreter finalizes. A gloo worker thread can still hold the
    last reference to a finished collective's work (its tensors have Python objects); destroyed during
    finalization, that work takes the GIL from a C++ thread, which aborts the process ("terminate called
    without an active exception") and turns a finished job into exit 1. Destroying the groups here joins
    those threads while Python is alive. After an uncaught exception NCCL groups are left alone (their
    destruction can wait on peers that are still in a collective)."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl" and getattr(sys, "last_value", None) is not None:
        return
    dist.destroy_process_group()


class GroupCache:
    """Sub-groups by their ranks. ``dist.new_group`` is collective over the whole job, so groups are made
    for a whole strategy at once, in the strategy's deterministic order, on every rank."""

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._placements: set[tuple[tuple[tuple[int, ...], ...], ...]] = set()

    def prepare(self, replicas: Sequence[ReplicaPlan]) -> None:
        """Create (once per placement) the groups ``replicas`` use: every tensor-parallel group of every replica,
        then every context-parallel one (pipeline neighbours talk point to point on the default group, replicas
        not at all). Under NCCL each group is a communicator, so nothing else is made. Collective: every rank
        passes the same replicas (``StepPlan.replicas``)."""
        placement = tuple(r.tp_groups + r.cp_groups for r in replicas)
        if placement in self._placements:
            return
        for groups in placement:
            for group in groups:
                self._make(group)
        self._placements.add(placement)

    @property
    def sizes(self) -> list[int]:
        """The sizes of the groups made so far (groups of one rank are None, not made)."""
        return [len(k) for k, g in self._groups.items() if g is not None]

    def _make(self, ranks: tuple[int, ...]) -> None:
        key = tuple(sorted(ranks))
        if key not in self._groups:
            self._groups[key] = dist.new_group(list(key)) if len(key) > 1 else None

    def get(self, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        """The group of ``ranks`` (None for a single rank: nothing to communicate)."""
        key = tuple(sorted(ranks))
        if key not in self._groups:
            raise KeyError(f"no process group for ranks {key}: call prepare() for its strategy on every rank")
        return self._groups[key]


# ---------------------------------------------------------------------------------------------------------------
# Where things are, and the job's shape

def is_initialized() -> bool:
    """Whether this process is part of a job (a world of one counts)."""
    return dist.is_initialized()


def world_size() -> int:
    """Ranks in the job (1 outside one)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    """This process's rank (0 outside a job)."""
    return dist.get_rank() if dist.is_initialized() else 0


def backend() -> str:
    """``nccl`` (GPUs) or ``gloo``."""
    name = dist.get_backend()
    return "nccl" if "nccl" in name else name


def group_device(group: ProcessGroup | None = None) -> torch.device:
    """Where tensors of ``group`` (None: the default group) must be: the current GPU under NCCL, else the CPU."""
    if dist.is_initialized() and "nccl" in dist.get_backend(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def world_group() -> ProcessGroup | None:
    """The group of every rank (None in a world of one)."""
    return dist.group.WORLD if world_size() > 1 else None


def group_name(group: ProcessGroup | None) -> str | None:
    """The name graph ops use to find ``group`` (None for a group of one rank)."""
    return None if group is None else group.group_name


def _on(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    device = group_device(group)
    return tensor if tensor.device == device else tensor.to(device)


# ---------------------------------------------------------------------------------------------------------------
# Objects: host metadata, pickled over the CPU side of the default group

def all_gather_object(obj: Any) -> list:
    """Every rank's ``obj``, in rank order (``[obj]`` outside a job)."""
    if world_size() == 1:
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def agree_errors(error: str | None) -> list[tuple[int, str]]:
    """(rank, message) of every rank that failed (passed a message), the same list on every rank."""
    return [(r, e) for r, e in enumerate(all_gather_object(error)) if e]


# ---------------------------------------------------------------------------------------------------------------
# Tensors: collectives and point to point, on the group's device

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: ProcessGroup | None = None) -> torch.Tensor:
    """``tensor`` reduced (``sum``, ``max`` or ``min``) over ``group``, on the group's device (a new tensor when
    it had to move, else ``tensor`` itself, reduced in place)."""
    tensor = _on(tensor, group)
    if world_size() > 1:
        dist.all_reduce(tensor, op=_OPS[op], group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group: ProcessGroup | None = None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape everywhere), in rank order, on the group's device."""
    tensor = _on(tensor, group)
    if world_size() == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_into(flat: torch.Tensor, piece: torch.Tensor) -> None:
    """Every rank's ``piece`` concatenated into ``flat`` (both on the group's device), in rank order."""
    if world_size() == 1:
        flat.copy_(piece)
    else:
        _all_gather_single(flat, piece.contiguous())


def barrier(group: ProcessGroup | None = None) -> None:
    """Wait for every rank of ``group``."""
    if world_size() > 1:
        dist.barrier(group=group)


def send(tensor: torch.Tensor, dst: int) -> None:
    """Blocking send of ``tensor`` (on the default group's device) to rank ``dst``."""
    dist.send(_on(tensor, None).contiguous(), dst)


def recv(tensor: torch.Tensor, src: int) -> None:
    """Blocking receive into ``tensor`` (which must be on the default group's device) from rank ``src``."""
    if tensor.device != group_device(None):
        raise ValueError(f"receive buffers must be on {group_device(None)}, got {tensor.device}")
    dist.recv(tensor, src)


def isend(tensor: torch.Tensor, dst: int) -> tuple[Work, torch.Tensor]:
    """Non-blocking send; the work and the tensor it reads (keep both until the work is done)."""
    tensor = _on(tensor, None).contiguous()
    return dist.isend(tensor, dst), tensor


def irecv(tensor: torch.Tensor, src: int) -> Work:
    """Non-blocking receive into ``tensor`` (on the default group's device)."""
    if tensor.device != group_device(None):
        raise ValueError(f"receive buffers must be on {group_device(None)}, got {tensor.device}")
    return dist.irecv(tensor, src)


def exchange(sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]) -> None:
    """Post these sends (tensor, to) and receives (buffer, from) together and wait for all of them (pairs of
    ranks that send to each other at once do not deadlock)."""
    ops = [dist.P2POp(dist.isend, _on(t, None).contiguous(), peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, buf, peer) for buf, peer in recvs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def post(sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
         group: ProcessGroup | None = None) -> list[Work]:
    """Post these sends (tensor, to) and receives (buffer, from) on ``group`` (global ranks) and return at once:
    the works to wait for (keep the send tensors alive until then). Between any two ranks, what one posts is
    matched with what the other posts in the order both posted it; under NCCL one call is one NCCL group."""
    ops = [dist.P2POp(dist.isend, _on(t, group).contiguous(), peer, group=group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, buf, peer, group=group) for buf, peer in recvs]
    return list(dist.batch_isend_irecv(ops)) if ops else []


_movement: dict[int, ProcessGroup] = {}
"""The movement group, by the id of the default group it was made in (a new job in the process makes anew)."""


def movement_group() -> ProcessGroup | None:
    """A group of every rank for parameter and gradient movement alone (None in a world of one), made on first
    use (collective: every rank calls it at the same point): movement posted ahead of compute never interleaves
    with pipeline or tensor-parallel messages between the same two ranks (under NCCL it is a communicator of its
    own, set up here by a barrier of all its ranks, since a rank may post nothing in a window)."""
    if world_size() == 1:
        return None
    key = id(dist.group.WORLD)
    if key not in _movement:
        _movement.clear()
        group = dist.new_group(list(range(world_size())))
        dist.barrier(group=group)
        _movement[key] = group
    return _movement[key]


def shutdown() -> None:
    """Leave the job: destroy every process group (before the interpreter finalizes)."""
    _movement.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
