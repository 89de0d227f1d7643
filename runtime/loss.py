"""The causal-LM loss over packed micro-batches: each token's logits against the next token of the same
sequence, summed, and divided by the number of such pairs in the whole global batch, so that replicas of any
strategy add up to exactly the single-device mean loss and gradient.

Also owns the vocabulary-parallel cross-entropy (:func:`vocab_parallel_loss_sum`, :class:`VocabShard`): when a
tensor-parallel LM head leaves its logits split by vocabulary over the TP group (``Lowering.vocab_range``), each
rank holds (T, V/tp) columns and the loss is assembled with two all-reduces of (T,)-sized values, never the whole
(T, V) logits; :func:`vocab_shard_of` reads the split from a stage program.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from passes.graph.collectives import all_reduce_tensor

__all__ = ["next_token_targets", "packed_causal_lm_loss_sum", "targets_loss_sum", "global_pair_count",
           "VocabShard", "vocab_shard_of", "vocab_parallel_loss_sum", "IGNORE"]

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


def packed_causal_lm_loss_sum(logits: torch.Tensor, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                              shard: "VocabShard | None" = None) -> torch.Tensor:
    """Sum of next-token cross-entropy over the pairs of a packed micro-batch (padding ignored). ``shard``: the
    logits hold only this TP rank's vocabulary columns (:func:`vocab_parallel_loss_sum`); None: every column."""
    return targets_loss_sum(logits, next_token_targets(input_ids, cu_seqlens), shard)


def targets_loss_sum(logits: torch.Tensor, targets: torch.Tensor, shard: "VocabShard | None" = None) -> torch.Tensor:
    """Sum of cross-entropy against given targets (IGNORE where a token has none: a sequence's last token,
    padding), for tokens whose next token is not beside them (context parallelism). ``shard`` as in
    :func:`packed_causal_lm_loss_sum`."""
    if shard is not None:
        return vocab_parallel_loss_sum(logits[: targets.shape[0]], targets, shard)
    return F.cross_entropy(logits[: targets.shape[0]].float(), targets, ignore_index=IGNORE, reduction="sum")


@dataclass(frozen=True, slots=True, kw_only=True)
class VocabShard:
    """Where this rank's logits sit in a vocabulary split over a tensor-parallel group: columns
    ``[start, stop)`` of the whole vocabulary, the other ranks of ``group`` holding the rest (disjoint ranges
    covering it; they need not be equal, so a vocabulary that is not a multiple of tp is fine)."""

    start: int
    """First vocabulary id of this rank's columns."""
    stop: int
    """One past the last."""
    group: str
    """The TP process group's name (``group_name``, resolved as ``passes.graph.collectives`` does)."""

    def __post_init__(self) -> None:
        for name in ("start", "stop"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"VocabShard.{name} must be an int, got {value!r}")
        if not 0 <= self.start < self.stop:
            raise ValueError(f"a vocabulary shard needs 0 <= start < stop, got [{self.start}, {self.stop})")
        if not isinstance(self.group, str) or not self.group:
            raise ValueError(f"VocabShard.group must be a process group's name, got {self.group!r}")

    @property
    def width(self) -> int:
        """Columns this rank holds."""
        return self.stop - self.start


