"""What bounds a job's waits: the environment a job is joined with (``job_from_env``: every variable checked up
front, a bad one named with its value and what it must be), the groups made during warm-up (made with the job's
timeout, their point-to-point messages waited within the timeout in force: ``p2p_timeout``, ``wait``), and the
overlapped movement's progress thread, whose start cannot hang (``runtime.overlap._ProgressThread``)."""

from __future__ import annotations

import contextlib
import threading
import time
import types

import pytest
import torch
from dist_util import run_ranks

from passes.graph.tensor_parallel import ParamSlice
from runtime import distributed as comm
from runtime import overlap
from runtime.distributed import job_from_env
from runtime.fixed_layout import FixedLayout

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HCOMPILE_TIMEOUT_S",
        "HCOMPILE_WARMUP_TIMEOUT_S", "HCOMPILE_PLAN_TIMEOUT_S")


@pytest.fixture
def clean_env(monkeypatch):
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(("env", "message"), [
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc': expected a positive integer: the ranks in the job"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0': expected a positive integer"),
    ({"WORLD_SIZE": "2.0"}, "WORLD_SIZE='2.0': expected a positive integer"),
    ({"RANK": "1", "WORLD_SIZE": "1"}, "RANK=1 is not a rank of a job of WORLD_SIZE=1 (expected 0..0)"),
    ({"RANK": "1"}, "RANK=1 is not a rank of a job of WORLD_SIZE=1"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1': expected an integer >= 0"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x': expected an integer >= 0"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1", "LOCAL_RANK": "a"},
     "LOCAL_RANK='a': expected an integer >= 0"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "WORLD_SIZE=2 but MASTER_ADDR is not set: start the job with `hcompile "
                                       "launch` or torchrun"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT is not set: expected a port number"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"},
     "MASTER_PORT='70000': expected a port number in [1, 65535]"),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "http"}, "MASTER_PORT='http'"),
    ({"HCOMPILE_TIMEOUT_S": "abc"}, "HCOMPILE_TIMEOUT_S='abc': expected a positive number of seconds"),
    ({"HCOMPILE_TIMEOUT_S": "-5"}, "HCOMPILE_TIMEOUT_S='-5': expected a positive number of seconds"),
    ({"HCOMPILE_TIMEOUT_S": "0"}, "HCOMPILE_TIMEOUT_S='0'"),
    ({"HCOMPILE_TIMEOUT_S": "inf"}, "HCOMPILE_TIMEOUT_S='inf'"),
    ({"HCOMPILE_WARMUP_TIMEOUT_S": "nan"}, "HCOMPILE_WARMUP_TIMEOUT_S='nan'"),
    ({"HCOMPILE_PLAN_TIMEOUT_S": "-1"}, "HCOMPILE_PLAN_TIMEOUT_S='-1'"),
])
def test_a_bad_variable_is_named_with_its_value_before_the_job_is_joined(clean_env, env, message):
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(ValueError) as failure:
        job_from_env()
    assert message in str(failure.value), str(failure.value)
    joined = comm.is_initialized()  # an earlier test of this process may have left a world of one
    with pytest.raises(ValueError, match="WORLD_SIZE|RANK|MASTER|HCOMPILE_"):
        comm.init_distributed()  # the same check, before any group is made
    assert comm.is_initialized() == joined


def test_good_variables_and_arguments_give_the_job(clean_env):
    assert job_from_env() == (0, 1, comm.DEFAULT_TIMEOUT_S)  # a plain `python train.py`
    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node0",
                        "MASTER_PORT": "29500", "HCOMPILE_TIMEOUT_S": "20"}.items():
        clean_env.setenv(name, value)
    assert job_from_env() == (3, 4, 20.0)
    assert job_from_env("file:///tmp/store", rank=1, world_size=2, timeout_s=5) == (1, 2, 5.0)
    clean_env.delenv("MASTER_ADDR")
    assert job_from_env("file:///tmp/store") == (3, 4, 20.0)  # a store of its own: no MASTER_ADDR needed
    for bad, message in [({"timeout_s": -1}, "timeout_s must be a positive number of seconds, got -1"),
                         ({"world_size": 0}, "world_size must be a positive integer, got 0"),
                         ({"rank": 2, "world_size": 2}, "rank=2 is not a rank of a job of world_size=2")]:
        with pytest.raises(ValueError, match=message):
            job_from_env("file:///tmp/store", **bad)


