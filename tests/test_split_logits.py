"""Tensor parallel's vocab-parallel head with split logits (``split_logits``): the golden rewrite of a hand-built
graph, ``vocab_range`` on the plan, the lowering and the variant, the fall-back to a replicated head where the
vocabulary does not divide by tp, and gloo runs on 2 and 4 ranks whose split logits and parameter gradients match
the unsharded model's under a loss summed over the ranks' vocabulary slices; and the sequence-parallel collectives
(``sp_all_gather``, ``sp_reduce_scatter``, ``sp_split``) forward and backward on gloo, ready for a sequence-parallel
rewrite (the tensor-parallel rewrite does not use them yet)."""

import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_util import run_ranks
from test_tensor_parallel import tied_graph
from torch import fx, nn

from hcompile.capture import capture
from hcompile.models import Llama, LlamaConfig, init_weights_
from passes.graph.collectives import TP_ALL_GATHER
from passes.graph.lowering import LoweringCache, decide_lowerings
from passes.graph.pass_runner import PassContext, propagate_vals, run_passes
from passes.graph.tensor_parallel import decide_tensor_parallel, shard_tensor_parallel_pass
from passes.graph.variant import TokenBuckets
from passes.plan.ir import ParallelScheme
from runtime.loss import IGNORE, VocabShard, next_token_targets, packed_causal_lm_loss_sum

CFG = LlamaConfig(layers=1, heads=4, kv_heads=2, hidden=64, ffn_hidden=128, vocab=96)


def _model(cfg: LlamaConfig = CFG) -> nn.Module:
    return init_weights_(Llama(cfg), seed=1)


def _tied_graph() -> fx.GraphModule:
    return tied_graph()


SPLIT_GOLDEN = """\
graph():
    %ids : [num_users=1] = placeholder[target=ids]
    %emb : [num_users=2] = get_attr[target=emb]
    %embedding : [num_users=1] = call_function[target=passes.graph.collectives.vocab_parallel_embedding](args = (%ids, %emb, 5, g, None), kwargs = {})
    %tp_copy_default : [num_users=1] = call_function[target=torch.ops.hydraulis.tp_copy.default](args = (%embedding, g), kwargs = {})
    %linear : [num_users=1] = call_function[target=torch._C._nn.linear](args = (%tp_copy_default, %emb, None), kwargs = {})
    return (linear,)"""  # noqa: E501


def test_split_logits_golden_on_a_hand_built_graph():
    """With split_logits the head's output is this rank's vocabulary columns: no all-gather, shape (1, 3, 5)."""
    ctx = PassContext(scheme=ParallelScheme(tp=2), tp_rank=1, tp_group="g",
                      options={"shard_tensor_parallel_pass.vocab_parallel": True,
                               "shard_tensor_parallel_pass.split_logits": True})
    result = shard_tensor_parallel_pass(_tied_graph(), ctx)
    plan = result.info["plan"]
    assert plan.vocab_range == (5, 10)
    assert str(result.graph_module.graph).strip().replace("'g'", "g") == SPLIT_GOLDEN
    out = next(n for n in result.graph_module.graph.nodes if n.op == "output").args[0][0]
    assert tuple(out.meta["val"].shape) == (1, 3, 5)


def test_without_split_logits_the_logits_are_gathered_and_vocab_range_is_none():
    for options in ({"shard_tensor_parallel_pass.vocab_parallel": True},
                    {"shard_tensor_parallel_pass.split_logits": True}):  # split_logits alone: nothing to split
        ctx = PassContext(scheme=ParallelScheme(tp=2), tp_rank=0, tp_group="g", options=options)
        result = shard_tensor_parallel_pass(_tied_graph(), ctx)
        assert result.info["plan"].vocab_range is None
        out = next(n for n in result.graph_module.graph.nodes if n.op == "output").args[0][0]
        assert tuple(out.meta["val"].shape) == (1, 3, 10), options


