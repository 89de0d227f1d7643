"""Attention masks (``passes.graph.attention_masks``): a mask built from positions is fitted to causal limits
exactly (a window, chunks, both) or refused with what it does; the limits are decided on the largest bucket and
every smaller bucket must agree; a mask constant that could limit sequences longer than any capture (context
parallelism) is refused; the cost model's attention shape counts the kept pairs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hcompile
from codegen.reference import causal_mask
from passes.graph.attention_masks import (
    MaskLimits,
    attention_shape,
    classify_mask,
    decide_attention_limits,
    fit_limits,
)
from passes.graph.normalize import canonical_graph
from passes.graph.pass_runner import PassError
from passes.plan.ir import AttentionShape


@pytest.mark.parametrize("window, chunk", [(None, None), (0, None), (3, None), (18, None), (None, 1), (None, 5),
                                           (None, 7), (2, 6), (4, 5), (30, 6)])
def test_every_window_and_chunk_is_fitted_exactly(window, chunk):
    visible = causal_mask(20, torch.device("cpu"), window=window, chunk=chunk)
    fitted = fit_limits(visible)
    assert isinstance(fitted, MaskLimits)
    assert torch.equal(causal_mask(20, torch.device("cpu"), window=fitted.window, chunk=fitted.chunk), visible)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.__setitem__((3, 5), True), "is not causal: query 3 sees the later key 5"),
    (lambda m: m.__setitem__((6, 6), False), "hides query 6 from itself"),
    (lambda m: m.__setitem__((9, 4), False), "not one run ending at it"),
    (lambda m: m.__setitem__((9, slice(0, 9)), False) or m.__setitem__((9, 0), True), "not one run"),
])
def test_other_masks_say_what_they_do(edit, message):
    visible = causal_mask(12, torch.device("cpu"))
    edit(visible)
    assert message in fit_limits(visible)


def test_a_pattern_no_window_or_chunk_gives_is_named():
    visible = causal_mask(12, torch.device("cpu"), window=2)
    visible[7] = causal_mask(12, torch.device("cpu"), window=4)[7]  # one row sees further back
    assert fit_limits(visible).endswith("which no window or chunk gives")


class _Limited(nn.Module):
    """Attention under a mask built from positions: ``window`` (Hugging Face's sliding_window: keys i - w + 1 .. i)
    and ``chunk`` counted on positions (restarting per sequence), or chunks counted on the token index
    (``by_index``: not per sequence); ``bias`` adds a position bias instead (ALiBi-like)."""

    def __init__(self, window=None, chunk=None, by_index=False, bias=False, threshold=None):
        super().__init__()
        self.window, self.chunk, self.by_index, self.bias, self.threshold = window, chunk, by_index, bias, threshold
        self.proj = nn.Linear(32, 32)
        self.register_buffer("chunk_of_index", torch.arange(64) // (chunk or 1))  # a table read by token index

    def forward(self, x):  # x: (1, T, 32)
        t = x.shape[1]
        pos = torch.arange(t)[None]  # (1, T) positions
        seq = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        q_idx, kv_idx = torch.arange(t)[:, None], torch.arange(t)[None, :]
        qp, kp = pos[0][q_idx], pos[0][kv_idx]
        keep = (kp <= qp) & (seq[0][q_idx] == seq[0][kv_idx])
        if self.window is not None:
            keep = keep & (kp > qp - self.window)
        if self.chunk is not None:
            keep = keep & ((self.chunk_of_index[q_idx] == self.chunk_of_index[kv_idx]) if self.by_index else
                           (qp // self.chunk == kp // self.chunk))
        if self.threshold is not None:  # a comparison with a constant that only matters past it
            keep = keep & ((qp - kp < self.threshold) | (qp < self.threshold))
        q = self.proj(x + pos[..., None]).view(1, t, 2, 16).transpose(1, 2)
        mask = keep[None, None]
        if self.bias:
            mask = torch.zeros(1, 1, t, t).masked_fill(~keep, float("-inf")) - 0.5 * (qp - kp).float()
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def _canonical(model: nn.Module, tokens: int):
    return canonical_graph(hcompile.capture(model, torch.randn(1, tokens, 32)).graph_module)


def _site(gm):
    return next(n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention)


@pytest.mark.parametrize("window, chunk, expected", [(5, None, MaskLimits(window=4)),
                                                     (None, 8, MaskLimits(chunk=8)),
                                                     (3, 6, MaskLimits(window=2, chunk=6)),
                                                     (40, None, MaskLimits())])
def test_classify_finds_the_limits_of_a_position_mask(window, chunk, expected):
    gm = _canonical(_Limited(window, chunk), 24)
    assert classify_mask(gm, _site(gm), 24) == expected


@pytest.mark.parametrize("model, message", [
    (_Limited(chunk=8, by_index=True), "on a sequence of 6 tokens packed at token 14 of 24"),
    (_Limited(bias=True), "adds a bias to the scores .* as ALiBi does"),
])
def test_masks_the_op_cannot_take_are_refused_by_name(model, message):
    gm = _canonical(model, 24)
    with pytest.raises(PassError, match=message):
        classify_mask(gm, _site(gm), 24)


def test_limits_are_decided_on_the_largest_bucket_and_checked_on_the_others():
    model = _Limited(window=20)
    captures = [_canonical(model, t) for t in (16, 32)]
    decided = decide_attention_limits(captures, longest=32)
    assert list(decided.values()) == [MaskLimits(window=19)]  # the 16-token capture shows no window: it agrees


def test_a_mask_that_changes_with_the_bucket_is_refused():
    small, large = _canonical(_Limited(window=3), 16), _canonical(_Limited(window=5), 32)
    with pytest.raises(PassError, match="keeps causal, window 2 in the capture of 16 tokens but causal, window 4"):
        decide_attention_limits([small, large], longest=32)


def test_a_constant_no_capture_reaches_is_refused_when_sequences_are_longer():
    """Context parallelism trains sequences of 64 tokens on captures of 32: a window of 40 would bite there and
    cannot show in any capture."""
    captures = [_canonical(_Limited(window=41), 32)]
    assert decide_attention_limits(captures, longest=32) == {_site(captures[0]).name: MaskLimits()}
    with pytest.raises(PassError, match="compares positions with 41 in its mask, .* beyond the 32 tokens"):
        decide_attention_limits(captures, longest=64)
    with pytest.raises(PassError, match="compares positions with 40"):
        decide_attention_limits([_canonical(_Limited(threshold=40), 32)], longest=64)


def test_the_attention_shape_counts_the_pairs_a_window_or_chunk_keeps():
    for window, chunk in ((None, None), (7, None), (None, 16), (31, None)):
        shape = AttentionShape(limited=((1.0, window, chunk),)) if (window, chunk) != (None, None) else \
            AttentionShape()
        for s in (1, 5, 8, 16, 17, 40, 100):
            kept = int(causal_mask(s, torch.device("cpu"), window=window, chunk=chunk).sum())
            # attention work counted as s^2 for causal s(s+1)/2 pairs: the shape keeps the same ratio
            assert shape.quadratic(s) == pytest.approx(2 * kept - s, abs=1e-9)
    half = AttentionShape(limited=((0.5, 3, None),))
    assert half.quadratic(100.0) == pytest.approx(0.5 * 100 ** 2 + 0.5 * (100 ** 2 - 96 * 97))
    with pytest.raises(Exception, match="add up to more than 1"):
        AttentionShape(limited=((0.7, 3, None), (0.6, None, 8)))


def test_attention_shape_weighs_sites_by_heads():
    gm = _canonical(_Limited(window=5), 16)
    shape = attention_shape(gm, {_site(gm).name: MaskLimits(window=4)})
    assert shape.limited == ((1.0, 4, None),)
    assert attention_shape(gm, {}).limited == ()
