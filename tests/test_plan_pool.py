"""The data-aware strategy pool: valid, deterministic, and close to the paper's case-study pool."""

import numpy as np

from passes.plan.cost_model import build_cost_model, load_profile
from passes.plan.datasets import LengthDataset, load_dataset
from passes.plan.ir import Strategy
from passes.plan.placement import assign_ranks, placeable
from passes.plan.pool import build_pool, fluid_estimate, tier_caps

LAYOUT = Strategy.parse("4x(tp16)")
CM = build_cost_model(load_profile("llama-32b"), LAYOUT)


def test_pool_is_valid_deterministic_and_holds_the_data():
    data = load_dataset("commoncrawl")
    pool = build_pool(CM, 64, data, 200_000, LAYOUT, seed=0)
    assert pool == build_pool(CM, 64, data, 200_000, LAYOUT, seed=0)
    assert LAYOUT in pool and 3 <= len(pool) <= 12
    for strategy in pool:
        assert strategy.gpus == 64 and placeable(strategy, 8)
        assign_ranks(strategy, 8)
    # every tier the data reaches has a strategy that holds it
    assert max(CM.max_tokens(s) for p in pool for s in p.schemes) >= data.max_len
    # heterogeneous mixes are in the pool: a large replica for the tail, small ones for the bulk
    assert any(len(p.parts) >= 2 for p in pool)


def test_short_data_gets_small_replicas_only():
    short = LengthDataset.from_lengths("short", list(range(100, 3000, 7)))
    pool = build_pool(CM, 64, short, 200_000, LAYOUT, seed=0)
    assert pool[0].describe() == "16x(tp4,pp1)"


def test_tiers_stop_at_the_first_cap_holding_the_longest():
    caps = tier_caps(CM, 64, 30_000)
    assert caps[-1] == 43520 and caps == sorted(caps)


def test_fluid_estimate_orders_strategies_sensibly():
    rng = np.random.default_rng(0)
    batch = [int(x) for x in rng.integers(100, 3000, 150)]
    fast = fluid_estimate(CM, Strategy.parse("16x(tp4)"), batch)
    slow = fluid_estimate(CM, LAYOUT, batch)
    assert fast < slow
    assert fluid_estimate(CM, Strategy.parse("16x(tp4)"), batch + [20_000]) == float("inf")