# ---------------------------------------------------------------------------------------------------------------
# The progress thread's start


def test_the_progress_thread_runs_its_target_and_ends():
    ran = threading.Event()
    thread = overlap._ProgressThread(ran.set, "t")
    thread.start(5.0)
    thread.join(5.0)
    assert ran.is_set() and thread.ended


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the thread's MemoryError
def test_a_thread_that_dies_before_it_runs_is_a_bounded_wait(monkeypatch):
    """As a ``MemoryError`` in a thread's bootstrap: ``Thread.start`` would wait forever; this start gives up."""
    def dies(self):
        raise MemoryError
    monkeypatch.setattr(overlap._ProgressThread, "_main", dies)
    thread = overlap._ProgressThread(lambda: None, "movement")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="the thread movement was started but did not run within 0.3 s"):
        thread.start(0.3)
    assert time.monotonic() - started < 3 and thread.ended


def _flight_without_a_thread(monkeypatch, error: BaseException):
    """A world of one's movement whose progress thread cannot be made (``error`` from the OS call)."""
    from runtime.redistribute import Redistribution
    from runtime.stage_params import StageParams

    def refuse(*args):
        raise error
    monkeypatch.setattr(overlap, "_thread", types.SimpleNamespace(start_new_thread=refuse))
    layout = FixedLayout.from_tensors({"w": torch.ones(6), "b": torch.ones(3)}, 0, 1)
    params = StageParams(layout, {n: ParamSlice(name=n, full_shape=(s,)) for n, s in (("w", 6), ("b", 3))}, tp=1)
    move = Redistribution.build(layout, params.ranges, chunk_numel=4)
    plan = overlap.WindowedMovement(move, layout, overlap.layout_windows(layout, 2), 4)
    flat = params.materialize()
    params.zero_grads()
    return lambda: plan.start(layout, flat, params, torch.float32)


@pytest.mark.parametrize("error", [RuntimeError("can't start new thread"), MemoryError()])
def test_a_progress_thread_that_cannot_start_is_a_movement_error(monkeypatch, error):
    start = _flight_without_a_thread(monkeypatch, error)
    with pytest.raises(overlap.MovementError, match=f"rank 0: the overlapped movement's progress thread did not "
                                                    f"start, so its peers' messages with it cannot travel: "
                                                    f"{type(error).__name__}"):
        start()


# ---------------------------------------------------------------------------------------------------------------
# Groups made during warm-up


def _late_messages(rank, world):
    """Groups made inside a long block (as warm-up makes the movement group), then a message rank 1 never sends:
    rank 0's wait for it ends after the job's timeout (2 s here), not the block's 600 s, whether waited plainly (a
    group made with the job's timeout) or with :func:`comm.wait`; inside a later block, after that block's."""
    comm._timeouts["job"] = 2.0  # the job's timeout, as if the job had been made with it (run_ranks' is its own)
    with comm.collective_timeout(600):
        groups = [comm._new_group([0, 1]) for _ in range(3)]
        inside = comm.timeout_of(groups[0])
    out = {"inside": inside, "after": [comm.timeout_of(g) for g in groups]}
    if rank == 0:
        for name, group, block in (("plain", groups[0], None), ("wait", groups[1], None),
                                   ("narrowed", groups[2], 1.0)):
            started = time.monotonic()
            with comm.collective_timeout(block) if block else contextlib.nullcontext():
                timeout = comm.p2p_timeout(group)
                work = comm.post([], [(torch.zeros(1), 1)], group)
                try:
                    work[0].wait() if name == "plain" else comm.wait(work, timeout)
                    out[name] = "received"
                except RuntimeError as exc:
                    out[name] = (round(time.monotonic() - started, 1), "Timed out" in str(exc))
    return out


def test_groups_made_during_warm_up_time_out_after_the_jobs_timeout(tmp_path):
    results = run_ranks(2, tmp_path, _late_messages, timeout_s=60)
    for out in results:
        assert out["inside"] == 600.0 and out["after"] == [2.0, 2.0, 2.0], out
    out = results[0]
    for name, seconds in (("plain", 2.0), ("wait", 2.0), ("narrowed", 1.0)):
        assert out[name][1] and seconds - 0.3 <= out[name][0] < seconds + 2, (name, out)
