"""All of this project's communication between ranks: the one module of the runtime (and of ``hcompile``) that calls
``torch.distributed`` (``tests/test_layering.py`` keeps every other module off it; the graph's own tensor-parallel
collectives are ops in ``passes.graph.collectives``).

Owns the default process group (``cpu:gloo,cuda:nccl`` on GPUs: device tensors travel over NCCL, host metadata over
gloo; gloo on CPU) with a timeout on every collective, destroyed at exit while the interpreter is still whole; the
sub-groups a strategy needs (``GroupCache``: its tensor-parallel groups, created once, in the same order on every
rank); and every collective and point-to-point call the runtime makes. On GPUs the default group is made bound to
the rank's device (``device_id``: NCCL's communicator is made at once, and every sub-group's is split from it with
``ncclCommSplit``), and a sub-group is NCCL alone (:func:`subgroup_backend`): nothing sends a host tensor on a
sub-group (objects travel on the default group, and every tensor call here moves its tensor to its group's device
first), so a gloo side would only open a socket mesh per group. Tensors are moved to where their group works
(``group_device``) before a call, so no caller hands a host tensor to NCCL: metadata the callers build on the host
(digests, counts, flags) is placed here. Objects (strings, plans) travel as pickles over the CPU side of the default
group. Point-to-point messages between two ranks are posted in the same order on both (NCCL runs one communicator's
operations in issue order and a send completes only once its receive is posted): callers post each set of messages
that belongs together as one batch (:func:`exchange`, :func:`post`). Warm-up compiles inside collectives, so it runs
under its own, longer timeout (:func:`collective_timeout`); every group is made with the job's timeout and
point-to-point works are waited within the timeout in force (:func:`wait`), so that after warm-up a rank stalled
inside a step fails its peers after ``HCOMPILE_TIMEOUT_S``.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from passes.graph.collectives import is_nccl, uses_nccl
from passes.plan.ir import ReplicaPlan

__all__ = ["DistContext", "init_distributed", "GroupCache", "MAX_REMEMBERED_PLACEMENTS", "DEFAULT_TIMEOUT_S",
           "ProcessGroup", "Work",
           "is_initialized", "world_size", "rank", "backend", "group_device", "all_gather_object",
           "broadcast_object", "agree_errors", "all_reduce", "all_gather", "all_gather_into", "barrier", "send",
           "recv", "isend", "irecv", "exchange", "post", "movement_group", "group_name", "world_group", "shutdown",
           "is_nccl", "uses_nccl", "cuda_device_for", "joined_context", "collective_timeout", "timeout_of",
           "DEFAULT_WARMUP_TIMEOUT_S", "warmup_timeout_s", "env_seconds", "job_from_env", "wait",
           "p2p_timeout", "subgroup_backend", "init_options"]

ProcessGroup = dist.ProcessGroup
"""A process group (what ``GroupCache.get`` returns; None stands for a group of one rank)."""
Work = dist.Work
"""A pending point-to-point operation; ``wait()`` it."""

DEFAULT_TIMEOUT_S = 300.0
"""Seconds after which a collective or point-to-point call fails (env ``HCOMPILE_TIMEOUT_S``)."""
DEFAULT_WARMUP_TIMEOUT_S = 3600.0
"""The collective timeout during a trainer's warm-up, which compiles inside collectives (env
``HCOMPILE_WARMUP_TIMEOUT_S``)."""


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


def subgroup_backend(default_backend: str) -> str | None:
    """The backend to make a sub-group with, given the default group's (``dist.get_backend()``): ``nccl`` when
    that is a per-device list that runs device tensors on NCCL (``cpu:gloo,cuda:nccl``: the sub-group needs no
    gloo side, module docstring); else None (the default group's, as before: gloo on the CPU, ``nccl`` when the
    user made an NCCL-only group)."""
    if "," in default_backend and is_nccl(default_backend):
        return "nccl"
    return None


def init_options(dist_backend: str, device: torch.device) -> dict[str, Any]:
    """Keyword arguments ``init_distributed`` adds to ``init_process_group``: under NCCL ``device_id`` (the
    rank's device, with its index), which makes the default communicator at once and lets sub-groups split from
    it (``ncclCommSplit``) instead of each making one through the store; nothing on gloo."""
    if dist_backend != "nccl":
        return {}
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"under NCCL a rank computes on a CUDA device with an index, got {device}")
    return {"device_id": device}


def init_distributed(init_method: str | None = None, rank: int | None = None, world_size: int | None = None,
                     timeout_s: float | None = None, dist_backend: str | None = None) -> DistContext:
    """Join the job (reading ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` from torchrun when not given); a process
    started without a launcher (no ``WORLD_SIZE``, no ``MASTER_ADDR``) is a world of one. Collectives time out
    after ``timeout_s`` (env ``HCOMPILE_TIMEOUT_S``), so a dead rank ends the job. Under NCCL the rank computes on
    ``cuda:LOCAL_RANK`` (:func:`cuda_device_for`), set as the current device before the group is made, and the
    default group's communicator is set up at once by all ranks (batched point-to-point calls that only some
    ranks make must not be its first use). Every variable it reads is checked first (:func:`job_from_env`): a bad
    one is a ValueError naming it, before anything waits on other ranks."""
    rank, world_size, timeout_s = job_from_env(init_method, rank, world_size, timeout_s)
    if dist_backend is None:
        dist_backend = "nccl" if torch.cuda.is_available() else "gloo"
    if dist_backend == "nccl":
        local = cuda_device_for(rank, world_size, os.environ.get("LOCAL_RANK"), torch.cuda.device_count(),
                                torch.cuda.current_device(), launched=False)
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        atexit.register(_destroy_at_exit)
        timeout = datetime.timedelta(seconds=timeout_s)
        _timeouts["job"] = timeout_s
        # on GPUs the default group has both sides: device tensors over NCCL, host metadata and objects over gloo
        backends = "cpu:gloo,cuda:nccl" if dist_backend == "nccl" else dist_backend
        if world_size == 1 and init_method is None and "MASTER_ADDR" not in os.environ:
            # a plain `python train.py`: a world of one, its store in memory (no launcher, no rendezvous)
            dist.init_process_group(backend=backends, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                                    **init_options(dist_backend, device))
        else:
            dist.init_process_group(backend=backends, init_method=init_method or "env://", rank=rank,
                                    world_size=world_size, timeout=timeout, **init_options(dist_backend, device))
            if dist_backend == "nccl":
                _set_up(None)
    return DistContext(rank=rank, world_size=world_size, dist_backend=dist_backend, device=device)


_TIMEOUT_ENV = ("HCOMPILE_TIMEOUT_S", "HCOMPILE_WARMUP_TIMEOUT_S", "HCOMPILE_PLAN_TIMEOUT_S")
"""The timeouts a job reads from its environment (each checked by :func:`job_from_env`)."""


def job_from_env(init_method: str | None = None, rank: int | None = None, world_size: int | None = None,
                 timeout_s: float | None = None) -> tuple[int, int, float]:
    """(rank, world size, collective timeout in seconds) of a job about to be joined: each given value, else the
    one in the environment (``RANK``, ``WORLD_SIZE``, ``HCOMPILE_TIMEOUT_S``), else 0, 1 and
    :data:`DEFAULT_TIMEOUT_S`. Checks every variable the job reads, so that a bad one is a ValueError naming it,
    its value and what it must be (not ``int()``'s or gloo's message, or a wrong rank found after minutes of
    capture): ``RANK`` an integer in [0, ``WORLD_SIZE``), ``WORLD_SIZE`` a positive integer, ``LOCAL_RANK`` (where
    set) an integer >= 0, ``MASTER_ADDR`` and a ``MASTER_PORT`` in [1, 65535] where the rendezvous reads them (a
    job of several ranks without ``init_method``), and every ``HCOMPILE_*_TIMEOUT_S`` a positive number of
    seconds (:func:`env_seconds`)."""
    for name in _TIMEOUT_ENV:
        env_seconds(name, DEFAULT_TIMEOUT_S)
    if timeout_s is None:
        timeout_s = env_seconds("HCOMPILE_TIMEOUT_S", DEFAULT_TIMEOUT_S)
    elif isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    rank_name = "RANK" if rank is None else "rank"
    world_name = "WORLD_SIZE" if world_size is None else "world_size"
    if world_size is None:
        world_size = _env_int("WORLD_SIZE", 1, 1, "a positive integer: the ranks in the job")
    elif isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if rank is None:
        rank = _env_int("RANK", 0, 0, "an integer >= 0: this process's rank in the job")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"{rank_name}={rank!r} is not a rank of a job of {world_name}={world_size} (expected "
                         f"0..{world_size - 1}): each process needs its own rank below the job's size")
    _env_int("LOCAL_RANK", 0, 0, "an integer >= 0: this process's rank on its machine")
    rendezvous = init_method in (None, "env://") and (world_size > 1 or "MASTER_ADDR" in os.environ)
    if rendezvous:
        if not os.environ.get("MASTER_ADDR"):
            raise ValueError(f"{world_name}={world_size} but MASTER_ADDR is not set: start the job with `hcompile "
                             f"launch` or torchrun, or set MASTER_ADDR and MASTER_PORT (the address and port of "
                             f"rank 0) on every rank")
        _env_int("MASTER_PORT", None, 1, "a port number in [1, 65535] on MASTER_ADDR that rank 0 listens on",
                 high=65535)
    return rank, world_size, float(timeout_s)


def _env_int(name: str, default: int | None, low: int, expected: str, high: int | None = None) -> int:
    """Env ``name`` as an integer in [``low``, ``high``], else ``default`` (None: it must be set); otherwise a
    ValueError naming it, its value and ``expected``."""
    text = os.environ.get(name)
    if text is None and default is not None:
        return default
    if text is None:
        raise ValueError(f"{name} is not set: expected {expected}")
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name}={text!r}: expected {expected}")
    return value