def test_a_vocabulary_tp_does_not_divide_falls_back_to_a_replicated_head():
    """Vocabulary 97 over tp=2: the head and embedding stay replicated, the logits whole, no refusal."""
    cfg = LlamaConfig(layers=1, heads=4, kv_heads=2, hidden=64, ffn_hidden=128, vocab=97)
    ids = torch.zeros(1, 16, dtype=torch.long)
    gm = capture(_model(cfg), ids).graph_module
    propagate_vals(gm, [ids])
    plan = decide_tensor_parallel(gm, 2, 1, vocab_parallel=True, split_logits=True)
    assert plan.vocab_range is None and not plan.split_logits
    assert plan.param("lm_head.weight").dim is None and plan.param("embed_tokens.weight").dim is None
    lowerings = decide_lowerings(gm, ParallelScheme(tp=2, pp=2), tp_rank=1, tp_group="g", vocab_parallel=True,
                                 split_logits=True)
    assert [lw.vocab_range for lw in lowerings] == [None, None]


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_range_reaches_the_last_stage_lowering_only(tp):
    ids = torch.zeros(1, 16, dtype=torch.long)
    gm = capture(_model(), ids).graph_module
    propagate_vals(gm, [ids])
    share = CFG.vocab // tp
    for rank in range(tp):
        lowerings = decide_lowerings(gm, ParallelScheme(tp=tp, pp=2), tp_rank=rank, tp_group="g",
                                     vocab_parallel=True, split_logits=True)
        assert [lw.vocab_range for lw in lowerings] == [None, (rank * share, (rank + 1) * share)]
        off = decide_lowerings(gm, ParallelScheme(tp=tp, pp=2), tp_rank=rank, tp_group="g",
                               vocab_parallel=True)
        assert [lw.vocab_range for lw in off] == [None, None]


def _split_logits_rank(rank, world, graph_bytes):
    """One rank: a compiled variant with split logits. The loss is sum(logits * G) over the whole vocabulary, each
    rank adding its own columns' share, and the vocabulary-parallel cross-entropy (``runtime.loss``); either way
    every parameter slice's gradient must equal the unsharded gradient's slice (a replicated parameter's: the
    whole gradient, on every rank)."""
    model = _model()
    gm = pickle.loads(graph_bytes)
    propagate_vals(gm, [torch.zeros(1, 32, dtype=torch.long)])
    cache = LoweringCache(lambda tokens: gm, TokenBuckets(sizes=(32,)), vocab_parallel=True, split_logits=True,
                          compile_backend="aot_eager")
    variant = cache.variant(ParallelScheme(tp=world), 0, 32, rank, dist.group.WORLD.group_name)
    share = CFG.vocab // world
    assert variant.vocab_range == (rank * share, (rank + 1) * share)
    assert not any(n.target is TP_ALL_GATHER for n in variant.graph_module.graph.nodes)
    lens = [7, 1, 12, 5]
    ids = torch.randint(0, CFG.vocab, (sum(lens),), generator=torch.Generator().manual_seed(5))
    cu = torch.tensor([0, 7, 8, 20, 25], dtype=torch.int32)
    weights = torch.randn(sum(lens), CFG.vocab, generator=torch.Generator().manual_seed(6))
    start, stop = variant.vocab_range
    shard = VocabShard(start=start, stop=stop, group=dist.group.WORLD.group_name)
    targets = next_token_targets(ids, cu)
    for form in ("linear", "cross_entropy"):
        for p in (*variant.graph_module.parameters(), *model.parameters()):
            p.grad = None
        logits = variant.logits(variant(ids, cu), len(ids))
        assert tuple(logits.shape) == (len(ids), share)
        ref = torch.cat([model(seq[None])[0] for seq in ids.split(lens)])
        if form == "linear":
            (logits * weights[:, start:stop]).sum().backward()
            (ref * weights).sum().backward()
        else:  # the vocabulary-parallel cross-entropy over the TP group
            loss = packed_causal_lm_loss_sum(logits, ids, cu, shard)
            want = F.cross_entropy(ref, targets, ignore_index=IGNORE, reduction="sum")
            torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
            loss.backward()
            want.backward()
        torch.testing.assert_close(logits, ref[:, start:stop], rtol=1e-5, atol=1e-5)
        for sl in variant.params:
            grad = variant.graph_module.get_parameter(sl.name).grad
            full = sl.take(model.get_parameter(sl.name).grad)
            torch.testing.assert_close(grad, full, rtol=1e-5, atol=1e-4, msg=f"{form}: {sl.describe()}")


