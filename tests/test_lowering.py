"""Lowerings: decided once per (scheme, stage, TP rank) on the analysed capture and applied to every bucket's
capture; a capture the decisions do not fit is refused, never lowered another way; pass options name passes."""

import pytest
import torch

import hcompile
from hcompile.models import GPT, GPTConfig, Llama, LlamaConfig, init_weights_
from passes.graph.lowering import apply_lowering, decide_lowerings
from passes.graph.pass_runner import PassContext, PassError, run_passes
from passes.graph.pipeline_split import split_pipeline_pass
from passes.graph.variant import TokenBuckets
from passes.plan.ir import ParallelScheme


def _reads(variant):
    return sorted(n.target for n in variant.graph_module.graph.nodes if n.op == "get_attr")


def test_one_decision_serves_every_bucket():
    model = init_weights_(Llama(LlamaConfig(layers=4)))
    cache = hcompile.compile(model, buckets=TokenBuckets(sizes=(16, 32, 64))).lowerings(
        cost_tokens=lambda scheme: 4096)  # the cut balanced for long micro-batches, whatever the bucket
    scheme = ParallelScheme(pp=2)
    for stage in (0, 1):
        lowering = cache.lowering(scheme, stage)
        variants = [cache.variant(scheme, stage, bucket) for bucket in (16, 32, 64)]
        assert all(v.params == lowering.params for v in variants)
        assert _reads(variants[0]) == _reads(variants[1]) == _reads(variants[2])
        assert all(v.boundary_in == lowering.boundary_in and v.boundary_out == lowering.boundary_out
                   for v in variants)
    assert len(cache._lowerings) == 1  # both stages of the scheme were decided together, once
    names = {sl.name for s in (0, 1) for sl in cache.lowering(scheme, s).params}
    assert names == {n for n, _ in model.named_parameters()}


def test_a_capture_the_decisions_do_not_fit_is_refused():
    small = hcompile.compile(init_weights_(GPT(GPTConfig(layers=2)))).captured(16).graph_module
    other = hcompile.compile(init_weights_(GPT(GPTConfig(layers=4)))).captured(16).graph_module
    stage = decide_lowerings(small, ParallelScheme(pp=2))[0]
    with pytest.raises(PassError, match="this capture's nodes differ from the analysed capture's"):
        apply_lowering(stage, other, 16)
    tp = decide_lowerings(small, ParallelScheme(tp=2), tp_rank=0, tp_group="g")[0]
    with pytest.raises(PassError, match="linears differ from the analysed capture's"):
        apply_lowering(tp, other, 16, tp_group="g")


def test_lowering_an_undecided_scheme_is_an_error():
    from passes.graph.lowering import lower_graph

    captured = hcompile.compile(init_weights_(GPT())).captured(16).graph_module
    with pytest.raises(ValueError, match=r"needs a tensor-parallel plan exactly when tp > 1"):
        lower_graph(captured, ParallelScheme(tp=2), tp_group="g")


def test_an_option_that_names_no_pass_is_refused():
    gm = hcompile.compile(init_weights_(GPT())).captured(16).graph_module
    ctx = PassContext(scheme=ParallelScheme(pp=2), options={"pipeline.seq_len": 2048})
    with pytest.raises(PassError, match=r"options \['pipeline.seq_len'\] name no pass of this run"):
        run_passes(gm, [split_pipeline_pass], ctx)
    ctx = PassContext(scheme=ParallelScheme(pp=2), options={"split_pipeline_pass.seq_len": 2048})
    out, records = run_passes(gm, [split_pipeline_pass], ctx)
    assert records[0].modified and torch.fx.GraphModule in type(out).__mro__