def cuda_device_for(rank: int, world_size: int, local_rank: str | None, count: int, current: int, *,
                    launched: bool) -> int:
    """The CUDA device index a rank computes on. ``local_rank``: env ``LOCAL_RANK`` (torchrun sets it) or None;
    ``count``: the devices this process sees; ``current``: ``torch.cuda.current_device()`` (0 unless the process
    set another); ``launched``: the user made the process group (and may have set the device), else this module
    makes it. One visible device is that device (a launcher that gives each rank its own
    ``CUDA_VISIBLE_DEVICES``); otherwise ``LOCAL_RANK``; without it, the device the user set, or ``rank % count``
    when this module makes the group. What would put a rank on another rank's device is a ValueError naming
    the values: a ``LOCAL_RANK`` past the visible devices, a device set by the user that is not ``LOCAL_RANK``,
    or a user's group without ``LOCAL_RANK`` whose rank is not the first of its node still on ``cuda:0``."""
    if count < 1:
        raise ValueError(f"rank {rank}: NCCL needs a CUDA device, and this process sees none")
    if count == 1:
        return 0
    if local_rank is not None:
        try:
            local = int(local_rank)
        except ValueError:
            raise ValueError(f"rank {rank}: LOCAL_RANK must be an integer, got {local_rank!r}") from None
        if not 0 <= local < count:
            raise ValueError(f"rank {rank}: LOCAL_RANK={local} but this process sees {count} CUDA devices "
                             f"(0..{count - 1})")
        if current not in (0, local):
            raise ValueError(f"rank {rank}: the current CUDA device is cuda:{current} but LOCAL_RANK={local}; call "
                             f"torch.cuda.set_device({local}) (or leave it unset) so that each rank of a node "
                             f"computes on its own device")
        return local
    if current != 0 or world_size == 1:
        return current
    if not launched:
        return rank % count
    if rank % count:
        raise ValueError(f"rank {rank} of {world_size}: the process group was made without "
                         f"torch.cuda.set_device and LOCAL_RANK is not set, so this rank would compute on cuda:0 "
                         f"beside another rank; call torch.cuda.set_device(<local rank>) before "
                         f"init_process_group, or launch with torchrun")
    return 0


