"""Plan IR: parsing and printing, validation, the 1F1B formula."""

import dataclasses
import math

import pytest

from passes.plan.ir import (
    CostModel,
    ParallelScheme,
    PlanError,
    ReplicaPlan,
    SchemeCost,
    StepPlan,
    Strategy,
    bucket_padding,
)


def test_strategy_round_trip_golden():
    s = Strategy.parse("12x(tp4) + 1x(tp16,pp1)")
    assert s.describe() == "1x(tp16,pp1)+12x(tp4,pp1)"
    assert Strategy.parse(s.describe()) == s
    assert s.gpus == 64 and not s.is_homogeneous
    assert [r.tp for r in s.replicas()] == [16] + [4] * 12


def test_strategy_cp_and_bare_parts():
    s = Strategy.parse("(tp2,pp2,cp2)+2x(tp8,cp1)")
    assert s.describe() == "2x(tp8,pp1)+1x(tp2,pp2,cp2)"
    assert s.gpus == 24


def test_strategy_merges_duplicate_schemes():
    assert Strategy.parse("2x(tp4)+3x(tp4)").describe() == "5x(tp4,pp1)"


@pytest.mark.parametrize("text", ["", "4x", "4x(tq4)", "(tp4,tp2)", "x(tp4)", "0x(tp4)"])
def test_strategy_parse_errors_name_the_text(text):
    with pytest.raises(PlanError) as err:
        Strategy.parse(text)
    assert repr(text) in str(err.value)


def test_scheme_validation_quotes_value():
    with pytest.raises(PlanError, match="tp must be a positive integer, got 0"):
        ParallelScheme(tp=0)
    with pytest.raises(PlanError, match="got 2.5"):
        ParallelScheme(pp=2.5)


def test_homogeneous_must_divide():
    assert Strategy.homogeneous(ParallelScheme(tp=16), 64).describe() == "4x(tp16,pp1)"
    with pytest.raises(PlanError, match="64 GPUs cannot be filled by replicas of \\(tp8,pp3\\)"):
        Strategy.homogeneous(ParallelScheme(tp=8, pp=3), 64)


@pytest.mark.parametrize("field,value", [("a", -1.0), ("b", float("nan")), ("c", float("inf"))])
def test_cost_coefficients_validated(field, value):
    kwargs = dict(scheme=ParallelScheme(tp=4), a=1e-6, b=0.2, c=100.0, max_tokens=4096)
    kwargs[field] = value
    with pytest.raises(PlanError, match=f"cost coefficient {field} of \\(tp4,pp1\\)"):
        SchemeCost(**kwargs)


def _model():
    return CostModel(name="toy", entries=(
        SchemeCost(scheme=ParallelScheme(tp=1), a=1e-3, b=1.0, c=10.0, max_tokens=100),
        SchemeCost(scheme=ParallelScheme(tp=2, pp=2), a=5e-4, b=0.25, c=5.0, max_tokens=300),
    ))


def test_unknown_scheme_lists_known():
    with pytest.raises(PlanError, match=r"unknown scheme \(tp8,pp1\).*known: \(tp2,pp2\), \(tp1,pp1\)"):
        _model().cost(ParallelScheme(tp=8))


def test_micro_batch_and_replica_formulas_hand_computed():
    m = _model()
    # 1e-3*(10^2+20^2) + 1.0*30 + 10 = 0.5 + 30 + 10
    assert m.micro_batch_ms(ParallelScheme(tp=1), [10, 20]) == pytest.approx(40.5)
    pp2 = ParallelScheme(tp=2, pp=2)
    assert m.replica_ms(pp2, [3.0, 5.0, 4.0]) == pytest.approx(12.0 + 1 * 5.0)
    assert m.replica_ms(pp2, []) == 0.0
    replica = ReplicaPlan(scheme=ParallelScheme(tp=1), ranks=(0,), micro_batches=((2, 0), (1,)), max_tokens=64,
                          est_ms=0.0)
    # micro-batch (20, 10) as above; (5,): 1e-3*25 + 5 + 10
    assert m.micro_batch_times(replica, [10, 5, 20]) == pytest.approx([40.5, 15.025])


def test_bucket_padding_and_padded_micro_batch_hand_computed():
    assert [bucket_padding((64, 128), t) for t in (0, 1, 64, 65, 128, 129)] == [0, 63, 0, 63, 0, 0]
    assert bucket_padding((), 50) == 0
    m = dataclasses.replace(_model(), buckets=(32, 64))
    # [10, 20] is padded to 32 by one sequence of 2: 1e-3*(100+400+4) + 1.0*(30+2) + 10
    assert m.micro_batch_ms(ParallelScheme(tp=1), [10, 20]) == pytest.approx(0.504 + 32 + 10)
    tp1 = ParallelScheme(tp=1)
    assert m.micro_batch_ms(tp1, [32]) == pytest.approx(_model().micro_batch_ms(tp1, [32]))


@pytest.mark.parametrize("buckets", [(64, 32), (0, 8), (8, 8), [8, 16], (8, True)])
def test_bad_buckets_are_named(buckets):
    with pytest.raises(PlanError, match="buckets of cost model 'toy' must be a tuple of strictly ascending"):
        dataclasses.replace(_model(), buckets=buckets)


def test_step_plan_json_fields():
    scheme = ParallelScheme(tp=2)
    plan = StepPlan(strategy=Strategy.homogeneous(scheme, 2), seq_lens=(5, 7),
                    replicas=(ReplicaPlan(scheme=scheme, ranks=(0, 1), micro_batches=((0, 1),), max_tokens=16,
                                          est_ms=1.5),),
                    est_step_ms=1.5, lower_bound_ms=1.0, solve_ms=0.1)
    d = plan.to_dict(step=3)
    assert list(d) == ["step", "policy", "strategy", "num_gpus", "seq_lens", "replicas", "est_step_ms",
                       "est_move_ms", "lower_bound_ms", "solve_ms"]
    assert d["replicas"][0] == {"tp": 2, "pp": 1, "cp": 1, "ranks": [0, 1], "max_tokens": 16,
                                "micro_batches": [[0, 1]], "est_ms": 1.5}
    with pytest.raises(PlanError, match="needs 2 ranks, got 1"):
        ReplicaPlan(scheme=scheme, ranks=(0,), micro_batches=(), max_tokens=1, est_ms=0.0)
    assert not math.isnan(d["est_step_ms"])
