"""Activation recomputation (a scheme's ``rc``): each layer keeps only its input and runs its forward again in its
backward. A recomputing stage computes what the plain one does (outputs and every gradient), keeps far less
(the live bytes of a whole step, measured, against the memory model's prediction), and trains exactly on 4 gloo
ranks beside plain replicas, under tensor, pipeline and context parallelism (GPT, and an unmodified Hugging Face
Mistral whose window of 8 is shorter than its CP chunks, its K/V exchange pipelined): loss and every parameter
against single-process SGD at 1e-5, the point-to-point and collective orders matched on every rank (the
recomputation posts its collectives again, in the same order on every rank of a group). The planner prices it:
caps from layer inputs, the forward charged twice, planned only where the data needs it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_util import run_ranks
from p2p_order import p2p_problems
from test_cp_equivalence import _batch, _model, _vocab
from test_equivalence import reference_sgd
from test_hf_models import _HFLogits
from torch.utils._pytree import tree_leaves, tree_map

import hcompile
from hcompile.models import GPT, GPTConfig, Llama, LlamaConfig, init_weights_
from passes.graph.lowering import apply_lowering, decide_lowerings, recompute_pieces
from passes.graph.variant import TokenBuckets
from passes.plan.cost_model import (
    HCOMPILE_RUNTIME,
    RECOMPUTE_TIME,
    activation_bytes_per_token,
    build_cost_model,
    load_profile,
    max_tokens_for,
)
from passes.plan.ir import ParallelScheme, PlanError, Strategy
from passes.plan.movement import compute_scheme

TOKENS = 512


def _small(name: str) -> torch.nn.Module:
    if name == "gpt":
        return init_weights_(GPT(GPTConfig(layers=6, block_size=TOKENS, hidden=128, vocab=512)), seed=3)
    return init_weights_(Llama(LlamaConfig(layers=6, hidden=128, ffn_hidden=384, heads=4, kv_heads=2, vocab=512)))


def _step(variant, params, ids, cu, boundary=()):
    """One stage's forward and backward (a loss on its outputs) under the live-bytes meter: its outputs, every
    gradient and the step's peak of live tensor bytes."""
    from benchmarks.memory import LiveBytes

    for p in params.values():
        p.grad = None
    with LiveBytes(0) as meter:
        out = variant(ids, cu, *boundary)
        first = out[0].float()
        leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        loss = (F.cross_entropy(first.reshape(-1, 512)[:-1], ids[1:]) if first.shape[-1] == 512
                else sum(t.float().square().mean() for t in leaves))
        loss.backward()
    detached = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tuple(out))
    return detached, {n: p.grad.clone() for n, p in params.items() if p.grad is not None}, max(meter.peaks.values())


@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("pp", [1, 2])
def test_a_recomputing_stage_computes_the_same_and_keeps_far_less(name, pp):
    """Before: a plain stage. Expected: the recomputing stage cut into one piece per attention layer, the same
    outputs and gradients of every parameter, a step peak under 60% of the plain one's, and the memory model's
    bytes per token (``ModelMemory.per_token``) within 25% of the measured peak of a single stage."""
    from hcompile.memory import model_memory

    model = _small(name)
    captured = hcompile.compile(model).captured(TOKENS).graph_module
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (TOKENS,), generator=g)
    cu = torch.tensor([0, 300, TOKENS], dtype=torch.int32)
    plain = decide_lowerings(captured, ParallelScheme(pp=pp))
    again = decide_lowerings(captured, ParallelScheme(pp=pp, rc=True))
    boundary: tuple = ()
    peaks = {}
    for stage in range(pp):
        one, rc = apply_lowering(plain[stage], captured, TOKENS), apply_lowering(again[stage], captured, TOKENS)
        assert plain[stage].pieces is None
        assert len(again[stage].pieces.stages) == recompute_pieces(one.graph_module) == 6 // pp
        params = {sl.name: torch.nn.Parameter(dict(model.named_parameters())[sl.name].detach().clone())
                  for sl in one.params}
        one.bind_(params)
        rc.bind_(params)
        want, want_grads, want_peak = _step(one, params, ids, cu, boundary)
        got, got_grads, got_peak = _step(rc, params, ids, cu, boundary)
        for w, o in zip(tree_leaves(want), tree_leaves(got)):
            torch.testing.assert_close(o, w, rtol=0, atol=0)
        assert want_grads.keys() == got_grads.keys() == params.keys()
        for n in params:
            torch.testing.assert_close(got_grads[n], want_grads[n], msg=n)
        peaks[stage] = (want_peak, got_peak)
        boundary = want
    if pp == 1:
        want_peak, got_peak = peaks[0]
        assert got_peak < 0.6 * want_peak, (got_peak, want_peak)
        memory = model_memory(captured, TOKENS)
        predicted = memory.per_token(ParallelScheme(rc=True)) * TOKENS
        assert 0.75 * got_peak <= predicted <= 1.25 * got_peak, (predicted, got_peak)
        assert memory.per_token(ParallelScheme(rc=True)) < 0.6 * memory.per_token(ParallelScheme())


