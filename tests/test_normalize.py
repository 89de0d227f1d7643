"""Canonical attention: repeat_kv folded into SDPA's grouped-query form (Before/Expected), the same values,
and graphs that only look alike left alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import hcompile
from passes.graph.analyze import SDPA_TARGETS
from passes.graph.normalize import fold_repeat_kv_pass
from passes.graph.pass_runner import PassContext


class _RepeatKV(nn.Module):
    """Hugging Face's repeat_kv: each of 2 kv heads repeated for its 2 query heads."""

    def __init__(self, n_rep: int = 2, merge: bool = True):
        super().__init__()
        self.n_rep, self.merge = n_rep, merge

    def forward(self, q, k, v):  # q (1, 4, T, 8), k and v (1, 2, T, 8)
        b, kv, t, d = k.shape
        if self.merge:
            k = k[:, :, None, :, :].expand(b, kv, self.n_rep, t, d).reshape(b, kv * self.n_rep, t, d)
            v = v[:, :, None, :, :].expand(b, kv, self.n_rep, t, d).reshape(b, kv * self.n_rep, t, d)
        else:  # repeat_interleave: a different op, left to SDPA as it is
            k, v = k.repeat_interleave(self.n_rep, dim=1), v.repeat_interleave(self.n_rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 4, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g),
            torch.randn(1, 2, 6, 8, generator=g))


def test_repeat_kv_becomes_grouped_query_sdpa():
    model = _RepeatKV()
    gm = hcompile.capture(model, *_inputs()).graph_module
    before = sum(1 for n in gm.graph.nodes if n.op == "call_method" and n.target in ("expand", "reshape"))
    result = fold_repeat_kv_pass(gm, PassContext())
    assert before == 4 and result.modified and result.info == {"folded": 1}
    nodes = list(result.graph_module.graph.nodes)
    assert not any(n.op == "call_method" and n.target in ("expand", "reshape") for n in nodes)
    (sdpa,) = [n for n in nodes if n.op == "call_function" and n.target in SDPA_TARGETS]
    assert sdpa.kwargs["enable_gqa"] is True and [a.op for a in sdpa.args[:3]] == ["placeholder"] * 3
    given = dict(zip("qkv", _inputs()))
    order = [n.name.split("_")[1] for n in nodes if n.op == "placeholder"]  # dynamo orders inputs by first use
    torch.testing.assert_close(result.graph_module(*(given[k] for k in order))[0], model(*_inputs()))


def test_look_alikes_are_left_alone():
    gm = hcompile.capture(_RepeatKV(merge=False), *_inputs()).graph_module
    assert fold_repeat_kv_pass(gm, PassContext()).modified is False
