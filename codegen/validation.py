"""Input contract of packed attention: every check raises a ValueError that quotes the bad value.

``check_layout`` looks only at metadata (dims, dtypes, devices, head counts) and is safe to run while
torch.compile traces.  ``check_offsets`` reads the values of ``cu_seqlens`` and therefore runs inside the op's
real implementation, before any kernel is launched.
"""

from __future__ import annotations

import torch

from codegen.spec import MAX_REFERENCE_HEAD_DIM, SUPPORTED_DTYPES, TRITON_HEAD_DIMS

KERNELS: tuple[str, ...] = ("auto", "triton", "cpu-flash", "reference")
"""Accepted values of ``kernel`` in ``packed_attention``."""

RESOLVED_KERNELS: tuple[str, ...] = ("triton", "cpu-flash", "reference")
"""Backends the custom op itself runs ("auto" is resolved by ``packed_attention`` before the op is called)."""


def check_kernel(kernel: str) -> None:
    """Reject an unknown kernel name."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}")


def check_layout(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    kernel: str,
    separate_keys: bool = False,
) -> None:
    """Validate shapes, dtypes, devices and head counts for a resolved kernel (no tensor values are read).
    ``separate_keys``: the keys have their own offsets, so their token count may differ from the queries'."""
    if kernel not in RESOLVED_KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {RESOLVED_KERNELS}; resolve 'auto' first")
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.dim() != 3:
            raise ValueError(f"{name} must be (total_tokens, heads, head_dim); got shape {tuple(tensor.shape)}")
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}.dtype={tensor.dtype} is not one of {SUPPORTED_DTYPES}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device == cu_seqlens.device):
        raise ValueError(f"devices differ: q {q.device}, k {k.device}, v {v.device}, cu_seqlens {cu_seqlens.device}")
    if kernel == "cpu-flash" and q.device.type != "cpu":
        raise ValueError(f"kernel='cpu-flash' runs on the CPU only; the tensors are on {q.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.shape[0] != q.shape[0] and not separate_keys:
        raise ValueError(f"q has {q.shape[0]} tokens but k and v have {k.shape[0]}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q head_dim={q.shape[2]} differs from k/v head_dim={k.shape[2]}")
    _check_heads(q.shape[1], k.shape[1])
    _check_head_dim(q.shape[2], kernel)
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens.dtype={cu_seqlens.dtype}; it must be torch.int32")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be 1-D with num_seqs + 1 >= 1 entries; got shape {tuple(cu_seqlens.shape)}")
    if max_seqlen < 0:
        raise ValueError(f"max_seqlen={max_seqlen} must be >= 0")


def _check_heads(heads_q: int, heads_kv: int) -> None:
    if heads_kv < 1 or heads_q < 1:
        raise ValueError(f"head counts must be >= 1; got heads_q={heads_q}, heads_kv={heads_kv}")
    if heads_q % heads_kv != 0:
        raise ValueError(f"heads_q={heads_q} is not a multiple of heads_kv={heads_kv}")


def _check_head_dim(head_dim: int, kernel: str) -> None:
    if kernel in ("reference", "cpu-flash"):
        if not 1 <= head_dim <= MAX_REFERENCE_HEAD_DIM:
            raise ValueError(f"head_dim={head_dim} is outside 1..{MAX_REFERENCE_HEAD_DIM}")
    elif head_dim not in TRITON_HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} is not supported by the Triton kernels; use one of {TRITON_HEAD_DIMS}")


def check_offsets(cu_seqlens: torch.Tensor, total_tokens: int, max_seqlen: int) -> list[int]:
    """Validate the values of ``cu_seqlens`` against the packed batch; returns them as a host list."""
    offsets = [int(x) for x in cu_seqlens.tolist()]
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens[0]={offsets[0]}; it must be 0")
    lengths = [end - start for start, end in zip(offsets[:-1], offsets[1:])]
    for index, length in enumerate(lengths):
        if length < 0:
            raise ValueError(
                f"cu_seqlens is not non-decreasing: cu_seqlens[{index}]={offsets[index]} > "
                f"cu_seqlens[{index + 1}]={offsets[index + 1]}"
            )
    if offsets[-1] != total_tokens:
        raise ValueError(f"cu_seqlens[-1]={offsets[-1]} but the packed batch has total_tokens={total_tokens}")
    longest = max(lengths, default=0)
    if longest > max_seqlen:
        raise ValueError(f"max_seqlen={max_seqlen} is below the longest sequence in cu_seqlens ({longest})")
    return offsets


def check_key_offsets(cu_seqlens_k: torch.Tensor, total_keys: int, max_seqlen_k: int | None, offsets: list[int],
                      causal: bool) -> list[int]:
    """Validate the keys' own offsets against the queries' (validated) ``offsets``: one key span per query span,
    and every query row sees at least one key (causal: each key span at least as long as its query span, whose
    last row is aligned with the last key)."""
    if cu_seqlens_k.dtype != torch.int32 or cu_seqlens_k.dim() != 1:
        raise ValueError(f"cu_seqlens_k must be 1-D torch.int32; got {cu_seqlens_k.dtype} of shape "
                         f"{tuple(cu_seqlens_k.shape)}")
    if max_seqlen_k is None:
        raise ValueError("cu_seqlens_k is given without max_seqlen_k")
    keys = check_offsets(cu_seqlens_k, total_keys, max_seqlen_k)
    if len(keys) != len(offsets):
        raise ValueError(f"cu_seqlens_k has {len(keys) - 1} key spans but cu_seqlens has {len(offsets) - 1} "
                         "query spans; they must pair up")
    for index, (queries, span) in enumerate(zip(_lengths(offsets), _lengths(keys))):
        least = queries if causal else min(queries, 1)
        if span < least:
            raise ValueError(f"span {index} has {queries} queries but {span} keys; "
                             f"{'causal attention' if causal else 'attention'} needs at least {least}")
    return keys


def _lengths(offsets: list[int]) -> list[int]:
    return [end - start for start, end in zip(offsets[:-1], offsets[1:])]


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """Sink logits, when given: one floating-point value per query head, on q's device."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or sinks.shape[0] != q.shape[1]:
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sinks must be a 1-D tensor of one logit per query head ({q.shape[1]}), got {shape}")
    if not sinks.dtype.is_floating_point:
        raise ValueError(f"sinks.dtype={sinks.dtype}; it must be a floating-point dtype")
    if sinks.device != q.device:
        raise ValueError(f"sinks are on {sinks.device} but q is on {q.device}")
