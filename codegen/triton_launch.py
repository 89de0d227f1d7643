"""Generation and launch of the Triton packed-attention kernels.

Kernels are generated on first use from the bodies in ``codegen.triton_kernels``: one jitted kernel per
(kernel body, autotune space, interpreter mode), cached.  On a GPU the space of ``KernelSpec``s that
``codegen.spec.spec_space`` allows becomes a ``triton.autotune`` config list keyed by the bucketed
``max_seqlen``; under ``TRITON_INTERPRET=1`` the single small interpreter spec is passed directly.  Triton is
imported here only when a kernel is first needed, so ``import codegen`` works without it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from codegen.reference import sink_grad
from codegen.spec import KernelSpec, spec_space

_TRUE_STRINGS = ("1", "true", "on", "yes")


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``), read at call time."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE_STRINGS


def triton_available() -> bool:
    """Whether the optional ``triton`` package can be imported."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def require_triton_runnable(device: torch.device) -> None:
    """Raise a RuntimeError explaining why the Triton kernel cannot run on ``device``, if it cannot."""
    if not triton_available():
        raise RuntimeError("kernel='triton' needs the triton package: pip install 'hydraulis[triton]'")
    if device.type == "cpu" and not interpreting():
        raise RuntimeError(
            "kernel='triton' on CPU tensors runs only under Triton's interpreter: set TRITON_INTERPRET=1 "
            "before the first call, or use kernel='reference'"
        )
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"kernel='triton' does not support device {device}")


def _problem_specs(q: torch.Tensor, k: torch.Tensor, causal: bool) -> tuple[KernelSpec, ...]:
    return spec_space(
        head_dim=q.shape[2],
        dtype=q.dtype,
        causal=causal,
        group_size=q.shape[1] // k.shape[1],
        interpret=interpreting(),
    )


def _with_helpers(body: Callable, triton: Any) -> Callable:
    """``body`` over the kernel module's globals with every helper of ``triton_kernels.HELPERS`` jitted (in the
    current interpreter mode): the kernels call them as Triton functions."""
    from codegen import triton_kernels

    namespace = dict(vars(triton_kernels))
    namespace.update({name: triton.jit(getattr(triton_kernels, name)) for name in triton_kernels.HELPERS})
    fn = types.FunctionType(body.__code__, namespace, body.__name__, body.__defaults__, body.__closure__)
    fn.__doc__, fn.__module__, fn.__qualname__ = body.__doc__, body.__module__, body.__qualname__
    return fn


@functools.lru_cache(maxsize=None)
def _generate(body_name: str, specs: tuple[KernelSpec, ...], interpret: bool) -> Any:
    """Jit one kernel body; wrap it in an autotuner over ``specs`` unless interpreting (then len(specs) == 1)."""
    import triton

    from codegen import triton_kernels

    kernel = triton.jit(_with_helpers(getattr(triton_kernels, body_name), triton))
    if interpret:
        return kernel
    configs = [
        triton.Config(
            {"BLOCK_M": spec.block_m, "BLOCK_N": spec.block_n}, num_warps=spec.num_warps, num_stages=spec.num_stages
        )
        for spec in specs
    ]
    return triton.autotune(configs=configs, key=["seqlen_bucket", "stride_qh", "stride_kh"])(kernel)


def _launch(
    body_name: str, specs: tuple[KernelSpec, ...], grid_rows: Callable[[dict], int], grid_rest: tuple[int, int],
    args: tuple, max_seqlen: int, softcap: float, limits: "Limits",
) -> None:
    """Launch a generated kernel with the spec's constexprs; block sizes come from autotuning on a GPU."""
    interpret = interpreting()
    kernel = _generate(body_name, specs, interpret)
    spec = specs[0]
    constexprs: dict[str, Any] = {
        "HEAD_DIM": spec.head_dim,
        "CAUSAL": spec.causal,
        "GROUP": spec.group_size,
        "DOT_PRECISION": "ieee" if spec.ieee_dot else "tf32",
        "UPCAST": spec.upcast_operands,
        "SOFTCAP": softcap > 0,
        "WINDOW": limits.window is not None,
        "CHUNK": limits.chunk is not None,
    }
    if body_name == "packed_attention_forward_kernel":
        constexprs["SINKS"] = limits.sinks is not None
    if interpret:
        constexprs.update(BLOCK_M=spec.block_m, BLOCK_N=spec.block_n)
    bucket = 1 << max(max_seqlen - 1, 0).bit_length()  # next power of two: the autotune key

    def grid(meta: dict) -> tuple[int, int, int]:
        return (grid_rows(meta), *grid_rest)

    kernel[grid](*args, bucket, **constexprs)


