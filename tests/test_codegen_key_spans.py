"""Packed attention with keys on their own spans (``cu_seqlens_k``): the shape context parallelism runs, a query
chunk of a long sequence against the keys up to its end, causal aligned at the bottom right. Every kernel, forward
and backward, against an independent float64 oracle built from absolute token positions; and the contract."""

from __future__ import annotations

import itertools

import pytest
import torch
from codegen_cases import segment_leaves, segment_oracle

import codegen


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _segments(queries: list[int], keys: list[int], *, heads_q: int, heads_kv: int, head_dim: int, seed: int):
    q, k, v, _ = segment_leaves(queries, keys, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, seed=seed)
    return q, k, v, _offsets(queries), _offsets(keys)


CASES = [
    # (query spans, key spans): chunks of long sequences (fewer queries than keys) beside whole sequences
    ([8, 8, 5], [16, 40, 5]),
    ([3, 0, 12, 7], [3, 0, 25, 31]),
    ([17], [17]),
]


@pytest.mark.parametrize("kernel", ["reference", "cpu-flash", "triton"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_key_spans_match_the_oracle(kernel, causal, case):
    queries, keys = CASES[case]
    q, k, v, cu_q, cu_k = _segments(queries, keys, heads_q=4, heads_kv=2, head_dim=16, seed=case)
    scale = 16 ** -0.5
    out = codegen.packed_attention(q, k, v, cu_q, max(queries), causal=causal, kernel=kernel,
                                   cu_seqlens_k=cu_k, max_seqlen_k=max(keys))
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want_out = segment_oracle(q, k, v, queries, keys, causal=causal, scale=scale)
    want = torch.autograd.grad(want_out, (q, k, v), grad)
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=2e-5)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5, msg=lambda m, n=name: f"d{n}: {m}")


def test_equal_spans_give_the_self_attention_result():
    """Key spans equal to the query spans are plain packed attention, bit for bit on the reference."""
    q, k, v, cu, _ = _segments([5, 9, 3], [5, 9, 3], heads_q=2, heads_kv=1, head_dim=16, seed=4)
    plain = codegen.packed_attention(q, k, v, cu, 9, kernel="reference")
    spans = codegen.packed_attention(q, k, v, cu, 9, kernel="reference", cu_seqlens_k=cu.clone(), max_seqlen_k=9)
    assert torch.equal(plain, spans)


def test_contract_errors_name_the_bad_value():
    q, k, v, cu_q, cu_k = _segments([8, 4], [6, 10], heads_q=2, heads_kv=1, head_dim=16, seed=0)
    with pytest.raises(ValueError, match="span 0 has 8 queries but 6 keys"):
        codegen.packed_attention(q, k, v, cu_q, 8, kernel="reference", cu_seqlens_k=cu_k, max_seqlen_k=10)
    with pytest.raises(ValueError, match="1 key spans but cu_seqlens has 2"):
        codegen.packed_attention(q, k, v, cu_q, 8, kernel="reference",
                                 cu_seqlens_k=torch.tensor([0, 16], dtype=torch.int32), max_seqlen_k=16)
    with pytest.raises(ValueError, match="come together"):
        codegen.packed_attention(q, k, v, cu_q, 8, kernel="reference", cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="q has 12 tokens but k and v have 16"):
        codegen.packed_attention(q, k, v, cu_q, 8, kernel="reference")
