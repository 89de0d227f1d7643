"""Context parallelism: the layout (every token exactly once, balanced causal work, whole-sequence positions) and
the attention over a CP group on 2 and 4 gloo ranks, forward and backward, against one process's packed
attention over the whole sequences (an independent float64 dense oracle)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_util import run_ranks

from passes.graph.context_parallel import CpAttentionInputs, _causal_work, cp_attention, cp_layout


def test_layout_covers_every_token_once_with_whole_sequence_positions():
    lengths = [40, 3, 0, 17, 64, 5]
    layout = cp_layout(lengths, cp=4, split_at=16)
    seen = {(seq, i) for r in range(4) for p in layout.ranks[r] for seq, i in ((p.seq, j) for j in range(p.start,
                                                                                                         p.stop))}
    assert seen == {(s, i) for s, n in enumerate(lengths) for i in range(n)}
    assert sum(layout.tokens(r) for r in range(4)) == sum(lengths)
    for r in range(4):
        assert layout.positions(r) == [i for p in layout.ranks[r] for i in range(p.start, p.stop)]
    # the split sequences (40, 17, 64) give every rank chunks r and 7 - r: the same causal work, to one chunk
    for seq in (0, 3, 4):
        work = [sum(_causal_work(p) for p in layout.ranks[r] if p.seq == seq) for r in range(4)]
        chunk = -(-lengths[seq] // 8)
        assert max(work) - min(work) <= 2 * chunk * lengths[seq] / 8 + chunk, (seq, work)
    assert all(len([p for p in layout.ranks[r] if p.seq == 4]) == 2 for r in range(4))
    # the short ones whole, on one rank each
    assert all(sum(1 for r in range(4) for p in layout.ranks[r] if p.seq == s) == 1 for s in (1, 5))


def test_layout_errors_name_the_value():
    with pytest.raises(ValueError, match="cp=0"):
        cp_layout([4], cp=0)
    with pytest.raises(ValueError, match=r"\[4, -1\]"):
        cp_layout([4, -1], cp=2)


def test_one_rank_is_plain_packed_attention():
    layout = cp_layout([9, 4], cp=1)
    assert layout.ranks == ((layout.ranks[0][0], layout.ranks[0][1]),) and layout.tokens(0) == 13


def _dense(q, k, v, lengths):
    """Causal attention of each whole sequence, float64 dense, plain autograd."""
    outs, at = [], 0
    group = q.shape[1] // k.shape[1]
    for n in lengths:
        qs = q[at:at + n].double().transpose(0, 1)
        ks = k[at:at + n].double().repeat_interleave(group, 1).transpose(0, 1)
        vs = v[at:at + n].double().repeat_interleave(group, 1).transpose(0, 1)
        scores = (qs @ ks.transpose(1, 2)) / qs.shape[-1] ** 0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        outs.append((torch.softmax(scores, -1) @ vs).transpose(0, 1))
        at += n
    return torch.cat(outs).float()


def _local_rows(layout, rank, lengths):
    starts = [sum(lengths[:s]) for s in range(len(lengths))]
    return torch.tensor([starts[p.seq] + i for p in layout.ranks[rank] for i in range(p.start, p.stop)],
                        dtype=torch.long)


def _cp_worker(rank, world, lengths, split_at, kernel):
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    torch.manual_seed(0)  # the same whole tensors on every rank; each rank keeps its own rows
    total, heads_q, heads_kv, dim = sum(lengths), 4, 2, 16
    q, k, v = (torch.randn(total, h, dim) for h in (heads_q, heads_kv, heads_kv))
    grad = torch.randn(total, heads_q, dim)
    layout = cp_layout(lengths, cp=world, split_at=split_at)
    rows = _local_rows(layout, rank, lengths)
    lq, lk, lv = (x[rows].clone().requires_grad_() for x in (q, k, v))
    inputs = CpAttentionInputs.build(layout, rank)
    out = cp_attention(lq, lk, lv, inputs, dist.group.WORLD.group_name, kernel=kernel)
    (out * grad[rows]).sum().backward()

    wq, wk, wv = (x.clone().requires_grad_() for x in (q, k, v))
    want = _dense(wq, wk, wv, lengths)
    (want * grad).sum().backward()
    torch.testing.assert_close(out, want[rows], atol=3e-5, rtol=3e-5)
    for name, got, ref in (("q", lq.grad, wq.grad), ("k", lk.grad, wk.grad), ("v", lv.grad, wv.grad)):
        torch.testing.assert_close(got, ref[rows], atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"d{n}: {m}")
    return layout.tokens(rank)


@pytest.mark.parametrize("world,lengths,split_at,kernel", [
    (2, [37, 6, 21, 2], 16, "cpu-flash"),   # two split sequences (odd lengths), two whole ones
    (4, [70, 9, 33, 1], 16, "reference"),
    (2, [24, 11], 16, "triton"),            # the Triton kernels under the interpreter
])
def test_cp_attention_matches_whole_sequence_attention(tmp_path, world, lengths, split_at, kernel):
    tokens = run_ranks(world, tmp_path, _cp_worker, lengths, split_at, kernel, timeout_s=300)
    assert sum(tokens) == sum(lengths)
