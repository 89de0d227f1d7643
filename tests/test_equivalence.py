"""A heterogeneous step equals a single-device step: random strategies on 4 gloo ranks (tp1/tp2/tp4, pp1/pp2,
cp2/cp4, mixed, and regrouped steps whose CP groups re-form per sequence on a slot layout), random batches,
caps small enough that replicas run several micro-batches in several token buckets, GPT and LLaMA, against plain
single-process SGD at 1e-5 (loss and every parameter), every rank's point-to-point operations in an order NCCL
completes (``tests/p2p_order.py``). Also the case that exposed buckets sharing the model's Parameters: one rank,
micro-batches in two buckets."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_util import LateOwner, run_ranks
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from p2p_order import p2p_problems
from tiers import FULL

from hcompile.models import GPT, GPTConfig, Llama, LlamaConfig, init_weights_
from passes.graph.variant import TokenBuckets
from passes.plan.ir import Strategy

MODELS = {
    "gpt": (GPT, GPTConfig(layers=2, heads=4, hidden=32, vocab=64, block_size=256)),
    "llama": (Llama, LlamaConfig(layers=2, heads=4, kv_heads=2, hidden=32, ffn_hidden=64, vocab=64)),
}
# Every strategy of tp in {1, 2, 4} and pp in {1, 2} that 4 ranks can run, and context-parallel ones.
STRATEGIES = ["4x(tp1)", "2x(tp2)", "1x(tp4)", "1x(tp2)+2x(tp1)", "2x(tp1,pp2)", "1x(tp1,pp2)+2x(tp1)",
              "1x(tp2,pp2)", "1x(tp1,pp2)+1x(tp2)", "1x(cp4)", "1x(tp2,cp2)", "1x(cp2)+2x(tp1)", "1x(pp2,cp2)"]
# Regrouped steps (``StepPlan.regrouped``): on a slot layout, CP groups of aligned slots re-form per sequence
# (``passes.plan.regrouped``), then each slot runs its own micro-batches.
REGROUPED = ["regroup:4x(tp1)", "regroup:1x(tp2)+2x(tp1)", "regroup:2x(tp2)"]
CAP = 24  # tokens per rank: a tp-t replica holds 24 t tokens per micro-batch
BUCKETS = TokenBuckets(sizes=(8, 16, 24, 32, 48, 64, 96, 128, 192, 256))  # fine: micro-batches land in several


def _cap(strategy: str) -> int:
    """The longest sequence a strategy holds: its widest replica's cap (tp times cp ranks' tokens); a regrouped
    layout's, its widest CP group of one scheme's slots."""
    if strategy.startswith("regroup:"):
        layout = Strategy.parse(_layout(strategy))
        return CAP * max(s.tp * _pow2_floor(n) for s, n in layout.parts)
    return CAP * max(s.tp * s.cp for s in Strategy.parse(strategy).replicas())


def _layout(strategy: str) -> str:
    return strategy.removeprefix("regroup:")


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _regrouped_plan(trainer, strategy: str, lens: list[int]):
    """The regrouped plan of ``lens`` on the layout ``strategy`` names, on the trainer's cost model with the CP
    schemes its slots can form."""
    from hcompile.cost import add_listed_cp_schemes
    from passes.plan.ir import StepPlan
    from passes.plan.regrouped import regrouped_schedule

    layout = Strategy.parse(_layout(strategy))
    cp = [f"1x(tp{s.tp},cp{c})" for s, n in layout.parts for c in (2, 4) if c <= n]
    model = add_listed_cp_schemes(trainer.cost_model, cp)
    schedule = regrouped_schedule(model, layout, list(lens))
    return StepPlan(strategy=layout, seq_lens=tuple(lens), replicas=schedule.replicas,
                    est_step_ms=schedule.makespan_ms, lower_bound_ms=0.0, regrouped=True)


def reference_sgd(model, batches, lr):
    """Plain single-process training: per step the mean next-token loss over the batch, one SGD step. The model
    returns the logits, or an output holding them (``.logits``, as Hugging Face models do)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, states = [], []

    def logits(seq):
        out = model(seq[None])
        return (out if isinstance(out, torch.Tensor) else out.logits)[0]

    for batch in batches:
        pairs = sum(len(s) - 1 for s in batch)
        loss = sum(F.cross_entropy(logits(s)[:-1], s[1:], reduction="sum") for s in batch) / pairs
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        states.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, states


