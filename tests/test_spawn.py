"""hcompile.tools.spawn.run_local_ranks: results in rank order with one thread per rank; a failing rank or a hang
ends the job with RankError, quickly."""

import time

import pytest
from spawn_targets import fail_on_rank_1, hang, rank_and_world

from hcompile.tools.spawn import RankError, max_local_ranks, run_local_ranks


def test_results_in_rank_order_with_one_thread():
    assert run_local_ranks(2, rank_and_world, timeout_s=120) == [(0, 2, 1.0, 1), (1, 2, 1.0, 1)]


def test_failing_rank_ends_the_job_with_its_traceback():
    started = time.monotonic()
    with pytest.raises(RankError, match="rank one is broken"):
        run_local_ranks(2, fail_on_rank_1, timeout_s=120)
    assert time.monotonic() - started < 55


def test_timeout_kills_the_ranks():
    started = time.monotonic()
    with pytest.raises(RankError, match="did not finish within 8 s"):
        run_local_ranks(1, hang, timeout_s=8)  # past the rank's start-up: it is inside hang() when the time is up
    assert time.monotonic() - started < 30


def test_too_many_ranks_is_refused_before_starting():
    with pytest.raises(RankError, match="more than this machine can start"):
        run_local_ranks(max_local_ranks() + 1, hang)
