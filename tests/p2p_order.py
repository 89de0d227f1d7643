"""Point-to-point order as NCCL needs it, checked on gloo ranks: a recorder of every rank's point-to-point
operations, the matching rule, and an emulation of NCCL's rendezvous on gloo.

gloo buffers sends, so a gloo run completes whatever order two ranks post their messages in; NCCL does not:

- operations of one communicator run on one stream, in the order they are issued (both directions of a pair
  share it);
- a send completes only once its receive is posted on the other rank (beyond NCCL's small buffers, so for any
  activation or gradient of a real model), and a receive only once its send is;
- a batch (``batch_isend_irecv``, one NCCL group) runs its operations together: it completes once every one of
  them is matched.

:class:`P2PRecorder` wraps the comm layer's entry points (``runtime.distributed``: ``send``, ``recv``, ``isend``,
``irecv``, ``exchange``, ``post``) on one rank and records each operation (kind, peer, shape, dtype, group, the
batch it was posted in: a lone call is a batch of its own). :func:`p2p_problems` takes every rank's records and
says what NCCL would do wrong, group by group: the k-th send from rank a to rank b must meet b's k-th receive
from a, with the same shape and dtype; batches must pair up (a batch's messages with a peer all meet one batch of
the peer, which meets no other batch of it); and a replay of every rank's batches, one group's in issue order
on that rank (different groups are different communicators and streams), where a message completes only while
the batches holding its send and its receive are both their ranks' current ones, must finish.
:class:`BlockingSends` makes gloo behave so on a few ranks: a send returns only once its receive is posted
(announced through a file store).
"""

from __future__ import annotations

import datetime
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

__all__ = ["P2POp", "P2PRecorder", "p2p_problems", "BlockingSends", "ENTRY_POINTS"]

ENTRY_POINTS = ("send", "recv", "isend", "irecv", "exchange", "post")
"""The point-to-point functions of ``runtime.distributed`` (every caller goes through them)."""


@dataclass(frozen=True, slots=True)
class P2POp:
    """One point-to-point operation a rank posted."""

    kind: str
    """``send`` or ``recv``."""
    peer: int
    """The other rank (global)."""
    shape: tuple[int, ...]
    """The tensor's shape."""
    dtype: str
    """The tensor's dtype."""
    group: str
    """The process group (``default``, or the group's name)."""
    batch: int
    """The batch it was posted in, numbered on this rank (a lone send or receive is a batch of its own)."""

    def describe(self) -> str:
        arrow = "->" if self.kind == "send" else "<-"
        return f"{self.kind}{arrow}{self.peer} {list(self.shape)} {self.dtype.replace('torch.', '')}"


class P2PRecorder:
    """Records this rank's point-to-point operations while installed (``with P2PRecorder() as rec:``); ``ops``."""

    def __init__(self) -> None:
        import threading

        self.ops: list[P2POp] = []
        self._batches = 0
        self._saved: dict[str, Callable] = {}
        self._lock = threading.Lock()
        """Overlapped movement posts from a progress thread of its own."""

    def __enter__(self) -> "P2PRecorder":
        from runtime import distributed as comm

        for name in ENTRY_POINTS:
            self._saved[name] = getattr(comm, name)
        lone = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}
        for name, kind in lone.items():
            setattr(comm, name, self._lone(self._saved[name], kind))
        comm.exchange = self._batched(self._saved["exchange"])  # type: ignore[assignment]
        comm.post = self._batched(self._saved["post"])  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        from runtime import distributed as comm

        for name, fn in self._saved.items():
            setattr(comm, name, fn)
        self._saved.clear()

    def record(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
               group: Any = None) -> None:
        """One batch: these sends (tensor, to) and receives (buffer, from), in that order."""
        if not sends and not recvs:
            return  # nothing is posted
        name = _group_name(group)
        with self._lock:
            for kind, items in (("send", sends), ("recv", recvs)):
                for tensor, peer in items:
                    self.ops.append(P2POp(kind, int(peer), tuple(tensor.shape), str(tensor.dtype), name,
                                          self._batches))
            self._batches += 1

    def _lone(self, fn: Callable, kind: str) -> Callable:
        def call(tensor: torch.Tensor, peer: int, *args: Any, **kwargs: Any) -> Any:
            self.record([(tensor, peer)] if kind == "send" else [], [(tensor, peer)] if kind == "recv" else [])
            return fn(tensor, peer, *args, **kwargs)
        return call

    def _batched(self, fn: Callable) -> Callable:
        def call(sends: Sequence, recvs: Sequence, group: Any = None) -> Any:
            self.record(sends, recvs, group)
            return fn(sends, recvs) if group is None else fn(sends, recvs, group)
        return call


