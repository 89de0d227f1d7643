"""The ``round-four`` job under the real launcher (``hcompile launch --nproc 2``, gloo; cases in
``tests/fault_round_four.py``): one rank's data iterator raising inside ``fit`` is the same ``DataError`` on
every rank, and a script that catches it and saves keeps the first untrained batch as its position; one rank's
iterator ending early is a ``DataError`` on every rank; ``save``, ``save_pretrained`` and ``load`` on rank 0
alone are the same ``CollectiveCallError`` on every rank (never a gloo abort or a timeout), nothing written, and
the ranks train on together afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_refusals import read_cases

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import os, sys, torch, torch.distributed as dist
import hcompile
from hcompile.models import Llama, LlamaConfig, init_weights_
import fault_round_four

trainer = hcompile.compile(init_weights_(Llama(LlamaConfig(vocab=64)), seed=0)).trainer(loss="causal_lm",
                           optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, strategies=["2x(tp1)"],
                           tokens_per_rank=128, calibrate=False, plan_timeout_s=8)
fault_round_four.run(trainer, sys.argv[1], dist.get_rank())
print("finished", flush=True)
"""
TIMEOUT_S = 10  # every collective (HCOMPILE_TIMEOUT_S): a mismatch met by a timeout would show in the duration


@pytest.fixture(scope="module")
def round_four(tmp_path_factory) -> dict[str, list[dict]]:
    """The job, run once for the tests below: every case's result on rank 0 and rank 1."""
    tmp = tmp_path_factory.mktemp("round-four")
    (tmp / "job.py").write_text(SCRIPT)
    env = {**os.environ, "HCOMPILE_TIMEOUT_S": str(TIMEOUT_S),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hcompile.cli", "launch", "--nproc", "2", str(tmp / "job.py"),
                           str(tmp)], capture_output=True, text=True, timeout=240, env=env, cwd=tmp)
    elapsed = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and proc.stdout.count("finished") == 2, out[-4000:]
    assert elapsed < 120, f"took {elapsed:.0f}s: a collective timed out"
    return read_cases(proc.stdout)


def test_one_ranks_iterator_raising_is_the_same_error_and_a_caught_save_keeps_the_untrained_batch(round_four):
    rank0, rank1 = round_four["one-rank-raises"]
    assert rank0["error"] == rank1["error"] and rank0["error"][0] == "DataError", round_four["one-rank-raises"]
    assert rank0["error"][1].startswith("the batches raised on rank 1: ValueError: corrupt record in encode call")
    assert (rank0["cause"], rank1["cause"]) == (None, "ValueError")  # chained on the rank that raised
    for r in (rank0, rank1):
        assert r["trained"] == 3 and r["position_first_untrained"] and r["saved_position_first_untrained"], r
        assert r["loads"], r


def test_one_ranks_iterator_ending_early_is_the_same_error(round_four):
    rank0, rank1 = round_four["one-rank-ends"]
    assert rank0["refused"] == rank1["refused"] == [
        "DataError", "the batches ended on rank 1 but not on rank 0: every rank must read the same batches"]


@pytest.mark.parametrize("case, call", [("rank0-save", "save"), ("rank0-export", "save_pretrained"),
                                        ("rank0-load", "load")])
def test_a_collective_call_on_rank_0_alone_is_named_on_every_rank(round_four, case, call):
    rank0, rank1 = round_four[case]
    assert rank0["refused"] == rank1["refused"], round_four[case]
    kind, message = rank0["refused"]
    assert kind == "CollectiveCallError" and message.startswith(
        f"`{call}` is collective: rank 0 called it while rank 1 called `train_step`"), message
    assert all(r["unchanged"] and r["then_trains"] for r in (rank0, rank1)), round_four[case]
