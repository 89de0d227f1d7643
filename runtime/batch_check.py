"""Before a step touches anything: every rank holds a well-formed global batch, and the same one.

Owns :func:`agree_on_batch`. Each rank checks its batch locally (a non-empty list of non-empty 1-D integer
tensors, token ids in [0, vocab)), then the ranks exchange one small digest each (the status, the number of
sequences, the tokens, and a 128-bit blake2b hash of the lengths and the token ids, computed on the host once
per batch). When every rank is well formed and every digest equals rank 0's, the step goes on; otherwise the
ranks exchange their messages and every rank raises the same :class:`BatchError`, before any other collective
of the step and before any state changes.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

from runtime import distributed as comm

__all__ = ["BatchError", "agree_on_batch", "local_batch_problem"]

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


class BatchError(ValueError):
    """A global batch that is malformed on some rank, or not the same on every rank; the same on every rank."""


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


def agree_on_batch(batch: object, vocab_size: int | None) -> list[int]:
    """The sequence lengths of ``batch``, once every rank holds the same well-formed batch (collective when
    the job has more than one rank); otherwise the same :class:`BatchError` on every rank."""
    problem = local_batch_problem(batch, vocab_size)
    if comm.world_size() == 1:
        if problem:
            raise BatchError(problem)
        return [int(t.numel()) for t in batch]
    rows = [d.cpu().tolist() for d in comm.all_gather(_digest(batch, problem))]  # on the group's device
    if all(r[0] == 0 for r in rows) and all(r == rows[0] for r in rows):
        return [int(t.numel()) for t in batch]
    for rank, message in comm.agree_errors(problem):
        raise BatchError(f"rank {rank}: {message}")
    differs = next(r for r, row in enumerate(rows) if row != rows[0])
    raise BatchError(f"rank {differs} was given another global batch than rank 0 ({rows[differs][1]} sequences, "
                     f"{rows[differs][2]} tokens against {rows[0][1]}, {rows[0][2]}, or other token ids): every "
                     "rank must pass the same batch")
