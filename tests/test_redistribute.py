"""Parameter and gradient movement on 2 and 4 gloo ranks: every rank receives exactly the elements it computes
with, owners receive the sum of every rank's gradient of their shard, whatever the chunk size, and the bytes
counted are those of the slices moved (nothing to itself)."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st

from passes.plan.movement import merged
from runtime.redistribute import Redistribution, Traffic, intersect

NUMEL = 103


def _random_needs(seed: int, world: int) -> list[list[tuple[int, int]]]:
    g = torch.Generator().manual_seed(seed)
    needs = []
    for _ in range(world):
        cuts = sorted(set(torch.randint(0, NUMEL + 1, (6,), generator=g).tolist()) | {0, NUMEL})
        keep = [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a and torch.rand(1, generator=g) < 0.6]
        needs.append(list(merged(keep)) or [(0, 1)])
    return needs


def _layout(rank, world, regions):
    """One parameter (one region), or a whole one of 40 elements then a split one (two regions); either way the
    flat vector is ``arange(NUMEL) * 0.5``."""
    from runtime.fixed_layout import FixedLayout

    flat = torch.arange(NUMEL, dtype=torch.float32) * 0.5
    if regions == 1:
        return FixedLayout.from_tensors({"w": flat}, rank, world)
    return FixedLayout.from_tensors({"w": flat[40:], "n": flat[:40]}, rank, world, split_dims={"w": 0})


def _move(rank, world, needs, chunk, dtype, regions=1, reduce_dtype=None):
    layout = _layout(rank, world, regions)
    move = Redistribution.build(layout, needs[rank], chunk_numel=chunk)
    buf = torch.full((move.numel,), -1.0, dtype=dtype)
    pulled = move.pull(layout, buf)
    grads = buf.float() * (rank + 1)  # rank r's gradient: (r + 1) times each element it holds
    pushed = move.push(layout, grads.to(dtype), reduce_dtype=reduce_dtype or dtype)
    return buf.float(), layout.shard.grad.clone(), pulled + pushed, move.local_numel, move.served_numel()


@pytest.mark.parametrize(("world", "chunk", "regions"), [(2, 1000, 1), (4, 7, 1), (2, 7, 2), (4, 5, 2)])
def test_pull_and_push_move_exactly_the_slices(tmp_path, world, chunk, regions):
    needs = _random_needs(world * 31 + chunk, world)
    results = run_ranks(world, tmp_path, _move, needs, chunk, torch.float32, regions)
    flat = torch.arange(NUMEL, dtype=torch.float32) * 0.5
    expected_grad = torch.zeros(NUMEL)
    for rank, need in enumerate(needs):
        for a, b in need:
            expected_grad[a:b] += flat[a:b] * (rank + 1)
    for rank, (buf, shard_grad, traffic, local, served) in enumerate(results):
        layout = _layout(rank, world, regions)
        assert len(layout.regions) == regions
        want = torch.cat([flat[a:b] for a, b in needs[rank]])
        assert torch.equal(buf, want), f"rank {rank} pulled other elements"
        expected_shard = torch.zeros(layout.shard_numel)
        for lo, hi, pos in layout.owned(rank):
            expected_shard[pos:pos + hi - lo] = expected_grad[lo:hi]
        torch.testing.assert_close(shard_grad, expected_shard)
        size = sum(b - a for a, b in needs[rank])
        assert traffic.params_received == traffic.grads_sent == (size - local) * 4
        assert traffic.params_sent == traffic.grads_received == served * 4
        mine = sum(b - a for lo, hi in layout.owner_ranges(rank) for a, b in intersect(needs[rank], lo, hi))
        assert local == mine


def test_bf16_messages_are_half_the_bytes(tmp_path):
    """bf16 parameters and gradients are half the bytes; bf16 gradients reduced in fp32 (cast message by message
    through one buffer) are fp32's bytes and sums."""
    needs = _random_needs(5, 2)
    fp32 = run_ranks(2, tmp_path, _move, needs, 7, torch.float32)
    bf16 = run_ranks(2, tmp_path, _move, needs, 7, torch.bfloat16)
    mixed = run_ranks(2, tmp_path, _move, needs, 7, torch.bfloat16, 1, torch.float32)
    for (_, g32, t32, _, _), (_, g16, t16, _, _), (_, gmix, tmix, _, _) in zip(fp32, bf16, mixed):
        assert t16.params_received * 2 == t32.params_received and t16.grads_sent * 2 == t32.grads_sent
        torch.testing.assert_close(g16, g32, rtol=1e-2, atol=1e-2)
        assert tmix.grads_sent == t32.grads_sent and tmix.params_received == t16.params_received
        torch.testing.assert_close(gmix, g32, rtol=1e-2, atol=1e-2)


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 80), max_size=10, unique=True), lo=st.integers(0, 90), width=st.integers(0, 30))
def test_intersect_keeps_exactly_the_elements_inside(cuts, lo, width):
    points = sorted(cuts)
    spans = list(zip(points[::2], points[1::2]))  # disjoint, sorted
    got = {i for a, b in intersect(spans, lo, lo + width) for i in range(a, b)}
    want = {i for a, b in spans for i in range(a, b) if lo <= i < lo + width}
    assert got == want


