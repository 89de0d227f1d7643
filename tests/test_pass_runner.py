"""The pass runner: names, orders, disables, times and checks passes; propagate_vals refreshes shapes."""

import operator

import pytest
import torch
from torch import fx, nn

from passes.graph.pass_runner import (
    PassContext,
    PassError,
    PassResult,
    fill_vals,
    propagate_vals,
    run_passes,
    same_val,
)
from passes.plan.ir import ParallelScheme


def _graph() -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(operator.mul, (x, 2))
    z = g.call_function(operator.add, (y, 0))
    g.output(z)
    return fx.GraphModule(nn.Module(), g)


def remove_add_zero_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    changed = False
    for node in list(gm.graph.nodes):
        if node.target is operator.add and node.args[1] == 0:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            changed = True
    if changed:
        gm.recompile()
    return PassResult(graph_module=gm, modified=changed, info={"removed": int(changed)})


def copy_module_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    return PassResult(graph_module=fx.GraphModule(gm, gm.graph), modified=False)


def test_runs_in_order_and_records():
    gm, records = run_passes(_graph(), [remove_add_zero_pass, remove_add_zero_pass], PassContext())
    assert [(r.name, r.ran, r.modified) for r in records] == [
        ("remove_add_zero_pass", True, True),
        ("remove_add_zero_pass", True, False),
    ]
    assert gm(torch.tensor(3.0)) == 6.0
    assert all(r.ms >= 0 for r in records)
    assert str(gm.graph).strip().splitlines()[-1].strip() == "return mul"


def test_unmodified_pass_returns_the_same_module():
    gm = fx.symbolic_trace(lambda x: x * 2)
    out, records = run_passes(gm, [remove_add_zero_pass], PassContext())
    assert out is gm and not records[0].modified


def test_disabled_pass_is_skipped():
    gm = _graph()
    out, records = run_passes(gm, [remove_add_zero_pass], PassContext(disabled=frozenset({"remove_add_zero_pass"})))
    assert out is gm and records[0].ran is False
    assert any(n.target is operator.add for n in out.graph.nodes)


def test_a_pass_that_lies_about_no_change_is_refused():
    with pytest.raises(PassError, match="copy_module_pass reported no change"):
        run_passes(_graph(), [copy_module_pass], PassContext())


def test_badly_named_pass_is_refused():
    def helper(gm, ctx):
        return PassResult(graph_module=gm, modified=False)

    with pytest.raises(PassError, match="'helper' is not named"):
        run_passes(_graph(), [helper], PassContext())


def test_context_validates_and_quotes():
    with pytest.raises(PassError, match="tp_rank must be in \\[0, 2\\), got 2"):
        PassContext(scheme=ParallelScheme(tp=2), tp_rank=2, tp_group="g")
    with pytest.raises(PassError, match="needs a tp_group name"):
        PassContext(scheme=ParallelScheme(tp=2))


def test_propagate_vals_sets_fake_shapes():
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 6), nn.ReLU()))
    propagate_vals(gm, [torch.randn(3, 4)])
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert tuple(out.meta["val"].shape) == (3, 6)


def test_fill_vals_runs_only_the_nodes_without_one_and_falls_back_to_a_full_propagation():
    gm = _graph()
    propagate_vals(gm, [torch.randn(3, 4)])
    kept = {n.name: n.meta["val"] for n in gm.graph.nodes}
    g = gm.graph
    last = next(n for n in g.nodes if n.target is operator.add)
    with g.inserting_after(next(n for n in g.nodes if n.op == "placeholder")):
        y = g.placeholder("y")
    with g.inserting_after(last):
        z = g.call_function(torch.matmul, (last, y))
    next(n for n in g.nodes if n.op == "output").args = (z,)
    del next(n for n in g.nodes if n.op == "output").meta["val"]
    fill_vals(gm, {y: torch.randn(4, 5)})
    assert all(n.meta["val"] is kept[n.name] for n in g.nodes if n.name in kept and n.op != "output")
    assert tuple(z.meta["val"].shape) == (3, 5) and tuple(y.meta["val"].shape) == (4, 5)
    assert same_val(next(n for n in g.nodes if n.op == "output").meta["val"], z.meta["val"])
    bare = _graph()  # no vals at all: no mode to run in, so every node is propagated from the inputs given
    fill_vals(bare, {next(n for n in bare.graph.nodes if n.op == "placeholder"): torch.randn(2, 2)})
    assert all(tuple(n.meta["val"].shape) == (2, 2) for n in bare.graph.nodes if n.op == "call_function")


def test_same_val_ignores_the_stride_of_a_dim_of_one_only():
    a = torch.empty(1, 4, 3)
    assert same_val(a, torch.empty_strided((1, 4, 3), (99, 3, 1)))
    assert not same_val(a, torch.empty(1, 3, 4).transpose(1, 2))
    assert not same_val(a, a.double()) and not same_val(a, None) and not same_val(None, None)
    assert same_val((a, 3), (a, 3)) and not same_val((a, 3), (a, 4))
