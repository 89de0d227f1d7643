"""Sharding propagation rules: reshape constants, transposes, indexing, broadcasting (replicated operands cut to
the rank's block), reductions completed by an all-reduce, the fake-shape fallback and named refusals."""

import operator
from fractions import Fraction

import pytest
import torch
from torch import fx, nn

from passes.graph.pass_runner import PassError, propagate_vals
from passes.graph.sharding import Shard, propagate_node

HALF = Fraction(1, 2)


def _graph(build, *shapes):
    g = fx.Graph()
    xs = [g.placeholder(f"x{i}") for i in range(len(shapes))]
    g.output(build(g, *xs))
    gm = fx.GraphModule(nn.Module(), g)
    propagate_vals(gm, [torch.randn(*s) for s in shapes])
    return gm, xs


def _node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


def test_view_splitting_the_sharded_dim_into_heads_rewrites_the_head_count():
    gm, (x,) = _graph(lambda g, x: g.call_method("view", (x, 1, 6, 4, 8)), (1, 6, 32))
    prop = propagate_node(_node(gm, "view"), {x: Shard(dim=2, frac=HALF)}, _node(gm, "view").args, None)
    assert prop.spec == Shard(dim=2, frac=HALF) and prop.args[1:] == (1, 6, 2, 8)


def test_view_merging_heads_back_rewrites_the_width():
    gm, (x,) = _graph(lambda g, x: g.call_method("view", (x, 1, 6, 32)), (1, 6, 4, 8))
    prop = propagate_node(_node(gm, "view"), {x: Shard(dim=2, frac=Fraction(1, 4))}, _node(gm, "view").args, None)
    assert prop.spec == Shard(dim=2, frac=Fraction(1, 4)) and prop.args[1:] == (1, 6, 8)


def test_transpose_moves_the_shard_and_slicing_the_last_dim_keeps_it():
    gm, (x,) = _graph(lambda g, x: g.call_function(operator.getitem, (
        g.call_method("transpose", (x, 1, 2)), (Ellipsis, slice(None, 4)))), (1, 6, 4, 8))
    specs = {x: Shard(dim=2, frac=HALF)}
    t = _node(gm, "transpose")
    specs[t] = propagate_node(t, specs, t.args, None).spec
    assert specs[t] == Shard(dim=1, frac=HALF)
    item = _node(gm, "getitem")
    assert propagate_node(item, specs, item.args, None).spec == Shard(dim=1, frac=HALF)


def test_a_replicated_operand_spanning_the_sharded_dim_is_cut_to_the_ranks_block():
    gm, (x, y) = _graph(lambda g, x, y: g.call_function(operator.mul, (x, y)), (1, 4, 6, 8), (4, 6, 8))
    mul = _node(gm, "mul")
    prop = propagate_node(mul, {x: Shard(dim=1, frac=HALF)}, mul.args, None)
    assert prop.spec == Shard(dim=1, frac=HALF) and prop.narrow == ((y, 0, HALF),)


def test_broadcast_over_a_size_one_dim_is_fine():
    gm, (x, y) = _graph(lambda g, x, y: g.call_function(operator.mul, (x, y)), (1, 4, 6, 8), (1, 1, 6, 8))
    mul = _node(gm, "mul")
    prop = propagate_node(mul, {x: Shard(dim=1, frac=HALF)}, mul.args, None)
    assert prop.spec == Shard(dim=1, frac=HALF) and prop.narrow == ()


def test_pointwise_ops_are_found_by_their_aten_tag():
    gm, (x, y) = _graph(lambda g, x, y: g.call_function(torch.where, (
        g.call_function(operator.gt, (x, 0.0)), x, y)), (2, 8), (8,))
    gt, where = _node(gm, "gt"), _node(gm, "where")
    specs = {x: Shard(dim=1, frac=HALF)}
    specs[gt] = propagate_node(gt, specs, gt.args, None).spec
    prop = propagate_node(where, specs, where.args, None)
    assert specs[gt] == Shard(dim=1, frac=HALF) and prop.spec == Shard(dim=1, frac=HALF)
    assert prop.narrow == ((y, 0, HALF),)


