"""The fixed layout: flat order (parameters TP never splits first) with split dims outermost, every rank's
share of each region, slice ranges, filling the shard one parameter at a time (from tensors, an initialiser, a
rank-0 state dict), and the gathered state dict."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_ranks

from hcompile.init import normal_init
from passes.graph.tensor_parallel import ParamSlice
from runtime.fixed_layout import FixedLayout

SHAPES = {"emb": (6, 4), "row": (4, 6), "bias": (5,), "col": (6, 3)}
DIMS = {"row": 1, "col": 0}  # row-parallel weight split by input features: stored transposed


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def test_offsets_and_storage_order():
    layout = FixedLayout(SHAPES, 0, 1, split_dims=DIMS)
    # the parameters TP never splits (emb, bias) first, then the split ones, each group in the model's order
    assert {n: s.offset for n, s in layout.specs.items()} == {"emb": 0, "bias": 24, "row": 29, "col": 53}
    assert list(layout.specs) == ["emb", "bias", "row", "col"]
    assert layout.numel == 71 and layout.shard_numel == 71 and layout.regions == [(0, 29), (29, 71)]
    assert [s.offset for s in FixedLayout(SHAPES, 0, 1).specs.values()] == [0, 24, 48, 53]  # no split: model order
    full = tensors()
    stored = layout.specs["row"].stored(full["row"])
    torch.testing.assert_close(stored, full["row"].t().contiguous())  # split dim 1 outermost
    view = layout.specs["row"].unstore(stored.view(-1), (4, 6))
    assert torch.equal(view, full["row"])


def test_slice_ranges_are_one_range_per_block_along_the_split_dim():
    layout = FixedLayout(SHAPES, 0, 1, split_dims=DIMS)
    row = ParamSlice(name="row", full_shape=(4, 6), dim=1, ranges=((3, 6),))  # columns 3..6 of (4, 6)
    assert layout.slice_ranges(row) == [(29 + 3 * 4, 29 + 6 * 4)]  # stored (6, 4): rows 3..6
    col = ParamSlice(name="col", full_shape=(6, 3), dim=0, ranges=((0, 2), (4, 6)))
    assert layout.slice_ranges(col) == [(53, 59), (65, 71)]
    # a dim that is not stored outermost: one range per outer index
    emb = ParamSlice(name="emb", full_shape=(6, 4), dim=1, ranges=((1, 3),))
    assert layout.slice_ranges(emb) == [(o * 4 + 1, o * 4 + 3) for o in range(6)]
    assert layout.slice_ranges(ParamSlice(name="bias", full_shape=(5,))) == [(24, 29)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_every_rank_owns_an_equal_share_of_each_region(world):
    """Each region is cut into ``world`` contiguous shares (the last ones short or empty); the ranges of all
    ranks cover the flat vector exactly once; a rank's shard is its shares one after the other."""
    layouts = [FixedLayout(SHAPES, r, world, split_dims=DIMS) for r in range(world)]
    covered = sorted(r for layout in layouts for r in layout.owner_ranges(layout.rank))
    assert [a for a, _ in covered] == sorted({a for a, _ in covered})
    assert sum(b - a for a, b in covered) == 71 and covered[0][0] == 0 and covered[-1][1] == 71
    assert all(x[1] <= y[0] for x, y in zip(covered, covered[1:]))
    for lo, hi in layouts[0].regions:  # every rank holds at most ceil(size / world) of each region
        share = -(-(hi - lo) // world)
        for layout in layouts:
            held = sum(max(0, min(b, hi) - max(a, lo)) for a, b in layout.owner_ranges(layout.rank))
            assert held <= share
        assert layouts[0].owner_ranges(0)[0 if lo == 0 else -1] == (lo, lo + share)
    shard_of = {r: layouts[r].owned(r) for r in range(world)}
    for r, owned in shard_of.items():
        assert owned == layouts[0].owned(r)  # every rank knows every owner's ranges alike
        for (lo, hi, pos), nxt in zip(owned, owned[1:]):
            assert nxt[2] >= pos + hi - lo
    for r in range(world):  # everything, in the owner's shard coordinates: its shares one after the other
        assert layouts[0].in_shard([(0, 71)], r) == [(pos, pos + hi - lo) for lo, hi, pos in shard_of[r]]
    assert layouts[0].in_shard([(5, 6)], 0) == ([(5, 6)] if 5 < -(-29 // world) else [])


def test_slice_ranges_select_exactly_the_slice_elements():
    """The flat elements the ranges name, in order, are the slice's elements in storage order."""
    layout = FixedLayout(SHAPES, 0, 1, split_dims=DIMS)
    full = tensors(3)
    layout.fill_from(full)
    flat = layout.shard.detach()
    for slc in [ParamSlice(name="row", full_shape=(4, 6), dim=1, ranges=((0, 2), (4, 5))),
                ParamSlice(name="emb", full_shape=(6, 4), dim=1, ranges=((2, 4),)),
                ParamSlice(name="col", full_shape=(6, 3), dim=0, ranges=((2, 4),))]:
        got = torch.cat([flat[a:b] for a, b in layout.slice_ranges(slc)])
        want = layout.specs[slc.name].stored(slc.take(full[slc.name])).view(-1)
        assert torch.equal(got, want), slc.describe()


def test_shards_fill_from_tensors_or_an_initialiser_alike():
    full = {n: torch.empty(s) for n, s in SHAPES.items()}
    init = normal_init(0.5, seed=4)
    for n, t in full.items():
        init(n, t)
    for rank in range(3):
        a = FixedLayout(SHAPES, rank, 3, split_dims=DIMS)
        a.fill_from(full)
        b = FixedLayout(SHAPES, rank, 3, split_dims=DIMS)
        b.initialise(init)
        assert torch.equal(a.shard, b.shard)
    # the shards' ranges together are the flat vector, padding zero
    layouts = [FixedLayout.from_tensors(full, r, 3, split_dims=DIMS) for r in range(3)]
    whole = FixedLayout.from_tensors(full, 0, 1, split_dims=DIMS).shard.detach()
    flat = torch.full((71,), float("nan"))
    for layout in layouts:
        shard = layout.shard.detach()
        assert shard.numel() == 10 + 14  # ceil(29 / 3) + ceil(42 / 3)
        used = torch.zeros(shard.numel(), dtype=torch.bool)
        for lo, hi, pos in layout.owned(layout.rank):
            flat[lo:hi] = shard[pos:pos + hi - lo]
            used[pos:pos + hi - lo] = True
        assert torch.all(shard[~used] == 0)
    assert torch.equal(flat, whole)


def test_bad_input_names_the_value():
    with pytest.raises(KeyError, match="unknown parameters"):
        FixedLayout(SHAPES, 0, 1, split_dims={"nope": 0})
    with pytest.raises(ValueError, match="split dim 2 of 'row'"):
        FixedLayout(SHAPES, 0, 1, split_dims={"row": 2})
    layout = FixedLayout(SHAPES, 0, 1)
    with pytest.raises(KeyError, match="no value for parameters"):
        layout.fill_from({"emb": torch.zeros(6, 4)})
    with pytest.raises(ValueError, match="'emb': expected shape"):
        layout.fill_from({**tensors(), "emb": torch.zeros(4, 6)})
    with pytest.raises(ValueError, match="meta device"):
        layout.fill_from({**tensors(), "emb": torch.zeros(6, 4, device="meta")})
    with pytest.raises(ValueError, match="rank must be in"):
        FixedLayout(SHAPES, 3, 2)


def _stream(rank, world):
    layout = FixedLayout(SHAPES, rank, world, split_dims=DIMS)
    layout.stream_from_rank0(tensors(5) if rank == 0 else None)
    return layout.shard.detach().clone(), layout.full_state_dict()


def test_stream_from_rank0_and_full_state_dict(tmp_path):
    results = run_ranks(4, tmp_path, _stream)
    full = tensors(5)
    for rank, (shard, state) in enumerate(results):
        want = FixedLayout.from_tensors(full, rank, 4, split_dims=DIMS).shard.detach()
        assert torch.equal(shard, want)
        for n, t in full.items():
            assert torch.equal(state[n], t) and state[n].is_contiguous()
