"""Regrouped context parallelism trains exactly: on 4 gloo ranks, plans whose ranks re-form CP groups group after
group inside one step (``StepPlan.regrouped``) train GPT, an unmodified Hugging Face LLaMA and Mistral (a sliding
window of 8 tokens, shorter than every CP chunk, so every group's attention crosses chunk and rank boundaries
inside the window), each step equal to plain single-process SGD at 1e-5: the loss and every parameter.

- Step "1-2-4": four tp1 slots run a CP group of all 4 slots (a sequence longer than 2 slots hold), then two
  CP groups of 2 slots, then each slot alone with two micro-batches: every rank joins a group of 1, 2 and 4.
- Step "beside-tp2": a tp2 replica on ranks 0-1 trains its share while ranks 2-3 run a CP group of 2 and then
  one slot each.

GPT and Mistral move their parameters overlapped and pipeline their K/V exchange over head groups
(``passes.graph.kv_exchange``); LLaMA moves them plain, gathers its K/V at once and takes turns
(``runtime.measure.TakeTurns``: the groups one by one, in the plan's order, as the harness measures them on few
cores). Each rank pulls its slot's
parameters once, accumulates every group's gradients in one compute copy and pushes them once; every rank's
point-to-point operations come in an order NCCL completes (``tests/p2p_order.py``), and the collectives of each
group are posted in the plan's order on every rank."""

from __future__ import annotations

import pytest
import torch
from collective_order import collective_problems
from dist_util import run_ranks
from p2p_order import p2p_problems
from test_equivalence import reference_sgd
from test_hf_models import _HFLogits

from hcompile.models import GPT, GPTConfig, init_weights_
from passes.graph.variant import TokenBuckets
from passes.plan.ir import ParallelScheme, PlanError, ReplicaPlan, StepPlan, Strategy

CAP = 24  # tokens per rank: a (tp t, cp c) group holds 24 t c tokens per micro-batch
BUCKETS = TokenBuckets(sizes=(16, 32, 64, 128))
VOCAB = 64
TP1, TP2 = ParallelScheme(tp=1), ParallelScheme(tp=2)
CP2, CP4 = ParallelScheme(tp=1, cp=2), ParallelScheme(tp=1, cp=4)


def _group(scheme: ParallelScheme, ranks: tuple[int, ...], micro: tuple[tuple[int, ...], ...]) -> ReplicaPlan:
    return ReplicaPlan(scheme=scheme, ranks=ranks, micro_batches=micro, max_tokens=CAP * scheme.gpus, est_ms=0.0)


def _plan(layout: str, lens: list[int], groups: list[ReplicaPlan]) -> StepPlan:
    return StepPlan(strategy=Strategy.parse(layout), seq_lens=tuple(lens), replicas=tuple(groups),
                    est_step_ms=0.0, lower_bound_ms=0.0, policy="by-hand", regrouped=True)


def plans() -> dict[str, StepPlan]:
    """The two regrouped steps (module docstring), with lengths that need the groups they run in."""
    one_two_four = _plan("4x(tp1)", [90, 40, 45, 20, 9, 14, 6, 17, 11, 17, 5, 3], [
        _group(CP4, (0, 1, 2, 3), ((0,),)),  # 90 > 48: four slots
        _group(CP2, (0, 1), ((1,),)),
        _group(CP2, (2, 3), ((2,),)),
        _group(TP1, (0,), ((3,), (4, 5))),
        _group(TP1, (1,), ((6, 7),)),
        _group(TP1, (2,), ((8,), (9,))),
        _group(TP1, (3,), ((10, 11),)),
    ])
    beside = _plan("1x(tp2)+2x(tp1)", [30, 12, 44, 10, 7, 20], [
        _group(TP2, (0, 1), ((0,), (1,))),
        _group(CP2, (2, 3), ((2,),)),  # 44 > 24: two slots
        _group(TP1, (2,), ((3, 4),)),
        _group(TP1, (3,), ((5,),)),
    ])
    return {"1-2-4": one_two_four, "beside-tp2": beside}


