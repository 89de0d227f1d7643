"""``strategies="auto"`` trains documents longer than every scheme without context parallelism holds: the trainer
adds ``(tp, cp)`` schemes where the data needs them (``hcompile.cost.add_needed_cp_schemes``) and nowhere else.
On 4 gloo ranks a GPT of 2 heads (tensor parallelism up to 2: 48 tokens per replica at 24 per rank) trains a
batch holding an 80-token document, then one without, each step equal to single-process SGD at 1e-5 (the loss
and every parameter), every rank's point-to-point order one NCCL completes."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_ranks
from p2p_order import p2p_problems
from test_equivalence import reference_sgd

from hcompile.cost import add_needed_cp_schemes
from hcompile.models import GPT, GPTConfig, init_weights_
from passes.graph.variant import TokenBuckets
from passes.plan.ir import CostModel, ParallelScheme, SchemeCost

CAP = 24
BUCKETS = TokenBuckets(sizes=(16, 32, 64, 128))
VOCAB = 64
STEPS = [[80, 30, 12, 9], [20, 40, 7, 15, 33]]


def _model() -> torch.nn.Module:
    return init_weights_(GPT(GPTConfig(layers=2, heads=2, hidden=32, vocab=VOCAB, block_size=256)), seed=5)


def _batch(lens: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(sum(lens))
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lens]


def _train(rank, world):
    from p2p_order import P2PRecorder

    import hcompile

    with P2PRecorder() as rec:
        trainer = hcompile.compile(_model(), buckets=BUCKETS).trainer(
            loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.5}, tokens_per_rank=CAP,
            calibrate=False)
        out = []
        for lens in STEPS:
            stats = trainer.train_step(_batch(lens))
            plan = trainer.last_plan.plan
            holder = next(r.scheme for r in plan.replicas if any(plan.seq_lens[i] == max(lens)
                                                                 for mb in r.micro_batches for i in mb))
            out.append((stats.loss, stats.strategy, holder, trainer.full_state_dict()))
        schemes = sorted(e.scheme.describe() for e in trainer.cost_model.entries if e.scheme.cp > 1)
    return out, schemes, rec.ops


def test_auto_adds_context_parallelism_where_a_document_needs_it_and_trains_exactly(tmp_path):
    per_rank = run_ranks(4, tmp_path, _train, timeout_s=400)
    assert p2p_problems([ops for _, _, ops in per_rank]) == []
    losses, states = reference_sgd(_model(), [_batch(lens) for lens in STEPS], 0.5)
    for out, schemes, _ in per_rank:
        assert schemes == ["(tp1,pp1,cp2)", "(tp1,pp1,cp4)", "(tp2,pp1,cp2)"]
        (_, _, holder, _), _ = out
        assert holder.cp > 1 and CAP * holder.tp < 80 <= CAP * holder.tp * holder.cp  # CP holds what TP cannot
        for step, (loss, strategy, _, state) in enumerate(out):
            assert loss == pytest.approx(losses[step], rel=1e-5), strategy
            for n, p in states[step].items():
                torch.testing.assert_close(state[n], p, rtol=1e-5, atol=1e-6, msg=f"step {step} {strategy} {n}")


def test_no_context_parallel_scheme_where_every_sequence_fits():
    entries = tuple(SchemeCost(scheme=ParallelScheme(tp=t), a=1e-4, b=0.05, c=1.0, max_tokens=CAP * t) for t in (1, 2))
    model = CostModel(name="toy", entries=entries, gpus_per_node=8)
    assert add_needed_cp_schemes(model, 4, 48) is model  # tp2 holds it
    grown = add_needed_cp_schemes(model, 4, 49)
    added = {e.scheme: e for e in grown.entries if e.scheme.cp > 1}
    assert set(added) == {ParallelScheme(tp=1, cp=2), ParallelScheme(tp=1, cp=4), ParallelScheme(tp=2, cp=2)}
    cp4 = added[ParallelScheme(tp=1, cp=4)]
    assert (cp4.a, cp4.b, cp4.c, cp4.max_tokens) == (1e-4 / 4, 0.05 / 4, 1.0, 4 * CAP)
    # within the job's ranks only (on 2 it still cannot hold 49 tokens: the planner says so by name)
    assert set(add_needed_cp_schemes(model, 2, 49).schemes) == {*model.schemes, ParallelScheme(tp=1, cp=2)}
