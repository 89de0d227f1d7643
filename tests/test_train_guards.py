"""What the trainer refuses or leaves alone: optimisers that are not elementwise (with the supported list), a
strategy given as one string, a TP degree that does not divide the head count, a context-parallel scheme the
cost model lacks (a listed one is added from its (tp, pp) scheme), a token cap the machine cannot
hold (a clear error in seconds, not a process the OOM killer ends), a batch with no next-token pair (no
optimiser step, no weight decay, said so in the stats), and with ``non_finite="skip"`` a step whose loss is NaN
(skipped with nothing changed, counted in the stats)."""

from __future__ import annotations

import time

import pytest
import torch
from dist_util import run_ranks

from hcompile.train import ELEMENTWISE_OPTIMIZERS, TrainOptions


@pytest.mark.parametrize("optimizer", [torch.optim.Adafactor, torch.optim.LBFGS, torch.optim.SparseAdam,
                                       torch.optim.Muon, type("MyOptimizer", (torch.optim.Optimizer,), {})])
def test_optimisers_that_are_not_elementwise_are_refused_with_the_supported_list(optimizer):
    with pytest.raises(ValueError, match=f"optimizer {optimizer.__name__} is not supported: .*\\(SGD, Adam, AdamW, "
                                         ".*Rprop\\); pass elementwise_optimizer=True"):
        TrainOptions(optimizer=optimizer)
    assert TrainOptions(optimizer=optimizer, elementwise_optimizer=True).optimizer is optimizer
    with pytest.raises(ValueError, match="optimizer must be a torch.optim.Optimizer class, got 'adamw'"):
        TrainOptions(optimizer="adamw")


@pytest.mark.parametrize("optimizer", ELEMENTWISE_OPTIMIZERS)
def test_every_supported_optimiser_steps_a_split_vector_as_the_whole(optimizer):
    """What the allow-list promises: two halves stepped by two instances equal the whole vector stepped by one."""
    g = torch.Generator().manual_seed(0)
    start, grads = torch.randn(10, generator=g), [torch.randn(10, generator=g) for _ in range(3)]
    kwargs = {"lr": 0.01, "weight_decay": 0.1} if optimizer not in (torch.optim.Rprop,) else {"lr": 0.01}
    whole = torch.nn.Parameter(start.clone())
    halves = [torch.nn.Parameter(start[:4].clone()), torch.nn.Parameter(start[4:].clone())]
    opts = [optimizer([whole], **kwargs), optimizer([halves[0]], **kwargs), optimizer([halves[1]], **kwargs)]
    for grad in grads:
        whole.grad, halves[0].grad, halves[1].grad = grad.clone(), grad[:4].clone(), grad[4:].clone()
        for opt in opts:
            opt.step()
    torch.testing.assert_close(torch.cat([h.detach() for h in halves]), whole.detach(), rtol=0, atol=1e-7)


def test_one_strategy_as_a_string_is_one_strategy():
    assert TrainOptions(strategies="1x(tp1)").strategies == ("1x(tp1)",)
    assert TrainOptions(strategies=["2x(tp1)", "1x(tp2)"]).strategies == ("2x(tp1)", "1x(tp2)")
    assert TrainOptions().strategies == "auto"
    with pytest.raises(ValueError, match="strategies must be 'auto' or strategies such as"):
        TrainOptions(strategies=())


def test_a_tp_degree_that_does_not_divide_the_heads_is_named():
    import hcompile
    from hcompile.cost import add_listed_cp_schemes, check_strategies, default_cost_model
    from hcompile.models import Llama, LlamaConfig, init_weights_
    from passes.plan.ir import ParallelScheme

    graph = hcompile.compile(init_weights_(Llama(LlamaConfig()), seed=0)).captured(64).graph_module
    model = default_cost_model(graph, "llama", 4, 64)
    with pytest.raises(ValueError, match="strategy '1x\\(tp3\\)\\+1x\\(tp1\\)': tp3 does not divide the model's 4 "
                                         "attention heads"):
        check_strategies(("2x(tp2)", "1x(tp3)+1x(tp1)"), model, graph, 4)
    with pytest.raises(ValueError, match="strategy '1x\\(tp2\\)' covers 2 ranks, the job has 4"):
        check_strategies(("1x(tp2)",), model, graph, 4)
    with pytest.raises(ValueError, match="pp4 is more than the model's 2 layers"):
        check_strategies(("1x(tp1,pp4)",), model, graph, 4)
    check_strategies(("2x(tp2)", "1x(tp2)+2x(tp1)"), model, graph, 4)
    with pytest.raises(ValueError, match="strategy '1x\\(cp2,tp2\\)': \\(tp2,pp1,cp2\\) is not a scheme of the cost "
                                         "model"):
        check_strategies(("1x(cp2,tp2)",), model, graph, 4)
    listed = add_listed_cp_schemes(model, ("1x(cp2,tp2)",))  # the trainer adds a listed strategy's CP schemes
    check_strategies(("1x(cp2,tp2)",), listed, graph, 4)
    base, cp = listed.cost(ParallelScheme(tp=2)), listed.cost(ParallelScheme(tp=2, cp=2))
    assert (cp.a, cp.b, cp.c, cp.max_tokens) == (base.a / 2, base.b / 2, base.c, 2 * base.max_tokens)
    assert add_listed_cp_schemes(model, "auto") is model  # never planned on its own


