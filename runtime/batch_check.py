"""Before a step touches anything: every rank called the same collective method and holds a well-formed global
batch, and the same one.

Owns :func:`agree_on_batch` and :func:`agree_on_call`. Each rank checks its batch locally (a non-empty list of
non-empty 1-D integer tensors, token ids in [0, vocab)), then the ranks exchange one small digest each (the
call, the status, the number of sequences, the tokens, and a 128-bit blake2b hash of the lengths and the token
ids, computed on the host once per batch). When every rank made the same call, is well formed and every digest
equals rank 0's, the step goes on; otherwise the ranks exchange their messages and every rank raises the same
error, before any other collective of the step and before any state changes: :class:`CollectiveCallError` when
the ranks called different methods, :class:`SourceError` when the iterator of batches raised or ended on some
rank, :class:`BatchError` for a malformed batch or one that differs. A collective method without a batch
(``save``, ``load``, ...) starts with :func:`agree_on_call`, the same fixed-size exchange, so that a call made on
some ranks only is told apart by content, never by a message-size mismatch inside the collective library.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

from runtime import distributed as comm

__all__ = ["BatchError", "SourceError", "CollectiveCallError", "CALLS", "agree_on_batch", "agree_on_call",
           "local_batch_problem"]

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)

CALLS = ("train_step", "fit", "train_plan", "save", "load", "save_pretrained", "full_state_dict")
"""The collective methods whose first exchange names them (``Trainer``'s)."""

_OK, _MALFORMED, _RAISED, _ENDED, _NO_BATCH = range(5)


class BatchError(ValueError):
    """A global batch that is malformed on some rank, or not the same on every rank; the same on every rank."""


class SourceError(BatchError):
    """The iterator of batches raised, or ended, on some rank (and not on every rank); the same on every rank."""


class CollectiveCallError(RuntimeError):
    """The ranks called different collective methods at once (``save`` on rank 0 alone); the same on every
    rank."""


def local_batch_problem(batch: object, vocab_size: int | None) -> str | None:
    """What is wrong with this rank's batch (None when nothing is)."""
    if not isinstance(batch, (list, tuple)) or not batch:
        return f"a global batch is a non-empty list of 1-D token tensors, got {type(batch).__name__}"
    for i, t in enumerate(batch):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() < 1 or t.dtype not in _INT_DTYPES:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else ""
            dtype = t.dtype if isinstance(t, torch.Tensor) else ""
            return (f"sequence {i} of the batch must be a non-empty 1-D integer tensor, got {type(t).__name__} "
                    f"{shape} {dtype}".rstrip())
        low, high = int(t.min()), int(t.max())
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            bad = low if low < 0 else high
            return f"sequence {i} holds token id {bad}, outside the vocabulary [0, {vocab_size})"
    return None


def _digest(batch: Sequence[torch.Tensor], problem: str | None) -> torch.Tensor:
    """[status, sequences, tokens, h0, h1]: a blake2b hash (128 bits, two int64s) of the lengths and the int64
    token bytes, computed on the host once, so that a reordered cut of the same tokens or changed ids differ."""
    if problem is not None:
        return torch.tensor([1, 0, 0, 0, 0], dtype=torch.int64, device="cpu")
    lengths = torch.tensor([len(t) for t in batch], dtype=torch.int64, device="cpu")
    ids = torch.cat([t.detach().to(device="cpu", dtype=torch.int64) for t in batch])
    digest = hashlib.blake2b(lengths.numpy().tobytes(), digest_size=16)
    digest.update(ids.numpy().tobytes())
    raw = digest.digest()
    halves = [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in (0, 8)]
    return torch.tensor([0, len(batch), ids.numel(), *halves], dtype=torch.int64, device="cpu")


def _exchange(call: str, row: torch.Tensor) -> list[list[int]]:
    """Every rank's ``[call, *row]`` (six int64s on every rank, whatever each calls); a
    :class:`CollectiveCallError` on every rank when the calls differ."""
    if call not in CALLS:
        raise ValueError(f"unknown collective call {call!r}; known: {', '.join(CALLS)}")
    mine = torch.cat([torch.tensor([CALLS.index(call)], dtype=torch.int64, device="cpu"),
                      row.to(device="cpu", dtype=torch.int64)])
    rows = [d.cpu().tolist() for d in comm.all_gather(mine)]  # on the group's device
    names = [CALLS[r[0]] if 0 <= r[0] < len(CALLS) else f"call {r[0]}" for r in rows]
    other = next((r for r, name in enumerate(names) if name != names[0]), None)
    if other is not None:
        raise CollectiveCallError(f"`{names[0]}` is collective: rank 0 called it while rank {other} called "
                                  f"`{names[other]}` (every rank calls the trainer's collective methods, "
                                  f"{', '.join(CALLS)}, together and in the same order)")
    return [r[1:] for r in rows]


def agree_on_call(call: str) -> None:
    """The first exchange of a collective method without a batch (``save``, ``load``, ``save_pretrained``,
    ...): returns once every rank called ``call``; a :class:`CollectiveCallError` on every rank otherwise
    (nothing is exchanged with one rank)."""
    if comm.world_size() > 1:
        _exchange(call, torch.tensor([_NO_BATCH, 0, 0, 0, 0], dtype=torch.int64, device="cpu"))


def agree_on_batch(batch: object, vocab_size: int | None, *, call: str = "train_step", failure: str | None = None,
                   ended: bool = False) -> list[int] | None:
    """The sequence lengths of ``batch``, once every rank called ``call`` and holds the same well-formed batch
    (collective when the job has more than one rank); otherwise the same error on every rank. ``failure``: what
    this rank's iterator of batches raised instead of giving one (a :class:`SourceError` on every rank naming
    the rank and the message); ``ended``: this rank's iterator ended (None when it ended on every rank, a
    :class:`SourceError` when only on some)."""
    if failure is not None or ended:
        problem, row = None, torch.tensor([_RAISED if failure is not None else _ENDED, 0, 0, 0, 0],
                                    dtype=torch.int64, device="cpu")
    else:
        problem = local_batch_problem(batch, vocab_size)
        row = _digest(batch, problem)
    if comm.world_size() == 1:
        if failure is not None:
            raise SourceError(f"the batches raised on rank 0: {failure}")
        if ended:
            return None
        if problem:
            raise BatchError(problem)
        return [int(t.numel()) for t in batch]
    rows = _exchange(call, row)
    if any(r[0] == _RAISED for r in rows):
        raised = comm.agree_errors(failure)
        rank, message = raised[0]
        also = f" (and on rank {', '.join(str(r) for r, _ in raised[1:])})" if len(raised) > 1 else ""
        raise SourceError(f"the batches raised on rank {rank}{also}: {message}; every rank stops at this batch")
    stopped = [r for r, row in enumerate(rows) if row[0] == _ENDED]
    if len(stopped) == len(rows):
        return None
    if stopped:
        going = [r for r in range(len(rows)) if r not in stopped]
        raise SourceError(f"the batches ended on rank {', '.join(map(str, stopped))} but not on rank "
                          f"{', '.join(map(str, going))}: every rank must read the same batches")
    if all(r[0] == _OK for r in rows) and all(r == rows[0] for r in rows):
        return [int(t.numel()) for t in batch]
    for rank, message in comm.agree_errors(problem):
        raise BatchError(f"rank {rank}: {message}")
    differs = next(r for r, row in enumerate(rows) if row != rows[0])
    raise BatchError(f"rank {differs} was given another global batch than rank 0 ({rows[differs][1]} sequences, "
                     f"{rows[differs][2]} tokens against {rows[0][1]}, {rows[0][2]}, or other token ids): every "
                     "rank must pass the same batch")
