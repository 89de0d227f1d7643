"""Fault injection under the real launcher (`hcompile launch --nproc 2`, gloo): a rank that raises, a rank that
hangs, a planner that raises, a planner that hangs, a collective that times out. Every case ends the whole job
with a non-zero status within the configured timeouts, and the checkpoint written before the fault is intact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import os, sys, time, torch, torch.distributed as dist
import hcompile
from hcompile.models import Llama, LlamaConfig, init_weights_
from passes.plan.policies import Planner

fault, ckpt = sys.argv[1], sys.argv[2]
trainer = hcompile.compile(init_weights_(Llama(LlamaConfig(vocab=64)), seed=0)).trainer(loss="causal_lm",
                           optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, strategies=["2x(tp1)"],
                           tokens_per_rank=64, calibrate=False, plan_timeout_s=8)
rank = dist.get_rank()
batch = [torch.arange(12) % 64, torch.arange(9) % 64]
trainer.train_step(batch)
trainer.save(ckpt, step=1, data_position=1)
if fault == "raise" and rank == 1:
    raise RuntimeError("rank 1 broke on purpose")
if fault == "hang" and rank == 1:
    time.sleep(10_000)
if fault == "planner-raises" and rank == 0:
    def broken(self, *args, **kwargs):
        raise RuntimeError("the planner broke on purpose")
    Planner.plan = broken
if fault == "planner-hangs" and rank == 0:
    Planner.plan = lambda self, *args, **kwargs: time.sleep(10_000)
if fault == "collective" and rank == 1:
    dist.barrier()  # a collective rank 0 never joins
for step in range(3):
    trainer.train_step([torch.arange(12 + step) % 64, torch.arange(9) % 64])
print("finished", flush=True)
"""
TIMEOUT_S = 10  # every collective (HCOMPILE_TIMEOUT_S); planning waits plan_timeout_s = 8


@pytest.mark.parametrize("fault, needle", [
    ("raise", "rank 1 broke on purpose"),
    ("hang", ""),
    ("planner-raises", "the planner broke on purpose"),
    ("planner-hangs", "planning a step took more than 8 s"),
    ("collective", ""),
])
def test_every_fault_ends_the_job_in_time_with_the_checkpoint_intact(tmp_path, fault, needle):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "HCOMPILE_TIMEOUT_S": str(TIMEOUT_S), "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hcompile.cli", "launch", "--nproc", "2", str(script), fault,
                           str(ckpt)], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    elapsed = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "finished" not in proc.stdout, out[-3000:]
    assert needle in out, out[-3000:]
    assert elapsed < 4 * TIMEOUT_S + 45, f"{fault}: took {elapsed:.0f}s"  # start-up, compile, one timeout
    version = ckpt / (ckpt / "LATEST").read_text().strip()
    meta = json.loads((version / "meta.json").read_text())
    assert meta["step"] == 1 and sorted(p.name for p in version.iterdir()) == [
        "meta.json", "rank0.safetensors", "rank1.safetensors"]