@dataclass(frozen=True, slots=True)
class Limits:
    """What limits attention in one call: the left window, the chunk and the sinks (None: not limited)."""

    window: int | None = None
    chunk: int | None = None
    sinks: torch.Tensor | None = None

    def scalars(self) -> tuple[int, int]:
        """(window, chunk) as the kernels take them (0 when absent; the constexpr flags say which apply)."""
        return (self.window or 0, self.chunk or 0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _nothing_to_do(q: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> bool:
    return q.shape[0] == 0 or cu_seqlens.shape[0] < 2 or max_seqlen == 0


def triton_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
    *, causal: bool, softmax_scale: float, softcap: float = 0.0, cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None, window: int | None = None, chunk: int | None = None,
    sinks: torch.Tensor | None = None, grid_seqlen: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed attention forward with the generated kernel: ``out`` like q and fp32 ``lse`` (heads_q, tokens).
    ``cu_seqlens_k`` / ``max_seqlen_k``: the keys' own spans (default: the queries'); ``window``, ``chunk``,
    ``sinks``: limited attention and sink logits (``codegen.reference``). ``grid_seqlen``: this call's longest
    span (at most ``max_seqlen``), which sizes the grid; ``max_seqlen`` stays the autotune key."""
    require_triton_runnable(q.device)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    if sinks is not None:  # rows of an empty batch still count their sink
        lse += sinks.float()[:, None]
    if _nothing_to_do(q, cu_seqlens, max_seqlen):
        return out, lse
    cu_k, max_k = _key_spans(cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k)
    specs = _problem_specs(q, k, causal)
    limits = Limits(window, chunk, None if sinks is None else sinks.float().contiguous())
    args = (
        q, k, v, out, lse, cu_seqlens, cu_k, limits.sinks if limits.sinks is not None else lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), softmax_scale, softcap, *limits.scalars(),
    )
    rows, _ = _grid_lengths(max_seqlen, max_k, grid_seqlen, separate_keys=cu_seqlens_k is not None)
    with _device_guard(q.device):
        _launch("packed_attention_forward_kernel", specs, lambda meta: _cdiv(rows, meta["BLOCK_M"]),
                (cu_seqlens.shape[0] - 1, q.shape[1]), args, max(max_seqlen, max_k), softcap, limits)
    return out, lse


def _grid_lengths(max_seqlen: int, max_k: int, grid_seqlen: int | None, separate_keys: bool) -> tuple[int, int]:
    """(query rows, key rows) the grid covers per span: the call's own longest span when given (the keys' too
    for self-attention), else the bounds."""
    if grid_seqlen is None:
        return max_seqlen, max_k
    return grid_seqlen, (max_k if separate_keys else grid_seqlen)


def _key_spans(cu_seqlens: torch.Tensor, max_seqlen: int, cu_seqlens_k: torch.Tensor | None,
               max_seqlen_k: int | None) -> tuple[torch.Tensor, int]:
    """The keys' offsets and the bound on their longest span (the queries' when not given)."""
    if cu_seqlens_k is None:
        return cu_seqlens, max_seqlen
    return cu_seqlens_k, max_seqlen if max_seqlen_k is None else max_seqlen_k


def triton_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, *, causal: bool, softmax_scale: float,
    softcap: float = 0.0, cu_seqlens_k: torch.Tensor | None = None, max_seqlen_k: int | None = None,
    window: int | None = None, chunk: int | None = None, sinks: torch.Tensor | None = None,
    grid_seqlen: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients for q, k, v and the sinks (None without): a dq kernel over query blocks, a dk/dv kernel over
    key blocks, the sinks' gradient from ``lse`` and ``delta`` in torch; ``grid_seqlen`` as the forward's."""
    require_triton_runnable(q.device)
    q, k, v, grad_out, lse = q.contiguous(), k.contiguous(), v.contiguous(), grad_out.contiguous(), lse.contiguous()
    grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    # delta_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij: (tokens, heads_q, d) -> (heads_q, tokens)
    delta = (grad_out.float() * out.float()).sum(dim=-1).transpose(0, 1).contiguous()
    grad_sinks = None if sinks is None else sink_grad(sinks, lse, delta)
    if _nothing_to_do(q, cu_seqlens, max_seqlen):
        return grad_q, grad_k, grad_v, grad_sinks
    cu_k, max_k = _key_spans(cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k)
    longest = max(max_seqlen, max_k)  # the autotune key
    specs = _problem_specs(q, k, causal)
    num_seqs = cu_seqlens.shape[0] - 1
    common = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
              grad_out.stride(0), grad_out.stride(1))
    limits = Limits(window, chunk)  # the sinks are in lse already
    dq_args = (q, k, v, grad_out, lse, delta, grad_q, cu_seqlens, cu_k, *common,
               grad_q.stride(0), grad_q.stride(1), lse.stride(0), softmax_scale, softcap, *limits.scalars())
    dkdv_args = (q, k, v, grad_out, lse, delta, grad_k, grad_v, cu_seqlens, cu_k, *common,
                 grad_k.stride(0), grad_k.stride(1), grad_v.stride(0), grad_v.stride(1), lse.stride(0), softmax_scale,
                 softcap, *limits.scalars())
    rows, key_rows = _grid_lengths(max_seqlen, max_k, grid_seqlen, separate_keys=cu_seqlens_k is not None)
    with _device_guard(q.device):
        _launch("packed_attention_backward_dq_kernel", specs, lambda meta: _cdiv(rows, meta["BLOCK_M"]),
                (num_seqs, q.shape[1]), dq_args, longest, softcap, limits)
        _launch("packed_attention_backward_dkdv_kernel", specs, lambda meta: _cdiv(key_rows, meta["BLOCK_N"]),
                (num_seqs, k.shape[1]), dkdv_args, longest, softcap, limits)
    return grad_q, grad_k, grad_v, grad_sinks


