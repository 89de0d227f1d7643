"""The self-check's probe (``hcompile.verify.probe_plan``): at each scheme's largest bucket, a long sequence filling
most of it and longer than every window the model keeps, plus short ones; ``self_check_max_tokens`` bounds it
and the plan says what the bound left out; what the probe costs at 7B and 32B."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import hcompile
from hcompile.verify import probe_plan, self_check_cost
from passes.graph.attention_masks import MaskLimits
from passes.graph.variant import TokenBuckets
from passes.plan.ir import ParallelScheme


class _WindowLM(nn.Module):
    """A one-layer LM whose attention keeps a sliding window of ``window`` keys (Hugging Face's convention)."""

    def __init__(self, window: int):
        super().__init__()
        self.window = window
        self.embed, self.qkv, self.head = nn.Embedding(32, 16), nn.Linear(16, 48), nn.Linear(16, 32)

    def forward(self, ids):  # ids: (1, T)
        t = ids.shape[1]
        pos = torch.arange(t)[None]
        seq = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        q_idx, kv_idx = torch.arange(t)[:, None], torch.arange(t)[None, :]
        qp, kp = pos[0][q_idx], pos[0][kv_idx]
        keep = (kp <= qp) & (kp > qp - self.window) & (seq[0][q_idx] == seq[0][kv_idx])
        q, k, v = self.qkv(self.embed(ids)).view(1, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[None, None])
        return self.head(out.transpose(1, 2).reshape(1, t, 16))


def _cache(window: int, cap: int):
    compiled = hcompile.compile(_WindowLM(window), buckets=TokenBuckets(sizes=(16, 32, 64, 128)))
    return compiled.lowerings(cost_tokens=lambda scheme: cap * scheme.cp)


def test_the_probe_runs_at_the_largest_bucket_and_crosses_every_window():
    cache = _cache(window=50, cap=100)
    lowering = cache.lowering(ParallelScheme(), 0)
    assert [limits for _, limits in lowering.attention] == [MaskLimits(window=49)]
    probe = probe_plan(cache, lowering)
    assert probe.bucket == 128 and probe.skipped is None
    assert probe.lens[0] > 49 and probe.lens[0] <= 100 and len(probe.lens) >= 2 and sum(probe.lens) <= 128


def test_a_cp_scheme_probes_sequences_cp_times_the_bucket():
    cache = _cache(window=20, cap=64)
    probe = probe_plan(cache, cache.lowering(ParallelScheme(cp=2), 0, cp_rank=0, cp_group="g"))
    assert probe.bucket == 64 and probe.lens[0] == 96 and sum(probe.lens) <= 128


def test_the_bound_moves_the_probe_down_and_says_what_it_left_out():
    cache = _cache(window=50, cap=100)
    probe = probe_plan(cache, cache.lowering(ParallelScheme(), 0), max_tokens=40)
    assert probe.bucket == 32 and sum(probe.lens) <= 32
    assert "buckets 64..128 tokens per rank" in probe.skipped
    assert "sequences longer than its longest window or chunk (49 tokens)" in probe.skipped


def test_what_the_probe_costs_at_7b_and_32b():
    need, flops = self_check_cost(7 * 10**9, 16384, 2)
    assert (round(need / 1e9), round(flops / 1e15, 1)) == (70, 1.4)
    need, flops = self_check_cost(32 * 10**9, 16384, 2)
    assert (round(need / 1e9), round(flops / 1e15, 1)) == (320, 6.3)