def _make(name: str, seed: int):
    cls, cfg = MODELS[name]
    return init_weights_(cls(cfg), seed=seed)


def _train(rank, world, cases, lr):
    """Each case on every rank: its own model and trainer, its forced strategy per step; and every
    point-to-point operation the rank posted."""
    from p2p_order import P2PRecorder

    with P2PRecorder() as rec:
        out = _cases(cases, lr)
    return out, rec.ops


def _cases(cases, lr):
    import hcompile

    out = []
    for name, seed, steps, overlap in cases:
        trainer = hcompile.compile(_make(name, seed), buckets=BUCKETS).trainer(
            loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": lr},
            strategies=sorted({_layout(s) for s, _ in steps}), tokens_per_rank=CAP, calibrate=False,
            overlap_movement=overlap)
        if overlap:
            trainer.executor.hooks.insert(0, LateOwner(0.1))  # the pieces must wait for what they read
        results = []
        for strategy, lens in steps:
            batch = _batch(name, seed, lens)
            if strategy.startswith("regroup:"):
                plan = _regrouped_plan(trainer, strategy, lens)
                stats = trainer.train_plan(plan, batch)
            else:
                stats = trainer.train_step(batch, strategy=strategy)
                plan = trainer.last_plan.plan
            buckets = [sorted({BUCKETS.bucket_for(sum(plan.seq_lens[i] for i in mb)) for mb in r.micro_batches})
                       for r in plan.replicas]
            results.append((stats.loss, stats.strategy, [len(r.micro_batches) for r in plan.replicas], buckets,
                            trainer.full_state_dict()))
        out.append(results)
    return out


def _batch(name: str, seed: int, lens: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1000)
    return [torch.randint(0, MODELS[name][1].vocab, (n,), generator=g) for n in lens]


@st.composite
def cases(draw, name: str):
    """A model seed, two or three steps (each a strategy and a batch of lengths it can hold) and whether the
    movement overlaps the compute."""
    steps = []
    for _ in range(draw(st.integers(2, 3))):
        strategy = draw(st.sampled_from(STRATEGIES + REGROUPED))
        longest = _cap(strategy)
        lens = draw(st.lists(st.integers(2, longest), min_size=8, max_size=16))
        steps.append((strategy, lens))
    return (name, draw(st.integers(0, 2**16)), steps, draw(st.booleans()))


def _check(results, cases_, lr) -> list[int]:
    """Every rank's losses and parameters against the reference; per case, how many replica steps ran
    several micro-batches spread over several buckets."""
    several = []
    for case, got in zip(cases_, zip(*results)):  # got: per rank, that case's steps
        name, seed, steps, _ = case
        losses, states = reference_sgd(_make(name, seed), [_batch(name, seed, lens) for _, lens in steps], lr)
        count = 0
        for step, per_rank in enumerate(zip(*got)):
            for loss, _, _, _, state in per_rank:
                assert loss == pytest.approx(losses[step], rel=1e-5), (case, step)
                for n, p in states[step].items():
                    torch.testing.assert_close(state[n], p, rtol=1e-5, atol=1e-6, msg=f"{case} step {step} {n}")
            _, _, micro, buckets, _ = per_rank[0]
            count += sum(m >= 2 and len(b) >= 2 for m, b in zip(micro, buckets))
        several.append(count)
    return several


