"""The packed-attention custom op (``hydraulis::packed_attention``) and its public entry point.

Two ``torch.library`` custom ops, forward and backward, each with a fake implementation so that
``torch.compile(fullgraph=True)`` captures them without a graph break; the forward's autograd formula calls the
backward op.  ``max_seqlen`` is a ``SymInt`` in both schemas, so with dynamic shapes it is a symbol like the
token and sequence counts and new lengths do not recompile.  The real implementations validate the values of
``cu_seqlens`` on the CPU kernels (a ValueError, before any kernel runs) and dispatch to the Triton kernels, to
PyTorch's fused CPU flash kernel or to the plain-torch reference, as the already resolved ``kernel`` string
says. The Triton path never reads the offsets back to the host (on a GPU that would stall every call):
``packed_attention`` checks host offsets before the call, and the runtime builds its own on the host.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from codegen.cpu_flash import cpu_flash_backward, cpu_flash_forward
from codegen.reference import check_limits, reference_backward, reference_forward
from codegen.triton_launch import triton_backward, triton_forward
from codegen.validation import check_kernel, check_key_offsets, check_layout, check_offsets, check_sinks

_FORWARD_NAME = "hydraulis::packed_attention"
_BACKWARD_NAME = "hydraulis::packed_attention_backward"


@torch.library.custom_op(_FORWARD_NAME, mutates_args=())
def packed_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool,
    softmax_scale: float,
    softcap: float | None,
    kernel: str,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
    window: int = -1,
    chunk: int = 0,
    sinks: torch.Tensor | None = None,
    seqlen_grid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed attention forward on one kernel ("triton", "cpu-flash" or "reference"); returns (out, lse).
    PyTorch's CPU flash kernel has no score cap: with ``softcap`` the CPU runs the reference. ``softcap`` is None
    when there is no cap (not 0.0: a float constant would make dynamo restart its analysis to tensorify it).
    ``cu_seqlens_k`` / ``max_seqlen_k`` (None: the queries'): the keys' own spans, causal aligned bottom right.
    ``window`` (-1: none), ``chunk`` (0: none), ``sinks`` (heads_q,): limited attention and sink logits
    (``codegen.reference``); ``lse`` then includes the sinks. ``seqlen_grid``: a 0-d host tensor holding this
    call's longest span (at most ``max_seqlen``), read on the host to size the Triton grid; a tensor, so that a
    compiled graph takes a new value without recompiling."""
    softcap = softcap or 0.0
    check_layout(q, k, v, cu_seqlens, max_seqlen, kernel, separate_keys=cu_seqlens_k is not None)
    limits = _limits(window, chunk, sinks)
    if kernel == "triton":  # the offsets are not read back: on a GPU that would synchronise every call
        return triton_forward(q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=softmax_scale,
                              softcap=softcap, cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k, **limits,
                              grid_seqlen=grid_length(seqlen_grid, max_seqlen))
    offsets, offsets_k = _host_offsets(q, k, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k, causal)
    if kernel == "cpu-flash" and not softcap:
        return cpu_flash_forward(q, k, v, offsets, causal=causal, softmax_scale=softmax_scale, offsets_k=offsets_k,
                                 **limits)
    return reference_forward(q, k, v, offsets, causal=causal, softmax_scale=softmax_scale, softcap=softcap,
                             offsets_k=offsets_k, **limits)


def host_length(value: int) -> torch.Tensor:
    """A length as a 0-d int64 tensor that lives on the host (``max_seqlen`` for a compiled graph): reading it
    never waits on a device; it is marked ``_host_only`` so that checks counting host reads of device values
    leave it out."""
    length = torch.tensor(int(value), dtype=torch.int64)
    length._host_only = True  # type: ignore[attr-defined]
    return length


def grid_length(seqlen_grid: torch.Tensor | None, max_seqlen: int) -> int | None:
    """The value of a host ``seqlen_grid`` (None when not given), checked: 0 <= value <= ``max_seqlen``."""
    if seqlen_grid is None:
        return None
    value = int(seqlen_grid)  # a host tensor: no device synchronisation
    if not 0 <= value <= max_seqlen:
        raise ValueError(f"seqlen_grid={value} must be in [0, max_seqlen={max_seqlen}]")
    return value


def _limits(window: int, chunk: int, sinks: torch.Tensor | None) -> dict[str, Any]:
    """The op's encoded limits as the kernels take them (None where absent)."""
    return {"window": None if window < 0 else window, "chunk": chunk or None, "sinks": sinks}


def _host_offsets(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                  cu_seqlens_k: torch.Tensor | None, max_seqlen_k: int | None,
                  causal: bool) -> tuple[list[int], list[int] | None]:
    """The CPU kernels' validated host offsets of the queries and, when given, of the keys."""
    offsets = check_offsets(cu_seqlens, q.shape[0], max_seqlen)  # the CPU kernels loop over them anyway
    if cu_seqlens_k is None:
        return offsets, None
    return offsets, check_key_offsets(cu_seqlens_k, k.shape[0], max_seqlen_k, offsets, causal)