def _one_rank(rank, world):
    import hcompile
    from hcompile.memory import MemoryCapError
    from hcompile.models import Llama, LlamaConfig, init_weights_

    trainer = hcompile.compile(init_weights_(Llama(LlamaConfig()), seed=0)).trainer(
        loss="causal_lm", optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 0.1, "weight_decay": 0.5},
        strategies="1x(tp1)", tokens_per_rank=64, calibrate=False, non_finite="skip")
    ones = [torch.tensor([5]), torch.tensor([7]), torch.tensor([9])]
    good = [torch.arange(20) % 96, torch.arange(9)]
    before = trainer.full_state_dict()
    skipped = [trainer.train_step(ones)]
    source = iter([good, ones])
    skipped.append(trainer.train_step(source))  # the good batch, with the 1-token batch held and checked
    after_good = trainer.full_state_dict()
    skipped.append(trainer.train_step(source))  # nothing was planned for it: every rank stays in step
    unchanged = [all(torch.equal(before[n], t) for n, t in after_good.items()) is False,
                 all(torch.equal(after_good[n], t) for n, t in trainer.full_state_dict().items())]
    steps = trainer.optimizer.state_dict()["state"][0]["step"].item()
    trainer.train_step(good)
    flags = [s.skipped for s in skipped]
    layout, spec = trainer.layout, trainer.layout.specs["norm.weight"]
    with torch.no_grad():  # finite weights whose logits overflow: the loss is NaN
        for a, b in layout.in_shard([(spec.offset, spec.offset + spec.numel)], layout.rank):
            layout.shard[a:b] = 3e38
    huge = trainer.full_state_dict()
    overflow = trainer.train_step(good)  # non_finite="skip": no optimiser step, counted
    non_finite = (overflow.non_finite_skips, overflow.loss != overflow.loss,
                  all(torch.equal(huge[n], t) for n, t in trainer.full_state_dict().items()),
                  trainer.optimizer.state_dict()["state"][0]["step"].item())
    started = time.monotonic()
    try:  # a rotary model has no position table: only the memory bounds its buckets
        big = hcompile.compile(init_weights_(Llama(LlamaConfig(vocab=32000)), seed=0)).trainer(
            loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, tokens_per_rank=10**6)
        outcome = ("trained", max(e.max_tokens for e in big.cost_model.entries))
    except MemoryCapError as exc:
        outcome = ("refused", str(exc))
    return flags, skipped[0].loss, unchanged, steps, non_finite, outcome, time.monotonic() - started


def test_no_pair_changes_nothing_and_a_cap_the_machine_cannot_hold_is_refused_in_seconds(tmp_path):
    flags, loss, (good_step_changed, ones_changed_nothing), steps, non_finite, outcome, seconds = run_ranks(
        1, tmp_path, _one_rank)[0]
    assert flags == [True, False, True] and loss == 0.0
    assert good_step_changed and ones_changed_nothing and steps == 1  # one optimiser step: the good batch's
    assert non_finite == (1, True, True, 2)  # skipped and counted: NaN loss, weights and optimiser untouched
    kind, detail = outcome
    if kind == "trained":  # a machine with the ~700 GB a 10^6-token micro-batch of this model needs
        pytest.skip(f"this machine holds {detail} tokens")
    assert detail.startswith("tokens_per_rank=1000000 is more than this machine holds: about ") and "KiB per token" \
        in detail and "pass tokens_per_rank <=" in detail, detail
    assert seconds < 60, seconds