# Always run beside the drawn cases. Most sequences are over half a tp1 cap, so a micro-batch holds one of
# them and its bucket (16 or 24 tokens) follows that sequence's length: every replica has several
# micro-batches in several buckets.
FIXED_STEPS = [("1x(tp2)+2x(tp1)", [14, 22, 15, 23, 13, 20, 16, 24, 40, 30, 45, 14, 19, 3, 2]),
               ("1x(tp1,pp2)+1x(tp2)", [23, 14, 41, 15, 18, 13, 24, 35, 16, 21, 5, 33]),
               ("regroup:4x(tp1)", [70, 40, 30, 14, 9, 22, 5, 16, 3, 11])]  # CP groups of 4 and 2, then alone


@pytest.mark.parametrize("name", sorted(MODELS))
@settings(max_examples=2 if FULL else 1, deadline=None, phases=[Phase.explicit, Phase.generate, Phase.shrink],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_strategies_match_single_process_sgd(tmp_path, name, data):
    drawn = data.draw(st.lists(cases(name), min_size=2, max_size=2), label="cases")
    lr = 0.3
    fixed = (name, 7, FIXED_STEPS, name == "gpt")  # GPT's tied embedding is read first and last: overlapped
    per_rank = run_ranks(4, tmp_path, _train, [fixed, *drawn], lr, timeout_s=400)
    assert p2p_problems([ops for _, ops in per_rank]) == []
    several = _check([out for out, _ in per_rank], [fixed, *drawn], lr)
    assert several[0] >= 3, "the fixed case must run several micro-batches in several buckets"


def _one_rank(rank, world):
    import hcompile

    model = init_weights_(GPT(GPTConfig(block_size=256)), seed=1)
    trainer = hcompile.compile(model).trainer(loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.5},
                               strategies=["1x(tp1)"], tokens_per_rank=128, calibrate=False)
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, GPTConfig().vocab, (n,), generator=g) for n in (120, 50)]
    stats = trainer.train_step(batch)
    return stats.loss, trainer.last_plan.plan.replicas[0].micro_batches, trainer.full_state_dict(), batch


def test_micro_batches_in_two_buckets_on_one_rank(tmp_path):
    """120 + 50 tokens under a 128-token cap: two micro-batches, buckets 128 and 64, one Parameter copy."""
    loss, micro, state, batch = run_ranks(1, tmp_path, _one_rank)[0]
    assert sorted(len(mb) for mb in micro) == [1, 1]
    losses, states = reference_sgd(init_weights_(GPT(GPTConfig(block_size=256)), seed=1), [batch], 0.5)
    assert loss == pytest.approx(losses[0], rel=1e-5)
    for n, p in states[0].items():
        torch.testing.assert_close(state[n], p, rtol=1e-5, atol=1e-6, msg=n)


def _two_trainers(rank, world):
    """Two trainers over one CompiledModel (as the harness runs its policies): each keeps its own variants."""
    from hcompile.api import CompiledModel
    from hcompile.train import Trainer, TrainOptions

    compiled = CompiledModel(_make("llama", 5), buckets=BUCKETS)
    options = TrainOptions(optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.3}, strategies=("2x(tp1)",),
                           tokens_per_rank=CAP, buckets=BUCKETS, calibrate=False)
    first, second = Trainer(compiled, options), Trainer(compiled, options)
    losses = []
    for lens in ([14, 22, 15, 9], [23, 5, 18, 2]):
        batch = _batch("llama", 5, lens)
        losses.append((first.train_step(batch).loss, second.train_step(batch).loss))
    return losses, first.full_state_dict(), second.full_state_dict()


def test_two_trainers_over_one_compiled_model(tmp_path):
    steps = [[14, 22, 15, 9], [23, 5, 18, 2]]
    losses, states = reference_sgd(_make("llama", 5), [_batch("llama", 5, lens) for lens in steps], 0.3)
    for got, first, second in run_ranks(2, tmp_path, _two_trainers):
        assert [a for a, _ in got] == pytest.approx(losses, rel=1e-5)
        assert [b for _, b in got] == pytest.approx(losses, rel=1e-5)
        for n, p in states[-1].items():
            torch.testing.assert_close(first[n], p, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(second[n], p, rtol=1e-5, atol=1e-6)