def _device_guard(device: torch.device) -> Any:
    """Make ``device`` current for the launch (kernels go to the current CUDA device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


KERNEL_BODIES: tuple[str, ...] = (
    "packed_attention_forward_kernel",
    "packed_attention_backward_dq_kernel",
    "packed_attention_backward_dkdv_kernel",
)
"""Names of the kernel bodies in ``codegen.triton_kernels``."""

_POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}


def compile_for_gpu(spec: KernelSpec, body_name: str, *, arch: int = 90, window: bool = False, chunk: bool = False,
                    sinks: bool = False) -> dict[str, int]:
    """Compile one kernel body for an NVIDIA GPU of compute capability ``arch`` without needing that GPU.

    Proves the generated kernel is valid compiled Triton (not only interpretable) and reports its resource use:
    ``{"shared_bytes": ..., "num_warps": ...}``.  ``window`` / ``chunk`` / ``sinks``: compile the limited
    variants. Needs triton's CUDA backend (its bundled ptxas), not a GPU.
    """
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile
    from triton.runtime.jit import JITFunction

    from codegen import triton_kernels

    body = getattr(triton_kernels, body_name)
    constexprs = {
        "HEAD_DIM": spec.head_dim, "CAUSAL": spec.causal, "GROUP": spec.group_size,
        "DOT_PRECISION": "ieee" if spec.ieee_dot else "tf32", "UPCAST": spec.upcast_operands, "SOFTCAP": False,
        "WINDOW": window, "CHUNK": chunk, "BLOCK_M": spec.block_m, "BLOCK_N": spec.block_n,
    }
    if body_name == "packed_attention_forward_kernel":
        constexprs["SINKS"] = sinks
    signature = {}
    for name in inspect.signature(body).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("lse_ptr", "delta_ptr", "sinks_ptr"):
            signature[name] = "*fp32"
        elif name in ("cu_seqlens_ptr", "cu_seqlens_k_ptr"):
            signature[name] = "*i32"
        elif name.endswith("_ptr"):
            signature[name] = _POINTER_TYPES[spec.dtype]
        else:
            signature[name] = "fp32" if name in ("scale", "softcap") else "i32"
    import triton

    source = ASTSource(JITFunction(_with_helpers(body, triton)), signature, constexprs)
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    compiled = triton_compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    return {"shared_bytes": int(compiled.metadata.shared), "num_warps": int(compiled.metadata.num_warps)}
