"""torch.distributed set-up: the default process group (NCCL on GPUs, gloo on CPU) with a timeout on every
collective, destroyed at exit while the interpreter is still whole, and the cache of sub-groups per strategy
(created once, in the same order on every rank)."""

from __future__ import annotations

import atexit
import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from passes.plan.ir import Strategy
from runtime.topology import Placement

__all__ = ["DistContext", "init_distributed", "GroupCache", "DEFAULT_TIMEOUT_S"]

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
        if world_size == 1 and init_method is None and "MASTER_ADDR" not in os.environ:
            # a plain `python train.py`: a world of one, its store in memory (no launcher, no rendezvous)
            dist.init_process_group(backend=dist_backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend=dist_backend, init_method=init_method or "env://", rank=rank,
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
        self._strategies: set[Strategy] = set()

    def prepare(self, placement: Placement) -> None:
        """Create (once) every group ``placement`` needs: each replica, each TP group, and for each pair of
        neighbouring pipeline stages, the pair of ranks that exchange activations."""
        if placement.strategy in self._strategies:
            return
        for replica, ranks in enumerate(placement.replica_ranks):
            self._make(ranks)
            stages = placement.tp_groups(replica)
            for group in stages:
                self._make(group)
            for left, right in zip(stages, stages[1:]):
                for a, b in zip(left, right):
                    self._make((a, b))
        self._strategies.add(placement.strategy)

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
