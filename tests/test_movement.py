"""The planner's count of parameter and gradient movement (``passes.plan.movement``, no torch) equals the bytes the
runtime moves (``StepStats.traffic``) on every rank, for strategies drawn at random on 4 ranks; and the counting
itself on hand-made layouts."""

from __future__ import annotations

import random

import pytest
import torch
from dist_util import run_ranks
from tiers import FULL

from passes.plan.ir import ParallelScheme, PlanError, Strategy
from passes.plan.movement import ComputeLayout, merged, movement_bytes, places

STRATEGIES = ["4x(tp1)", "1x(tp2)+2x(tp1)", "2x(tp2)", "1x(tp4)", "1x(tp1,pp2)+2x(tp1)", "2x(tp1,pp2)",
              "1x(tp2,pp2)", "1x(tp1,pp4)"]
DRAWN = random.Random(23).sample(STRATEGIES, 5 if FULL else 3)  # the default tier checks three of them


def _rank(rank, world, strategies):
    import hcompile
    from hcompile.cost import compute_layout
    from hcompile.models import Llama, LlamaConfig, init_weights_

    trainer = hcompile.compile(init_weights_(Llama(LlamaConfig(layers=4)), seed=0)).trainer(
        loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, strategies=strategies,
        tokens_per_rank=64, calibrate=False)
    parsed = [Strategy.parse(s) for s in strategies]
    layout = compute_layout(trainer.lowerings, trainer.layout, sorted({s for p in parsed for s in p.schemes}))
    g = torch.Generator().manual_seed(3)  # the same batches on every rank
    out = []
    for strategy in strategies:
        batch = [torch.randint(0, 96, (n,), generator=g) for n in (30, 12, 50, 7, 21, 40)]
        stats = trainer.train_step(batch, strategy=strategy)
        predicted = movement_bytes(layout, Strategy.parse(strategy), trainer.cost_model.gpus_per_node,
                                   param_bytes=4, reduce_bytes=4)[rank]
        t = stats.traffic
        out.append((strategy, (t.params_received, t.params_sent, t.grads_sent, t.grads_received),
                    (predicted.params_received, predicted.params_sent, predicted.grads_sent,
                     predicted.grads_received)))
    return out


def test_the_planners_bytes_are_the_runtimes_on_every_rank(tmp_path):
    for rank, steps in enumerate(run_ranks(4, tmp_path, _rank, DRAWN, timeout_s=300)):
        for strategy, measured, predicted in steps:
            assert measured == predicted, (rank, strategy, measured, predicted)
            assert sum(measured) > 0, (rank, strategy)


def _toy(numel=100):
    one, two = ParallelScheme(), ParallelScheme(tp=2)
    return ComputeLayout(numel=numel, ranges={
        (one, 0, 0): ((0, numel),),
        (two, 0, 0): ((0, 10), (20, 60)), (two, 0, 1): ((10, 20), (60, 100)),
    })


def test_counting_on_a_hand_made_layout():
    # 4 ranks own 25 elements each; 1x(tp2)+2x(tp1): ranks 0, 1 are the tp2 pair, 2 and 3 hold everything
    moved = movement_bytes(_toy(), Strategy.parse("1x(tp2)+2x(tp1)"), 4, param_bytes=2, reduce_bytes=4)
    # rank 0 needs [0,10)+[20,60), 15 of it in its shard [0,25) -> receives 35; rank 1 needs [10,20)+[60,100),
    # none of it in its shard [25,50) -> receives 50; ranks 2, 3 need all 100 and hold 25 -> receive 75
    assert [m.params_received for m in moved] == [35 * 2, 50 * 2, 75 * 2, 75 * 2]
    assert [m.grads_sent for m in moved] == [35 * 4, 50 * 4, 75 * 4, 75 * 4]
    # shard 0 [0,25) serves rank 1 ([10,20): 10) and ranks 2 and 3 (25 each): 60 elements
    assert moved[0].params_sent == 60 * 2 and moved[0].grads_received == 60 * 4
    total_in = sum(m.params_received for m in moved)
    assert total_in == sum(m.params_sent for m in moved)  # every byte received was sent by someone
    assert [p[0].tp for p in places(Strategy.parse("1x(tp2)+2x(tp1)"), 4)] == [2, 2, 1, 1]


