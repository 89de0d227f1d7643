"""Triton packed-attention kernels (forward and backward) against the reference, under TRITON_INTERPRET=1.

``codegen`` reads TRITON_INTERPRET when a kernel is generated, so an autouse fixture sets it for these tests
only; every case is small because the interpreter runs each program in numpy.
"""

from __future__ import annotations

import random

import pytest
import torch
from codegen_cases import PackedBatch, make_batch, relative_error

import codegen

pytest.importorskip("triton")

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _run(batch: PackedBatch, kernel: str, causal: bool, grad_out: torch.Tensor | None, softcap: float | None = None):
    out = codegen.packed_attention(*batch.inputs(), causal=causal, softcap=softcap, kernel=kernel)
    grads = torch.autograd.grad(out, (batch.q, batch.k, batch.v), grad_out) if grad_out is not None else ()
    return out, grads


def _assert_triton_matches_reference(batch: PackedBatch, causal: bool, backward: bool = True,
                                     softcap: float | None = None) -> None:
    tolerance = TOLERANCE[batch.q.dtype]
    grad_out = None
    if backward:
        generator = torch.Generator().manual_seed(1)
        grad_out = torch.randn(batch.q.shape, generator=generator).to(batch.q.dtype)
    out, grads = _run(batch, "triton", causal, grad_out, softcap)
    ref_out, ref_grads = _run(batch, "reference", causal, grad_out, softcap)
    assert out.dtype == batch.q.dtype and out.shape == batch.q.shape
    assert relative_error(out, ref_out) < tolerance, "forward"
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert got.dtype == want.dtype
        assert relative_error(got, want) < tolerance, name


RAGGED = {
    "one-token": [1],
    "one-sequence-off-block": [37],
    "many-tiny": [1, 2, 1, 1, 3, 1, 1, 2],
    "with-empty": [5, 0, 17, 1, 20],
    "empty-at-ends": [0, 19, 0],
    "block-multiples": [16, 32],
}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name", sorted(RAGGED))
def test_ragged_batches_gqa(name, causal):
    _assert_triton_matches_reference(make_batch(RAGGED[name], heads_q=4, heads_kv=2, head_dim=16), causal)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", [(2, 2), (3, 1), (4, 1)], ids=["mha", "mqa3", "mqa4"])
def test_head_layouts(heads, causal):
    batch = make_batch([9, 1, 23], heads_q=heads[0], heads_kv=heads[1], head_dim=16, seed=3)
    _assert_triton_matches_reference(batch, causal)


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
def test_head_dims(head_dim):
    batch = make_batch([18, 3], heads_q=2, heads_kv=1, head_dim=head_dim, seed=head_dim)
    _assert_triton_matches_reference(batch, causal=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_half_precision(dtype, causal):
    batch = make_batch([21, 1, 11], heads_q=4, heads_kv=2, head_dim=32, dtype=dtype, seed=5)
    _assert_triton_matches_reference(batch, causal)


@pytest.mark.parametrize("seed", range(3))
def test_random_ragged_batches(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([0, 1, rng.randint(2, 40)]) for _ in range(rng.randint(1, 6))]
    if sum(lengths) == 0:
        lengths.append(rng.randint(1, 40))
    heads_kv = rng.choice([1, 2])
    batch = make_batch(lengths, heads_q=2 * heads_kv, heads_kv=heads_kv, head_dim=16, seed=seed)
    _assert_triton_matches_reference(batch, causal=rng.random() < 0.5)


def test_max_seqlen_may_exceed_the_longest_sequence():
    batch = make_batch([7, 12], heads_q=2, heads_kv=2, head_dim=16)
    loose = PackedBatch(q=batch.q, k=batch.k, v=batch.v, cu_seqlens=batch.cu_seqlens, max_seqlen=64)
    _assert_triton_matches_reference(loose, causal=True, backward=False)


def test_custom_softmax_scale_and_strided_inputs():
    batch = make_batch([10, 6], heads_q=2, heads_kv=2, head_dim=16)
    q_strided = torch.randn(16, 16, 2).transpose(1, 2).requires_grad_()  # (T, heads, d), not contiguous
    out = codegen.packed_attention(q_strided, batch.k, batch.v, batch.cu_seqlens, 10, softmax_scale=0.3,
                                   kernel="triton")
    ref = codegen.packed_attention(q_strided, batch.k, batch.v, batch.cu_seqlens, 10, softmax_scale=0.3,
                                   kernel="reference")
    assert relative_error(out, ref) < 1e-4


def test_empty_batch():
    batch = make_batch([0, 0], heads_q=2, heads_kv=1, head_dim=16)
    out = codegen.packed_attention(*batch.inputs(), kernel="triton")
    assert out.shape == (0, 2, 16)
    out.sum().backward()
    assert batch.q.grad.shape == (0, 2, 16)


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    batch = make_batch([4], heads_q=2, heads_kv=2, head_dim=16)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        codegen.packed_attention(*batch.inputs(), kernel="triton")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_soft_capped_scores_forward_and_backward(causal):
    """Gemma 2's score cap inside the kernels (scores ~4x the cap, so the cap's derivative matters)."""
    batch = make_batch([5, 0, 19, 2], heads_q=4, heads_kv=2, head_dim=16, seed=7)
    batch.q.data.mul_(6)
    _assert_triton_matches_reference(batch, causal, softcap=1.5)