CAP = 24
STEPS = [  # (strategy, lengths): recomputing replicas beside plain ones, under TP, PP and CP
    ("1x(tp2,rc)+2x(tp1)", [40, 30, 9, 20, 13, 22]),
    ("1x(tp2,cp2,rc)", [80, 50, 9, 30]),
    ("1x(pp2,rc)+1x(tp2)", [47, 30, 12, 6, 20]),
    ("1x(cp2,rc)+2x(tp1,rc)", [45, 40, 20, 11, 5, 17]),
]
HF_STEPS = [STEPS[3]]


def _train(rank, world, name):
    from collective_order import CollectiveRecorder
    from p2p_order import P2PRecorder

    out = []
    with P2PRecorder() as p2p, CollectiveRecorder() as coll:
        compiled = hcompile.compile(_model(name), buckets=TokenBuckets(sizes=(16, 32, 64, 128)))
        for strategy, lens in (STEPS if name == "gpt" else HF_STEPS):
            trainer = compiled.trainer(
                loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.5}, strategies=[strategy],
                tokens_per_rank=CAP, calibrate=False, kv_splits=1 if name == "gpt" else 4)
            stats = trainer.train_step(_batch(lens, _vocab(name)), strategy=strategy)
            rc_pieces = sorted({(v.key.scheme.pp, len(v.pieces), _recomputes(v))
                                for v in trainer.lowerings._variants.values() if v.key.scheme.rc})
            out.append((stats.loss, stats.strategy, rc_pieces, trainer.full_state_dict()))
    return out, p2p.ops, coll.calls


def _recomputes(variant) -> bool:
    """Whether every piece of a variant runs under ``torch.utils.checkpoint``."""
    pieces = [m for m in variant.compiled.children() if hasattr(m, "recompute")]
    return bool(pieces) and all(m.recompute for m in pieces) or type(variant.compiled).__name__ == "_Recomputed"


@pytest.mark.parametrize("name", ["gpt", "mistral"])
def test_recomputing_replicas_train_exactly(tmp_path, name):
    from collective_order import collective_problems

    per_rank = run_ranks(4, tmp_path, _train, name, timeout_s=500)
    assert p2p_problems([ops for _, ops, _ in per_rank]) == []
    assert collective_problems([ops for _, _, ops in per_rank]) == []
    for step, (strategy, lens) in enumerate(STEPS if name == "gpt" else HF_STEPS):
        model = _model(name) if name == "gpt" else _HFLogits(_model(name))
        losses, states = reference_sgd(model, [_batch(lens, _vocab(name))], 0.5)
        # the 2-layer models under the 4 pieces of overlapped movement: every recomputing stage in 4 pieces, each
        # recomputed
        runs = {run for out, _, _ in per_rank for run in out[step][2]}
        assert runs and all(pieces == 4 and again for _, pieces, again in runs), (strategy, runs)
        for out, _, _ in per_rank:
            loss, described, _, state = out[step]
            assert described == Strategy.parse(strategy).describe()
            assert loss == pytest.approx(losses[0], rel=1e-5), (strategy, loss, losses[0])
            for n, p in states[0].items():
                torch.testing.assert_close(state[n], p, rtol=1e-5, atol=1e-6, msg=f"{strategy}: {n}")


P32 = load_profile("llama-32b")


