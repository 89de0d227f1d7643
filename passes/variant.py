"""Variants: the compiled callable for one (scheme, pipeline stage, token bucket) and what it expects.

Owns :class:`TokenBuckets` (total tokens are padded up to a bucket so that varying lengths reuse one
compiled graph), :class:`VariantKey`, :class:`Variant` and :func:`build_variant`, which runs the rewrite
passes on a graph captured at the bucket's size (tensor parallel, then packed attention, then the pipeline
split) and compiles the stage once with ``torch.compile`` (static token count, dynamic sequence count).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import fx

from passes.ir import ParallelScheme
from passes.packed_attention import rewrite_packed_attention_pass
from passes.pass_runner import PassContext, PassRecord, run_passes

__all__ = ["TokenBuckets", "VariantKey", "Variant", "build_variant", "CompileCounter"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenBuckets:
    """Allowed token counts of one micro-batch, ascending; a batch is padded up to the next bucket."""

    sizes: tuple[int, ...]
    """Bucket sizes in tokens, strictly ascending."""

    def __post_init__(self) -> None:
        if not self.sizes or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in self.sizes):
            raise ValueError(f"bucket sizes must be positive integers, got {self.sizes!r}")
        if list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"bucket sizes must be strictly ascending, got {self.sizes!r}")

    @classmethod
    def powers_of_two(cls, smallest: int, largest: int) -> "TokenBuckets":
        """Buckets ``smallest, 2*smallest, ...`` up to and including the first >= ``largest``."""
        sizes = [smallest]
        while sizes[-1] < largest:
            sizes.append(sizes[-1] * 2)
        return cls(sizes=tuple(sizes))

    def bucket_for(self, tokens: int) -> int:
        """The smallest bucket that holds ``tokens``; more than the largest is an error quoting both."""
        i = bisect.bisect_left(self.sizes, tokens)
        if i == len(self.sizes):
            raise ValueError(f"{tokens} tokens exceed the largest bucket {self.sizes[-1]}")
        return self.sizes[i]
