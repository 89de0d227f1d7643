"""Parameter and gradient movement between the fixed ZeRO-1 layout and the ranks' compute copies.

Owns :class:`Redistribution`, the cached plan of one strategy: which flat ranges every rank computes with
(its TP slice of its pipeline stage), intersected with the owners' shards. It is built once per strategy,
collectively (every rank contributes its ranges), and then moves only those slices:

- ``pull``: every owner sends each rank the part of its shard that rank needs, cast to the compute dtype;
  a rank receives straight into its :class:`~runtime.stage_params.StageParams` buffer (which holds its
  ranges in flat order, so what comes from owner k is one contiguous segment of it);
- ``push``: every rank sends each owner the segment of its gradient buffer that falls in that owner's shard,
  in the reduction dtype; owners add what they receive into their shard's fp32 gradient.

Transfers go in rounds of pairs (round d: send to rank + d, receive from rank - d), each message in chunks
of at most ``chunk_numel`` elements, so the only buffers besides the compute copy are one send and one
receive chunk. Bytes are counted per direction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from runtime import distributed as comm
from runtime.fixed_layout import FixedLayout

__all__ = ["Traffic", "Redistribution", "Ranges", "intersect", "pieces", "total", "gather_ranges",
           "DEFAULT_CHUNK_NUMEL"]

DEFAULT_CHUNK_NUMEL = 1 << 24
"""Elements of the largest single message (64 MiB in fp32)."""

Ranges = list[tuple[int, int]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Traffic:
    """Bytes one rank moved in one step (messages to itself not counted)."""

    params_received: int = 0
    """Parameter slices received from their owners."""
    params_sent: int = 0
    """Parts of this rank's shard sent to the ranks that compute with them."""
    grads_sent: int = 0
    """Gradient slices sent to their owners."""
    grads_received: int = 0
    """Gradients of this rank's shard received from the ranks that computed them."""

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(params_received=self.params_received + other.params_received,
                       params_sent=self.params_sent + other.params_sent,
                       grads_sent=self.grads_sent + other.grads_sent,
                       grads_received=self.grads_received + other.grads_received)


def intersect(ranges: Ranges, lo: int, hi: int) -> Ranges:
    """The parts of sorted ``ranges`` inside [lo, hi)."""
    out = []
    for a, b in ranges:
        a, b = max(a, lo), min(b, hi)
        if b > a:
            out.append((a, b))
    return out


def pieces(ranges: Ranges, start: int, count: int) -> Iterator[tuple[int, int, int]]:
    """(position in the concatenation, range offset, length) covering elements [start, start + count) of the
    concatenation of ``ranges``."""
    pos = 0
    for lo, hi in ranges:
        n = hi - lo
        a, b = max(start, pos), min(start + count, pos + n)
        if b > a:
            yield a, lo + a - pos, b - a
        pos += n
        if pos >= start + count:
            return


def total(ranges: Ranges) -> int:
    """Elements of ``ranges``."""
    return sum(b - a for a, b in ranges)


