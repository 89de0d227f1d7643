"""Context parallelism in the planner (``passes/plan/context_parallel.py``): the IR's text forms with cp, the
CP schemes' costs and memory, which CP schemes are considered, and movement places of CP replicas."""

import pytest

from passes.plan.context_parallel import ceil_pow2, cp_cost, cp_schemes, needs_cp, with_context_parallel
from passes.plan.cost_model import HCOMPILE_RUNTIME, build_cost_model, default_optimizer_layout, load_profile
from passes.plan.ir import ParallelScheme, PlanError, SchemeCost, Strategy
from passes.plan.links import link_preset
from passes.plan.movement import places

PROFILE = load_profile("llama-32b")
LINKS = link_preset("a800-80g")
LAYOUT = default_optimizer_layout(PROFILE, 64, 4096, HCOMPILE_RUNTIME)
BASE = build_cost_model(PROFILE, LAYOUT, HCOMPILE_RUNTIME)


@pytest.mark.parametrize("text, expected", [
    ("1x(cp4)", "1x(tp1,pp1,cp4)"),
    ("1x(cp2,tp2)+2x(tp1)", "1x(tp2,pp1,cp2)+2x(tp1,pp1)"),
    ("1x(cp2,pp2)", "1x(tp1,pp2,cp2)"),
    ("(pp2,cp2,tp4)", "1x(tp4,pp2,cp2)"),
    ("cp2,tp4", "1x(tp4,pp1,cp2)"),
    ("2x(tp4,cp1)", "2x(tp4,pp1)"),
])
def test_degrees_parse_in_any_order_and_cp1_prints_as_before(text, expected):
    strategy = Strategy.parse(text)
    assert strategy.describe() == expected
    assert Strategy.parse(strategy.describe()) == strategy


def test_a_repeated_degree_is_refused():
    with pytest.raises(PlanError, match="cp2,cp4"):
        ParallelScheme.parse("(cp2,cp4)")


def test_cp_replica_gpus_and_tokens():
    scheme = ParallelScheme.parse("(cp2,tp4)")
    assert scheme.gpus == 8
    model = with_context_parallel(BASE, PROFILE, LINKS, 64, 160_000, LAYOUT, HCOMPILE_RUNTIME)
    one, two = model.max_tokens(ParallelScheme(tp=4)), model.max_tokens(scheme)
    assert 2 * one - 128 <= two <= 2 * one + 128  # the activations per token halve, the states do not change


def test_cp_cost_splits_compute_and_counts_the_exposed_exchange():
    base = BASE.cost(ParallelScheme(tp=8))
    costs = {cp: cp_cost(PROFILE, base, cp, LINKS, LAYOUT, HCOMPILE_RUNTIME) for cp in (2, 4, 8)}
    for cp, e in costs.items():
        assert e.a == pytest.approx(base.a / cp) and e.b == pytest.approx(base.b / cp)
        assert e.c > base.c and e.exchange > 0
    # a long sequence: attention hides the exchange, more CP ranks take less time each
    long = 120_000
    assert base.seq_ms(long) > costs[2].seq_ms(long) > costs[4].seq_ms(long) > costs[8].seq_ms(long)
    assert costs[2].seq_ms(long) == pytest.approx(costs[2].a * long * long + costs[2].b * long)
    # a short one: the exchange is longer than its attention and is what it costs
    short = 500
    assert costs[8].seq_ms(short) == pytest.approx(costs[8].exchange * short + costs[8].b * short)
    # a ring across nodes (tp4 x cp4) is slower per token than one inside a node (tp4 x cp2)
    tp4 = BASE.cost(ParallelScheme(tp=4))
    inside, across = (cp_cost(PROFILE, tp4, cp, LINKS, LAYOUT, HCOMPILE_RUNTIME) for cp in (2, 4))
    assert across.exchange / (3 / 4) == pytest.approx(inside.exchange / (1 / 2) * LINKS.intra_gbps / LINKS.inter_gbps)


def test_exchange_counts_only_what_attention_cannot_hide():
    e = SchemeCost(scheme=ParallelScheme(tp=1, cp=2), a=1e-4, b=0.5, c=1.0, max_tokens=1000, exchange=0.02)
    assert e.seq_ms(100) == pytest.approx(0.5 * 100 + 0.02 * 100)  # 1 ms attention, 2 ms exchange
    assert e.seq_ms(400) == pytest.approx(0.5 * 400 + 1e-4 * 400 * 400)  # 16 ms attention hides 8 ms
    with pytest.raises(PlanError, match="exchange"):
        SchemeCost(scheme=ParallelScheme(tp=1, cp=2), a=0, b=0, c=0, max_tokens=1, exchange=-1.0)


def test_cp_schemes_considered():
    assert ceil_pow2(1) == 1 and ceil_pow2(3) == 4 and ceil_pow2(8) == 8 and ceil_pow2(8.5) == 16
    found = cp_schemes(BASE, 64, 160_000)
    assert all(base.pp == 1 and base.cp == 1 for base, _ in found)
    assert {(b.tp, cp) for b, cp in found} >= {(8, 8), (16, 4), (4, 16)}
    assert all(b.tp * cp <= 64 for b, cp in found)
    assert needs_cp(BASE, 64, 160_000) and not needs_cp(BASE, 64, 30_000)


def test_auto_adds_cp_only_for_data_too_long_without_it():
    assert with_context_parallel(BASE, PROFILE, LINKS, 64, 30_000, LAYOUT, HCOMPILE_RUNTIME) is BASE
    assert with_context_parallel(BASE, PROFILE, LINKS, 64, 160_000, LAYOUT, HCOMPILE_RUNTIME, mode="off") is BASE
    on = with_context_parallel(BASE, PROFILE, LINKS, 64, 30_000, LAYOUT, HCOMPILE_RUNTIME, mode="on")
    assert any(s.cp > 1 for s in on.schemes)
    auto = with_context_parallel(BASE, PROFILE, LINKS, 64, 160_000, LAYOUT, HCOMPILE_RUNTIME)
    assert auto.longest_supported() >= 160_000
    with pytest.raises(PlanError, match="'sometimes'"):
        with_context_parallel(BASE, PROFILE, LINKS, 64, 1, LAYOUT, HCOMPILE_RUNTIME, mode="sometimes")


def test_cp_ranks_compute_with_the_slices_of_their_tp_rank():
    where = places(Strategy.parse("1x(tp2,cp2)+4x(tp1)"), 4)
    tp2 = ParallelScheme(tp=2)
    assert where[:4] == [(tp2, 0, 0), (tp2, 0, 1), (tp2, 0, 0), (tp2, 0, 1)]
