"""Micro-batches as the executor runs them: whole sequences packed, or one context-parallel rank's share.

Owns :class:`MicroBatch` (the tensors a stage program takes and how the loss of its tokens is summed) and the two
ways of making one on the host: :func:`packed` (whole sequences concatenated, the next-token targets built on the
device from the offsets) and :func:`context_parallel` (the rank's share of the sequences,
``passes.graph.context_parallel.CpShare``, padded to the bucket every rank of its CP group shares; each token's
target is the next token of its whole sequence, so a piece's last token is scored against the first token of the
next piece, which another rank holds). Everything is built from the host batch, before the step's micro-batch
loop, and copied to the device once without the host waiting (:func:`to_device`: pinned host memory on a GPU);
no device value is read back.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from passes.graph.context_parallel import CpShare
from runtime.loss import IGNORE, VocabShard, packed_causal_lm_loss_sum, targets_loss_sum

__all__ = ["MicroBatch", "packed", "context_parallel", "to_device"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroBatch:
    """What one rank computes for one micro-batch."""

    ids: torch.Tensor
    """(T,) token ids on the device."""
    cu_seqlens: torch.Tensor
    """int32 offsets of the packed spans (the query spans under context parallelism)."""
    max_seqlen: int
    """The longest span (the padding's included under context parallelism), known on the host: it sizes the
    attention kernels' grid."""
    tokens: int
    """Real tokens this rank computes (padding left out)."""
    targets: torch.Tensor | None = None
    """(T,) next-token targets, IGNORE where none; None: built from the offsets (whole sequences)."""
    cp_inputs: tuple[torch.Tensor, ...] | None = None
    """Under context parallelism, the values of ``passes.graph.context_parallel.CP_INPUTS``."""

    def run(self, program, boundary: tuple) -> tuple:
        """The stage program's outputs for this micro-batch."""
        if self.cp_inputs is None:
            return program(self.ids, self.cu_seqlens, self.max_seqlen, boundary)
        return program(self.ids, self.cu_seqlens, self.max_seqlen, boundary, cp_inputs=self.cp_inputs)

    def loss_sum(self, logits: torch.Tensor, shard: VocabShard | None = None) -> torch.Tensor:
        """Summed next-token cross-entropy of this micro-batch's tokens (on the device). ``shard``: the logits
        hold only this TP rank's vocabulary columns (``runtime.loss.vocab_shard_of`` the stage program; the loss
        is then assembled over the TP group, the same on each of its ranks); None: the whole vocabulary."""
        if self.targets is None:
            return packed_causal_lm_loss_sum(logits, self.ids, self.cu_seqlens, shard)
        return targets_loss_sum(logits, self.targets, shard)


def packed(batch: Sequence[torch.Tensor], indices: Sequence[int], device: torch.device) -> MicroBatch:
    """Whole sequences ``indices`` of the host ``batch``, concatenated."""
    seqs = [batch[i] for i in indices]
    lengths = [int(t.numel()) for t in seqs]  # host tensors: no device read
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    ids, cu = to_device([torch.cat([t.cpu() for t in seqs]), cu], device)
    return MicroBatch(ids=ids, cu_seqlens=cu, max_seqlen=max(lengths), tokens=sum(lengths))


def context_parallel(batch: Sequence[torch.Tensor], indices: Sequence[int], cp: int, cp_rank: int,
                     bucket: Callable[[int], int], device: torch.device) -> MicroBatch:
    """CP rank ``cp_rank``'s share of sequences ``indices`` spread over ``cp`` ranks, padded to
    ``bucket(widest rank's tokens)`` (the same on every rank of the group, as the all-gather needs)."""
    share = CpShare.build([batch[i] for i in indices], cp, cp_rank, bucket, ignore=IGNORE)
    ids, cu, targets, *cp_inputs = to_device([share.ids, share.inputs.cu_seqlens_q, share.next_ids, share.positions,
                                              share.inputs.key_rows, share.inputs.cu_seqlens_k], device)
    return MicroBatch(ids=ids, cu_seqlens=cu,
                      max_seqlen=share.inputs.max_seqlen_q,
                      tokens=share.tokens, targets=targets, cp_inputs=tuple(cp_inputs))


def to_device(host: Sequence[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Host tensors on ``device`` without the host waiting for the device: on the CPU themselves; on a GPU each
    copied from pinned memory with a non-blocking copy (from pageable memory that copy would block, as
    ``new_tensor`` or a plain ``.to`` does; the pinned block is not reused before the copy is done); on any other
    device a non-blocking copy."""
    device = torch.device(device)
    if device.type == "cpu":
        return [t.cpu() for t in host]
    if device.type == "cuda":
        return [t.pin_memory().to(device, non_blocking=True) for t in host]
    return [t.to(device, non_blocking=True) for t in host]