def _group_name(group: Any) -> str:
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return "default"
    return str(group.group_name)


def p2p_problems(per_rank: Sequence[Sequence[P2POp]], limit: int = 10) -> list[str]:
    """What NCCL would do wrong with these ranks' operations (``per_rank[r]``: rank r's, in issue order), per
    group: sends and receives of a pair that do not match (the k-th send from a to b against b's k-th receive
    from a: both present, same shape and dtype), batches that do not pair up (a batch's messages with a peer all
    matched in one batch of the peer, whose messages with it are all in this one), and batches that would wait
    for each other forever. Empty: the order is sound. At most ``limit`` problems."""
    problems: list[str] = []
    for group in sorted({op.group for ops in per_rank for op in ops}):
        queues = [_batches([op for op in ops if op.group == group]) for ops in per_rank]
        messages = _messages(group, queues, problems)
        if messages is not None and _paired(group, messages, problems):
            problems += _replay(group, queues, messages)
        if len(problems) >= limit:
            break
    return problems[:limit]


def _batches(ops: list[P2POp]) -> list[list[P2POp]]:
    """One rank's operations of one group, grouped into its batches, in issue order."""
    out: dict[int, list[P2POp]] = {}
    for op in ops:
        out.setdefault(op.batch, []).append(op)
    return [out[b] for b in sorted(out)]


def _messages(group: str, queues: list[list[list[P2POp]]], problems: list[str]) -> list[tuple] | None:
    """Every message as (sender, its batch index, receiver, its batch index): the k-th send from a to b is
    received by b's k-th receive from a. None (with problems) when they do not match."""
    sends: dict[tuple[int, int], list[tuple[int, P2POp]]] = defaultdict(list)  # (from, to) -> (batch, op)
    recvs: dict[tuple[int, int], list[tuple[int, P2POp]]] = defaultdict(list)
    for rank, queue in enumerate(queues):
        for b, batch in enumerate(queue):
            for op in batch:
                if not 0 <= op.peer < len(queues) or op.peer == rank:
                    problems.append(f"group {group}: rank {rank} posts {op.describe()} to itself or outside the job")
                    return None
                (sends if op.kind == "send" else recvs)[(rank, op.peer) if op.kind == "send" else (op.peer, rank)] \
                    .append((b, op))
    before, out = len(problems), []
    for pair in sorted(set(sends) | set(recvs)):
        sent, got = sends.get(pair, []), recvs.get(pair, [])
        a, b = pair
        if len(sent) != len(got):
            problems.append(f"group {group}: rank {a} sends {len(sent)} messages to rank {b}, which receives "
                            f"{len(got)} from it")
            continue
        for k, ((sb, s), (rb, r)) in enumerate(zip(sent, got)):
            if (s.shape, s.dtype) != (r.shape, r.dtype):
                problems.append(f"group {group}: message {k} from rank {a} to rank {b}: rank {a} sends "
                                f"{s.describe()} (its batch {sb}), rank {b} receives {r.describe()} (its batch {rb})")
            out.append((a, sb, b, rb))
    return None if len(problems) > before else out


def _paired(group: str, messages: list[tuple], problems: list[str]) -> bool:
    """Whether each batch's messages with a peer meet one batch of the peer, which meets no other batch of it."""
    meets: dict[tuple[int, int, int], set[int]] = defaultdict(set)  # (rank, batch, peer) -> the peer's batches
    for a, sb, b, rb in messages:
        meets[(a, sb, b)].add(rb)
        meets[(b, rb, a)].add(sb)
    before = len(problems)
    for (rank, batch, peer), theirs in sorted(meets.items()):
        if len(theirs) > 1:
            problems.append(f"group {group}: rank {rank}'s batch {batch} exchanges messages with batches "
                            f"{sorted(theirs)} of rank {peer}: batches must pair up one to one")
    return len(problems) == before