@pytest.mark.parametrize("world", [2, 4])
def test_split_logits_variant_matches_unsharded_on_gloo(world, tmp_path):
    cap = capture(_model(), torch.zeros(1, 32, dtype=torch.long))
    run_ranks(world, tmp_path, _split_logits_rank, pickle.dumps(cap.graph_module), timeout_s=180)


def test_split_logits_under_run_passes_keeps_vals_consistent():
    """The split logits' val is what a full propagation of the rewritten graph gives, on every rank."""
    from passes.graph.pass_runner import same_val

    ids = torch.zeros(1, 16, dtype=torch.long)
    gm = capture(_model(), ids).graph_module
    propagate_vals(gm, [ids])
    for rank in range(2):
        ctx = PassContext(scheme=ParallelScheme(tp=2), tp_rank=rank, tp_group="g",
                          options={"shard_tensor_parallel_pass.vocab_parallel": True,
                                   "shard_tensor_parallel_pass.split_logits": True})
        out, _ = run_passes(gm, [shard_tensor_parallel_pass], ctx)
        filled = {n.name: n.meta.get("val") for n in out.graph.nodes}
        propagate_vals(out)
        for node in out.graph.nodes:
            assert same_val(filled[node.name], node.meta.get("val")), (rank, node.format_node())
        logits = next(n for n in out.graph.nodes if n.op == "output").args[0][0]
        assert tuple(logits.meta["val"].shape) == (1, 16, CFG.vocab // 2)


def _sp_collectives_rank(rank, world):
    """The sequence-parallel collectives on gloo against their definitions, along the token dim of (1, T, H):
    every rank's inputs and loss weights are known to every rank (seeded by rank), so each rank computes the
    expected values and gradients itself."""
    from passes.graph.collectives import sp_all_gather, sp_reduce_scatter, sp_split

    group, t, h = dist.group.WORLD.group_name, 4, 3

    def rand(seed, *shape):
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))

    # all-gather of token blocks; backward: each rank's block of the group's summed gradient
    x = rand(rank, 1, t, h).requires_grad_()
    y = sp_all_gather(x, group, 1, world, rank)
    torch.testing.assert_close(y, torch.cat([rand(q, 1, t, h) for q in range(world)], dim=1))
    (y * rand(100 + rank, 1, world * t, h)).sum().backward()
    summed = sum(rand(100 + q, 1, world * t, h) for q in range(world))
    torch.testing.assert_close(x.grad, summed[:, rank * t:(rank + 1) * t])
    # reduce-scatter; backward: the all-gather of every rank's gradient block
    x = rand(200 + rank, 1, world * t, h).requires_grad_()
    y = sp_reduce_scatter(x, group, 1, world, rank)
    total = sum(rand(200 + q, 1, world * t, h) for q in range(world))
    torch.testing.assert_close(y, total[:, rank * t:(rank + 1) * t])
    (y * rand(300 + rank, 1, t, h)).sum().backward()
    torch.testing.assert_close(x.grad, torch.cat([rand(300 + q, 1, t, h) for q in range(world)], dim=1))
    # this rank's block of a whole value; backward: the whole gradient, the same on every rank
    x = rand(400, 1, world * t, h).requires_grad_()
    y = sp_split(x, group, 1, world, rank)
    torch.testing.assert_close(y, x.detach()[:, rank * t:(rank + 1) * t])
    (y * rand(500 + rank, 1, t, h)).sum().backward()
    torch.testing.assert_close(x.grad, torch.cat([rand(500 + q, 1, t, h) for q in range(world)], dim=1))
    with pytest.raises(ValueError, match="does not split into"):
        sp_split(rand(0, 1, world * t + 1, h), group, 1, world, rank)


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_collectives_on_gloo(world, tmp_path):
    run_ranks(world, tmp_path, _sp_collectives_rank, timeout_s=120)
