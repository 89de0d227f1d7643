"""Overlapped movement (``runtime.overlap``): the layout's windows, and window-by-window pull and push on gloo
ranks that move exactly what the rounds of ``runtime.redistribute`` move, whatever order each rank finishes
its windows' gradients in, with messages cut into small chunks."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_ranks

from passes.graph.tensor_parallel import ParamSlice
from runtime.fixed_layout import FixedLayout
from runtime.overlap import layout_windows, overlap_buffer_bytes

SHAPES = {"p0": (13,), "p1": (4, 5), "p2": (31,), "p3": (7, 3), "p4": (17,)}
SPLIT = {"p1": 1, "p3": 0}
"""Split dims of a layout with two regions (p0, p2, p4 whole first; then p1, p3)."""


def _values() -> dict[str, torch.Tensor]:
    flat, out, at = torch.arange(102, dtype=torch.float32) * 0.5, {}, 0
    for name, shape in SHAPES.items():
        n = torch.Size(shape).numel()
        out[name] = flat[at:at + n].reshape(shape).clone()
        at += n
    return out


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("dims", [{}, SPLIT])
def test_windows_cover_the_layout_at_parameter_boundaries(count, dims):
    layout = FixedLayout(SHAPES, rank=0, world_size=4, split_dims=dims)
    windows = layout_windows(layout, count)
    assert windows[0][0] == 0 and windows[-1][1] == layout.numel
    assert all(a[1] == b[0] for a, b in zip(windows, windows[1:])) and 1 <= len(windows) <= count + bool(dims)
    starts = {spec.offset for spec in layout.specs.values()}
    assert all(lo in starts for lo, _ in windows)
    for lo, hi in layout.regions:  # no window crosses a region's boundary
        assert all(b <= lo or a >= hi or (lo <= a and b <= hi) for a, b in windows), (windows, layout.regions)
    if not dims:
        assert all(hi - lo >= layout.numel / count for lo, hi in windows[:-1]), windows  # none smaller than due


def test_a_bad_window_count_is_refused():
    layout = FixedLayout(SHAPES, rank=0, world_size=2)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="number of movement windows"):
            layout_windows(layout, bad)


def _move(rank, world, subsets, orders, chunk, windows, dims):
    from runtime.overlap import WindowedMovement
    from runtime.redistribute import Redistribution
    from runtime.stage_params import StageParams

    layout = FixedLayout.from_tensors(_values(), rank, world, split_dims=dims)
    params = StageParams(layout, {n: ParamSlice(name=n, full_shape=SHAPES[n]) for n in subsets[rank]}, tp=1)
    move = Redistribution.build(layout, params.ranges, chunk_numel=chunk)
    plan = WindowedMovement(move, layout, layout_windows(layout, windows), chunk)
    flat = params.materialize()
    flat.fill_(-1.0)
    pull = plan.start_pull(layout, flat)
    posted = [len(pull._works)]  # windows posted before any is waited
    pull.wait(0)
    posted.append(len(pull._works))
    pull.wait_all()
    params.zero_grads()
    with torch.no_grad():
        params.grad_flat.copy_(flat * (rank + 1))  # rank r's gradient: (r + 1) times each element it holds
    push = plan.start_push(params, torch.float32, layout)
    for name in orders[rank]:  # the last backward finishing parameters in this order; the rest at the end
        push.accumulated(name)
    traffic = pull.traffic + push.finish(layout)
    return (flat.clone(), layout.shard.grad.clone(), traffic, move.local_numel, move.served_numel(), posted,
            len(plan.windows))


@pytest.mark.parametrize(("world", "chunk", "windows", "dims"), [(4, 5, 3, {}), (2, 1000, 8, {}), (4, 3, 4, SPLIT)])
def test_windowed_pull_and_push_move_exactly_the_slices(tmp_path, world, chunk, windows, dims):
    g = torch.Generator().manual_seed(world + chunk)
    names = list(SHAPES)
    subsets = [[n for n in names if torch.rand(1, generator=g) < 0.6] or ["p2"] for _ in range(world)]
    orders = [[subset[i] for i in torch.randperm(len(subset), generator=g)[: max(1, len(subset) - 1)]]
              for subset in subsets]
    results = run_ranks(world, tmp_path, _move, subsets, orders, chunk, windows, dims)
    values = _values()
    layout = FixedLayout(SHAPES, 0, world, split_dims=dims)
    expected_grad = torch.zeros(layout.numel)
    for rank, subset in enumerate(subsets):
        for n in subset:
            spec = layout.specs[n]
            expected_grad[spec.offset:spec.offset + spec.numel] += spec.stored(values[n]).flatten() * (rank + 1)
    for rank, (flat, shard_grad, traffic, local, served, posted, count) in enumerate(results):
        assert posted == [count, count], posted  # the whole pull posted before the compute starts
        want = torch.cat([layout.specs[n].stored(values[n]).flatten() for n in layout.specs if n in subsets[rank]])
        assert torch.equal(flat, want), f"rank {rank} pulled other elements"
        expected_shard = torch.zeros(layout.shard_numel)
        for lo, hi, pos in layout.owned(rank):
            expected_shard[pos:pos + hi - lo] = expected_grad[lo:hi]
        torch.testing.assert_close(shard_grad, expected_shard)
        assert traffic.params_received == traffic.grads_sent == (want.numel() - local) * 4
        assert traffic.params_sent == traffic.grads_received == served * 4


def test_windows_are_bounded_in_size_and_what_flies_is_counted(monkeypatch):
    """A model larger than eight windows of ``MAX_WINDOW_NUMEL`` is cut into more windows, none larger than it
    where the parameters allow; the buffers the memory model charges are the shard served to every replica both
    ways and the compute copy's gradients once."""
    import runtime.overlap as overlap

    monkeypatch.setattr(overlap, "MAX_WINDOW_NUMEL", 20)
    layout = FixedLayout(SHAPES, rank=0, world_size=2)
    windows = layout_windows(layout, 2)
    assert len(windows) > 2
    sizes = {lo: layout.specs[n].numel for n, spec in layout.specs.items() for lo in [spec.offset]}
    assert all(hi - lo <= 20 or hi - lo == sizes[lo] for lo, hi in windows), windows  # or one larger parameter
    assert overlap_buffer_bytes(1000, 4000, 8, param_bytes=2, reduce_bytes=4) == 1000 * 8 * 6 + 4000 * 4
