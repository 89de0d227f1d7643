"""Limited attention in every kernel: a left window, chunks, learned sinks, alone and together, with keys on
their own spans (context parallelism's shape) and without; forward and backward (q, k, v and the sinks) of the
reference, the CPU flash path and the Triton kernels (under ``TRITON_INTERPRET=1``) against an independent
float64 oracle that builds each segment's mask from absolute positions and appends the sink as one more logit.
Windows and chunks shorter than the sequences (they hide keys) and longer (they hide none) are both drawn; the
Triton block sizes are 16, so sequences of 40-70 tokens cross several key blocks the window skips."""

from __future__ import annotations

import itertools

import pytest
import torch
from codegen_cases import segment_leaves, segment_oracle
from tiers import FULL

import codegen


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


# (query spans, key spans): whole sequences (equal spans) and chunks of long ones (fewer queries than keys)
SELF = ([41, 0, 9, 70], [41, 0, 9, 70])
SPANS = ([20, 33, 6], [52, 33, 40])
LIMITS = [  # (window, chunk, sinks)
    (7, None, False), (24, None, False), (200, None, False), (0, None, False),
    (None, 16, False), (None, 13, False), (None, 500, False),
    (None, None, True), (11, None, True), (None, 20, True), (30, 16, False),
]


def _check(kernel, spans, window, chunk, sinks, seed, heads=(4, 2)):
    queries, keys = spans
    q, k, v, s = segment_leaves(queries, keys, heads_q=heads[0], heads_kv=heads[1], head_dim=16, seed=seed,
                                sinks=sinks)
    scale = 16 ** -0.5
    separate = {} if queries == keys else {"cu_seqlens_k": _offsets(keys), "max_seqlen_k": max(keys)}
    out = codegen.packed_attention(q, k, v, _offsets(queries), max(queries), kernel=kernel, window=window,
                                   chunk=chunk, sinks=s, **separate)
    want_out = segment_oracle(q, k, v, queries, keys, scale=scale, window=window, chunk=chunk, sinks=s)
    torch.testing.assert_close(out, want_out, atol=3e-5, rtol=3e-5)
    grad = torch.randn_like(out)
    leaves = (q, k, v) + ((s,) if sinks else ())
    got = torch.autograd.grad(out, leaves, grad)
    want = torch.autograd.grad(want_out, leaves, grad)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


TRITON_LIMITS = LIMITS if FULL else [(7, None, False), (0, None, False), (None, 13, False), (11, None, True),
                                     (30, 16, False)]
"""The interpreted Triton kernels are slow on a CPU: the default tier runs a window that skips key blocks, one
of 0, a chunk that crosses blocks, sinks with a window and both limits; ``make test-full`` runs them all."""


@pytest.mark.parametrize("kernel, limits", [(kernel, limits) for kernel in ("reference", "cpu-flash", "triton")
                                            for limits in (TRITON_LIMITS if kernel == "triton" else LIMITS)],
                         ids=lambda x: x if isinstance(x, str) else f"w{x[0]}-c{x[1]}-s{int(x[2])}")
def test_limited_self_attention_matches_the_oracle(kernel, limits):
    _check(kernel, SELF, *limits, seed=1)


@pytest.mark.parametrize("kernel", ["reference", "cpu-flash", "triton"])
@pytest.mark.parametrize("limits", [(9, None, False), (None, 16, True), (40, None, True)],
                         ids=lambda x: f"w{x[0]}-c{x[1]}-s{int(x[2])}")
def test_limited_key_spans_match_the_oracle(kernel, limits):
    """A query chunk at the end of a longer key span: the window and the chunks count from the span's start."""
    _check(kernel, SPANS, *limits, seed=2)


@pytest.mark.parametrize("kernel", ["reference", "cpu-flash", "triton"])
def test_multi_query_heads_with_sinks_and_a_window(kernel):
    _check(kernel, ([37, 18], [37, 18]), 5, None, True, seed=3, heads=(4, 1))


def test_a_window_longer_than_every_sequence_is_plain_causal_bit_for_bit():
    q, k, v, _ = segment_leaves([12, 30], [12, 30], heads_q=2, heads_kv=1, head_dim=16, seed=4, sinks=False)
    cu = _offsets([12, 30])
    plain = codegen.packed_attention(q, k, v, cu, 30, kernel="cpu-flash")
    wide = codegen.packed_attention(q, k, v, cu, 30, kernel="cpu-flash", window=29, chunk=30)
    assert torch.equal(plain, wide)


def test_zero_sinks_scale_the_output_by_one_over_one_plus_exp_minus_lse():
    """With a sink of 0 every row's weights sum to 1 - exp(-lse'): checked against plain attention's lse."""
    q, k, v, _ = segment_leaves([9], [9], heads_q=2, heads_kv=2, head_dim=16, seed=5, sinks=False)
    cu = _offsets([9])
    out, lse = codegen.packed_attention_op(q, k, v, cu, 9, True, 0.25, None, "reference")
    sunk, lse_sunk = codegen.packed_attention_op(q, k, v, cu, 9, True, 0.25, None, "reference", None, None, -1, 0,
                                                 torch.zeros(2))
    torch.testing.assert_close(lse_sunk, torch.logaddexp(lse, torch.zeros(())))
    torch.testing.assert_close(sunk, out * torch.exp(lse - lse_sunk).T[..., None])


def test_opcheck_with_limits():
    q, k, v, s = segment_leaves([7, 12], [7, 12], heads_q=2, heads_kv=1, head_dim=16, seed=6, sinks=True)
    for kernel in ("reference", "cpu-flash", "triton"):
        torch.library.opcheck(codegen.packed_attention_op,
                              (q, k, v, _offsets([7, 12]), 12, True, 0.25, None, kernel, None, None, 3, 8, s))


def test_limits_contract():
    q, k, v, s = segment_leaves([8], [8], heads_q=2, heads_kv=1, head_dim=16, seed=7, sinks=True)
    cu = _offsets([8])
    with pytest.raises(ValueError, match="window must be None or an int >= 0"):
        codegen.packed_attention(q, k, v, cu, 8, window=-2)
    with pytest.raises(ValueError, match="chunk must be None or an int >= 1"):
        codegen.packed_attention(q, k, v, cu, 8, chunk=0)
    with pytest.raises(ValueError, match="limit causal attention"):
        codegen.packed_attention(q, k, v, cu, 8, causal=False, window=3)
    with pytest.raises(ValueError, match=r"one logit per query head \(2\), got \(3,\)"):
        codegen.packed_attention(q, k, v, cu, 8, sinks=torch.zeros(3))
