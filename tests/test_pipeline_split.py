"""Pipeline split: golden stages on a hand-built graph, balanced cuts, and stages that compose to the original
forward and backward (run stage by stage with detached boundaries, as a pipeline runtime does)."""

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from hcompile.capture import capture
from hcompile.models import GPT, GPTConfig, Llama, LlamaConfig, init_weights_
from passes.graph.pass_runner import PassContext, PassError, propagate_vals, run_passes
from passes.graph.pipeline_split import decide_pipeline_split, graph_to_networkx, split_pipeline_pass
from passes.plan.ir import ParallelScheme


def _chain() -> fx.GraphModule:
    """x -> 4 linears of 8x8 with a relu between, the first output also added back at the end."""
    root = nn.Module()
    for i in range(4):
        root.register_parameter(f"w{i}", nn.Parameter(torch.randn(8, 8) * 0.3))
    g = fx.Graph()
    x = g.placeholder("x")
    h0 = g.call_function(torch._C._nn.linear, (x, g.get_attr("w0"), None))
    h = h0
    for i in range(1, 4):
        h = g.call_function(torch._C._nn.linear, (g.call_function(F.relu, (h,)), g.get_attr(f"w{i}"), None))
    g.output((g.call_function(torch.add, (h, h0)),))
    gm = fx.GraphModule(root, g)
    propagate_vals(gm, [torch.randn(5, 8)])
    return gm


GOLDEN = """\
graph():
    %x : [num_users=1] = placeholder[target=x]
    %stage_0 : [num_users=2] = call_module[target=stage_0](args = (%x,), kwargs = {})
    %getitem : [num_users=1] = call_function[target=operator.getitem](args = (%stage_0, 0), kwargs = {})
    %getitem_1 : [num_users=1] = call_function[target=operator.getitem](args = (%stage_0, 1), kwargs = {})
    %stage_1 : [num_users=1] = call_module[target=stage_1](args = (%getitem, %getitem_1), kwargs = {})
    %getitem_2 : [num_users=1] = call_function[target=operator.getitem](args = (%stage_1, 0), kwargs = {})
    return (getitem_2,)
---
graph():
    %linear : [num_users=1] = placeholder[target=linear]
    %linear_1 : [num_users=1] = placeholder[target=linear_1]
    %relu_1 : [num_users=1] = call_function[target=torch.nn.functional.relu](args = (%linear_1,), kwargs = {})
    %w2 : [num_users=1] = get_attr[target=w2]
    %linear_2 : [num_users=1] = call_function[target=torch._C._nn.linear](args = (%relu_1, %w2, None), kwargs = {})
    %relu_2 : [num_users=1] = call_function[target=torch.nn.functional.relu](args = (%linear_2,), kwargs = {})
    %w3 : [num_users=1] = get_attr[target=w3]
    %linear_3 : [num_users=1] = call_function[target=torch._C._nn.linear](args = (%relu_2, %w3, None), kwargs = {})
    %add : [num_users=1] = call_function[target=torch.add](args = (%linear_3, %linear), kwargs = {})
    return (add,)"""


def test_golden_stages_on_a_hand_built_graph():
    gm = _chain()
    out, records = run_passes(gm, [split_pipeline_pass], PassContext(scheme=ParallelScheme(pp=2)))
    plan = records[0].info["plan"]
    assert plan.describe() == (
        "stage 0: linear..linear_1 (3 nodes, 50.0% cost) in=['x'] out=['linear', 'linear_1']\n"
        "stage 1: relu_1..add (5 nodes, 50.0% cost) in=['linear', 'linear_1'] out=['add']"
    )
    assert str(out.graph).strip() + "\n---\n" + str(out.stage_1.graph).strip() == GOLDEN
    x = torch.randn(5, 8)
    torch.testing.assert_close(out(x), gm(x))


def test_pp1_and_already_split_graphs_are_returned_unchanged():
    gm = _chain()
    assert split_pipeline_pass(gm, PassContext()).graph_module is gm
    split = split_pipeline_pass(gm, PassContext(scheme=ParallelScheme(pp=2)))
    again = split_pipeline_pass(split.graph_module, PassContext(scheme=ParallelScheme(pp=2)))
    assert again.graph_module is split.graph_module and not again.modified


def test_too_many_stages_is_a_named_error():
    with pytest.raises(PassError, match="cannot cut .* into pp=5 stages: it has 4 costed nodes"):
        decide_pipeline_split(_chain(), 5)


def test_networkx_graph_mirrors_the_fx_graph():
    gm = _chain()
    g = graph_to_networkx(gm)
    assert g.number_of_nodes() == len(gm.graph.nodes)
    assert g.nodes["linear"]["cost"] == 2 * 8 * 8 * 5 and g.has_edge("linear", "add")


def _run_stages(pipe, inputs, targets, vocab):
    """Forward stage by stage with detached boundaries, then backward stage by stage; returns logits."""
    names = [n.name for n in pipe.graph.nodes if n.op == "placeholder"]
    user = dict(zip(names, inputs))
    stages = [m for name, m in sorted(pipe.named_children()) if name.startswith("stage_")]
    sent, saved = {}, []
    for stage in stages:
        args = []
        for n in stage.graph.nodes:
            if n.op == "placeholder":
                args.append(user[n.name] if n.name in user else sent[n.name])
        outs = stage(*args)
        out_names = [a.name for a in next(n for n in stage.graph.nodes if n.op == "output").args[0]]
        saved.append((args, outs))
        sent = {name: o.detach().requires_grad_(o.requires_grad) for name, o in zip(out_names, outs)}  # "send"
    logits = saved[-1][1][0]
    loss = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
    loss.backward()
    for k in range(len(stages) - 2, -1, -1):  # send each boundary's gradient back to the stage that made it
        nxt_args, (args, outs) = saved[k + 1][0], saved[k]
        pairs = [(o, a.grad) for o, a in zip(outs, [a for a in nxt_args if isinstance(a, torch.Tensor)][-len(outs):])
                 if o.requires_grad and a.grad is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return logits, loss


@pytest.mark.parametrize("model_cls, cfg", [(GPT, GPTConfig(layers=4)), (Llama, LlamaConfig(layers=4))])
@pytest.mark.parametrize("pp", [2, 4])
def test_stages_compose_to_the_original_forward_and_backward(model_cls, cfg, pp):
    model = init_weights_(model_cls(cfg))
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab, (1, 16), generator=gen)
    targets = torch.randint(0, cfg.vocab, (1, 16), generator=gen)
    cap = capture(model, ids)
    pipe, records = run_passes(cap.graph_module, [split_pipeline_pass], PassContext(scheme=ParallelScheme(pp=pp)))
    plan = records[0].info["plan"]
    assert len(plan.stages) == pp and plan.imbalance < 1.25, plan.describe()
    logits, loss = _run_stages(pipe, [ids], targets, cfg.vocab)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = model(ids)
    ref_loss = F.cross_entropy(ref.reshape(-1, cfg.vocab), targets.reshape(-1))
    ref_loss.backward()
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