def joined_context() -> DistContext:
    """This process's place in a job whose default process group is already made (by the user, or by
    :func:`init_distributed`). Under NCCL the rank's device is chosen by :func:`cuda_device_for` and made
    current (a user who called ``init_process_group("nccl")`` without ``torch.cuda.set_device`` would otherwise
    have every rank of a node on ``cuda:0``)."""
    rank_, world = rank(), world_size()
    if not uses_nccl():
        return DistContext(rank=rank_, world_size=world, dist_backend=backend(), device=torch.device("cpu"))
    bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
    if bound is not None and bound.index is not None:
        local = bound.index  # init_process_group(device_id=...) named it
    else:
        local = cuda_device_for(rank_, world, os.environ.get("LOCAL_RANK"), torch.cuda.device_count(),
                                torch.cuda.current_device(), launched=True)
    if torch.cuda.current_device() != local:
        torch.cuda.set_device(local)
    return DistContext(rank=rank_, world_size=world, dist_backend="nccl", device=torch.device("cuda", local))


def _destroy_at_exit() -> None:
    """Destroy every process group before the interpreter finalizes, as a job that ends should. After an
    uncaught exception NCCL groups are left alone (their destruction can wait on peers that are still in a
    collective). This does not stop a gloo group's worker threads: they are joined only when the group object
    is freed, and compiled graphs and the user's objects still hold it; one of them releasing a finished
    collective's tensors during finalization aborts the process, which is why ``runtime.rank_entry`` ends a
    rank without finalization."""
    if not dist.is_initialized():
        return
    if uses_nccl() and getattr(sys, "last_value", None) is not None:
        return
    dist.destroy_process_group()