def _replay(group: str, queues: list[list[list[P2POp]]], messages: list[tuple]) -> list[str]:
    """Run every rank's batches of one group in issue order: a message completes while the sender's batch holding
    it and the receiver's are both current; a batch is done once all its messages are. Problems for ranks left
    waiting."""
    pending: dict[tuple[int, int], list[tuple]] = defaultdict(list)  # (rank, batch) -> its messages not done
    for m in messages:
        a, sb, b, rb = m
        pending[(a, sb)].append(m)
        pending[(b, rb)].append(m)
    at, done = [0] * len(queues), set()
    moved = True
    while moved:
        moved = False
        for a, sb, b, rb in messages:
            if at[a] == sb and at[b] == rb:
                done.add((a, sb, b, rb))
        for rank, queue in enumerate(queues):
            while at[rank] < len(queue) and all(m in done for m in pending[(rank, at[rank])]):
                at[rank] += 1
                moved = True
    stuck = []
    for rank, queue in enumerate(queues):
        if at[rank] < len(queue):
            waits = sorted({m[2] if m[0] == rank else m[0] for m in pending[(rank, at[rank])] if m not in done})
            stuck.append(f"rank {rank} waits in its batch {at[rank]} "
                         f"({', '.join(o.describe() for o in queue[at[rank]])}) for rank(s) {waits}, which are in "
                         f"their batch {[at[p] for p in waits]}")
    return [f"group {group}: the ranks wait for each other forever: {'; '.join(stuck)}"] if stuck else []


class BlockingSends:
    """NCCL's rendezvous emulated on gloo while installed: a send returns (or its batch completes) only once the
    receiving rank has posted the matching receive, announced through a file store; a send still waiting after
    ``timeout_s`` is a ``TimeoutError`` naming it (the two ranks would wait forever under NCCL). Every batch
    completes before the call returns, as one stream runs it (for overlapped movement, ``post``, that blocks its
    progress thread, which waits for each message anyway). Messages are counted per group (a group is a
    communicator of its own under NCCL)."""

    def __init__(self, store_path: str, rank: int, world: int, timeout_s: float = 5.0):
        import torch.distributed as dist

        self.store = dist.FileStore(store_path, world)
        self.rank, self.timeout = rank, datetime.timedelta(seconds=timeout_s)
        self.sent: dict[tuple[str, int], int] = defaultdict(int)
        self.received: dict[tuple[str, int], int] = defaultdict(int)
        self.posted: list = []
        """What ``isend`` posted (the works and tensors), kept alive."""
        self._saved: dict[str, Callable] = {}

    def __enter__(self) -> "BlockingSends":
        from runtime import distributed as comm

        for name in ENTRY_POINTS:
            self._saved[name] = getattr(comm, name)
        saved = self._saved

        def isend(tensor: torch.Tensor, dst: int) -> Any:
            out = saved["isend"](tensor, dst)
            self.posted.append(out)  # kept: a work dropped before it completes is cancelled
            self._wait_received([dst])
            return out

        def send(tensor: torch.Tensor, dst: int) -> None:
            saved["send"](tensor, dst)
            self._wait_received([dst])

        def irecv(tensor: torch.Tensor, src: int) -> Any:
            self._announce([src])
            return saved["irecv"](tensor, src)

        def recv(tensor: torch.Tensor, src: int) -> None:
            self._announce([src])
            saved["recv"](tensor, src)

        def exchange(sends: Sequence, recvs: Sequence) -> None:
            self._announce([p for _, p in recvs])
            saved["exchange"](sends, recvs)
            self._wait_received([p for _, p in sends])

        def post(sends: Sequence, recvs: Sequence, group: Any = None) -> Any:
            name = _group_name(group)
            self._announce([p for _, p in recvs], name)
            works = saved["post"](sends, recvs) if group is None else saved["post"](sends, recvs, group)
            self._wait_received([p for _, p in sends], name)
            return works

        comm.isend, comm.send, comm.irecv, comm.recv, comm.exchange = isend, send, irecv, recv, exchange
        comm.post = post
        return self

    def __exit__(self, *exc: Any) -> None:
        from runtime import distributed as comm

        for name, fn in self._saved.items():
            setattr(comm, name, fn)
        self._saved.clear()

    def finish(self) -> None:
        """Wait for every send ``isend`` posted here (gloo sends only once the receive is posted: a work dropped
        before then is lost)."""
        for work, _ in self.posted:
            work.wait()
        self.posted.clear()

    def _announce(self, sources: list[int], group: str = "default") -> None:
        for src in sources:
            self.store.set(f"p2p/{group}/{src}->{self.rank}/{self.received[group, src]}", "posted")
            self.received[group, src] += 1

    def _wait_received(self, destinations: list[int], group: str = "default") -> None:
        for dst in destinations:
            k = self.sent[group, dst]
            try:
                self.store.wait([f"p2p/{group}/{self.rank}->{dst}/{k}"], self.timeout)
            except RuntimeError as exc:  # the store's timeout (DistStoreError is a RuntimeError)
                raise TimeoutError(f"rank {self.rank}: send #{k} to rank {dst} in group {group} was not received "
                                   f"within {self.timeout.total_seconds():g} s: under NCCL both would wait "
                                   f"forever") from exc
            self.sent[group, dst] += 1
