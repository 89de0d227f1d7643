"""Parameter and gradient movement between the fixed ZeRO-1 layout and the ranks' compute copies.

Owns :class:`Redistribution`, the cached plan of one strategy: which flat ranges every rank computes with
(its TP slice of its pipeline stage), intersected with the owners' ranges (``FixedLayout.owned``: a share of
each region of the layout). It is built once per strategy, collectively (every rank contributes its ranges),
and then moves only those slices:

- ``pull``: every owner sends each rank the part of its shard that rank needs, cast to the compute dtype;
  a rank receives straight into its :class:`~runtime.stage_params.StageParams` buffer (which holds its
  ranges in flat order, so what comes from owner k is one contiguous segment of it per region);
- ``push``: every rank sends each owner the parts of its gradient buffer that fall in that owner's
  ranges and that it pushes (its push ranges: all it computes with, less what another rank of its TP group
  pushes for it, ``StageParams.push_ranges``), in the reduction dtype; owners add what they receive into their
  shard's fp32 gradient.

Transfers go in rounds of pairs (round d: send to rank + d, receive from rank - d), a pair's transfer region
by region (one segment of the receiver's buffer each), in chunks of at most ``chunk_numel`` elements, so the
only buffers besides the compute copy are one send and one receive chunk. Bytes are counted per direction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from runtime import distributed as comm
from runtime.fixed_layout import FixedLayout, intersect

__all__ = ["Traffic", "Redistribution", "Ranges", "intersect", "pieces", "total", "zip_spans", "gather_ranges",
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


def zip_spans(first: Ranges, second: Ranges) -> Iterator[tuple[int, int, int]]:
    """(offset in ``first``'s range, offset in ``second``'s range, length) of each run where the two
    concatenations (of equal length) line up: element i of one is element i of the other."""
    for pos, a, n in pieces(first, 0, total(first)):
        for at, b, m in pieces(second, pos, n):
            yield a + at - pos, b, m


class Redistribution:
    """The movement plan of one strategy on this rank."""

    def __init__(self, layout: FixedLayout, needs: list[Ranges], chunk_numel: int = DEFAULT_CHUNK_NUMEL,
                 pushes: list[Ranges] | None = None):
        """``needs[r]``: the sorted flat ranges rank r computes with (every rank's, in rank order);
        ``pushes[r]``: the sorted flat ranges whose gradients rank r pushes, each inside ``needs[r]`` (None: all
        of ``needs[r]``)."""
        if len(needs) != layout.world_size:
            raise ValueError(f"need the ranges of all {layout.world_size} ranks, got {len(needs)}")
        if pushes is None:
            pushes = needs
        if len(pushes) != layout.world_size:
            raise ValueError(f"need the push ranges of all {layout.world_size} ranks, got {len(pushes)}")
        for r, (need, push) in enumerate(zip(needs, pushes)):
            if total(push) != sum(total(intersect(need, a, b)) for a, b in push):
                raise ValueError(f"rank {r} pushes ranges {list(push)[:4]} outside those it computes with "
                                 f"{list(need)[:4]}")
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel must be positive, got {chunk_numel!r}")
        self.rank, self.world_size, self.chunk = layout.rank, layout.world_size, chunk_numel
        mine = needs[self.rank]
        self.ranges: Ranges = list(mine)
        """The flat ranges this rank computes with, in order."""
        self.numel = total(mine)
        """Elements this rank computes with."""
        self.segments: list[Ranges] = []
        """Per owner k: the segments [start, end) of this rank's buffer that k's ranges hold, in order."""
        for k in range(self.world_size):
            segments = []
            for lo, hi in layout.owner_ranges(k):
                start, count = total(intersect(mine, 0, lo)), total(intersect(mine, lo, hi))
                if count:
                    segments.append((start, start + count))
            self.segments.append(segments)
        self.serves: list[Ranges] = [layout.in_shard(need, self.rank) for need in needs]
        """Per rank j: the ranges of this rank's shard (shard coordinates) that j computes with, in order."""
        own = layout.owned(self.rank)
        self.serve_parts: list[list[Ranges]] = [
            [part for lo, hi, pos in own for part in [intersect(ranges, pos, pos + hi - lo)] if part]
            for ranges in self.serves]
        """Per rank j: ``serves[j]`` cut by region (the non-empty parts, in order): what j's ``segments`` of this
        rank are. A pair's transfer goes part by part, so no message spans two segments of a buffer."""
        self.pushes: Ranges = [tuple(r) for r in pushes[self.rank]]
        """The flat ranges whose gradients this rank pushes (inside :attr:`ranges`)."""
        self.push_serves: list[Ranges] = [layout.in_shard(push, self.rank) for push in pushes]
        """Per rank j: the ranges of this rank's shard (shard coordinates) whose gradients j pushes, in order."""
        self.push_segments: list[list[Ranges]] = [
            [buf for lo, hi in layout.owner_ranges(k) for buf in [self.buffer_ranges(intersect(self.pushes, lo, hi))]
             if buf] for k in range(self.world_size)]
        """Per owner k, per region (the non-empty parts, in order): the ranges of this rank's buffer it pushes to
        k (:attr:`segments` less what it does not push)."""
        self.push_serve_parts: list[list[Ranges]] = [
            [part for lo, hi, pos in own for part in [intersect(ranges, pos, pos + hi - lo)] if part]
            for ranges in self.push_serves]
        """Per rank j: ``push_serves[j]`` cut by region: what j's ``push_segments`` of this rank are."""

    @classmethod
    def build(cls, layout: FixedLayout, mine: Ranges, chunk_numel: int = DEFAULT_CHUNK_NUMEL,
              pushes: Ranges | None = None) -> "Redistribution":
        """Collective: every rank passes the flat ranges it computes with and those it pushes (None: the same)."""
        both = comm.all_gather_object(([tuple(r) for r in mine],
                                       None if pushes is None else [tuple(r) for r in pushes]))
        needs = [list(map(tuple, n)) for n, _ in both]
        return cls(layout, needs, chunk_numel,
                   [n if p is None else list(map(tuple, p)) for n, (_, p) in zip(needs, both)])

    def buffer_ranges(self, flat: Ranges) -> Ranges:
        """The positions in this rank's buffer of sorted flat ranges inside :attr:`ranges` (one range each)."""
        out: Ranges = []
        for a, b in flat:
            start = total(intersect(self.ranges, 0, a))
            out.append((start, start + b - a))
        return out

    @property
    def pushed_numel(self) -> int:
        """Elements of this rank's buffer that it pushes (to other owners and into its own shard)."""
        return total(self.pushes)

    @property
    def local_numel(self) -> int:
        """Elements this rank computes with that its own shard holds."""
        return total(self.segments[self.rank])

    def served_numel(self) -> int:
        """Elements of this rank's shard that other ranks compute with (summed over them)."""
        return sum(total(r) for j, r in enumerate(self.serves) if j != self.rank)

    def pull(self, layout: FixedLayout, flat: torch.Tensor) -> Traffic:
        """Fill ``flat`` (this rank's buffer, any float dtype) with its parameter slices from their owners."""
        if flat.numel() != self.numel:
            raise ValueError(f"the buffer has {flat.numel()} elements, this rank computes with {self.numel}")
        shard = layout.shard.detach()
        with torch.no_grad():
            for at, off, n in zip_spans(self.segments[self.rank], self.serves[self.rank]):
                flat[at:at + n].copy_(shard[off:off + n])
        size = flat.element_size()
        sent = received = 0
        # one buffer for the messages gathered from several ranges of the shard or cast, reused message after
        # message (each exchange completes before the next is posted); none when every message is a view
        cast = flat.dtype != shard.dtype
        staged = self._largest_message([[total(part) for part in parts if len(part) > 1 or cast]
                                        for parts in self.serve_parts])
        staging = torch.empty(staged, dtype=flat.dtype, device=flat.device) if staged else None
        for step in range(1, self.world_size):
            to, frm = (self.rank + step) % self.world_size, (self.rank - step) % self.world_size
            for part, c, n_send, (start, n_recv) in self._messages(self.serve_parts[to], self.segments[frm]):
                sends, recvs = [], []
                if n_send:
                    sends.append((gather_ranges(shard, self.serve_parts[to][part], c, n_send, flat.dtype, staging), to))
                    sent += n_send * size
                if n_recv:
                    recvs.append((flat[start + c:start + c + n_recv], frm))
                    received += n_recv * size
                comm.exchange(sends, recvs)
        return Traffic(params_received=received, params_sent=sent)

    def _largest_message(self, per_rank: list[list[int]]) -> int:
        """Elements of the largest message to or from another rank, given per rank the element counts of its
        transfers (each sent in chunks of at most ``chunk``); 0 when there is none."""
        return max((min(self.chunk, n) for j, counts in enumerate(per_rank) if j != self.rank for n in counts),
                   default=0)

    def _messages(self, send_parts: list[Ranges], recv_segments: Ranges) -> Iterator[tuple[int, int, int, tuple]]:
        """The messages of one round, in the order both ends of each pair post them: per part (region), per
        chunk ``c``: (part, c, elements sent, (first element of the receiving segment, elements received))."""
        for part in range(max(len(send_parts), len(recv_segments))):
            n_send = total(send_parts[part]) if part < len(send_parts) else 0
            start, end = recv_segments[part] if part < len(recv_segments) else (0, 0)
            for c in range(0, max(n_send, end - start), self.chunk):
                yield part, c, max(0, min(self.chunk, n_send - c)), (start, max(0, min(self.chunk, end - start - c)))

    def push(self, layout: FixedLayout, grads: torch.Tensor, reduce_dtype: torch.dtype = torch.float32) -> Traffic:
        """Sum every rank's gradient buffer (``grads``, in this rank's buffer order; the parts each pushes,
        :attr:`pushes`) into the owners' shards: afterwards ``layout.shard.grad`` (fp32) holds this rank's shard of
        the step's summed gradient."""
        if grads.numel() != self.numel:
            raise ValueError(f"the gradient buffer has {grads.numel()} elements, this rank computes with {self.numel}")
        shard_grad = torch.zeros(layout.shard_numel, dtype=torch.float32, device=layout.shard.device)
        own = [r for part in self.push_segments[self.rank] for r in part]
        for at, off, n in zip_spans(own, [r for part in self.push_serve_parts[self.rank] for r in part]):
            shard_grad[off:off + n].add_(grads[at:at + n])
        size = torch.empty((), dtype=reduce_dtype).element_size()
        sent = received = 0
        # one receive buffer and (when a message is cast, or gathered from several parts of the buffer) one
        # staging buffer for every message: each exchange completes before the next is posted
        inbox = torch.empty(self._largest_message([[total(part) for part in parts]
                                                   for parts in self.push_serve_parts]),
                            dtype=reduce_dtype, device=grads.device)
        cast = grads.dtype != reduce_dtype
        staged = self._largest_message([[total(part) for part in parts if len(part) > 1 or cast]
                                        for parts in self.push_segments])
        staging = torch.empty(staged, dtype=reduce_dtype, device=grads.device) if staged else None
        for step in range(1, self.world_size):
            to, frm = (self.rank + step) % self.world_size, (self.rank - step) % self.world_size
            out_parts, in_parts = self.push_segments[to], self.push_serve_parts[frm]
            for part in range(max(len(out_parts), len(in_parts))):
                n_out = total(out_parts[part]) if part < len(out_parts) else 0
                n_in = total(in_parts[part]) if part < len(in_parts) else 0
                for c in range(0, max(n_out, n_in), self.chunk):
                    n_send, n_recv = max(0, min(self.chunk, n_out - c)), max(0, min(self.chunk, n_in - c))
                    sends, recvs = [], []
                    if n_send:
                        sends.append((gather_ranges(grads, out_parts[part], c, n_send, reduce_dtype, staging), to))
                        sent += n_send * size
                    if n_recv:
                        recvs.append((inbox[:n_recv], frm))
                        received += n_recv * size
                    comm.exchange(sends, recvs)
                    if n_recv:
                        for pos, off, n in pieces(in_parts[part], c, n_recv):
                            shard_grad[off:off + n].add_(inbox[pos - c:pos - c + n])
        layout.shard.grad = shard_grad
        return Traffic(grads_sent=sent, grads_received=received)


def gather_ranges(shard: torch.Tensor, ranges: Ranges, start: int, count: int, dtype: torch.dtype,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Elements [start, start + count) of the concatenation of ``ranges`` of ``shard``, contiguous, in ``dtype``:
    a view of the shard when that is one range already in ``dtype``, else written into ``out[:count]`` (a
    buffer of ``dtype`` with room for them) or, without ``out``, into a new tensor."""
    parts = [shard[off:off + n] for _, off, n in pieces(ranges, start, count)]
    if len(parts) == 1 and shard.dtype == dtype:
        return parts[0]
    if out is None:
        joined = parts[0] if len(parts) == 1 else torch.cat(parts)
        return joined.to(dtype).contiguous()
    if out.dtype != dtype or out.numel() < count:
        raise ValueError(f"the staging buffer ({out.dtype}, {out.numel()} elements) cannot hold {count} of {dtype}")
    pos = 0
    for piece in parts:
        out[pos:pos + piece.numel()].copy_(piece)
        pos += piece.numel()
    return out[:count]