@packed_attention_op.register_fake
def _packed_attention_fake(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, softcap, kernel,
                           cu_seqlens_k=None, max_seqlen_k=None, window=-1, chunk=0, sinks=None, seqlen_grid=None):
    out = torch.empty_like(q)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, lse


@torch.library.custom_op(_BACKWARD_NAME, mutates_args=())
def packed_attention_backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool,
    softmax_scale: float,
    softcap: float | None,
    kernel: str,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
    window: int = -1,
    chunk: int = 0,
    sinks: torch.Tensor | None = None,
    seqlen_grid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of packed attention for (q, k, v, sinks), recomputed from the saved output and log-sum-exp (the
    sinks' gradient is an empty tensor when there are none: a custom op returns tensors).

    The forward already validated ``cu_seqlens``; the Triton path does not read it back to the host again (that
    would synchronise the GPU), the reference path needs the offsets on the host anyway.
    """
    kwargs: dict[str, Any] = {"causal": causal, "softmax_scale": softmax_scale, **_limits(window, chunk, sinks)}
    softcap = softcap or 0.0
    if kernel == "triton":
        grads = triton_backward(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, softcap=softcap,
                                cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k, **kwargs,
                                grid_seqlen=grid_length(seqlen_grid, max_seqlen))
    else:
        offsets, offsets_k = _host_offsets(q, k, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k, causal)
        if kernel == "cpu-flash" and not softcap:
            grads = cpu_flash_backward(grad_out, q, k, v, out, lse, offsets, offsets_k=offsets_k, **kwargs)
        else:
            grads = reference_backward(grad_out, q, k, v, out, lse, offsets, softcap=softcap, offsets_k=offsets_k,
                                       **kwargs)
    grad_q, grad_k, grad_v, grad_sinks = grads
    return grad_q, grad_k, grad_v, (q.new_empty(0) if grad_sinks is None else grad_sinks)


@packed_attention_backward_op.register_fake
def _packed_attention_backward_fake(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, softmax_scale,
                                    softcap, kernel, cu_seqlens_k=None, max_seqlen_k=None, window=-1, chunk=0,
                                    sinks=None, seqlen_grid=None):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty(0) if sinks is None else torch.empty_like(sinks))


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    (q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, softcap, kernel, cu_seqlens_k, max_seqlen_k, window,
     chunk, sinks, seqlen_grid) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, cu_seqlens_k, sinks, seqlen_grid)
    ctx.window, ctx.chunk = window, chunk
    ctx.max_seqlen = max_seqlen
    ctx.max_seqlen_k = max_seqlen_k
    ctx.causal = causal
    ctx.softmax_scale = softmax_scale
    ctx.softcap = softcap
    ctx.kernel = kernel


def _backward(ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor | None) -> tuple:
    # lse is an internal output that packed_attention never returns, so grad_lse is None or zeros.
    q, k, v, out, lse, cu_seqlens, cu_seqlens_k, sinks, seqlen_grid = ctx.saved_tensors
    grad_q, grad_k, grad_v, grad_sinks = packed_attention_backward_op(
        grad_out, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.causal, ctx.softmax_scale, ctx.softcap,
        ctx.kernel, cu_seqlens_k, ctx.max_seqlen_k, ctx.window, ctx.chunk, sinks, seqlen_grid,
    )
    return (grad_q, grad_k, grad_v, None, None, None, None, None, None, None, None, None, None,
            None if sinks is None else grad_sinks, None)


packed_attention_op.register_autograd(_backward, setup_context=_setup_context)


def bucket_max_seqlen(max_seqlen: int, *, minimum: int = 16) -> int:
    """``max_seqlen`` rounded up to a power of two (at least ``minimum``): a valid bound for the op that takes few
    distinct values, for callers that compile with static ints rather than ``dynamic=True``."""
    if max_seqlen < 0:
        raise ValueError(f"max_seqlen={max_seqlen} must be >= 0")
    return max(minimum, 1 << max(max_seqlen - 1, 0).bit_length())


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """``"auto"`` is Triton on a CUDA device, the fused CPU flash kernel on the CPU and the reference elsewhere;
    other names pass through."""
    if kernel != "auto":
        return kernel
    return {"cuda": "triton", "cpu": "cpu-flash"}.get(device.type, "reference")


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    softcap: float | None = None,
    kernel: str = "auto",
    validate: bool = True,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
    window: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention within each sequence of a packed batch; differentiable in q, k, v (and ``sinks``).

    q: (total_tokens, heads_q, head_dim); k, v: (total_tokens, heads_kv, head_dim) with heads_q % heads_kv == 0
    (GQA, MQA); cu_seqlens: int32 (num_seqs + 1) offsets from 0 to total_tokens, non-decreasing; max_seqlen:
    an upper bound on the longest sequence.  ``softmax_scale`` defaults to 1/sqrt(head_dim).  ``softcap`` (None:
    no cap) caps the scaled scores to ``softcap * tanh(s / softcap)`` (Gemma 2; the CPU then runs the reference).
    ``kernel``: "triton", "cpu-flash" (PyTorch's fused CPU kernel), "reference" (plain torch, the oracle) or
    "auto" (Triton on a GPU, cpu-flash on the CPU, the reference elsewhere).  Returns a tensor like q.
    Contract violations raise ValueError before any kernel runs; offsets on a GPU are not read back (that would
    synchronise), so check them on the host first (``codegen.validation.check_offsets``). ``validate=False``
    skips the host check too, for callers that build the offsets themselves (the runtime's packed graphs).
    Under torch.compile, compile with dynamic shapes (``dynamic=True``, or mark the token dims dynamic and pass
    a bucketed ``max_seqlen``) so that new lengths and sequence counts reuse the compiled graph.

    Keys with their own spans (context parallelism: a query chunk of a long sequence against the keys up to its
    end): ``cu_seqlens_k`` (int32, num_seqs + 1, over k's tokens) and ``max_seqlen_k``; segment i's queries
    ``q[cu_seqlens[i]:cu_seqlens[i+1]]`` attend keys ``k[cu_seqlens_k[i]:cu_seqlens_k[i+1]]``, causal aligned
    at the bottom right (the last query row sees every key), so each key span must be at least as long as its
    query span.

    Limited attention (causal only): ``window`` W keeps, for the query at position i of its sequence, the keys
    at positions i - W .. i (flash-attn's ``window_size=(W, 0)``; a Hugging Face ``sliding_window`` of S is
    W = S - 1); ``chunk`` C keeps the keys in the query's own chunk of C positions (i // C == j // C, Llama 4's
    ``attention_chunk_size``); with key spans, positions count from each key span's start. ``sinks``
    (heads_q,): a learned logit per query head that joins every row's softmax denominator without a value
    (GPT-OSS); its gradient is returned like q's.

    ``max_seqlen`` may be a 0-d int tensor on the host (what the runtime passes to a compiled graph, so that a
    new value compiles nothing): the call's longest span, which sizes the Triton grid (programs of rows past it
    would exit at once); the bound the kernels are specialised and autotuned on is then q's token count.
    """
    out, _ = packed_attention_op(*packed_attention_args(
        q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=softmax_scale, softcap=softcap, kernel=kernel,
        validate=validate, cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k, window=window, chunk=chunk,
        sinks=sinks))
    return out


def packed_attention_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    softcap: float | None = None,
    kernel: str = "auto",
    validate: bool = True,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
    window: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple:
    """:func:`packed_attention`'s arguments checked and encoded as :func:`packed_attention_op` takes them, in its
    order (the kernel resolved, the scale a float, no window -1, no chunk 0, a tensor ``max_seqlen`` turned into
    the grid length): for callers that run the op on parts of the same call, such as its heads in groups."""
    grid = None
    if isinstance(max_seqlen, torch.Tensor):
        if max_seqlen.dim() != 0 or max_seqlen.device.type != "cpu" or max_seqlen.dtype.is_floating_point:
            raise ValueError(f"a tensor max_seqlen must be a 0-d integer tensor on the host, got "
                             f"{tuple(max_seqlen.shape)} {max_seqlen.dtype} on {max_seqlen.device}")
        grid, max_seqlen = max_seqlen, int(q.shape[0])
    check_kernel(kernel)
    if (cu_seqlens_k is None) != (max_seqlen_k is None):
        raise ValueError(f"cu_seqlens_k and max_seqlen_k come together; got cu_seqlens_k "
                         f"{'None' if cu_seqlens_k is None else 'given'} and max_seqlen_k={max_seqlen_k!r}")
    resolved = resolve_kernel(kernel, q.device)
    check_layout(q, k, v, cu_seqlens, max_seqlen, resolved, separate_keys=cu_seqlens_k is not None)
    if validate and not torch.compiler.is_compiling() and cu_seqlens.device.type == "cpu" and not is_fake(cu_seqlens):
        offsets = check_offsets(cu_seqlens, q.shape[0], max_seqlen)  # host offsets: checked here, for free
        if cu_seqlens_k is not None:
            check_key_offsets(cu_seqlens_k, k.shape[0], max_seqlen_k, offsets, causal)
    scale = 1.0 / math.sqrt(q.shape[2]) if softmax_scale is None else float(softmax_scale)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None (no cap), got {softcap!r}")
    check_limits(causal, window, chunk)
    check_sinks(sinks, q)
    return (q, k, v, cu_seqlens, max_seqlen, causal, scale, softcap, resolved, cu_seqlens_k, max_seqlen_k,
            -1 if window is None else window, chunk or 0, sinks, grid)