MAX_REMEMBERED_PLACEMENTS = 256
"""Placements whose groups are known to exist, remembered to skip the walk over their groups (a memo: a
regrouped plan's placement is new almost every step, and its groups are found by their ranks anyway)."""


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
        if len(self._placements) < MAX_REMEMBERED_PLACEMENTS:  # regrouped plans place anew every step
            self._placements.add(placement)

    @property
    def sizes(self) -> list[int]:
        """The sizes of the groups made so far (groups of one rank are None, not made)."""
        return [len(k) for k, g in self._groups.items() if g is not None]

    def _make(self, ranks: tuple[int, ...]) -> None:
        key = tuple(sorted(ranks))
        if key not in self._groups:
            self._groups[key] = _new_group(list(key)) if len(key) > 1 else None

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
    """``nccl`` (GPUs: device tensors over NCCL, whatever carries host tensors) or the default group's backend."""
    name = dist.get_backend()
    return "nccl" if is_nccl(name) else name


def group_device(group: ProcessGroup | None = None) -> torch.device:
    """Where tensors of ``group`` (None: the default group) must be: the current GPU under NCCL, else the CPU."""
    if dist.is_initialized() and uses_nccl(group):
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
    ranks that send to each other at once do not deadlock), within the default group's timeout in force
    (:func:`wait`)."""
    ops = [dist.P2POp(dist.isend, _on(t, None).contiguous(), peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, buf, peer) for buf, peer in recvs]
    if ops:
        wait(dist.batch_isend_irecv(ops), p2p_timeout(None))


def p2p_timeout(group: ProcessGroup | None = None) -> datetime.timedelta | None:
    """What :func:`wait` passes to the point-to-point works of ``group`` (None: the default group) for them to time
    out as its collectives do now (:func:`timeout_of`: inside :func:`collective_timeout` the block's, else the
    job's). On gloo that is the group's timeout in force, since a gloo send or receive waited without a timeout
    waits for the one its group was made with, whatever was set since; None under NCCL, whose works each time
    out (in its watchdog) after the timeout in force when they were posted, and whose ``wait`` with a timeout
    would block the host until the work is done instead of ordering the stream. Read it once per batch of works
    or per step, not per message."""
    if world_size() == 1 or uses_nccl(group):
        return None
    return datetime.timedelta(seconds=timeout_of(group))


def wait(works: Sequence[Work], timeout: datetime.timedelta | None) -> None:
    """Wait for each of ``works`` in turn, each within ``timeout`` (:func:`p2p_timeout`; None: the backend's own);
    a work not done by then raises the backend's timeout error."""
    for work in works:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)


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
    own, set up here by all its ranks at once, since a rank may post nothing in a window)."""
    if world_size() == 1:
        return None
    key = id(dist.group.WORLD)
    if key not in _movement:
        _movement.clear()
        group = _new_group(list(range(world_size())))
        _set_up(group)
        _movement[key] = group
    return _movement[key]


# ---------------------------------------------------------------------------------------------------------------
# Groups and their timeouts

_timeouts: dict[str, float] = {}
"""``job``: the collective timeout this module made the job with; ``now``: the one in force inside
:func:`collective_timeout` (groups made there get it too); ``outside``: the job's, inside the outermost block."""
_made: dict[int, list[ProcessGroup]] = {}
"""The sub-groups this module made, by the id of the default group they were made in."""


def _new_group(ranks: list[int]) -> ProcessGroup:
    """A sub-group of ``ranks`` made with the job's timeout (``dist.new_group`` would give torch's default, 10 or
    30 minutes), then given the timeout in force (inside :func:`collective_timeout`, the block's), remembered so
    that :func:`collective_timeout` reaches it. Made with the job's, never the block's: gloo's point-to-point
    waits without a timeout of their own keep the one the group was made with, whatever is set later, so a group
    made during warm-up with warm-up's hour would hold a rank stalled inside a later step for an hour."""
    group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=_job_timeout_s()),
                           backend=subgroup_backend(str(dist.get_backend())))
    if rank() in ranks:  # elsewhere new_group gives a placeholder that no call may name
        _made.setdefault(id(dist.group.WORLD), []).append(group)
        if "now" in _timeouts:
            _set_timeout(group, _timeouts["now"])
    return group


