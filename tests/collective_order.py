"""Collective order as NCCL needs it, checked on gloo ranks: a recorder of every collective a rank's main thread
issues, and the rule.

Under NCCL each process group is a communicator; its collectives run on one stream per rank in the order they are
issued, and a collective completes only once every member has issued it. So, per group, every member must issue
the same collectives in the same order (same operation, shape and dtype), and across groups the ranks' orders
must not wait on each other in a cycle: group A's k-th collective on one rank before group B's, and B's before
A's on another, hangs when the two ranks share both groups' streams (NCCL serialises a rank's collectives on its
compute stream). gloo completes more orders than that, so a run here proves nothing about them by itself.

:class:`CollectiveRecorder` wraps ``torch.distributed``'s collectives (and the module-level aliases the runtime
and the graph's collectives hold) on one rank and records each call from the thread that installed it: the
operation, the group's ranks, the tensor's shape and dtype. :func:`collective_problems` takes every rank's
records and says what NCCL would do wrong: per group, members whose sequences differ; then a replay of every
rank's sequence in order, where a collective completes only when every member has it next, which must finish.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

__all__ = ["Collective", "CollectiveRecorder", "collective_problems"]

_PATCHED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "barrier", "broadcast",
            "all_gather_object", "broadcast_object_list")
_ALIASES = (("passes.graph.collectives", "_ALL_GATHER_SINGLE"), ("passes.graph.collectives", "_REDUCE_SCATTER_SINGLE"),
            ("runtime.distributed", "_all_gather_single"))


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective a rank issued."""

    op: str
    group: tuple[int, ...]
    """The group's global ranks (every rank for the default group)."""
    shape: tuple[int, ...]
    dtype: str

    def describe(self) -> str:
        return f"{self.op}{list(self.group)} {list(self.shape)} {self.dtype.replace('torch.', '')}"


class CollectiveRecorder:
    """Records this rank's collectives from the installing thread while installed (``with CollectiveRecorder()
    as rec:``); ``calls``."""

    def __init__(self) -> None:
        self.calls: list[Collective] = []
        self._saved: list[tuple[Any, str, Callable]] = []
        self._thread = threading.get_ident()

    def __enter__(self) -> "CollectiveRecorder":
        import importlib

        import torch.distributed as dist

        self._thread = threading.get_ident()
        for name in _PATCHED:
            self._patch(dist, name, name)
        for module, name in _ALIASES:
            target = importlib.import_module(module)
            op = getattr(getattr(target, name), "__name__", name)
            self._patch(target, name, op)
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()

    def _patch(self, owner: Any, name: str, op: str) -> None:
        fn = getattr(owner, name)
        self._saved.append((owner, name, fn))

        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == self._thread:
                self.calls.append(_collective(op, args, kwargs))
            return fn(*args, **kwargs)

        setattr(owner, name, call)


def _collective(op: str, args: tuple, kwargs: dict) -> Collective:
    import torch.distributed as dist

    group = kwargs.get("group")
    if group is None and op in ("all_reduce", "broadcast", "barrier"):
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    ranks = tuple(range(dist.get_world_size())) if group is None else tuple(dist.get_process_group_ranks(group))
    tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if tensor is None:
        return Collective(op, ranks, (), "object")
    return Collective(op, ranks, tuple(tensor.shape), str(tensor.dtype))


def collective_problems(per_rank: Sequence[Sequence[Collective]], limit: int = 10) -> list[str]:
    """What NCCL would do wrong with these ranks' collectives (``per_rank[r]``: rank r's, in issue order):
    members of a group whose sequences on it differ, and orders that wait on each other forever. Empty: sound."""
    problems: list[str] = []
    groups = sorted({c.group for calls in per_rank for c in calls})
    for group in groups:
        seqs = {r: [c for c in per_rank[r] if c.group == group] for r in group if r < len(per_rank)}
        first = seqs[group[0]]
        for r, seq in seqs.items():
            if seq != first:
                at = next((k for k, (a, b) in enumerate(zip(first, seq)) if a != b), min(len(first), len(seq)))
                mine = seq[at].describe() if at < len(seq) else "nothing"
                theirs = first[at].describe() if at < len(first) else "nothing"
                problems.append(f"group {list(group)}: collective {at} is {mine} on rank {r} and {theirs} on rank "
                                f"{group[0]} ({len(seq)} against {len(first)} collectives)")
                break
        if len(problems) >= limit:
            return problems
    if problems:
        return problems
    return _replay(per_rank)


def _replay(per_rank: Sequence[Sequence[Collective]]) -> list[str]:
    """Every rank issues its collectives in order; one completes when every member of its group has it next."""
    at = [0] * len(per_rank)
    done = {}  # group -> collectives completed
    while True:
        progressed = False
        for r, calls in enumerate(per_rank):
            if at[r] >= len(calls):
                continue
            c = calls[at[r]]
            k = done.get(c.group, 0)
            ready = all(at[m] < len(per_rank[m]) and per_rank[m][at[m]].group == c.group
                        and sum(1 for x in per_rank[m][:at[m]] if x.group == c.group) == k for m in c.group)
            if ready:
                for m in c.group:
                    at[m] += 1
                done[c.group] = k + 1
                progressed = True
        if all(a >= len(calls) for a, calls in zip(at, per_rank)):
            return []
        if not progressed:
            stuck = [f"rank {r} waits in {per_rank[r][at[r]].describe()}" for r in range(len(per_rank))
                     if at[r] < len(per_rank[r])]
            return ["collectives wait on each other forever: " + "; ".join(stuck[:6])]
