"""Context parallelism trains exactly: on 4 gloo ranks, strategies with CP replicas (1x(cp4), 1x(tp2,cp2),
1x(cp2)+2x(tp1), 1x(pp2,cp2)) train batches whose longest sequences no replica of the same strategy without CP
could hold, GPT and an unmodified Hugging Face Mistral (GQA, rotary positions from position ids, a sliding window
of 8 that each CP rank applies on whole-sequence positions), and in ``make test-full`` Llama 4 with chunks of 8
(counted from each whole sequence's start), each step equal to plain single-process SGD at 1e-5: the loss and
every parameter. Each CP replica splits the long
sequences over its ranks (every rank's positions those of the whole sequence, every pair scored once), runs
several micro-batches, and passes the lowering self-check on a probe first; every rank's point-to-point
operations come in an order NCCL completes (``tests/p2p_order.py``). GPT gathers each layer's K/V at once; the
Hugging Face models pipeline the exchange over their kv heads (``kv_splits=4``, ``passes.graph.kv_exchange``)."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_ranks
from p2p_order import p2p_problems
from test_equivalence import reference_sgd
from test_hf_models import _HFLogits
from tiers import FULL

from hcompile.models import GPT, GPTConfig, init_weights_
from passes.graph.variant import TokenBuckets
from passes.plan.ir import Strategy

CAP = 24  # tokens per rank: a (tp t, cp c) replica holds 24 t c tokens per micro-batch
BUCKETS = TokenBuckets(sizes=(16, 32, 64, 128))
STEPS = [  # (strategy, lengths): the longest is more than the strategy's replicas would hold without CP
    ("1x(cp4)", [90, 31, 7, 41, 13]),
    ("1x(tp2,cp2)", [80, 50, 9, 30]),
    ("1x(cp2)+2x(tp1)", [45, 40, 20, 11, 5, 17]),
    ("1x(pp2,cp2)", [47, 30, 12, 6]),
]
VOCAB = 64


def _without_cp_cap(strategy: str) -> int:
    return CAP * max(s.tp for s in Strategy.parse(strategy).replicas())


def _model(name: str) -> torch.nn.Module:
    if name == "gpt":
        return init_weights_(GPT(GPTConfig(layers=2, heads=4, hidden=32, vocab=VOCAB, block_size=256)), seed=3)
    from benchmarks import hf_families
    return hf_families.make_model(name)


def _batch(lens: list[int], vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(sum(lens))
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


def _vocab(name: str) -> int:
    if name == "gpt":
        return VOCAB
    from benchmarks import hf_families
    return hf_families.VOCAB


def _steps(name: str) -> list:
    """GPT every step; the HF models two of them in ``make test`` (all four in ``make test-full``)."""
    return STEPS if name == "gpt" or FULL else [STEPS[1], STEPS[2]]


def _train(rank, world, name):
    """Each step on a trainer of its own, and every point-to-point operation this rank posted."""
    from p2p_order import P2PRecorder

    with P2PRecorder() as rec:
        out = _train_steps(name)
    return out, rec.ops


def _train_steps(name):
    import hcompile

    out = []
    compiled = hcompile.compile(_model(name), buckets=BUCKETS)  # one capture per bucket, a trainer per strategy
    for strategy, lens in _steps(name):
        trainer = compiled.trainer(
            loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.5}, strategies=[strategy],
            tokens_per_rank=CAP, calibrate=False, kv_splits=1 if name == "gpt" else 4)
        stats = trainer.train_step(_batch(lens, _vocab(name)), strategy=strategy)
        plan = trainer.last_plan.plan
        out.append((stats.loss, stats.strategy, [len(r.micro_batches) for r in plan.replicas],
                    trainer.full_state_dict()))
    return out


@pytest.mark.parametrize("name", ["gpt", "mistral", pytest.param("llama4_chunked", marks=[pytest.mark.slow])])
def test_context_parallel_steps_match_single_process_sgd(tmp_path, name):
    per_rank = run_ranks(4, tmp_path, _train, name, timeout_s=500)
    assert p2p_problems([ops for _, ops in per_rank]) == []
    results = [out for out, _ in per_rank]
    for step, (strategy, lens) in enumerate(_steps(name)):
        assert max(lens) > _without_cp_cap(strategy), "the batch must need context parallelism"
        model = _model(name) if name == "gpt" else _HFLogits(_model(name))
        losses, states = reference_sgd(model, [_batch(lens, _vocab(name))], 0.5)
        for per_rank in results:
            loss, described, micro, state = per_rank[step]
            assert described == Strategy.parse(strategy).describe()
            assert loss == pytest.approx(losses[0], rel=1e-5), (strategy, loss, losses[0])
            for n, p in states[0].items():
                torch.testing.assert_close(state[n], p, rtol=1e-5, atol=1e-6, msg=f"{strategy}: {n}")
        assert max(micro) >= 2, f"{strategy}: a replica should run several micro-batches, got {micro}"