class Redistribution:
    """The movement plan of one strategy on this rank."""

    def __init__(self, layout: FixedLayout, needs: list[Ranges], chunk_numel: int = DEFAULT_CHUNK_NUMEL):
        """``needs[r]``: the sorted flat ranges rank r computes with (every rank's, in rank order)."""
        if len(needs) != layout.world_size:
            raise ValueError(f"need the ranges of all {layout.world_size} ranks, got {len(needs)}")
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel must be positive, got {chunk_numel!r}")
        self.rank, self.world_size, self.chunk = layout.rank, layout.world_size, chunk_numel
        lo, hi = layout.owner_range(self.rank)
        mine = needs[self.rank]
        self.ranges: Ranges = list(mine)
        """The flat ranges this rank computes with, in order."""
        self.numel = total(mine)
        """Elements this rank computes with."""
        self.segments: list[tuple[int, int]] = []
        """Per owner k: (start, count) of the segment of this rank's buffer that k's shard holds."""
        start = 0
        for k in range(self.world_size):
            count = total(intersect(mine, *layout.owner_range(k)))
            self.segments.append((start, count))
            start += count
        self.serves: list[Ranges] = [[(a - lo, b - lo) for a, b in intersect(need, lo, hi)] for need in needs]
        """Per rank j: the ranges of this rank's shard (shard coordinates) that j computes with, in order."""

    @classmethod
    def build(cls, layout: FixedLayout, mine: Ranges, chunk_numel: int = DEFAULT_CHUNK_NUMEL) -> "Redistribution":
        """Collective: every rank passes the flat ranges it computes with."""
        needs = comm.all_gather_object([tuple(r) for r in mine])
        return cls(layout, [list(map(tuple, n)) for n in needs], chunk_numel)

    @property
    def local_numel(self) -> int:
        """Elements this rank computes with that its own shard holds."""
        return self.segments[self.rank][1]

    def served_numel(self) -> int:
        """Elements of this rank's shard that other ranks compute with (summed over them)."""
        return sum(total(r) for j, r in enumerate(self.serves) if j != self.rank)

    def pull(self, layout: FixedLayout, flat: torch.Tensor) -> Traffic:
        """Fill ``flat`` (this rank's buffer, any float dtype) with its parameter slices from their owners."""
        if flat.numel() != self.numel:
            raise ValueError(f"the buffer has {flat.numel()} elements, this rank computes with {self.numel}")
        shard = layout.shard.detach()
        start, count = self.segments[self.rank]
        with torch.no_grad():
            for pos, off, n in pieces(self.serves[self.rank], 0, count):
                flat[start + pos:start + pos + n].copy_(shard[off:off + n])
        size = flat.element_size()
        sent = received = 0
        for step in range(1, self.world_size):
            to, frm = (self.rank + step) % self.world_size, (self.rank - step) % self.world_size
            n_send, (r_start, n_recv) = total(self.serves[to]), self.segments[frm]
            for c in range(0, max(n_send, n_recv), self.chunk):
                sends, recvs = [], []
                if c < n_send:
                    n = min(self.chunk, n_send - c)
                    sends.append((gather_ranges(shard, self.serves[to], c, n, flat.dtype), to))
                    sent += n * size
                if c < n_recv:
                    recvs.append((flat[r_start + c:r_start + min(n_recv, c + self.chunk)], frm))
                    received += min(self.chunk, n_recv - c) * size
                comm.exchange(sends, recvs)
        return Traffic(params_received=received, params_sent=sent)

    def push(self, layout: FixedLayout, grads: torch.Tensor, reduce_dtype: torch.dtype = torch.float32) -> Traffic:
        """Sum every rank's gradient buffer (``grads``, in this rank's buffer order) into the owners' shards:
        afterwards ``layout.shard.grad`` (fp32) holds this rank's shard of the step's summed gradient."""
        if grads.numel() != self.numel:
            raise ValueError(f"the gradient buffer has {grads.numel()} elements, this rank computes with {self.numel}")
        shard_grad = torch.zeros(layout.shard_numel, dtype=torch.float32, device=layout.shard.device)
        start, count = self.segments[self.rank]
        for pos, off, n in pieces(self.serves[self.rank], 0, count):
            shard_grad[off:off + n].add_(grads[start + pos:start + pos + n])
        size = torch.empty((), dtype=reduce_dtype).element_size()
        sent = received = 0
        for step in range(1, self.world_size):
            to, frm = (self.rank + step) % self.world_size, (self.rank - step) % self.world_size
            (s_start, n_send), n_recv = self.segments[to], total(self.serves[frm])
            for c in range(0, max(n_send, n_recv), self.chunk):
                sends, recvs, buf = [], [], None
                if c < n_send:
                    piece = grads[s_start + c:s_start + min(n_send, c + self.chunk)].to(reduce_dtype)
                    sends.append((piece, to))
                    sent += piece.numel() * size
                if c < n_recv:
                    buf = torch.empty(min(self.chunk, n_recv - c), dtype=reduce_dtype, device=grads.device)
                    recvs.append((buf, frm))
                    received += buf.numel() * size
                comm.exchange(sends, recvs)
                if buf is not None:
                    for pos, off, n in pieces(self.serves[frm], c, buf.numel()):
                        shard_grad[off:off + n].add_(buf[pos - c:pos - c + n])
        layout.shard.grad = shard_grad
        return Traffic(grads_sent=sent, grads_received=received)



def gather_ranges(shard: torch.Tensor, ranges: Ranges, start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """Elements [start, start + count) of the concatenation of ``ranges`` of ``shard``, contiguous, in ``dtype``
    (a view of the shard when that is one range already in ``dtype``)."""
    parts = [shard[off:off + n] for _, off, n in pieces(ranges, start, count)]
    joined = parts[0] if len(parts) == 1 else torch.cat(parts)
    return joined.to(dtype).contiguous()