@pytest.mark.parametrize("scheme", [ParallelScheme(tp=8), ParallelScheme(tp=16, cp=4), ParallelScheme(tp=2, pp=4)])
def test_the_planner_prices_recomputation(scheme):
    """A recomputing scheme keeps every layer's input (2 bytes per hidden unit, whole on each TP rank) and one
    layer's activations, holds more tokens, and costs 4/3 of the attention and per-token terms."""
    rc = ParallelScheme(tp=scheme.tp, pp=scheme.pp, cp=scheme.cp, rc=True)
    layer = P32.hidden / scheme.tp * P32.activation_bytes_for(scheme.tp)
    assert activation_bytes_per_token(P32, rc) == pytest.approx((P32.layers * P32.hidden * 2 + layer) / scheme.cp)
    assert activation_bytes_per_token(P32, scheme) == pytest.approx(P32.layers * layer / scheme.cp)
    layout = Strategy.parse("4x(tp16)")
    assert max_tokens_for(P32, rc, layout, HCOMPILE_RUNTIME) > max_tokens_for(P32, scheme, layout, HCOMPILE_RUNTIME)
    model = build_cost_model(P32, layout, HCOMPILE_RUNTIME, recompute=True)
    base = scheme if scheme.cp == 1 else ParallelScheme(tp=scheme.tp)
    twin = ParallelScheme(tp=base.tp, pp=base.pp, rc=True)
    assert model.cost(twin).a == pytest.approx(model.cost(base).a * RECOMPUTE_TIME)
    assert model.cost(twin).b == pytest.approx(model.cost(base).b * RECOMPUTE_TIME)
    assert model.cost(twin).c == model.cost(base).c
    assert compute_scheme(rc) == compute_scheme(scheme)  # the same parameter slices: nothing moves to switch
    assert not any(s.rc for s in build_cost_model(P32, layout, HCOMPILE_RUNTIME).schemes)


def test_schemes_name_recomputation():
    scheme = ParallelScheme.parse("(tp8,cp2,rc)")
    assert scheme == ParallelScheme(tp=8, cp=2, rc=True) and scheme.describe() == "(tp8,pp1,cp2,rc)"
    assert compute_scheme(scheme) == ParallelScheme(tp=8)
    assert Strategy.parse("2x(tp8,rc)+2x(tp8)").describe() == "2x(tp8,pp1)+2x(tp8,pp1,rc)"
    for bad in ("rc", "(tp2,rc,rc)", "(tp2,rcx)"):
        with pytest.raises(PlanError, match="cannot parse scheme"):
            ParallelScheme.parse(bad)
    with pytest.raises(PlanError, match="rc must be True or False, got 1"):
        ParallelScheme(rc=1)


def test_auto_recomputes_only_where_the_data_needs_it():
    """The cost model a plan job plans with (``job_cost_model``, what ``prepare`` uses). ``long-context`` on 64
    GPUs: no scheme holds its 160K-token documents without recomputation, so ``auto`` plans recomputing twins
    (and ``off`` is refused with the longest held); on 128 GPUs (tp16,cp4) holds them, so ``auto`` plans exactly
    what ``off`` does."""
    import dataclasses

    from hcompile.tools.simulate import PlanJob, job_cost_model

    job = PlanJob(gpus=64, dataset="long-context", global_tokens=400_000, steps=1, policies=("hydraulis",))
    model = job_cost_model(job)
    assert any(s.rc for s in model.schemes) and any(not s.rc for s in model.schemes)
    with pytest.raises(PlanError, match="longer than every"):
        job_cost_model(dataclasses.replace(job, recompute="off"))
    wide = dataclasses.replace(job, gpus=128)
    assert not any(s.rc for s in job_cost_model(wide).schemes)
    assert job_cost_model(wide) == job_cost_model(dataclasses.replace(wide, recompute="off"))
    with pytest.raises(PlanError, match="unknown recompute mode 'yes'"):
        PlanJob(recompute="yes")


def _auto_with_twins(rank, world):
    compiled = hcompile.compile(_model("gpt"), buckets=TokenBuckets(sizes=(16, 32, 64, 128)))
    trainer = compiled.trainer(loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.5},
                               tokens_per_rank=CAP, calibrate=False, recompute=True)
    entries = {e.scheme: (e.a, e.b, e.c, e.max_tokens) for e in trainer.cost_model.entries}
    stats = trainer.train_step(_batch([40, 30, 9, 20], _vocab("gpt")))
    return entries, stats.loss, trainer.full_state_dict()


