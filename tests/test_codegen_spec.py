"""KernelSpec: validation, stable names, the pruned autotune space, and real (ahead-of-time) GPU compiles."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from codegen import TRITON_HEAD_DIMS, KernelSpec, spec_space
from codegen.spec import _SHARED_MEMORY_BUDGET_BYTES, INTERPRETER_BLOCK

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _spec(**overrides) -> KernelSpec:
    fields = dict(head_dim=64, dtype=torch.bfloat16, causal=True, group_size=4, block_m=128, block_n=64,
                  num_warps=8, num_stages=2)
    fields.update(overrides)
    return KernelSpec(**fields)


def test_describe_is_stable():
    assert _spec().describe() == "d64-bf16-causal-g4-m128n64-w8s2"
    assert _spec(causal=False, dtype=torch.float32, upcast_operands=True).describe() == (
        "d64-fp32-full-g4-m128n64-w8s2-upcast"
    )


@pytest.mark.parametrize(
    ("overrides", "quoted"),
    [
        ({"head_dim": 48}, "head_dim=48"),
        ({"dtype": torch.float64}, "dtype=torch.float64"),
        ({"group_size": 0}, "group_size=0"),
        ({"block_m": 24}, "block_m=24"),
        ({"block_n": 8}, "block_n=8"),
        ({"num_warps": 3}, "num_warps=3"),
        ({"num_stages": 0}, "num_stages=0"),
    ],
)
def test_bad_spec_names_the_value(overrides, quoted):
    with pytest.raises(ValueError, match=quoted):
        _spec(**overrides)


def test_spec_is_frozen():
    with pytest.raises(AttributeError):
        _spec().block_m = 32


@pytest.mark.parametrize("dtype", DTYPES)
def test_interpreter_space_is_one_small_spec(dtype):
    (spec,) = spec_space(head_dim=32, dtype=dtype, causal=False, group_size=2, interpret=True)
    assert (spec.block_m, spec.block_n) == (INTERPRETER_BLOCK, INTERPRETER_BLOCK)
    assert spec.upcast_operands == (dtype == torch.bfloat16)
    assert (spec.head_dim, spec.dtype, spec.causal, spec.group_size) == (32, dtype, False, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", TRITON_HEAD_DIMS)
def test_gpu_space_is_pruned_by_the_spec(head_dim, dtype):
    space = spec_space(head_dim=head_dim, dtype=dtype, causal=True, group_size=1, interpret=False)
    assert space and len(space) == len(set(space))
    for spec in space:
        assert not spec.upcast_operands
        assert spec.block_n <= spec.block_m
        if len(space) > 1 or spec.block_m > INTERPRETER_BLOCK:
            assert spec.shared_memory_bytes() <= _SHARED_MEMORY_BUDGET_BYTES
    if head_dim > 64:
        assert all(spec.block_n <= 64 for spec in space)
    if dtype == torch.float32:
        assert all(spec.num_stages == 1 for spec in space)


def test_larger_heads_get_a_smaller_space():
    sizes = [len(spec_space(head_dim=d, dtype=torch.float32, causal=True, group_size=1, interpret=False))
             for d in (64, 128)]
    assert sizes[0] > sizes[1]


_HAS_CUDA_BACKEND = importlib.util.find_spec("triton") is not None and (
    importlib.util.find_spec("triton.backends.nvidia") is not None
)


@pytest.mark.skipif(not _HAS_CUDA_BACKEND, reason="needs triton's CUDA backend (ptxas), not a GPU")
@pytest.mark.parametrize("body", ["packed_attention_forward_kernel", "packed_attention_backward_dkdv_kernel"])
def test_generated_kernels_compile_for_sm90(body):
    """The kernels are real compiled Triton, not only interpretable: compile them for an H100/H200 target."""
    from codegen.triton_launch import compile_for_gpu

    spec = _spec(head_dim=32, dtype=torch.float16, block_m=64, block_n=32, num_warps=4)
    resources = compile_for_gpu(spec, body, arch=90)
    assert resources["num_warps"] == 4
    assert 0 < resources["shared_bytes"] <= 1.25 * spec.shared_memory_bytes()  # the estimate is close


@pytest.mark.skipif(not _HAS_CUDA_BACKEND, reason="needs triton's CUDA backend (ptxas), not a GPU")
@pytest.mark.parametrize("body", ["packed_attention_forward_kernel", "packed_attention_backward_dq_kernel",
                                  "packed_attention_backward_dkdv_kernel"])
def test_limited_kernels_compile_for_sm90(body):
    """The window, chunk and sink variants compile too (their loop bounds are runtime values)."""
    from codegen.triton_launch import compile_for_gpu

    spec = _spec(head_dim=64, dtype=torch.bfloat16, block_m=64, block_n=32, num_warps=4)
    resources = compile_for_gpu(spec, body, arch=90, window=True, chunk=True, sinks=True)
    assert resources["num_warps"] == 4 and resources["shared_bytes"] > 0
