"""Kernel specs: the small frozen description from which the Triton packed-attention kernels are generated.

A ``KernelSpec`` fixes everything a kernel is specialised on (head dim, dtype, causal, GQA group size, block
sizes, warps, stages).  ``spec_space`` returns the autotune space for one problem, pruned by what the problem
allows (block sizes against shared-memory use by head dim and dtype); under the Triton interpreter it returns a
single spec with small fixed blocks.  This module imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

TRITON_HEAD_DIMS: tuple[int, ...] = (16, 32, 64, 128, 256)
"""Head dims the Triton kernels are generated for (powers of two: ``tl.arange`` needs them)."""

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
"""Element types of q, k and v that both kernels accept."""

MAX_REFERENCE_HEAD_DIM = 256
"""The reference kernel accepts any head dim from 1 up to this."""

INTERPRETER_BLOCK = 16
"""Block size (rows and columns) used under ``TRITON_INTERPRET=1``: the smallest ``tl.dot`` accepts."""

_SHARED_MEMORY_BUDGET_BYTES = 220 * 1024
"""Per-program shared-memory budget used to prune the autotune space (H100/H200 allow 227 KiB per block)."""

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelSpec:
    """Everything one generated packed-attention kernel is specialised on."""

    head_dim: int
    """Size of each head's vectors; a power of two in ``TRITON_HEAD_DIMS``."""
    dtype: torch.dtype
    """Element type of q, k, v and of the output."""
    causal: bool
    """Whether query i of a sequence sees only keys j <= i of the same sequence."""
    group_size: int
    """Query heads per key/value head (1: multi-head, heads_q: multi-query)."""
    block_m: int
    """Query rows per program."""
    block_n: int
    """Key/value rows per inner-loop step."""
    num_warps: int = 4
    """Warps per program (ignored by the interpreter)."""
    num_stages: int = 1
    """Software-pipelining stages of the inner loop (ignored by the interpreter)."""
    upcast_operands: bool = False
    """Cast loaded tiles to fp32 before ``tl.dot``; needed for bf16 under the interpreter, whose dot is wrong."""

    def __post_init__(self) -> None:
        if self.head_dim not in TRITON_HEAD_DIMS:
            raise ValueError(f"head_dim={self.head_dim} is not one of the Triton head dims {TRITON_HEAD_DIMS}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype={self.dtype} is not one of {SUPPORTED_DTYPES}")
        if self.group_size < 1:
            raise ValueError(f"group_size={self.group_size} must be >= 1")
        for name in ("block_m", "block_n"):
            size = getattr(self, name)
            if size < 16 or size & (size - 1):
                raise ValueError(f"{name}={size} must be a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} must be a power of two up to 16")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")

    @property
    def element_bytes(self) -> int:
        """Bytes per element of ``dtype``."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def ieee_dot(self) -> bool:
        """fp32 inputs use exact fp32 products (no TF32) so that results match the reference to 1e-4."""
        return self.dtype == torch.float32

    def shared_memory_bytes(self) -> int:
        """Estimated shared memory of the heaviest kernel (dk/dv backward): q, dout, k, v tiles plus one
        (block_m x block_n) tile; fp32 tiles count twice (exact-fp32 dots stage their operands twice).

        Checked against sm_90 compiles with Triton 3.9 (64 x 64 blocks, measured / estimated): fp16 d64 34/41 KiB,
        fp16 d128 65/72 KiB, fp32 d64 113/144 KiB, fp32 d128 209/272 KiB.  The autotuner also skips any config
        that still runs out of resources, so this only prunes what cannot fit.
        """
        operand_bytes = self.element_bytes * (2 if self.dtype == torch.float32 else 1)
        tiles = self.head_dim * operand_bytes * (2 * self.block_m + 2 * self.block_n)
        return tiles + self.block_m * self.block_n * self.element_bytes

    def describe(self) -> str:
        """A stable one-line name, e.g. ``d64-bf16-causal-g4-m128n64-w8s2``."""
        mask = "causal" if self.causal else "full"
        return (
            f"d{self.head_dim}-{_DTYPE_NAMES[self.dtype]}-{mask}-g{self.group_size}"
            f"-m{self.block_m}n{self.block_n}-w{self.num_warps}s{self.num_stages}"
            + ("-upcast" if self.upcast_operands else "")
        )


def interpreter_spec(*, head_dim: int, dtype: torch.dtype, causal: bool, group_size: int) -> KernelSpec:
    """The single spec used under ``TRITON_INTERPRET=1``: small fixed blocks keep CPU runs short."""
    return KernelSpec(
        head_dim=head_dim,
        dtype=dtype,
        causal=causal,
        group_size=group_size,
        block_m=INTERPRETER_BLOCK,
        block_n=INTERPRETER_BLOCK,
        num_warps=1,
        num_stages=1,
        upcast_operands=dtype == torch.bfloat16,
    )


def spec_space(
    *, head_dim: int, dtype: torch.dtype, causal: bool, group_size: int, interpret: bool
) -> tuple[KernelSpec, ...]:
    """The autotune space for one problem, pruned by head dim and dtype; one small spec under the interpreter."""
    base = interpreter_spec(head_dim=head_dim, dtype=dtype, causal=causal, group_size=group_size)
    if interpret:
        return (base,)
    base = replace(base, upcast_operands=False)
    candidates = [
        replace(base, block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
        for block_m in (64, 128)
        for block_n in (32, 64, 128)
        for warps in (4, 8)
        for stages in (1, 2, 3)
    ]
    fits = [spec for spec in candidates if _worth_trying(spec)]
    return tuple(fits) if fits else (replace(base, num_warps=4),)


def _worth_trying(spec: KernelSpec) -> bool:
    """Keep a config only if it fits in shared memory and its shape suits its tile sizes."""
    if spec.shared_memory_bytes() > _SHARED_MEMORY_BUDGET_BYTES:
        return False
    if spec.block_n > spec.block_m or (spec.block_n == 128 and spec.head_dim > 64):
        return False  # wide key tiles only pay off with short heads
    if (spec.num_warps == 8) != (spec.block_m == 128):
        return False  # 8 warps for 128-row tiles, 4 for 64-row tiles
    if spec.dtype == torch.float32:
        return spec.num_stages == 1 and spec.block_m == 64  # fp32 tiles are large: no pipelining
    return spec.num_stages in (2, 3)
