"""Context parallelism: the layout (every token exactly once, balanced causal work, whole-sequence positions) and
the attention over a CP group on 2 and 4 gloo ranks, forward and backward, against one process's packed
attention over the whole sequences (an independent float64 dense oracle)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_util import run_ranks

from passes.graph.context_parallel import CpAttentionInputs, CpPiece, cp_attention, cp_layout


def _causal_work(piece: CpPiece) -> float:
    """Query-key pairs a piece's rows attend: rows start..stop-1, each seeing its prefix."""
    return (piece.stop * (piece.stop + 1) - piece.start * (piece.start + 1)) / 2


def test_layout_covers_every_token_once_with_whole_sequence_positions():
    lengths = [40, 3, 0, 17, 64, 5]
    layout = cp_layout(lengths, cp=4, split_at=16)
    seen = {(seq, i) for r in range(4) for p in layout.ranks[r] for seq, i in ((p.seq, j) for j in range(p.start,
                                                                                                         p.stop))}
    assert seen == {(s, i) for s, n in enumerate(lengths) for i in range(n)}
    assert sum(layout.tokens(r) for r in range(4)) == sum(lengths)
    for r in range(4):
        assert layout.positions(r) == [i for p in layout.ranks[r] for i in range(p.start, p.stop)]
    # no rank above the even share: a micro-batch within a CP replica's cap fits every rank's
    assert max(layout.tokens(r) for r in range(4)) <= -(-sum(lengths) // 4)
    # the longest (64, split first, the ranks level) gives every rank chunks r and 7 - r of 8 tokens: equal work
    assert [[(p.start, p.stop) for p in layout.ranks[r] if p.seq == 4] for r in range(4)] == [
        [(8 * r, 8 * r + 8), (56 - 8 * r, 64 - 8 * r)] for r in range(4)]
    assert len({sum(_causal_work(p) for p in layout.ranks[r] if p.seq == 4) for r in range(4)}) == 1
    # a short one whole, on one rank, where it fits
    assert sum(1 for r in range(4) for p in layout.ranks[r] if p.seq == 5) == 1


@pytest.mark.parametrize("seed", range(20))
def test_layout_never_puts_a_rank_above_the_even_share(seed):
    g = torch.Generator().manual_seed(seed)
    cp = [2, 4, 8][seed % 3]
    lengths = torch.randint(0, 300, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
    layout = cp_layout(lengths, cp)
    tokens = [layout.tokens(r) for r in range(cp)]
    assert max(tokens) <= -(-sum(lengths) // cp), (lengths, tokens)
    covered = sorted((p.seq, i) for r in range(cp) for p in layout.ranks[r] for i in range(p.start, p.stop))
    assert covered == [(s, i) for s, n in enumerate(lengths) for i in range(n)]


def test_layout_errors_name_the_value():
    with pytest.raises(ValueError, match="cp=0"):
        cp_layout([4], cp=0)
    with pytest.raises(ValueError, match=r"\[4, -1\]"):
        cp_layout([4, -1], cp=2)


def test_one_rank_is_plain_packed_attention():
    layout = cp_layout([9, 4], cp=1)
    assert layout.ranks == ((layout.ranks[0][0], layout.ranks[0][1]),) and layout.tokens(0) == 13


def _dense(q, k, v, lengths, window=None, chunk=None, sinks=None):
    """Causal attention of each whole sequence (within a window and chunks, with sinks), float64 dense, plain
    autograd."""
    outs, at = [], 0
    group = q.shape[1] // k.shape[1]
    for n in lengths:
        qs = q[at:at + n].double().transpose(0, 1)
        ks = k[at:at + n].double().repeat_interleave(group, 1).transpose(0, 1)
        vs = v[at:at + n].double().repeat_interleave(group, 1).transpose(0, 1)
        scores = (qs @ ks.transpose(1, 2)) / qs.shape[-1] ** 0.5
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        hidden = (j > i) | ((i - j > window) if window is not None else False) | \
            ((i // chunk != j // chunk) if chunk is not None else False)
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None, None].expand(-1, n, 1)], dim=-1)
        outs.append((torch.softmax(scores, -1)[..., :n] @ vs).transpose(0, 1))
        at += n
    return torch.cat(outs).float()


def _local_rows(layout, rank, lengths):
    starts = [sum(lengths[:s]) for s in range(len(lengths))]
    return torch.tensor([starts[p.seq] + i for p in layout.ranks[rank] for i in range(p.start, p.stop)],
                        dtype=torch.long)


def _cp_worker(rank, world, lengths, split_at, kernel, limits):
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    window, chunk, with_sinks = limits
    torch.manual_seed(0)  # the same whole tensors on every rank; each rank keeps its own rows
    total, heads_q, heads_kv, dim = sum(lengths), 8, 4, 16
    q, k, v = (torch.randn(total, h, dim) for h in (heads_q, heads_kv, heads_kv))
    grad = torch.randn(total, heads_q, dim)
    sinks = torch.randn(heads_q) if with_sinks else None
    layout = cp_layout(lengths, cp=world, split_at=split_at)
    rows = _local_rows(layout, rank, lengths)
    wq, wk, wv = (x.clone().requires_grad_() for x in (q, k, v))
    ws = sinks.clone().requires_grad_() if with_sinks else None
    want = _dense(wq, wk, wv, lengths, window, chunk, ws)
    (want * grad).sum().backward()
    inputs = CpAttentionInputs.build(layout, rank)
    for splits in (1, 2, 4):  # one all-gather, and the exchange pipelined over 2 and 4 head groups (GQA: 2 q heads
        # per kv head, so a group's query heads must follow its kv heads)
        lq, lk, lv = (x[rows].clone().requires_grad_() for x in (q, k, v))
        ls = sinks.clone().requires_grad_() if with_sinks else None
        out = cp_attention(lq, lk, lv, inputs, dist.group.WORLD.group_name, kernel=kernel, window=window,
                           chunk=chunk, sinks=ls, kv_splits=splits)
        (out * grad[rows]).sum().backward()
        if with_sinks:  # each rank's rows add their part of the sinks' gradient
            summed = ls.grad.clone()
            dist.all_reduce(summed)
            torch.testing.assert_close(summed, ws.grad, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out, want[rows], atol=3e-5, rtol=3e-5, msg=lambda m, n=splits: f"{n}: {m}")
        for name, got, ref in (("q", lq.grad, wq.grad), ("k", lk.grad, wk.grad), ("v", lv.grad, wv.grad)):
            torch.testing.assert_close(got, ref[rows], atol=1e-4, rtol=1e-4,
                                       msg=lambda m, n=name, s=splits: f"splits {s}, d{n}: {m}")
    return layout.tokens(rank)


@pytest.mark.parametrize("world,lengths,split_at,kernel,limits", [
    (2, [37, 6, 21, 2], 16, "cpu-flash", (None, None, False)),   # two split sequences (odd lengths), two whole ones
    (4, [70, 9, 33, 1], 16, "reference", (None, None, False)),
    (2, [24, 11], 16, "triton", (None, None, False)),            # the Triton kernels under the interpreter
    # a window and chunks shorter than the split sequences, which positions count over the whole sequence
    (2, [37, 6, 21, 2], 16, "cpu-flash", (9, None, True)),
    (4, [70, 9, 33, 1], 16, "reference", (20, 16, True)),
    (2, [40, 11], 16, "triton", (None, 16, True)),
])
def test_cp_attention_matches_whole_sequence_attention(tmp_path, world, lengths, split_at, kernel, limits):
    tokens = run_ranks(world, tmp_path, _cp_worker, lengths, split_at, kernel, limits, timeout_s=300)
    assert sum(tokens) == sum(lengths)
