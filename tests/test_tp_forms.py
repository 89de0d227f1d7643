"""Correct or refused. ``forms_lm.FormsLM`` is written in every form that tensor parallelism once trained wrong
or refused (per-head q/k norms, a fused projection as ``x @ w.T + b`` sliced by getitem, interleaved rotary,
soft-capped eager attention, an RMSNorm over a whole split projection, a chunk after a per-head view, a fused
multi-query key/value projection): on 4 gloo ranks under tp1/tp2/tp4/pp2 strategies it trains equal to plain
single-process SGD at 1e-5, every parameter compared. And the safety net: a lowering made wrong on purpose (the
gradient reduction of replicated values meeting split ones switched off: exactly Qwen 3's silent defect) is
refused before the first step, with the same LoweringError on every rank naming the parameters, and nothing
changed."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_ranks
from forms_lm import VOCAB, FormsLM
from test_equivalence import reference_sgd

from passes.graph.variant import TokenBuckets

STRATEGIES = ["4x(tp1)", "1x(tp2)+2x(tp1)", "2x(tp2)", "1x(tp4)", "1x(tp2,pp2)"]
LENS = [[9, 14, 5, 11], [13, 3, 8, 16, 6], [7, 12, 10], [15, 4, 9, 2], [6, 11, 14]]
BUCKETS = TokenBuckets.powers_of_two(16, 128)


def _batches() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [[torch.randint(0, VOCAB, (n,), generator=g) for n in lens] for lens in LENS]


def _train(rank, world):
    import hcompile

    trainer = hcompile.compile(FormsLM(), buckets=BUCKETS).trainer(
        optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.5}, strategies=STRATEGIES, tokens_per_rank=16,
        calibrate=False)
    out = []
    for strategy, batch in zip(STRATEGIES, _batches()):
        stats = trainer.train_step(batch, strategy=strategy)
        out.append((stats.loss, stats.strategy, trainer.full_state_dict()))
    return out


def test_every_form_trains_like_one_device():
    results = run_ranks(4, None, _train, timeout_s=600)
    losses, states = reference_sgd(FormsLM(), _batches(), 0.5)
    for per_rank in results:
        for step, (loss, strategy, state) in enumerate(per_rank):
            assert loss == pytest.approx(losses[step], rel=1e-5), strategy
            for name, want in states[step].items():
                torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6, msg=f"{strategy} {name}")


def _train_with_a_wrong_rule(rank, world):
    import hcompile
    from passes.graph import tensor_parallel

    tensor_parallel._Rewriter.reduce_replicated_grads = lambda self, node, new: None  # the defect, put back
    model = FormsLM()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = hcompile.compile(model, buckets=BUCKETS).trainer(
        optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.5}, strategies=["1x(tp2)"], tokens_per_rank=16)
    try:
        trainer.train_step(_batches()[0])
    except hcompile.LoweringError as e:
        unchanged = all(torch.equal(trainer.full_state_dict()[n], v) for n, v in before.items())
        return str(e), unchanged
    return None, None


def test_a_wrong_lowering_is_refused_on_every_rank_before_the_first_step():
    results = run_ranks(2, None, _train_with_a_wrong_rule, timeout_s=300)
    messages = {message for message, _ in results}
    assert len(messages) == 1 and None not in messages, results
    message = messages.pop()
    assert "does not train this model correctly" in message and "(tp2,pp1)" in message
    assert "blocks.0.q_norm.weight" in message and "blocks.0.k_norm.weight" in message
    assert all(unchanged for _, unchanged in results)


def test_dropout_under_tensor_parallelism_is_refused_by_name():
    """Ranks would drop a replicated activation with different masks: refused under tp > 1, fine under tp1."""
    import hcompile
    from passes.graph.lowering import decide_lowerings
    from passes.graph.pass_runner import PassError
    from passes.plan.ir import ParallelScheme

    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=64, resid_pdrop=0.1, embd_pdrop=0.1,
        attn_pdrop=0.0, attn_implementation="sdpa"))
    captured = hcompile.compile(model).captured(16).graph_module
    assert any("dropout" in str(n.target) for n in captured.graph.nodes)
    decide_lowerings(captured, ParallelScheme(tp=1))
    with pytest.raises(PassError, match="applies dropout p=0.1 under tp=2"):
        decide_lowerings(captured, ParallelScheme(tp=2), tp_rank=0, tp_group="g")