def _model(name: str) -> torch.nn.Module:
    if name == "gpt":
        return init_weights_(GPT(GPTConfig(layers=2, heads=4, hidden=32, vocab=VOCAB, block_size=256)), seed=5)
    from benchmarks import hf_families
    return hf_families.make_model(name)


def _vocab(name: str) -> int:
    if name == "gpt":
        return VOCAB
    from benchmarks import hf_families
    return hf_families.VOCAB


def _batch(lens: tuple[int, ...], vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(sum(lens))
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


def _train(rank, world, name, overlap, turns):
    from collective_order import CollectiveRecorder
    from p2p_order import P2PRecorder

    import hcompile

    compiled = hcompile.compile(_model(name), buckets=BUCKETS)
    trainer = compiled.trainer(loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.5},
                               strategies=["4x(tp1)"], tokens_per_rank=CAP, calibrate=False,
                               overlap_movement=overlap, replicas_take_turns=turns,
                               kv_splits=1 if name == "llama" else 4)
    out = []
    for plan in plans().values():  # warmed first: the steps below are what the order is checked on
        trainer._warm_for(plan)
    with P2PRecorder() as rec, CollectiveRecorder() as calls:
        for plan in plans().values():
            stats = trainer.train_plan(plan, _batch(plan.seq_lens, _vocab(name)))
            out.append((stats.loss, stats.tokens_computed, trainer.full_state_dict()))
    return out, (rec.ops, calls.calls)


