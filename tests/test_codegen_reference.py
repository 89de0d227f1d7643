"""The CPU kernels through the custom op (the plain-torch reference and the fused ``cpu-flash`` kernel) against
naive dense masked attention, and against each other."""

from __future__ import annotations

import math

import pytest
import torch
from codegen_cases import dense_masked_attention, make_batch, relative_error
from hypothesis import given, settings
from hypothesis import strategies as st

import codegen

LAYOUTS = [(2, 2), (4, 2), (4, 1)]  # (heads_q, heads_kv): MHA, GQA, MQA
CPU_KERNELS = ["reference", "cpu-flash"]


def _check_against_dense(lengths: list[int], heads_q: int, heads_kv: int, causal: bool, seed: int = 0,
                         kernel: str = "reference") -> None:
    batch = make_batch(lengths, heads_q=heads_q, heads_kv=heads_kv, head_dim=8, seed=seed)
    scale = 1 / math.sqrt(8)
    out = codegen.packed_attention(*batch.inputs(), causal=causal, kernel=kernel)
    expected = dense_masked_attention(batch.q, batch.k, batch.v, batch.cu_seqlens, causal=causal, scale=scale)
    assert relative_error(out, expected) < 1e-5
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (batch.q, batch.k, batch.v), grad_out)
    want = torch.autograd.grad(expected, (batch.q, batch.k, batch.v), grad_out.double())
    # Relative to the step's largest gradient: a one-token sequence's dq is exactly 0, so both sides are rounding
    # noise whose size (about 1e-7 of the other gradients) depends on the CPU's vector width.
    floor = max(w.abs().max().item() for w in want)
    for name, g, w in zip("qkv", got, want):
        assert relative_error(g, w, floor=floor) < 1e-5, f"grad {name}"


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", LAYOUTS)
@pytest.mark.parametrize("lengths", [[1], [13], [3, 0, 7, 1, 5], [1, 1, 1, 1], [0, 6, 0]])
def test_cpu_kernels_match_dense_masked_attention(lengths, heads, causal, kernel):
    _check_against_dense(lengths, *heads, causal, kernel=kernel)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=12), min_size=1, max_size=6).filter(lambda ls: sum(ls) > 0),
    heads=st.sampled_from(LAYOUTS),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
    kernel=st.sampled_from(CPU_KERNELS),
)
def test_cpu_kernels_match_dense_on_random_ragged_batches(lengths, heads, causal, seed, kernel):
    _check_against_dense(lengths, *heads, causal, seed=seed, kernel=kernel)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_flash_matches_the_reference_in_half_precision(dtype):
    """Longer sequences than the tile size, in 16-bit: both accumulate in fp32, so they agree to rounding."""
    got = make_batch([70, 0, 130, 9], heads_q=4, heads_kv=2, head_dim=32, dtype=dtype, seed=3)
    want = make_batch([70, 0, 130, 9], heads_q=4, heads_kv=2, head_dim=32, dtype=dtype, seed=3)
    out = codegen.packed_attention(*got.inputs(), kernel="cpu-flash")
    ref = codegen.packed_attention(*want.inputs(), kernel="reference")
    assert out.dtype == dtype
    assert relative_error(out, ref) < 2e-2
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref.backward(grad_out)
    for name in "qkv":
        assert relative_error(getattr(got, name).grad, getattr(want, name).grad) < 3e-2, f"grad {name}"


def test_cpu_flash_rejects_tensors_off_the_cpu():
    batch = make_batch([3, 5], heads_q=2, heads_kv=2, head_dim=8)
    meta = [t.detach().to("meta") for t in (batch.q, batch.k, batch.v, batch.cu_seqlens)]
    with pytest.raises(ValueError, match="cpu-flash.*CPU only.*meta"):
        codegen.packed_attention(*meta, batch.max_seqlen, kernel="cpu-flash")


def test_reference_keeps_sequences_apart():
    """Changing one sequence's values must not change another sequence's output."""
    batch = make_batch([4, 5], heads_q=2, heads_kv=2, head_dim=8)
    q, k, v, cu_seqlens, max_seqlen = (x.detach() if isinstance(x, torch.Tensor) else x for x in batch.inputs())
    before = codegen.packed_attention(q, k, v, cu_seqlens, max_seqlen, causal=False, kernel="reference")
    k2, v2 = k.clone(), v.clone()
    k2[4:] += 3.0
    v2[4:] -= 2.0
    after = codegen.packed_attention(q, k2, v2, cu_seqlens, max_seqlen, causal=False, kernel="reference")
    assert torch.equal(before[:4], after[:4])
    assert not torch.allclose(before[4:], after[4:])


def test_reference_causal_first_token_copies_its_value():
    batch = make_batch([3, 6], heads_q=2, heads_kv=1, head_dim=8)
    out = codegen.packed_attention(*batch.inputs(), causal=True, kernel="reference")
    for start in (0, 3):
        torch.testing.assert_close(out[start], batch.v[start].expand(2, 8))


def test_reference_honours_softmax_scale():
    batch = make_batch([5, 2], heads_q=2, heads_kv=2, head_dim=8)
    out = codegen.packed_attention(*batch.inputs(), softmax_scale=0.7, kernel="reference")
    expected = dense_masked_attention(batch.q, batch.k, batch.v, batch.cu_seqlens, causal=True, scale=0.7)
    assert relative_error(out, expected) < 1e-5


@pytest.mark.parametrize("kernel", ["reference", "cpu-flash"])
def test_soft_capped_scores_match_dense_attention_forward_and_backward(kernel):
    """Gemma 2's score cap: the CPU kernels (cpu-flash falls back to the reference) against the dense oracle."""
    batch = make_batch([7, 1, 12], heads_q=4, heads_kv=2, head_dim=16, seed=3)
    scale = 16 ** -0.5
    # scores of size ~3 against a cap of 2: the cap bends them hard, so a missing or wrong cap shows
    q = (batch.q.detach() * 4).requires_grad_(True)
    out = codegen.packed_attention(q, batch.k, batch.v, batch.cu_seqlens, batch.max_seqlen, softcap=2.0, kernel=kernel)
    want = dense_masked_attention(q, batch.k, batch.v, batch.cu_seqlens, causal=True, scale=scale, softcap=2.0)
    assert relative_error(out, want.float()) < 1e-5
    uncapped = dense_masked_attention(q, batch.k, batch.v, batch.cu_seqlens, causal=True, scale=scale)
    assert relative_error(out, uncapped.float()) > 1e-2
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, batch.k, batch.v), grad)
    expected = torch.autograd.grad(want, (q, batch.k, batch.v), grad.double())
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert relative_error(g, e.float()) < 1e-5, name


def test_extended_attention_is_sdpa_without_a_cap_and_capped_with_one():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 6, 8, generator=g) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(codegen.reference.extended_attention(q, k, v, is_causal=True), sdpa)
    capped = codegen.reference.extended_attention(q * 4, k, v, is_causal=True, softcap=1.0)
    scores = (1.0 * torch.tanh((q * 4) @ k.transpose(-2, -1) / 8 ** 0.5)).masked_fill(
        ~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(capped, torch.softmax(scores, -1) @ v)
    with pytest.raises(ValueError, match="softcap must be a positive number or None"):
        codegen.packed_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                 torch.tensor([0, 6], dtype=torch.int32), 6, softcap=0.0)