def test_bad_input_is_refused():
    from runtime.fixed_layout import FixedLayout

    layout = FixedLayout({"w": (10,)}, 0, 2)
    with pytest.raises(ValueError, match="ranges of all 2 ranks"):
        Redistribution(layout, [[(0, 3)]])
    with pytest.raises(ValueError, match="chunk_numel must be positive"):
        Redistribution(layout, [[(0, 3)], [(3, 4)]], chunk_numel=0)
    assert Traffic(params_sent=1) + Traffic(grads_sent=2) == Traffic(params_sent=1, grads_sent=2)


def _random_pushes(seed: int, needs: list[list[tuple[int, int]]]) -> list[list[tuple[int, int]]]:
    """Per rank, a random part of its ranges (holes cut out, some ranges dropped): what it pushes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for need in needs:
        keep = []
        for a, b in need:
            cuts = sorted({a, b, *torch.randint(a, b + 1, (3,), generator=g).tolist()})
            keep += [(x, y) for x, y in zip(cuts, cuts[1:]) if y > x and torch.rand(1, generator=g) < 0.6]
        out.append(list(merged(keep)))
    return out


def _move_pushes(rank, world, needs, pushes, chunk, grad_dtype, windowed):
    """Push along ``pushes`` (a part of ``needs``) by rounds or window by window (``runtime.overlap``)."""
    from runtime.overlap import WindowedMovement, layout_windows

    layout = _layout(rank, world, 2)
    move = Redistribution.build(layout, needs[rank], chunk_numel=chunk, pushes=pushes[rank])
    buf = torch.full((move.numel,), -1.0)
    move.pull(layout, buf)
    grads = (buf * (rank + 1)).to(grad_dtype)
    if not windowed:
        traffic = move.push(layout, grads, reduce_dtype=torch.float32)
        return layout.shard.grad.clone(), traffic, move.pushed_numel

    class _Params:  # what the windowed push reads of a compute copy: its gradient buffer, unweighted
        grad_dtype = grads.dtype
        grad_flat = grads

        def starts(self):
            return iter([("all", 0, move.numel)])

        def weigh_grads(self, lo, hi):
            pass

    plan = WindowedMovement(move, layout, layout_windows(layout, 3), chunk)
    flight = plan.start(layout, torch.empty(move.numel), _Params(), torch.float32, inflight_bytes=64)
    flight.wait_all()
    traffic = flight.finish(layout)
    return layout.shard.grad.clone(), traffic, move.pushed_numel


@pytest.mark.parametrize(("world", "chunk", "grad_dtype", "windowed"), [
    (4, 5, torch.float32, False), (4, 1000, torch.bfloat16, False), (2, 7, torch.float32, False),
    (4, 5, torch.float32, True), (4, 6, torch.bfloat16, True)])
def test_owners_receive_the_sum_of_what_each_rank_pushes(tmp_path, world, chunk, grad_dtype, windowed):
    """A rank that pushes part of what it computes with (``Redistribution(pushes=...)``, replicated parameters on a
    TP rank other than 0): owners sum exactly the pushed parts, by rounds and window by window, fp32 or cast from
    bf16, gathered from holes in the buffer; the bytes are the pushed parts' (nothing to itself)."""
    needs = _random_needs(world * 7 + chunk, world)
    pushes = _random_pushes(chunk, needs)
    results = run_ranks(world, tmp_path, _move_pushes, needs, pushes, chunk, grad_dtype, windowed)
    flat = torch.arange(NUMEL, dtype=torch.float32) * 0.5
    expected = torch.zeros(NUMEL)
    for rank, push in enumerate(pushes):
        for a, b in push:
            expected[a:b] += (flat[a:b] * (rank + 1)).to(grad_dtype).float()
    sent_total = received_total = 0
    for rank, (shard_grad, traffic, pushed) in enumerate(results):
        layout = _layout(rank, world, 2)
        want = torch.zeros(layout.shard_numel)
        for lo, hi, pos in layout.owned(rank):
            want[pos:pos + hi - lo] = expected[lo:hi]
        torch.testing.assert_close(shard_grad, want, rtol=1e-6, atol=1e-6)
        own = sum(b - a for lo, hi in layout.owner_ranges(rank) for a, b in intersect(pushes[rank], lo, hi))
        assert pushed == sum(b - a for a, b in pushes[rank])
        assert traffic.grads_sent == (pushed - own) * 4
        sent_total += traffic.grads_sent
        received_total += traffic.grads_received
    assert sent_total == received_total


def test_pushes_outside_what_a_rank_computes_with_are_refused():
    from runtime.fixed_layout import FixedLayout

    layout = FixedLayout({"w": (10,)}, 0, 2)
    with pytest.raises(ValueError, match=r"rank 1 pushes ranges \[\(2, 5\)\] outside those it computes with"):
        Redistribution(layout, [[(0, 3)], [(3, 6)]], pushes=[[(0, 3)], [(2, 5)]])
    with pytest.raises(ValueError, match="push ranges of all 2 ranks"):
        Redistribution(layout, [[(0, 3)], [(3, 6)]], pushes=[[(0, 3)]])
