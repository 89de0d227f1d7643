"""Shared helpers for the codegen tests: packed batches and an independent dense masked attention."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class PackedBatch:
    """q, k, v of a packed batch with its offsets (leaf tensors that require grad)."""

    q: torch.Tensor
    """(total_tokens, heads_q, head_dim)."""
    k: torch.Tensor
    """(total_tokens, heads_kv, head_dim)."""
    v: torch.Tensor
    """(total_tokens, heads_kv, head_dim)."""
    cu_seqlens: torch.Tensor
    """int32 (num_seqs + 1)."""
    max_seqlen: int
    """Longest sequence length."""

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        return self.q, self.k, self.v, self.cu_seqlens, self.max_seqlen


def make_batch(
    lengths: list[int], *, heads_q: int, heads_kv: int, head_dim: int, dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PackedBatch:
    """A packed batch of random q, k, v for sequences of the given lengths (zeros allowed)."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def leaf(heads: int) -> torch.Tensor:
        return torch.randn(total, heads, head_dim, generator=generator).to(dtype).requires_grad_()

    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return PackedBatch(q=leaf(heads_q), k=leaf(heads_kv), v=leaf(heads_kv), cu_seqlens=cu_seqlens,
                       max_seqlen=max(lengths, default=0))


def dense_masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *, causal: bool, scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Naive attention over the whole packed batch with a (T x T) block-diagonal (causal) mask, in float64.

    Independent of codegen: one dense score matrix, a mask built from per-token sequence ids, and autograd.
    """
    total, heads_q, _ = q.shape
    group = heads_q // k.shape[1]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq_id = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # (T,)
    mask = seq_id[:, None] == seq_id[None, :]
    if causal:
        position = torch.arange(total)
        mask &= position[None, :] <= position[:, None]
    q64 = q.double().permute(1, 0, 2)  # (heads_q, T, d)
    k64 = k.double().permute(1, 0, 2).repeat_interleave(group, dim=0)
    v64 = v.double().permute(1, 0, 2).repeat_interleave(group, dim=0)
    scores = (q64 @ k64.transpose(1, 2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (probs @ v64).permute(1, 0, 2)  # (T, heads_q, d)


def relative_error(actual: torch.Tensor, expected: torch.Tensor, *, floor: float = 1e-2) -> float:
    """max |actual - expected| / max(max |expected|, floor).

    The floor keeps vanishing values comparable: a one-token sequence's dq is exactly 0 in exact arithmetic, so
    both sides are rounding noise around 1e-8 and only an absolute comparison means anything.
    """
    if expected.numel() == 0:
        return 0.0
    scale = max(expected.double().abs().max().item(), floor)
    return (actual.double() - expected.double()).abs().max().item() / scale


def segment_leaves(queries: list[int], keys: list[int], *, heads_q: int, heads_kv: int, head_dim: int, seed: int,
                   sinks: bool = False) -> tuple:
    """q for query spans ``queries``, k and v for key spans ``keys`` (leaves that require grad), and one sink logit
    per query head when ``sinks`` (else None)."""
    g = torch.Generator().manual_seed(seed)

    def leaf(*shape) -> torch.Tensor:
        return torch.randn(*shape, generator=g).requires_grad_()

    q = leaf(sum(queries), heads_q, head_dim)
    k, v = leaf(sum(keys), heads_kv, head_dim), leaf(sum(keys), heads_kv, head_dim)
    s = (2.0 * torch.randn(heads_q, generator=g)).requires_grad_() if sinks else None
    return q, k, v, s


def segment_oracle(q, k, v, queries: list[int], keys: list[int], *, scale: float, causal: bool = True,
                   window: int | None = None, chunk: int | None = None, sinks=None) -> torch.Tensor:
    """Dense float64 attention per segment, plain autograd: query row r of Lq rows stands at position
    r + Lk - Lq of its sequence, key c at c; (causal) visible iff c <= position, position - c <= window and
    position // chunk == c // chunk; a sink is one more logit with no value."""
    group = q.shape[1] // k.shape[1]
    outs, q_at, k_at = [], 0, 0
    for lq, lk in zip(queries, keys):
        qs = q[q_at:q_at + lq].double().transpose(0, 1)  # (H, lq, d)
        ks = k[k_at:k_at + lk].double().repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[k_at:k_at + lk].double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) * scale  # (H, lq, lk)
        if causal:
            position = torch.arange(lk - lq, lk)[:, None]
            key = torch.arange(lk)[None, :]
            hidden = key > position
            if window is not None:
                hidden |= position - key > window
            if chunk is not None:
                hidden |= position // chunk != key // chunk
            scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None, None].expand(-1, lq, 1)], dim=-1)
        outs.append((torch.softmax(scores, dim=-1)[..., :lk] @ vs).transpose(0, 1))
        q_at, k_at = q_at + lq, k_at + lk
    return torch.cat(outs).float()