def test_reducing_over_the_sharded_dim_is_completed_by_an_all_reduce():
    gm, (x,) = _graph(lambda g, x: g.call_method("mean", (x, -1), {"keepdim": True}), (2, 8))
    mean = _node(gm, "mean")
    prop = propagate_node(mean, {x: Shard(dim=1, frac=HALF)}, mean.args, None)
    assert prop.spec is None and prop.reduce == "mean"
    gm, (x,) = _graph(lambda g, x: g.call_function(torch.sum, (x, 0)), (2, 8))
    total = _node(gm, "sum_1")
    prop = propagate_node(total, {x: Shard(dim=1, frac=HALF)}, total.args, None)
    assert prop.spec == Shard(dim=0, frac=HALF) and prop.reduce is None


def test_unlisted_shape_ops_follow_the_dim_that_shrank():
    gm, (x, y) = _graph(lambda g, x, y: g.call_method("flatten", (
        g.call_function(torch.stack, ([x, y],), {"dim": -1}), -2)), (1, 6, 4, 8), (1, 6, 4, 8))
    stack, flat = _node(gm, "stack"), _node(gm, "flatten")
    specs = {x: Shard(dim=2, frac=HALF), y: Shard(dim=2, frac=HALF)}
    specs[stack] = propagate_node(stack, specs, stack.args, None).spec
    assert specs[stack] == Shard(dim=2, frac=HALF)
    assert propagate_node(flat, specs, flat.args, None).spec == Shard(dim=2, frac=HALF)


def test_expand_takes_the_local_size_of_the_sharded_dim():
    gm, (x,) = _graph(lambda g, x: g.call_method("expand", (x, 1, 4, 3, 6, 8)), (1, 4, 1, 6, 8))
    expand = _node(gm, "expand")
    prop = propagate_node(expand, {x: Shard(dim=1, frac=HALF)}, expand.args, None)
    assert prop.spec == Shard(dim=1, frac=HALF) and prop.args[1:] == (1, 2, 3, 6, 8)


def test_ops_that_mix_along_a_dim_and_unrunnable_ops_are_named():
    gm, (x,) = _graph(lambda g, x: g.call_function(torch.cumsum, (x, 0)), (2, 8))
    cum = _node(gm, "cumsum")
    with pytest.raises(PassError, match="node 'cumsum' .* no sharding rule for call_function cumsum"):
        propagate_node(cum, {x: Shard(dim=1, frac=HALF)}, cum.args, None)
    gm, (x,) = _graph(lambda g, x: g.call_method("flip", (x, 1)), (2, 8))
    flip = _node(gm, "flip")
    with pytest.raises(PassError, match="no sharding rule for call_method flip"):
        propagate_node(flip, {x: Shard(dim=1, frac=HALF)}, flip.args, None)
    gm, (x,) = _graph(lambda g, x: g.call_method("view", (x, 16)), (2, 8))
    view = _node(gm, "view")
    with pytest.raises(PassError, match="moves sharded dim 1 inside another dim"):
        propagate_node(view, {x: Shard(dim=1, frac=HALF)}, view.args, None)


def test_split_of_a_sharded_dim_uses_the_column_linear_chunks():
    gm, (x,) = _graph(lambda g, x: g.call_method("split", (x, 8), {"dim": -1}), (1, 6, 24))
    split = _node(gm, "split")
    prop = propagate_node(split, {x: Shard(dim=2, frac=HALF)}, split.args, lambda n: [4, 4, 4])
    assert prop.spec == (Shard(dim=2, frac=HALF),) * 3 and prop.args[1:] == ([4, 4, 4], 2) and prop.kwargs == {}
    with pytest.raises(PassError, match="splits a sharded dim that does not come from a column-parallel"):
        propagate_node(split, {x: Shard(dim=2, frac=HALF)}, split.args, lambda n: None)
