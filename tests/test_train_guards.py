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



@pytest.mark.parametrize(("kwargs", "message"), [
    ({"lr": "0.1"}, r"optimizer_kwargs\['lr'\] must be a real number \(or a one-element floating tensor\) for AdamW, "
                    r"got '0.1' \(str\)"),
    ({"lr": True}, r"optimizer_kwargs\['lr'\] must be a real number .* got True \(bool\)"),
    ({"lr": torch.tensor([0.1, 0.2])}, r"optimizer_kwargs\['lr'\] must be a real number"),
    ({"betas": (0.9,)}, r"optimizer_kwargs\['betas'\] must be a tuple of 2 real numbers such as \(0.9, 0.999\) "
                        r"for AdamW, got \(0.9,\) \(tuple\)"),
    ({"betas": ("0.9", 0.95)}, r"optimizer_kwargs\['betas'\] must be a tuple of 2 real numbers"),
    ({"maximize": 1}, r"optimizer_kwargs\['maximize'\] must be True or False for AdamW, got 1 \(int\)"),
    ({"fused": "yes"}, r"optimizer_kwargs\['fused'\] must be True or False or None for AdamW, got 'yes'"),
    ({"learning_rate": 0.1}, r"optimizer_kwargs: AdamW takes no keyword argument 'learning_rate' \(it takes lr, "
                             r"betas, eps"),
    ({"params": []}, "optimizer_kwargs must not hold 'params'"),
    ({1: 0.1}, r"optimizer_kwargs keys must be keyword names, got 1 \(int\)"),
    ([("lr", 0.1)], r"optimizer_kwargs must be a mapping of keyword arguments such as \{'lr': 1e-3\}, got "
                    r"\[\('lr', 0.1\)\] \(list\)"),
    ({"lr": -1.0}, r"optimizer_kwargs \{'lr': -1.0\} are refused by AdamW: Invalid learning rate: -1.0"),
    ({"betas": (0.9, 1.5)}, r"are refused by AdamW: Invalid beta parameter at index 1: 1.5"),
    ({"lr": float("nan")}, "optimizer_kwargs must be finite numbers, got lr=nan"),
])
def test_optimiser_settings_of_the_wrong_type_are_refused_before_anything_is_captured(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainOptions(optimizer_kwargs=kwargs)


class _MySGD(torch.optim.SGD):
    """A subclass with keywords of its own (a string among them) and ``**kwargs``."""

    def __init__(self, params, lr=0.1, mode="a", **kwargs):
        super().__init__(params, lr=lr)


@pytest.mark.parametrize(("optimizer", "kwargs"), [
    (torch.optim.AdamW, {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "foreach": None,
                         "fused": False, "maximize": True, "capturable": True, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": torch.tensor(0.01), "betas": [0.9, 0.95], "fused": True}),
    (torch.optim.Adam, {"lr": torch.tensor(0.01), "betas": (torch.tensor(0.9), torch.tensor(0.99)),
                        "capturable": True, "foreach": True, "decoupled_weight_decay": True}),
    (torch.optim.SGD, {"lr": 1, "momentum": 0.9, "nesterov": True, "dampening": 0, "differentiable": False}),
    (torch.optim.Rprop, {"lr": 0.01, "etas": (0.4, 1.1), "step_sizes": (1e-6, 50)}),
    (torch.optim.RMSprop, {"lr": 0.01, "alpha": 0.9, "centered": True, "momentum": 0.5}),
    (_MySGD, {"lr": 0.2, "mode": "b", "anything": object()}),  # **kwargs: any further key, unchecked
])
def test_what_torch_optimisers_take_is_accepted(optimizer, kwargs):
    assert TrainOptions(optimizer=optimizer, optimizer_kwargs=kwargs).optimizer_kwargs is kwargs


def test_buckets_as_token_counts_are_token_buckets_and_wrong_types_are_named():
    from passes.graph.variant import TokenBuckets

    assert TrainOptions(buckets=[64, 128]).buckets == TokenBuckets(sizes=(64, 128))
    assert TrainOptions(buckets=(256,)).buckets == TokenBuckets(sizes=(256,))
    assert TrainOptions().buckets is None
    for value in ("64", 64, {64: 1}):
        with pytest.raises(ValueError, match=f"buckets must be TokenBuckets, token counts such as \\(64, 128, 256\\), "
                                             f"or None; got {value!r} \\({type(value).__name__}\\)"):
            TrainOptions(buckets=value)
    with pytest.raises(ValueError, match=r"buckets \[128, 64\]: bucket sizes must be strictly ascending"):
        TrainOptions(buckets=[128, 64])
    with pytest.raises(ValueError, match=r"buckets \[64.0\]: bucket sizes must be positive integers"):
        TrainOptions(buckets=[64.0])


@pytest.mark.parametrize("name", ["elementwise_optimizer", "regroup", "replicas_take_turns", "calibrate",
                                  "self_check", "overlap_movement", "recompute"])
def test_a_flag_that_is_not_a_bool_is_named(name):
    for value in ("False", 0, None):
        with pytest.raises(ValueError, match=f"{name} must be True or False, got {value!r}"):
            TrainOptions(**{name: value})


def test_other_fields_of_the_wrong_type_are_named():
    cases = [({"strategies": [4]}, r"strategies must be 'auto' or strings such as '4x\(tp1\)', got 4 \(int\) in "
                                   r"\(4,\)"),
             ({"strategies": None}, "strategies must be 'auto' or strategies such as"),
             ({"strategies": ("1x(tp1)", b"1x(tp1)")}, r"got b'1x\(tp1\)' \(bytes\)"),
             ({"policy": ["hydraulis"]}, r"unknown policy \['hydraulis'\]; known: "),
             ({"loss": None}, "unknown loss None"),
             ({"non_finite": ["raise"]}, r"non_finite must be one of \('raise', 'skip'\), got \['raise'\]"),
             ({"tokens_per_rank": "64"}, "tokens_per_rank must be a positive integer or None, got '64'"),
             ({"tokens_per_rank": 64.0}, "tokens_per_rank must be a positive integer or None, got 64.0"),
             ({"param_dtype": "bfloat16"}, "param_dtype must be torch.float32 or torch.bfloat16, got 'bfloat16'"),
             ({"plan_timeout_s": "10"}, "plan_timeout_s must be a positive number of seconds or None, got '10'"),
             ({"movement_pieces": 2.0}, "movement_pieces must be a positive integer, got 2.0"),
             ({"kv_splits": "2"}, "kv_splits must be a positive integer or None, got '2'"),
             ({"movement_inflight_bytes": 1.5}, "movement_inflight_bytes must be an integer >= 0, got 1.5"),
             ({"self_check_max_tokens": True}, "self_check_max_tokens must be a positive integer, got True"),
             ({"optimizer": "AdamW"}, "optimizer must be a torch.optim.Optimizer class, got 'AdamW'")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            TrainOptions(**kwargs)

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
