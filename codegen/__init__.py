"""Generated kernels: Triton packed (varlen) causal attention, its torch.library custom op and a pure-torch
reference. May import torch and triton only.

``packed_attention`` is the entry point; ``KernelSpec`` / ``spec_space`` describe what the Triton kernels are
generated from; ``reference_forward`` / ``reference_backward`` are the plain-torch oracle.  Triton itself is
imported only when a Triton kernel is first generated, so this package imports without it.
"""

from codegen.op import packed_attention, packed_attention_backward_op, packed_attention_op, resolve_backend
from codegen.reference import reference_backward, reference_forward
from codegen.spec import TRITON_HEAD_DIMS, KernelSpec, spec_space
from codegen.triton_launch import interpreting, triton_available

__all__ = [
    "KernelSpec",
    "TRITON_HEAD_DIMS",
    "interpreting",
    "packed_attention",
    "packed_attention_backward_op",
    "packed_attention_op",
    "reference_backward",
    "reference_forward",
    "resolve_backend",
    "spec_space",
    "triton_available",
]