def vocab_shard_of(program: Any) -> VocabShard | None:
    """The vocabulary split of a last-stage program's logits: a :class:`VocabShard` when its lowering's
    ``vocab_range`` is set (``passes.graph.lowering.Lowering``; the program's ``tp_group`` is the group), else
    None (the logits hold the whole vocabulary). A program without a lowering (a test's stand-in) has none."""
    lowering = getattr(program, "lowering", None)
    vocab_range = getattr(lowering, "vocab_range", None)
    if vocab_range is None:
        return None
    group = getattr(program, "tp_group", None)
    if group is None:
        raise ValueError(f"{lowering.describe()}: its logits are split by vocabulary {tuple(vocab_range)} but the "
                         "program names no tensor-parallel group to assemble the loss over")
    start, stop = vocab_range
    return VocabShard(start=start, stop=stop, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy summed over tokens, the logits split by vocabulary over a TP group. Forward (fp32): the max
    over the whole vocabulary (all-reduce MAX of (T,)), then the sum of exponentials and the target's logit
    (from the rank whose columns hold it, zero elsewhere) in one all-reduce SUM of (2, T); the same loss on every
    rank. Backward: this rank's columns of ``softmax - onehot(target)`` times the incoming gradient, rows of
    ignored targets zero, with no communication. Keeps one fp32 (T, V/tp) tensor for the backward (the local
    softmax, made in place from the one fp32 copy of the logits) and overwrites it there, so the graph can be
    differentiated once (a second backward is refused)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, start: int, group: str) -> torch.Tensor:
        width = logits.shape[-1]
        with torch.no_grad():
            row_max = logits.max(dim=-1).values.float()  # on the logits' own dtype: no copy
            row_max = all_reduce_tensor(row_max, group, "max")
            probs = logits.to(torch.float32, copy=True)  # the one fp32 (T, V/tp) tensor
            probs.sub_(row_max.unsqueeze(-1)).exp_()
            local = targets - start
            valid = targets != IGNORE
            mine = valid & (local >= 0) & (local < width)
            local = local.masked_fill(~mine, 0)
            picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).float().masked_fill(~mine, 0.0)
            sums = torch.stack([probs.sum(dim=-1), picked])
            sums = all_reduce_tensor(sums, group, "sum")
            sum_exp, target_logit = sums[0], sums[1]
            losses = (sum_exp.log() + row_max - target_logit).masked_fill(~valid, 0.0)
            probs.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(probs, local, mine, valid)
        ctx.dtype = logits.dtype
        ctx.used = False
        return losses.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.used:
            raise RuntimeError("the vocabulary-parallel cross-entropy overwrites its saved softmax in the backward: "
                               "it can be differentiated once (retain_graph=True and a second backward is refused)")
        ctx.used = True
        probs, local, mine, valid = ctx.saved_tensors
        probs.scatter_add_(-1, local.unsqueeze(-1), -mine.to(probs.dtype).unsqueeze(-1))  # - onehot, own columns
        probs.mul_((valid.to(probs.dtype) * grad.to(probs.dtype)).unsqueeze(-1))
        return probs.to(ctx.dtype), None, None, None


def vocab_parallel_loss_sum(logits: torch.Tensor, targets: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Sum over tokens of the cross-entropy of ``targets`` (T,) (IGNORE: not scored) against logits split by
    vocabulary: ``logits`` (T, shard.width) are this rank's columns ``[shard.start, shard.stop)``, the other
    ranks of ``shard.group`` hold the rest. Computed in fp32 whatever the logits' dtype; equals
    ``F.cross_entropy(whole_logits.float(), targets, ignore_index=IGNORE, reduction="sum")`` on every rank of
    the group, and its gradient is this rank's columns of that loss's gradient. Collective over the group (two
    all-reduces of (T,)-sized fp32 values). A target outside the whole vocabulary is not detected here (no host
    read; the trainer checks token ids on the host)."""
    if logits.dim() != 2 or logits.shape[-1] != shard.width:
        raise ValueError(f"vocabulary-parallel loss: logits must be (tokens, {shard.width}) for columns "
                         f"[{shard.start}, {shard.stop}), got {tuple(logits.shape)}")
    if targets.shape != logits.shape[:1]:
        raise ValueError(f"vocabulary-parallel loss: targets must be ({logits.shape[0]},) like the logits' rows, "
                         f"got {tuple(targets.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"vocabulary-parallel loss: logits must be floating point, got {logits.dtype}")
    return _VocabParallelCrossEntropy.apply(logits, targets.to(torch.long), shard.start, shard.group)


def global_pair_count(seq_lens: list[int]) -> int:
    """Next-token pairs in a global batch: ``sum(len - 1)``."""
    return sum(max(0, s - 1) for s in seq_lens)