@pytest.mark.parametrize("name,overlap,turns", [("gpt", True, False), ("llama", False, True), ("mistral", True, False)])
def test_regrouped_steps_match_single_process_sgd(tmp_path, name, overlap, turns):
    per_rank = run_ranks(4, tmp_path, _train, name, overlap, turns, timeout_s=500)
    assert p2p_problems([ops for _, (ops, _) in per_rank]) == []
    calls = [c for _, (_, c) in per_rank]
    assert collective_problems(calls) == []
    # the CP groups' K/V all-gathers are among them: 2-rank and 4-rank groups of the tp1 slots
    sizes = {len(c.group) for rank in calls for c in rank if c.op in ("all_gather_single", "all_gather_into_tensor")}
    assert {2, 4} <= sizes, sizes
    # GPT (4 kv heads) and Mistral (2) gather one kv head at a time (pipelined); LLaMA its 2 at once
    heads = {c.shape[1] for rank in calls for c in rank
             if c.op in ("all_gather_single", "all_gather_into_tensor") and len(c.shape) == 3}
    assert heads == ({2} if name == "llama" else {1}), heads
    steps = list(plans().values())
    batches = [_batch(p.seq_lens, _vocab(name)) for p in steps]
    model = _model(name) if name == "gpt" else _HFLogits(_model(name))
    if name == "mistral":  # the window must cut the CP chunks and the longest sequences, or it tests nothing
        assert 1 < model.model.config.sliding_window < min(max(p.seq_lens) // 4 for p in steps), \
            model.model.config.sliding_window
    losses, states = reference_sgd(model, batches, 0.5)
    for step in range(len(steps)):
        for out, _ in per_rank:
            loss, computed, state = out[step]
            assert loss == pytest.approx(losses[step], rel=1e-5), (step, loss, losses[step])
            for n, p in states[step].items():
                torch.testing.assert_close(state[n], p, rtol=1e-5, atol=1e-6, msg=f"step {step}: {n}")
        # every rank computed a share of several groups: the CP groups' padded shares and its own sequences
        assert all(c > 0 for c in computed)


def test_regrouped_plans_join_several_groups_per_rank_with_one_slice():
    one_two_four, beside = plans().values()
    assert [len(one_two_four.places_of(r)) for r in range(4)] == [3, 3, 3, 3]
    assert {one_two_four.replicas[p.replica].scheme.cp for p in one_two_four.places_of(0)} == {1, 2, 4}
    assert [len(beside.places_of(r)) for r in range(4)] == [1, 1, 2, 2]
    assert one_two_four.slot_problem() is None and beside.slot_problem() is None
    with pytest.raises(PlanError, match="no rank has one place"):
        one_two_four.place_of(0)


def test_a_rank_whose_groups_hold_different_slices_is_named():
    """A tp2 group on ranks 0-1 and then a tp1 group on rank 1 would need a different slice of the weights:
    parameters would move between groups, which a regrouped plan must not ask for."""
    bad = _plan("1x(tp2)+2x(tp1)", [30, 10, 8], [
        _group(TP2, (0, 1), ((0,),)),
        _group(TP1, (1,), ((1,),)),
        _group(TP1, (2,), ((2,),)),
        _group(TP1, (3,), ()),
    ])
    problem = bad.slot_problem()
    assert problem is not None and "rank 1" in problem and "one parameter slice" in problem


POLICY_STEPS = [[80, 9, 14, 6, 17, 11, 20, 5, 3, 12], [50, 44, 20, 7, 15, 9]]
"""An 80-token document (four tp1 slots hold it) beside short ones; then two that need two slots each."""


def _two_heads() -> torch.nn.Module:
    """Tensor parallelism up to 2 (48 tokens per replica): the 80-token document needs CP."""
    return init_weights_(GPT(GPTConfig(layers=2, heads=2, hidden=32, vocab=VOCAB, block_size=256)), seed=5)


def _train_policies(rank, world):
    from collective_order import CollectiveRecorder
    from p2p_order import P2PRecorder

    import hcompile

    compiled = hcompile.compile(_two_heads(), buckets=BUCKETS)
    out = {}
    with P2PRecorder() as rec, CollectiveRecorder() as calls:
        for policy in ("hydraulis", "dynamic-cp", "homogeneous-cp"):
            trainer = compiled.trainer(loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.5},
                                       tokens_per_rank=CAP, calibrate=False, policy=policy)
            steps = []
            for lens in POLICY_STEPS:
                stats = trainer.train_step(_batch(tuple(lens), VOCAB))
                steps.append((stats.loss, trainer.last_plan.plan.regrouped, trainer.full_state_dict()))
            out[policy] = steps
    return out, (rec.ops, calls.calls)


def test_the_trainer_plans_and_runs_regrouped_steps_hydraulis_and_dynamic_cp(tmp_path):
    """``strategies="auto"`` adds the CP schemes the 80-token document needs; the trainer plans and runs each
    policy for real, the CP baselines with the TP they choose on the first batch: ``dynamic-cp`` regroups every
    step, ``homogeneous-cp`` never does, hydraulis where its estimate says so (on this CPU cost model CP costs no
    exchange, so one CP replica for the step is as fast: ``test_regrouped_plans.py`` has the GPU preset, where
    it regroups); every step exact."""
    per_rank = run_ranks(4, tmp_path, _train_policies, timeout_s=500)
    assert p2p_problems([ops for _, (ops, _) in per_rank]) == []
    assert collective_problems([calls for _, (_, calls) in per_rank]) == []
    losses, states = reference_sgd(_two_heads(), [_batch(tuple(lens), VOCAB) for lens in POLICY_STEPS], 0.5)
    for out, _ in per_rank:
        for policy, steps in out.items():
            if policy != "hydraulis":
                assert [regrouped for _, regrouped, _ in steps] == [policy == "dynamic-cp"] * 2, policy
            for step, (loss, _, state) in enumerate(steps):
                assert loss == pytest.approx(losses[step], rel=1e-5), (policy, step)
                for n, p in states[step].items():
                    torch.testing.assert_close(state[n], p, rtol=1e-5, atol=1e-6, msg=f"{policy} {step}: {n}")
