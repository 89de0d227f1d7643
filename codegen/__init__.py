"""Generated kernels: Triton packed (varlen) causal attention, its torch.library custom op and a pure-torch
reference. May import torch and triton only.

``packed_attention`` is the entry point; ``KernelSpec`` / ``spec_space`` describe what the Triton kernels are
generated from; ``reference_forward`` / ``reference_backward`` are the plain-torch oracle;
``cpu_flash_forward`` / ``cpu_flash_backward`` the CPU path (PyTorch's fused flash kernel, per sequence).
Triton itself is imported only when a Triton kernel is first generated, so this package imports without it.

For graph rewrites: the op is ``torch.ops.hydraulis.packed_attention(q, k, v, cu_seqlens, max_seqlen, causal,
softmax_scale, softcap, kernel) -> (out, lse)`` with ``max_seqlen`` a SymInt and ``kernel`` already resolved
("triton", "cpu-flash" or "reference"; see ``resolve_kernel``); its autograd calls ``torch.ops.hydraulis.
packed_attention_backward``.  Either compile with dynamic shapes or pass ``bucket_max_seqlen(longest)``.
"""

from codegen.cpu_flash import cpu_flash_backward, cpu_flash_forward
from codegen.op import (
    bucket_max_seqlen,
    host_length,
    packed_attention,
    packed_attention_args,
    packed_attention_backward_op,
    packed_attention_op,
    resolve_kernel,
)
from codegen.reference import reference_backward, reference_forward
from codegen.spec import TRITON_HEAD_DIMS, KernelSpec, spec_space
from codegen.triton_launch import interpreting, triton_available

__all__ = [
    "bucket_max_seqlen",
    "cpu_flash_backward",
    "cpu_flash_forward",
    "host_length",
    "KernelSpec",
    "TRITON_HEAD_DIMS",
    "interpreting",
    "packed_attention",
    "packed_attention_args",
    "packed_attention_backward_op",
    "packed_attention_op",
    "reference_backward",
    "reference_forward",
    "resolve_kernel",
    "spec_space",
    "triton_available",
]