def test_owners_hold_a_share_of_each_region():
    """With two regions (the parameters TP never splits, then the split ones) every owner holds an equal share
    of each: a region that every rank needs is served by all owners, not by the few whose one contiguous
    shard of the whole vector would hold it."""
    one = ParallelScheme()
    two = ParallelScheme(tp=2)
    layout = ComputeLayout(numel=100, regions=((0, 40), (40, 100)), ranges={
        (one, 0, 0): ((0, 100),), (two, 0, 0): ((0, 70),), (two, 0, 1): ((0, 40), (70, 100))})
    assert layout.owner_ranges(0, 4) == ((0, 10), (40, 55)) and layout.owner_ranges(3, 4) == ((30, 40), (85, 100))
    assert layout.shard_numel(4) == 10 + 15 and layout.shard_numel(3) == 14 + 20
    moved = movement_bytes(layout, Strategy.parse("2x(tp2)"), 4, param_bytes=1, reduce_bytes=1)
    # every rank needs the 40 whole elements (it holds 10) and 30 of the 60 split ones (it holds 15, of which
    # it needs the half its TP rank computes with: ranks 0 and 2 need [40, 70), ranks 1 and 3 [70, 100))
    need_split = [(40, 70), (70, 100), (40, 70), (70, 100)]
    for rank, m in enumerate(moved):
        lo, hi = layout.owner_ranges(rank, 4)[1]
        local_split = max(0, min(hi, need_split[rank][1]) - max(lo, need_split[rank][0]))
        assert m.params_received == 30 + 30 - local_split
    # the whole region's owners each serve their 10 to the 3 others: nobody is a hot spot
    assert len({m.params_sent for m in moved}) <= 2
    with pytest.raises(PlanError, match="regions must cut"):
        ComputeLayout(numel=100, regions=((0, 40), (50, 100)), ranges={})


def test_bad_layouts_are_named():
    with pytest.raises(PlanError, match="overlapping ranges"):
        merged([(0, 10), (5, 12)])
    assert merged([(5, 8), (0, 5), (9, 9)]) == ((0, 8),)
    with pytest.raises(PlanError, match=r"must be sorted, disjoint, joined and inside \[0, 50\)"):
        ComputeLayout(numel=50, ranges={(ParallelScheme(), 0, 0): ((0, 60),)})
    with pytest.raises(PlanError, match=r"no ranges for \(tp4,pp1\) stage 0 TP rank 0"):
        movement_bytes(_toy(), Strategy.parse("1x(tp4)"), 4)


def test_the_synthesised_llama_layout_is_the_lowerings():
    """The planner's LLaMA layout (no graph, any scale) equals the one the lowerings give hcompile's LLaMA: exactly
    for every tp of one stage (kv heads split or, at tp4 over 2 kv heads, held whole per rank) and for the pipeline
    cuts the cost-balanced split also makes evenly."""
    import hcompile
    from hcompile.cost import compute_layout
    from hcompile.models import Llama, LlamaConfig, init_weights_
    from passes.graph.normalize import canonical_graph
    from passes.graph.tensor_parallel import split_dims
    from passes.plan.movement import llama_compute_layout
    from runtime.fixed_layout import FixedLayout

    cfg = LlamaConfig(layers=4, kv_heads=2)
    model = init_weights_(Llama(cfg))
    compiled = hcompile.compile(model)
    dims = split_dims(canonical_graph(compiled.captured(64).graph_module))
    layout = FixedLayout({n: tuple(p.shape) for n, p in model.named_parameters()}, 0, 1, "cpu", dims)
    schemes = [ParallelScheme(tp=1), ParallelScheme(tp=2), ParallelScheme(tp=4), ParallelScheme(pp=2),
               ParallelScheme(pp=4), ParallelScheme(tp=2, pp=2)]
    real = compute_layout(compiled.lowerings(), layout, schemes)
    synthesised = llama_compute_layout(layers=cfg.layers, hidden=cfg.hidden, ffn_hidden=cfg.ffn_hidden,
                                       heads=cfg.heads, kv_heads=cfg.kv_heads, vocab=cfg.vocab, schemes=schemes)
    assert synthesised.numel == real.numel == sum(p.numel() for p in model.parameters())
    assert synthesised.ranges == real.ranges and synthesised.regions == real.regions
    # the overlapped runtime's windows, counted by the planner as the runtime cuts them: 8, and more once the
    # windows' bound (33.5M elements at scale) makes the runtime cut more
    from runtime import overlap

    assert synthesised.windows == real.windows == len(overlap.layout_windows(layout)) == 8
    import passes.plan.movement as movement

    for bound in (4000, 20000):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(movement, "MAX_WINDOW_NUMEL", bound)  # the one bound of both
            small = llama_compute_layout(layers=cfg.layers, hidden=cfg.hidden, ffn_hidden=cfg.ffn_hidden,
                                         heads=cfg.heads, kv_heads=cfg.kv_heads, vocab=cfg.vocab, schemes=schemes)
            assert small.windows == len(overlap.layout_windows(layout)) > 8, bound
    with pytest.raises(PlanError, match=r"\(tp3,pp1\) does not fit a LLaMA of 4 heads"):
        llama_compute_layout(layers=4, hidden=64, ffn_hidden=128, heads=4, kv_heads=2, vocab=96,
                             schemes=[ParallelScheme(tp=3)])