def test_recompute_option_plans_every_schemes_twin_and_trains_exactly(tmp_path):
    """``TrainOptions(recompute=True)``: every scheme's recomputing twin is in the trainer's cost model, charged
    4/3 of its attention and per-token terms, its cap at least the plain one's; a step planned with them trains
    as single-process SGD does."""
    per_rank = run_ranks(2, tmp_path, _auto_with_twins, timeout_s=300)
    entries, _, _ = per_rank[0]
    plain = [s for s in entries if not s.rc]
    assert plain and all(ParallelScheme(tp=s.tp, pp=s.pp, cp=s.cp, rc=True) in entries for s in plain)
    for s in plain:
        a, b, c, cap = entries[s]
        ra, rb, rc_c, rc_cap = entries[ParallelScheme(tp=s.tp, pp=s.pp, cp=s.cp, rc=True)]
        assert (ra, rb, rc_c) == pytest.approx((a * RECOMPUTE_TIME, b * RECOMPUTE_TIME, c)) and rc_cap >= cap
    losses, states = reference_sgd(_model("gpt"), [_batch([40, 30, 9, 20], _vocab("gpt"))], 0.5)
    for _, loss, state in per_rank:
        assert loss == pytest.approx(losses[0], rel=1e-5)
        for n, p in states[0].items():
            torch.testing.assert_close(state[n], p, rtol=1e-5, atol=1e-6, msg=n)


def test_the_trainer_refuses_a_bad_recompute_option():
    with pytest.raises(ValueError, match="recompute must be True or False, got 'auto'"):
        hcompile.TrainOptions(recompute="auto")


