"""The causal-LM loss over packed micro-batches: each token's logits against the next token of the same
sequence, summed, and divided by the number of such pairs in the whole global batch, so that replicas of any
strategy add up to exactly the single-device mean loss and gradient."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["next_token_targets", "packed_causal_lm_loss_sum", "global_pair_count"]

IGNORE = -100


def next_token_targets(input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Targets for a packed batch: the next token, or IGNORE at each sequence's last token and in padding."""
    targets = torch.full_like(input_ids, IGNORE)
    targets[:-1] = input_ids[1:]
    ends = cu_seqlens[1:].to(torch.long) - 1
    ends = ends[ends >= 0]
    targets[ends] = IGNORE
    targets[int(cu_seqlens[-1]):] = IGNORE
    return targets


def packed_causal_lm_loss_sum(logits: torch.Tensor, input_ids: torch.Tensor,
                              cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over the pairs of a packed micro-batch (padding ignored)."""
    targets = next_token_targets(input_ids, cu_seqlens)
    return F.cross_entropy(logits[: targets.shape[0]].float(), targets, ignore_index=IGNORE, reduction="sum")


def global_pair_count(seq_lens: list[int]) -> int:
    """Next-token pairs in a global batch: ``sum(len - 1)``."""
    return sum(max(0, s - 1) for s in seq_lens)