def _set_up(group: ProcessGroup | None) -> None:
    """Set up ``group`` by all its ranks at once. Under NCCL: a zero summed on the device, which makes its
    communicator (its first use must involve every rank: a batched point-to-point call of some ranks would
    hang); a barrier on gloo."""
    if uses_nccl(group):
        dist.all_reduce(torch.zeros(1, device=group_device(group)), group=group)
    else:
        dist.barrier(group=group)


def _job_timeout_s() -> float:
    """The job's collective timeout: the one this module made the job with, else the default group's."""
    if "job" in _timeouts:
        return _timeouts["job"]
    if "outside" in _timeouts:  # a user's job inside collective_timeout: the default group's is the block's
        return _timeouts["outside"]
    try:
        return timeout_of(None)
    except (AttributeError, RuntimeError):  # a backend that does not show its options
        return env_seconds("HCOMPILE_TIMEOUT_S", DEFAULT_TIMEOUT_S)


def _groups_of_job() -> list[ProcessGroup]:
    return [dist.group.WORLD, *_made.get(id(dist.group.WORLD), [])]


def timeout_of(group: ProcessGroup | None = None) -> float:
    """Seconds after which a collective or point-to-point call on ``group`` (None: the default group) times out,
    as its backend holds it (the device side's under NCCL)."""
    group = dist.group.WORLD if group is None else group
    device = torch.device("cuda" if uses_nccl(group) else "cpu")
    return group._get_backend(device).options._timeout.total_seconds()


def _set_timeout(group: ProcessGroup, seconds: float) -> None:
    timeout = datetime.timedelta(seconds=seconds)
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is not None:
        setter(timeout, group)
    else:  # pragma: no cover - torch releases without the helper
        group.set_timeout(timeout)


def env_seconds(name: str, default: float) -> float:
    """Env ``name`` as a number of seconds, else ``default``; a value that is not a positive, finite number of
    seconds is a ValueError naming it."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"{name}={text!r}: expected a positive number of seconds")
    return value


def warmup_timeout_s() -> float:
    """``HCOMPILE_WARMUP_TIMEOUT_S`` (seconds), else :data:`DEFAULT_WARMUP_TIMEOUT_S` (:func:`env_seconds`)."""
    return env_seconds("HCOMPILE_WARMUP_TIMEOUT_S", DEFAULT_WARMUP_TIMEOUT_S)


@contextlib.contextmanager
def collective_timeout(seconds: float) -> Iterator[None]:
    """Inside the block, every collective and point-to-point call of the job (the default group, the sub-groups
    this module made, those made inside the block) times out after ``seconds``; afterwards each group has its
    timeout from before again (a group made inside, the job's). For work whose ranks legitimately wait on each
    other for long, such as warm-up: each rank compiles its variants inside collective dry-run steps (a 32B
    variant under inductor takes minutes), and the ranks that compile less wait for the others in their next
    collective. Each rank calls it around the same work; it changes local state only."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"a collective timeout must be a positive number of seconds, got {seconds!r}")
    if not dist.is_initialized() or world_size() == 1:
        yield
        return
    job = _job_timeout_s()
    before = {id(g): timeout_of(g) for g in _groups_of_job()}
    outer = _timeouts.get("now")
    if outer is None:
        _timeouts["outside"] = job
    _timeouts["now"] = float(seconds)
    for group in _groups_of_job():
        _set_timeout(group, seconds)
    try:
        yield
    finally:
        if outer is None:
            _timeouts.pop("now", None)
            _timeouts.pop("outside", None)
        else:
            _timeouts["now"] = outer
        for group in _groups_of_job():
            _set_timeout(group, before.get(id(group), job if outer is None else outer))


def shutdown() -> None:
    """Leave the job: destroy every process group (before the interpreter finalizes)."""
    _movement.clear()
    _made.clear()
    _timeouts.pop("now", None)
    _timeouts.pop("outside", None)
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_world(rank: int, world: int) -> Iterator[None]:
    """This process as rank ``rank`` of a fake job of ``world`` ranks (the ``fake`` backend of
    ``torch.testing._internal.distributed.fake_pg``: collectives return at once, nothing is sent; what the
    rehearsal, ``hcompile.rehearsal``, runs one rank of a large job in), destroyed on exit. Refused
    (RuntimeError) when a process group is already initialised: the rehearsal would replace it."""
    from torch.distributed._tools import fake_collectives  # noqa: F401  (fake collectives under fake mode)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if isinstance(world, bool) or not isinstance(world, int) or world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank!r}")
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised: a rehearsal makes its own fake world of the "
                           "whole job; destroy the group first (dist.destroy_process_group())")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
