"""Overlapped movement (``runtime.overlap``): the layout's windows, and window-by-window pull and push on gloo
ranks that move exactly what the rounds of ``runtime.redistribute`` move, whatever order each rank finishes
its windows' gradients in, with messages cut into small chunks and the buffers in flight bounded (down to one
message at a time); both ranks of every message agree on its place in the order."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_ranks

from passes.graph.tensor_parallel import ParamSlice
from runtime.fixed_layout import FixedLayout
from runtime.overlap import largest_unit_numel, layout_windows, overlap_buffer_bytes

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


def _move(rank, world, subsets, orders, chunk, windows, dims, inflight):
    from runtime.overlap import WindowedMovement
    from runtime.redistribute import Redistribution
    from runtime.stage_params import StageParams

    layout = FixedLayout.from_tensors(_values(), rank, world, split_dims=dims)
    params = StageParams(layout, {n: ParamSlice(name=n, full_shape=SHAPES[n]) for n in subsets[rank]}, tp=1)
    move = Redistribution.build(layout, params.ranges, chunk_numel=chunk)
    plan = WindowedMovement(move, layout, layout_windows(layout, windows), chunk)
    flat = params.materialize()
    flat.fill_(-1.0)
    params.zero_grads()
    flight = plan.start(layout, flat, params, torch.float32, inflight_bytes=inflight)
    flight.wait(0)
    flight.wait_all()
    with torch.no_grad():
        params.grad_flat.copy_(flat * (rank + 1))  # rank r's gradient: (r + 1) times each element it holds
    for name in orders[rank]:  # the last backward finishing parameters in this order; the rest at the end
        flight.accumulated(name)
    traffic = flight.traffic + flight.finish(layout)
    units = {(u.key, u.peer): sorted((m.key, m.send) for m in u.messages) for u in plan.units}
    return (flat.clone(), layout.shard.grad.clone(), traffic, move.local_numel, move.served_numel(),
            flight.peak_bytes, units, [u.key for u in plan.units], largest_unit_numel(layout, plan.windows))


@pytest.mark.parametrize(("world", "chunk", "windows", "dims", "inflight"), [
    (4, 5, 3, {}, 0), (4, 5, 3, {}, 1 << 20), (2, 1000, 8, {}, 1 << 20), (4, 3, 4, SPLIT, 40)])
def test_windowed_pull_and_push_move_exactly_the_slices(tmp_path, world, chunk, windows, dims, inflight):
    g = torch.Generator().manual_seed(world + chunk)
    names = list(SHAPES)
    subsets = [[n for n in names if torch.rand(1, generator=g) < 0.6] or ["p2"] for _ in range(world)]
    orders = [[subset[i] for i in torch.randperm(len(subset), generator=g)[: max(1, len(subset) - 1)]]
              for subset in subsets]
    results = run_ranks(world, tmp_path, _move, subsets, orders, chunk, windows, dims, inflight)
    values = _values()
    layout = FixedLayout(SHAPES, 0, world, split_dims=dims)
    expected_grad = torch.zeros(layout.numel)
    for rank, subset in enumerate(subsets):
        for n in subset:
            spec = layout.specs[n]
            expected_grad[spec.offset:spec.offset + spec.numel] += spec.stored(values[n]).flatten() * (rank + 1)
    every = [units for *_, units, _, _ in results]
    for rank, (flat, shard_grad, traffic, local, served, peak, units, order, unit_numel) in enumerate(results):
        want = torch.cat([layout.specs[n].stored(values[n]).flatten() for n in layout.specs if n in subsets[rank]])
        assert torch.equal(flat, want), f"rank {rank} pulled other elements"
        expected_shard = torch.zeros(layout.shard_numel)
        for lo, hi, pos in layout.owned(rank):
            expected_shard[pos:pos + hi - lo] = expected_grad[lo:hi]
        torch.testing.assert_close(shard_grad, expected_shard)
        assert traffic.params_received == traffic.grads_sent == (want.numel() - local) * 4
        assert traffic.params_sent == traffic.grads_received == served * 4
        assert order == sorted(order, key=lambda k: (k[0], k[1], k[2], k[3])), "units in the one global order"
        for (key, peer), messages in units.items():  # the peer's unit holds the same messages, the other way
            assert every[peer][(key, rank)] == sorted((k, not send) for k, send in messages), (rank, key)
        # fp32 compute and reduction: only the push's receives (and the pull's multi-range sends) hold buffers
        assert 0 < peak <= overlap_buffer_bytes(inflight, unit_numel, 4, 4), (peak, inflight)
        if inflight == 0:
            assert peak <= 2 * unit_numel * 4  # one unit at a time


def test_windows_are_bounded_in_size_and_what_flies_is_counted(monkeypatch):
    """A model larger than eight windows of ``MAX_WINDOW_NUMEL`` is cut into more windows, none larger than it
    where the parameters allow; the buffers the memory model charges are the bound in flight, or one unit each
    way in the wider dtype when that is more."""
    import passes.plan.movement as movement

    monkeypatch.setattr(movement, "MAX_WINDOW_NUMEL", 20)  # the one bound of the runtime's and the planner's rule
    layout = FixedLayout(SHAPES, rank=0, world_size=2)
    windows = layout_windows(layout, 2)
    assert len(windows) > 2
    sizes = {lo: layout.specs[n].numel for n, spec in layout.specs.items() for lo in [spec.offset]}
    assert all(hi - lo <= 20 or hi - lo == sizes[lo] for lo, hi in windows), windows  # or one larger parameter
    assert overlap_buffer_bytes(1 << 28, 1 << 24, param_bytes=2, reduce_bytes=4) == 1 << 28
    assert overlap_buffer_bytes(1 << 20, 1 << 24, param_bytes=2, reduce_bytes=4) == 8 << 24
    assert largest_unit_numel(layout, windows) == min(max(hi - lo for lo, hi in windows), layout.shard_numel)


def _failing_push(rank, world):
    """Every rank's push messages fail to post (a link gone): the compute's next wait (for the pull, or the push's
    ``finish``) raises the progress thread's error as a ``MovementError`` naming the rank and the message,
    instead of hanging."""
    from runtime.overlap import MovementError, MovementInFlight, WindowedMovement
    from runtime.redistribute import Redistribution
    from runtime.stage_params import StageParams

    layout = FixedLayout.from_tensors(_values(), rank, world)
    params = StageParams(layout, {n: ParamSlice(name=n, full_shape=SHAPES[n]) for n in SHAPES}, tp=1)
    move = Redistribution.build(layout, params.ranges, chunk_numel=8)
    plan = WindowedMovement(move, layout, layout_windows(layout, 3), 8)
    flat = params.materialize()
    params.zero_grads()
    post = MovementInFlight._post_batch

    def broken(self, batch, group):
        if batch[0].phase == "push":
            raise ConnectionError("link down")
        return post(self, batch, group)
    MovementInFlight._post_batch = broken
    try:
        flight = plan.start(layout, flat, params, torch.float32, inflight_bytes=0)
        with pytest.raises(MovementError) as failure:  # at the first wait after the failure
            flight.wait_all()
            for name in SHAPES:
                flight.accumulated(name)
            flight.finish(layout)
        return str(failure.value)
    finally:
        MovementInFlight._post_batch = post


def test_a_failed_message_is_a_movement_error_on_the_compute_thread(tmp_path):
    for rank, message in enumerate(run_ranks(2, tmp_path, _failing_push)):
        assert message.startswith(f"rank {rank}: the overlapped movement failed at the push's "), message
        assert "ConnectionError: link down" in message
