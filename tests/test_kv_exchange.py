"""The pipelined K/V exchange's choices and its benchmark: how many head groups a rank pipelines over, the
trainer's option (validated; 1 on the CPU, where it was measured slower), the lowering that carries it, and
``python -m benchmarks.kv_exchange`` running on 2 gloo ranks. Exactness against naive attention over whole
sequences is in ``tests/test_context_parallel.py`` (kv_splits 1, 2 and 4, with windows, chunks, sinks and the
Triton kernels); whole training steps in ``tests/test_regrouped_cp.py`` and ``tests/test_cp_equivalence.py``."""

from __future__ import annotations

import pytest

from benchmarks.kv_exchange import main, model_exposed
from hcompile.train import TrainOptions
from passes.graph.lowering import LoweringCache
from passes.graph.variant import TokenBuckets
from passes.plan.context_parallel import KV_SPLITS, kv_splits


def test_splits_divide_the_rank_kv_heads():
    assert KV_SPLITS == 4
    assert [kv_splits(n) for n in (1, 2, 3, 4, 6, 8, 12)] == [1, 2, 3, 4, 3, 4, 4]
    assert kv_splits(8, 1) == 1 and kv_splits(8, 2) == 2
    with pytest.raises(ValueError, match="kv_heads=0"):
        kv_splits(0)


@pytest.mark.parametrize("value", [0, -2, True, 2.0, "4"])
def test_the_option_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match=f"kv_splits must be a positive integer or None, got {value!r}"):
        TrainOptions(kv_splits=value)
    with pytest.raises(ValueError, match="kv_splits must be a positive integer"):
        LoweringCache(lambda tokens: None, TokenBuckets(sizes=(16,)), kv_splits=value)


def test_the_model_charges_the_first_group_and_what_the_attention_cannot_cover():
    assert model_exposed(40.0, 100.0, 1, 0.0) == 40.0  # one all-gather: all of it
    assert model_exposed(40.0, 100.0, 4, 0.0) == 10.0  # the first quarter; three hide behind the attention
    assert model_exposed(40.0, 100.0, 4, 1.0) == 40.0  # transfers that cost compute as much hide nothing
    assert model_exposed(40.0, 20.0, 4, 0.0) == 10.0 + 30.0 - 20.0  # the attention covers 20 of the 30


def test_the_benchmark_times_every_split_on_two_ranks(capsys):
    assert main(["--tokens", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "attention alone" in out and "exchange alone" in out
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [("1", "1"), ("2", "2"), ("4", "2")]  # 2 kv heads: at most 2 groups


@pytest.mark.parametrize("argv, message", [
    (["--splits", "1,x"], "--splits '1,x'"),
    (["--world", "1"], "--world must be >= 2"),
    (["--heads", "6", "--kv-heads", "4"], "--kv-heads 4 must divide --heads 6"),
    (["--tokens", "3"], "--tokens 3 must be at least twice --world 2"),
])
def test_the_benchmark_refuses_bad_input(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
