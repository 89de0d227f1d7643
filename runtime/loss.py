"""The causal-LM loss over packed micro-batches: each token's logits against the next token of the same
sequence, summed, and divided by the number of such pairs in the whole global batch, so that replicas of any
strategy add up to exactly the single-device mean loss and gradient."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["next_token_targets", "packed_causal_lm_loss_sum", "targets_loss_sum", "global_pair_count"]

IGNORE = -100


def next_token_targets(input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Targets for a packed batch: the next token, or IGNORE at each sequence's last token and in padding.
    Built without reading any value back to the host (no data-dependent shapes either): on a GPU the micro-batch
    loop never waits for the device."""
    total = input_ids.shape[0]
    targets = torch.full_like(input_ids, IGNORE)
    targets[:-1] = input_ids[1:]
    boundary = torch.zeros(total + 1, dtype=torch.bool, device=input_ids.device)
    boundary.index_fill_(0, cu_seqlens[1:].to(torch.long).clamp(max=total), True)  # a sequence starts (or ends)
    padding = torch.arange(total, device=input_ids.device) >= cu_seqlens[-1]
    return targets.masked_fill(boundary[1:] | padding, IGNORE)  # token i is last when a boundary is at i + 1


def packed_causal_lm_loss_sum(logits: torch.Tensor, input_ids: torch.Tensor,
                              cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over the pairs of a packed micro-batch (padding ignored)."""
    targets = next_token_targets(input_ids, cu_seqlens)
    return F.cross_entropy(logits[: targets.shape[0]].float(), targets, ignore_index=IGNORE, reduction="sum")


def targets_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy against given targets (IGNORE where a token has none: a sequence's last token,
    padding), for tokens whose next token is not beside them (context parallelism)."""
    return F.cross_entropy(logits[: targets.shape[0]].float(), targets, ignore_index=IGNORE, reduction="sum")


def global_pair_count(seq_lens: list[int]) -> int:
    """Next-token pairs in a global batch: ``sum(len - 1)``."""
    return sum(max(0, s - 1) for s in seq_lens)
