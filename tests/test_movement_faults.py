"""A rank that fails or stalls inside a step's overlapped movement, under the real launcher (`hcompile launch
--nproc 2`, gloo), after a first step that warmed up under the default warm-up timeout (an hour): the job ends
within the job's timeout (``HCOMPILE_TIMEOUT_S``), not warm-up's, with a ``MovementError`` that names the rank.
``stall``: rank 1 stalls where its movement starts (the progress thread's start never returns), so rank 0 waits
for its messages on the movement group, made during warm-up. ``thread-dies``: rank 1's progress thread dies
before it runs (as a ``MemoryError`` in its bootstrap does), which once left ``Thread.start`` waiting forever."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import sys, time, torch, torch.distributed as dist
import hcompile
from hcompile.models import Llama, LlamaConfig, init_weights_
from runtime import overlap

fault = sys.argv[1]
model = Llama(LlamaConfig(layers=1, hidden=32, ffn_hidden=64, vocab=64))
trainer = hcompile.compile(init_weights_(model, seed=0)).trainer(loss="causal_lm",
                           optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, strategies=["2x(tp1)"],
                           tokens_per_rank=64, calibrate=False, plan_timeout_s=8)
rank = dist.get_rank()
batch = [torch.arange(12) % 64, torch.arange(9) % 64]
trainer.train_step(batch)  # warm-up (the movement group is made here) and a first step
if rank == 1 and fault == "stall":  # a rank stuck inside a step: its movement never starts
    overlap._ProgressThread.start = lambda self, within_s: time.sleep(10_000)
if rank == 1 and fault == "thread-dies":  # the progress thread dies before it runs
    def dies(self):
        raise MemoryError
    overlap._ProgressThread._main = dies
sys.stdout.write(f"rank {rank} stepping at {time.time():.3f}\\n")
sys.stdout.flush()
trainer.train_step(batch)
print("finished", flush=True)
"""
TIMEOUT_S = 15  # HCOMPILE_TIMEOUT_S; the warm-up timeout is the default hour


@pytest.mark.parametrize("fault, failed, needles", [
    ("stall", 0, ["MovementError: rank 0: the overlapped movement failed at the pull's messages with rank(s) [1]",
                  f"Timed out waiting {TIMEOUT_S * 1000}ms"]),
    ("thread-dies", 1, ["MovementError: rank 1: the overlapped movement's progress thread did not start",
                        "did not run within 7.5 s"]),
])
def test_a_rank_failing_inside_a_steps_movement_ends_the_job_within_the_job_timeout(tmp_path, fault, failed,
                                                                                      needles):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "HCOMPILE_TIMEOUT_S": str(TIMEOUT_S),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    env.pop("HCOMPILE_WARMUP_TIMEOUT_S", None)
    proc = subprocess.run([sys.executable, "-m", "hcompile.cli", "launch", "--nproc", "2", str(script), fault],
                          capture_output=True, text=True, timeout=200, env=env, cwd=tmp_path)
    ended = time.time()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "finished" not in proc.stdout, out[-3000:]
    assert f"hcompile launch: rank {failed} failed (exit code 1):" in proc.stderr, out[-3000:]
    for needle in needles:
        assert needle in out, (needle, out[-3000:])
    stepping = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("rank ")]
    assert len(stepping) == 2, out[-3000:]
    # from the faulty step to the job's end: one job timeout (not warm-up's hour), the exits and the launcher
    assert ended - max(stepping) < TIMEOUT_S + 25, f"{fault}: the job ended {ended - max(stepping):.0f}s after"
