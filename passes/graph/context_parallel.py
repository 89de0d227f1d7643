"""Context parallelism (CP): the sequences of a micro-batch spread over the ranks of a CP group, attention exact.

Owns two things.

- The layout, decided on the host (:func:`cp_layout`): a sequence of at least ``split_at`` tokens is cut into
  ``2 * cp`` chunks and rank r holds chunks r and 2cp-1-r, so every rank gets the same causal attention work (the
  per-document sharding of Megatron-Core's CP and WLB-LLM); a shorter sequence goes whole to the rank with the
  least work so far (longest first). Each token keeps its position in its whole sequence (``positions``), which
  is what rotary or learned positions must read. A :class:`CpLayout` is plain data, the same on every rank.
- The attention over the group (:func:`cp_attention`): every rank all-gathers the keys and values of the group
  once per attention layer (``collectives.cp_all_gather``, padded to the widest rank; its backward sums every
  token's key and value gradient over the ranks that read it and leaves it with the rank that holds it), picks each
  query chunk's keys, its sequence from the start to the chunk's end (``index_select``, whose backward adds the
  copies back), and runs the packed kernel with key spans (causal aligned at the bottom right). All-gather, not a
  ring: with grouped-query attention K/V are a small part of the activations (Llama 3 makes the same choice),
  one collective per layer instead of cp - 1 dependent steps, and the backward is the kernel's own with no
  log-sum-exp merging; the price is every rank holding one whole sequence's K/V per layer during attention.

The index tensors (:class:`CpAttentionInputs`) are built once per micro-batch on the host and moved to the
device with the tokens: nothing here reads a device tensor back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

import codegen
from passes.graph.collectives import CP_ALL_GATHER

__all__ = ["CpPiece", "CpLayout", "CpAttentionInputs", "cp_layout", "cp_attention"]


@dataclass(frozen=True, slots=True)
class CpPiece:
    """Tokens ``start .. stop`` of sequence ``seq`` (an index into the layout's lengths)."""

    seq: int
    start: int
    stop: int

    @property
    def tokens(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class CpLayout:
    """Which pieces of which sequences each CP rank holds, in its local token order."""

    lengths: tuple[int, ...]
    """Every sequence's whole length."""
    ranks: tuple[tuple[CpPiece, ...], ...]
    """Per CP rank, its pieces in local order."""

    @property
    def cp(self) -> int:
        return len(self.ranks)

    @property
    def width(self) -> int:
        """Tokens of the widest rank: every rank's keys are padded to it for the all-gather."""
        return max((self.tokens(r) for r in range(self.cp)), default=0)

    def tokens(self, rank: int) -> int:
        return sum(p.tokens for p in self.ranks[rank])

    def positions(self, rank: int) -> list[int]:
        """Each local token's position in its whole sequence."""
        return [i for p in self.ranks[rank] for i in range(p.start, p.stop)]

    def token_ids(self, rank: int, sequences: Sequence[torch.Tensor]) -> torch.Tensor:
        """This rank's tokens, cut from the whole ``sequences`` (one 1-D tensor per sequence)."""
        parts = [sequences[p.seq][p.start:p.stop] for p in self.ranks[rank]]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)

    def gathered_rows(self) -> list[list[int]]:
        """Per sequence, the row of each of its tokens in the gathered (cp * width) key buffer."""
        rows: list[list[int]] = [[0] * n for n in self.lengths]
        for rank, pieces in enumerate(self.ranks):
            at = rank * self.width
            for p in pieces:
                rows[p.seq][p.start:p.stop] = range(at, at + p.tokens)
                at += p.tokens
        return rows


def cp_layout(lengths: Sequence[int], cp: int, split_at: int | None = None) -> CpLayout:
    """Spread sequences of ``lengths`` over ``cp`` ranks: those of at least ``split_at`` tokens (default: half a
    rank's even share, and never fewer than 2 * cp) in 2 * cp chunks, rank r taking chunks r and 2cp-1-r; the
    others whole, longest first, each to the rank with the least causal attention work so far."""
    if cp < 1:
        raise ValueError(f"cp={cp} must be >= 1")
    if any(n < 0 for n in lengths):
        raise ValueError(f"sequence lengths must be >= 0; got {list(lengths)}")
    if split_at is None:
        split_at = max(1, math.ceil(sum(lengths) / (2 * cp)))
    split_at = max(split_at, 2 * cp)
    pieces: list[list[CpPiece]] = [[] for _ in range(cp)]
    work = [0.0] * cp
    for seq in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[seq]
        if cp > 1 and n >= split_at:
            bounds = _chunk_bounds(n, 2 * cp)
            for rank in range(cp):
                for chunk in (rank, 2 * cp - 1 - rank):
                    piece = CpPiece(seq, bounds[chunk], bounds[chunk + 1])
                    pieces[rank].append(piece)
                    work[rank] += _causal_work(piece)
        elif n > 0:
            rank = min(range(cp), key=lambda r: (work[r], r))
            pieces[rank].append(CpPiece(seq, 0, n))
            work[rank] += _causal_work(CpPiece(seq, 0, n))
    ordered = tuple(tuple(sorted(p, key=lambda x: (x.seq, x.start))) for p in pieces)
    return CpLayout(lengths=tuple(int(n) for n in lengths), ranks=ordered)


def _chunk_bounds(n: int, chunks: int) -> list[int]:
    """Boundaries of ``chunks`` near-equal chunks, the longer ones first (so every chunk but the first has at
    least as many tokens before it as in it)."""
    base, extra = divmod(n, chunks)
    bounds = [0]
    for i in range(chunks):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def _causal_work(piece: CpPiece) -> float:
    """Query-key pairs a piece's rows attend: rows start..stop-1, each seeing its prefix."""
    return (piece.stop * (piece.stop + 1) - piece.start * (piece.start + 1)) / 2


@dataclass(frozen=True, slots=True)
class CpAttentionInputs:
    """One CP rank's index tensors for one micro-batch: which gathered rows are each query piece's keys."""

    key_rows: torch.Tensor
    """int64, the gathered key buffer's rows, piece by piece: each piece's sequence from 0 to its end."""
    cu_seqlens_q: torch.Tensor
    """int32 offsets of the local pieces (the query spans)."""
    cu_seqlens_k: torch.Tensor
    """int32 offsets into ``key_rows`` (the key spans)."""
    max_seqlen_q: int
    max_seqlen_k: int
    width: int
    """Rows each rank contributes to the gather (the widest rank's tokens)."""
    cp: int
    rank: int

    @classmethod
    def build(cls, layout: CpLayout, rank: int, device: torch.device | str = "cpu") -> "CpAttentionInputs":
        rows = layout.gathered_rows()
        pieces = layout.ranks[rank]
        key_rows = [r for p in pieces for r in rows[p.seq][:p.stop]]
        cu_q, cu_k = [0], [0]
        for p in pieces:
            cu_q.append(cu_q[-1] + p.tokens)
            cu_k.append(cu_k[-1] + p.stop)
        return cls(key_rows=torch.tensor(key_rows, dtype=torch.long, device=device),
                   cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
                   cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
                   max_seqlen_q=max((p.tokens for p in pieces), default=0),
                   max_seqlen_k=max((p.stop for p in pieces), default=0),
                   width=layout.width, cp=layout.cp, rank=rank)




def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: CpAttentionInputs, group: str, *,
                 softmax_scale: float | None = None, softcap: float | None = None,
                 kernel: str = "auto") -> torch.Tensor:
    """Causal attention of this CP rank's queries (T_local, heads, dim) over their whole sequences, whose keys
    and values are spread over the group named ``group``; differentiable in q, k and v (k and v's gradients
    include what the other ranks' queries contribute)."""
    k_all = CP_ALL_GATHER(k, group, inputs.width, inputs.cp, inputs.rank)
    v_all = CP_ALL_GATHER(v, group, inputs.width, inputs.cp, inputs.rank)
    keys = k_all.index_select(0, inputs.key_rows)
    values = v_all.index_select(0, inputs.key_rows)
    return codegen.packed_attention(q, keys, values, inputs.cu_seqlens_q, inputs.max_seqlen_q, causal=True,
                                    softmax_scale=softmax_scale, softcap=softcap, kernel=kernel, validate=False,
                                    cu_seqlens_k=inputs.cu_seqlens_k, max_seqlen_k=inputs.max_seqlen_k)