@pytest.mark.parametrize("scheme", [ParallelScheme(), ParallelScheme(pp=2)])
def test_a_stage_cut_into_pieces_computes_what_the_whole_stage_does(scheme):
    """Before: one stage graph. Expected: the same outputs and gradients from its pieces run in turn, each piece
    asking the gate for exactly the parameters it reads, every parameter asked for before it is read."""
    model = init_weights_(GPT(GPTConfig(layers=3)), seed=3)
    captured = hcompile.compile(model).captured(16).graph_module
    whole = decide_lowerings(captured, scheme)
    cut = decide_lowerings(captured, scheme, pieces=3)
    g = torch.Generator().manual_seed(0)
    ids, cu = torch.randint(0, GPTConfig().vocab, (16,), generator=g), torch.tensor([0, 9, 16], dtype=torch.int32)
    boundary: tuple = ()
    for stage in range(scheme.pp):
        assert whole[stage].pieces is None and len(cut[stage].pieces.stages) == 3
        one, pieces = apply_lowering(whole[stage], captured, 16), apply_lowering(cut[stage], captured, 16)
        params = {sl.name: torch.nn.Parameter(torch.randn(sl.local_shape, generator=g)) for sl in one.params}
        one.bind_(params)
        pieces.bind_(params)
        asked: list[tuple[str, ...]] = []
        pieces.gate[0] = asked.append
        want = one(ids, cu, *boundary)
        got = pieces(ids, cu, *boundary)
        assert len(asked) == 3 and sorted({n for names in asked for n in names}) == sorted(params)
        assert [set(names) for names in asked] == [set(n) for n in pieces.piece_params]
        for w, o in zip(want, got):
            torch.testing.assert_close(o, w)
        grads = []
        for out in (want, got):
            for p in params.values():
                p.grad = None
            sum(t.float().sum() for t in out if t.is_floating_point()).backward(retain_graph=True)
            grads.append({n: p.grad.clone() for n, p in params.items() if p.grad is not None})
        assert grads[0].keys() == grads[1].keys() and grads[0]
        for n in grads[0]:
            torch.testing.assert_close(grads[1][n], grads[0][n], msg=n)
        boundary = tuple(t.detach() for t in want)


@pytest.mark.parametrize("model_name, scheme, rank", [("gpt", ParallelScheme(cp=2), 1),
                                                      ("llama", ParallelScheme(tp=2, cp=2), 0),
                                                      ("llama", ParallelScheme(cp=4, pp=2), 3)])
def test_lowered_vals_equal_a_full_propagation_and_no_rewrite_propagates_the_whole_graph(model_name, scheme, rank,
                                                                                       monkeypatch):
    """The packed-attention and context-parallel rewrites keep the shape of every value they replace, so they give
    vals only to the nodes they add or change (``fill_vals``); every node of every lowered stage still carries the
    val a full propagation of the lowered graph gives."""
    import passes.graph.pass_runner as runner
    from passes.graph.pass_runner import propagate_vals, same_val

    def refused(*args, **kwargs):
        raise AssertionError("a rewrite propagated the whole graph again")

    model = GPT(GPTConfig(layers=2, heads=4, hidden=32, vocab=64, block_size=256)) if model_name == "gpt" else \
        Llama(LlamaConfig(layers=2, heads=4, kv_heads=2, hidden=32, ffn_hidden=64, vocab=64))
    cache = hcompile.compile(init_weights_(model), buckets=TokenBuckets(sizes=(16, 32))).lowerings(
        cost_tokens=lambda s: 32 * s.cp)
    monkeypatch.setattr(runner, "propagate_vals", refused)
    for stage in range(scheme.pp):
        for bucket in (16, 32):
            variant = cache.variant(scheme, stage, bucket, tp_rank=0, tp_group="tp" if scheme.tp > 1 else None,
                                    cp_rank=rank, cp_group="cp")
            gm = variant.graph_module
            # a pipeline stage's output has no val: the cut (torch.fx split_module) gives it none
            filled = {n.name: n.meta.get("val") for n in gm.graph.nodes if n.op != "output" or scheme.pp == 1}
            assert all(v is not None for v in filled.values())
            propagate_vals(gm)
            for node in gm.graph.nodes:
                if node.name in filled:
                    assert same_val(filled[node.name], node.meta.get("val")), (stage, bucket, node.format_node())