def test_hcompile_plan_takes_the_recompute_mode(capsys):
    """``hcompile plan --recompute off`` refuses the 160K-token documents on 64 GPUs (exit 2, the longest held
    named); ``--recompute auto`` plans them, and its JSON says it recomputes."""
    import json

    from hcompile.cli import main

    job = ["plan", "--gpus", "64", "--dataset", "long-context", "--global-tokens", "400000", "--steps", "1",
           "--policy", "homogeneous-cp"]
    assert main([*job, "--recompute", "off"]) == 2
    assert "longer than every scheme can hold on 64 GPUs (longest supported: 146816 tokens)" in capsys.readouterr().err
    assert main([*job, "--recompute", "auto", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["recompute"] is True and report["cp_fixed_strategy"].endswith(",rc)")


def _recomputing(plan):
    """A regrouped plan of ``tests/test_regrouped_cp.py`` with every slot and group recomputing."""
    import dataclasses

    strategy = Strategy.of({dataclasses.replace(s, rc=True): n for s, n in plan.strategy.parts})
    groups = tuple(dataclasses.replace(g, scheme=dataclasses.replace(g.scheme, rc=True)) for g in plan.replicas)
    return dataclasses.replace(plan, strategy=strategy, replicas=groups)


def _train_regrouped(rank, world, per_group=False, name="gpt"):
    """Train the two regrouped steps of ``tests/test_regrouped_cp.py`` on model ``name``, every slot and group
    recomputing, or on plain slots recomputing group by group (``per_group``): per step the loss and the full
    state, the variants built (scheme, recomputing or not), and the rank's p2p operations and collectives."""
    from collective_order import CollectiveRecorder
    from p2p_order import P2PRecorder
    from test_regrouped_cp import BUCKETS, plans

    compiled = hcompile.compile(_model(name), buckets=BUCKETS)
    trainer = compiled.trainer(loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.5},
                               strategies=["4x(tp1)" if per_group else "4x(tp1,rc)"], tokens_per_rank=CAP,
                               calibrate=False, recompute=per_group, kv_splits=1 if name == "gpt" else 4)
    steps = [(_per_group if per_group else _recomputing)(p) for p in plans().values()]
    for plan in steps:
        trainer._warm_for(plan)
    out = []
    with P2PRecorder() as p2p, CollectiveRecorder() as coll:
        for plan in steps:
            stats = trainer.train_plan(plan, _batch(list(plan.seq_lens), _vocab(name)))
            out.append((stats.loss, trainer.full_state_dict()))
    runs = sorted({(v.key.scheme.describe(), _recomputes(v)) for v in trainer.lowerings._variants.values()})
    return out, runs, p2p.ops, coll.calls


def _assert_regrouped_exact(per_rank, steps, name="gpt") -> set:
    """Every rank's p2p and collective orders matched, and per step its loss and every parameter equal to
    single-process SGD on the step's batch; the variants the ranks built."""
    from collective_order import collective_problems

    assert p2p_problems([r[2] for r in per_rank]) == []
    assert collective_problems([r[3] for r in per_rank]) == []
    model = _model(name) if name == "gpt" else _HFLogits(_model(name))
    for step, plan in enumerate(steps):
        losses, states = reference_sgd(model, [_batch(list(plan.seq_lens), _vocab(name))], 0.5)
        for out, _, _, _ in per_rank:
            loss, state = out[step]
            assert loss == pytest.approx(losses[0], rel=1e-5), (step, loss, losses[0])
            for n, p in states[0].items():
                torch.testing.assert_close(state[n], p, rtol=1e-5, atol=1e-6, msg=f"step {step}: {n}")
    return {run for r in per_rank for run in r[1]}


def test_regrouped_steps_of_recomputing_slots_train_exactly(tmp_path):
    """The two regrouped steps of ``tests/test_regrouped_cp.py`` (CP groups of 4, 2 and 1 slots in one step; CP
    groups beside a tp2 replica), every slot and group recomputing, as hydraulis plans them where long documents
    need recomputation: loss and every parameter equal to single-process SGD, orders matched on every rank."""
    from test_regrouped_cp import plans

    per_rank = run_ranks(4, tmp_path, _train_regrouped, timeout_s=400)
    runs = _assert_regrouped_exact(per_rank, list(plans().values()))
    assert {d for d, _ in runs} >= {"(tp1,pp1,cp4,rc)", "(tp1,pp1,cp2,rc)", "(tp1,pp1,rc)"} and all(a for _, a in runs)


def _per_group(plan):
    """A regrouped plan of ``tests/test_regrouped_cp.py`` on plain slots whose groups choose recomputation one by
    one, as the planner now plans them: every other CP group recomputes, and each slot's first own micro-batch
    runs as a recomputing group of one slot before the slot's plain micro-batches."""
    import dataclasses

    groups, seen_cp = [], 0
    for g in plan.replicas:
        if g.scheme.cp > 1:
            seen_cp += 1
            groups.append(dataclasses.replace(g, scheme=dataclasses.replace(g.scheme, rc=seen_cp % 2 == 1)))
        elif g.scheme.tp == 1 and len(g.micro_batches) > 1:
            groups.append(dataclasses.replace(g, scheme=dataclasses.replace(g.scheme, rc=True),
                                              micro_batches=g.micro_batches[:1]))
            groups.append(dataclasses.replace(g, micro_batches=g.micro_batches[1:]))
        else:
            groups.append(g)
    return dataclasses.replace(plan, replicas=tuple(groups))


@pytest.mark.parametrize("name", ["gpt", "mistral"])
def test_regrouped_steps_choose_recomputation_group_by_group(tmp_path, name):
    """The two regrouped steps of ``tests/test_regrouped_cp.py`` on plain slots, recomputation chosen group by
    group as the planner plans it where a document needs it: a recomputing CP group of 4 then a plain and a
    recomputing CP group of 2 in one step, and a slot running a recomputing group of one slot and then its plain
    micro-batches with the same parameter slice. GPT, and unmodified HF Mistral with a sliding window shorter
    than every CP chunk of the longest documents (the window crosses chunk and rank boundaries inside the
    recomputed groups). Loss and every parameter equal to single-process SGD, the p2p and collective orders
    matched on every rank."""
    from test_regrouped_cp import plans

    steps = [_per_group(p) for p in plans().values()]
    if name == "mistral":
        window = _model(name).config.sliding_window
        assert 1 < window < min(max(p.seq_lens) // 4 for p in steps), window
    assert all(p.slot_problem() is None for p in steps)
    assert {(g.scheme.describe(), len(g.ranks)) for p in steps for g in p.replicas} >= {
        ("(tp1,pp1,cp4,rc)", 4), ("(tp1,pp1,cp2,rc)", 2), ("(tp1,pp1,cp2)", 2), ("(tp1,pp1,rc)", 1), ("(tp1,pp1)", 1)}
    per_rank = run_ranks(4, tmp_path, _train_regrouped, True, name, timeout_s=400)
    runs = _assert_regrouped_exact(per_rank, steps, name)
    assert {("(tp1,pp1,cp4,rc)", True), ("(tp1,pp1,cp2,rc)", True), ("(tp1,pp1,cp2)", False),
            ("(tp1,pp1,rc)", True), ("(tp1,pp1)", False)} <= runs, runs
