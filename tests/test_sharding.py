"""Sharding propagation rules: reshape constants, transposes, indexing, broadcasting and named refusals."""

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
    spec, args, _ = propagate_node(_node(gm, "view"), {x: Shard(dim=2, frac=HALF)}, _node(gm, "view").args, None)
    assert spec == Shard(dim=2, frac=HALF) and args[1:] == (1, 6, 2, 8)


def test_view_merging_heads_back_rewrites_the_width():
    gm, (x,) = _graph(lambda g, x: g.call_method("view", (x, 1, 6, 32)), (1, 6, 4, 8))
    spec, args, _ = propagate_node(_node(gm, "view"), {x: Shard(dim=2, frac=Fraction(1, 4))}, _node(gm, "view").args,
                                   None)
    assert spec == Shard(dim=2, frac=Fraction(1, 4)) and args[1:] == (1, 6, 8)


def test_transpose_moves_the_shard_and_slicing_the_last_dim_keeps_it():
    gm, (x,) = _graph(lambda g, x: g.call_function(operator.getitem, (
        g.call_method("transpose", (x, 1, 2)), (Ellipsis, slice(None, 4)))), (1, 6, 4, 8))
    specs = {x: Shard(dim=2, frac=HALF)}
    t = _node(gm, "transpose")
    specs[t] = propagate_node(t, specs, t.args, None)[0]
    assert specs[t] == Shard(dim=1, frac=HALF)
    item = _node(gm, "getitem")
    assert propagate_node(item, specs, item.args, None)[0] == Shard(dim=1, frac=HALF)


def test_broadcast_with_a_replicated_operand_that_spans_the_sharded_dim_is_refused():
    gm, (x, y) = _graph(lambda g, x, y: g.call_function(operator.mul, (x, y)), (1, 4, 6, 8), (4, 6, 8))
    mul = _node(gm, "mul")
    with pytest.raises(PassError, match="node 'mul' .* replicated operand 'x1' of shape \\(4, 6, 8\\) spans sharded"):
        propagate_node(mul, {x: Shard(dim=1, frac=HALF)}, mul.args, None)


def test_broadcast_over_a_size_one_dim_is_fine():
    gm, (x, y) = _graph(lambda g, x, y: g.call_function(operator.mul, (x, y)), (1, 4, 6, 8), (1, 1, 6, 8))
    mul = _node(gm, "mul")
    assert propagate_node(mul, {x: Shard(dim=1, frac=HALF)}, mul.args, None)[0] == Shard(dim=1, frac=HALF)


def test_reducing_over_the_sharded_dim_and_unknown_ops_are_named():
    gm, (x,) = _graph(lambda g, x: g.call_method("mean", (x, -1), {"keepdim": True}), (2, 8))
    mean = _node(gm, "mean")
    with pytest.raises(PassError, match="node 'mean' .* reduces over sharded dim 1"):
        propagate_node(mean, {x: Shard(dim=1, frac=HALF)}, mean.args, None)
    gm, (x,) = _graph(lambda g, x: g.call_function(torch.cumsum, (x, 0)), (2, 8))
    cum = _node(gm, "cumsum")
    with pytest.raises(PassError, match="node 'cumsum' .* no sharding rule for call_function cumsum"):
        propagate_node(cum, {x: Shard(dim=1, frac=HALF)}, cum.args, None)


def test_split_of_a_sharded_dim_uses_the_column_linear_chunks():
    gm, (x,) = _graph(lambda g, x: g.call_method("split", (x, 8), {"dim": -1}), (1, 6, 24))
    split = _node(gm, "split")
    specs, args, kwargs = propagate_node(split, {x: Shard(dim=2, frac=HALF)}, split.args, lambda n: [4, 4, 4])
    assert specs == (Shard(dim=2, frac=HALF),) * 3 and args[1:] == ([4, 4, 4], 2) and kwargs == {}
    with pytest.raises(PassError, match="splits a sharded dim that does not come from a column-parallel"):
        propagate_node(split, {x: Shard(dim=2, frac=HALF)}, split.args, lambda n: None)
