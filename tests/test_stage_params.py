"""A stage's compute copy: Parameters viewing one flat buffer in the layout's order, gradients of every call
accumulated into one flat gradient buffer, factors for replicated slices, storage only while in use."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from passes.graph.tensor_parallel import ParamSlice
from runtime.fixed_layout import FixedLayout
from runtime.stage_params import StageParams

SHAPES = {"a": (4, 3), "b": (3, 4), "n": (3,)}


def _slices():
    return {"a": ParamSlice(name="a", full_shape=(4, 3), dim=0, ranges=((2, 4),)),
            "b": ParamSlice(name="b", full_shape=(3, 4), dim=1, ranges=((0, 2),)),
            "n": ParamSlice(name="n", full_shape=(3,))}


def test_parameters_view_the_flat_buffer_in_layout_order():
    layout = FixedLayout(SHAPES, 0, 1, split_dims={"a": 0, "b": 1})
    params = StageParams(layout, _slices(), tp=2)
    assert params.numel == 6 + 6 + 3
    # n (never split) comes first in the layout; a rows 2..4 and b (stored (4, 3)) rows 0..2 touch: joined
    assert params.ranges == [(0, 3), (9, 21)]
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    layout.fill_from(full)
    flat = params.materialize()
    flat.copy_(torch.cat([layout.shard.detach()[a:b] for a, b in params.ranges]))
    for name, slc in _slices().items():
        assert torch.equal(params.params[name], slc.take(full[name])), name
        assert params.params[name].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_gradients_of_every_call_accumulate_once_with_factors():
    layout = FixedLayout(SHAPES, 0, 1, split_dims={"a": 0, "b": 1})
    params = StageParams(layout, _slices(), tp=2)
    params.materialize()
    params.fill_from({n: torch.ones(s) for n, s in SHAPES.items()})
    params.zero_grads()
    x = torch.ones(5, 3)
    for _ in range(3):  # three micro-batches (any buckets): one gradient buffer
        (F.linear(x, params.params["a"]).sum() + (params.params["b"] * 2).sum() + params.params["n"].sum()).backward()
    grads = params.weighted_grads()
    n, a, b = grads[:3], grads[3:9], grads[9:]  # the layout's order: n, never split, first
    assert torch.equal(a, torch.full((6,), 15.0))  # d/dW sum(x W^T) = 5 per element, three times
    assert torch.equal(b, torch.full((6,), 6.0))
    assert torch.equal(n, torch.full((3,), 1.5))  # replicated on tp=2 ranks: counts half on each
    params.release()
    assert params.flat is None and params.grad_flat is None
    assert all(p.numel() == 0 and p.grad is None for p in params.params.values())


def test_bf16_copies_and_errors():
    layout = FixedLayout(SHAPES, 0, 1)
    params = StageParams(layout, _slices(), tp=2, dtype=torch.bfloat16)
    assert params.materialize().dtype == torch.bfloat16 and params.nbytes == 15 * 2
    with pytest.raises(RuntimeError, match="zero_grads"):
        StageParams(layout, _slices(), tp=2).weighted_grads()
    with pytest.raises(KeyError, match="'zzz'"):
        StageParams(layout, {"zzz": ParamSlice(name="zzz", full_shape=(2,))}, tp=1)


def test_replicated_slices_are_pushed_whole_by_tp_rank_0_alone():
    """With its TP rank known, rank 0 of the group pushes the replicated ``n`` at factor 1 and rank 1 not at
    all; the split slices as before. Without it (or at tp=1) every rank pushes everything."""
    layout = FixedLayout(SHAPES, 0, 1, split_dims={"a": 0, "b": 1})
    first = StageParams(layout, _slices(), tp=2, tp_rank=0)
    other = StageParams(layout, _slices(), tp=2, tp_rank=1)
    legacy = StageParams(layout, _slices(), tp=2)
    assert first.ranges == other.ranges == legacy.ranges == [(0, 3), (9, 21)]
    assert first.push_ranges == legacy.push_ranges == [(0, 3), (9, 21)] and other.push_ranges == [(9, 21)]
    assert legacy.weights == [(0, 3, 0.5)] and first.weights == [] and other.weights == []
    for params in (first, other):
        params.materialize()
        params.fill_from({n: torch.ones(s) for n, s in SHAPES.items()})
        params.zero_grads()
        params.params["n"].sum().backward()
        assert torch.equal(params.weighted_grads()[:3], torch.ones(3))  # whole: only rank 0's is pushed
    single = StageParams(layout, {"n": ParamSlice(name="n", full_shape=(3,))}, tp=1, tp_rank=0)
    assert single.push_ranges == single.ranges == [(0, 3)]
    for bad in (2, -1, True, 0.0):
        with pytest.raises(ValueError, match=f"tp_rank must be an integer in \\[0, 2\\).*got {bad!r}"):
            StageParams(layout, _slices(), tp=2, tp_rank=bad)
