"""Fault injection under the real launcher (`hcompile launch --nproc 2`, gloo): a rank that raises, a rank that
hangs, a planner that raises, a planner that hangs, a collective that times out, a rank that exits with its own
code. Every case ends the whole job with a non-zero status within the configured timeouts (the failing rank's
own exit code where it chose one), and the checkpoint written before the fault is intact. One more job meets
what must be refused with nothing changed (a batch that differs on one rank, a checkpoint with a flipped byte,
a batch with no next-token pair, a corpus that gives no sequence, a save into a run folder) and finishes with
exit 0."""

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


def say(*words):  # one write per line: two ranks share the launcher's stdout
    sys.stdout.write(" ".join(map(str, words)) + "\\n")
    sys.stdout.flush()


def refusals(trainer, ckpt, rank):
    from pathlib import Path
    from hcompile.data import ByteTokenizer, Corpus, DataError, TokenBatches
    from runtime.batch_check import BatchError
    from runtime.checkpoint import CheckpointError
    before = trainer.full_state_dict()
    ids = torch.arange(90) % 64
    try:  # the same tokens cut into other sequences on rank 1
        trainer.train_step(list(torch.split(ids, [20, 40, 30] if rank == 0 else [30, 20, 40])))
    except BatchError as exc:
        say("refused", type(exc).__name__)
    assert trainer.train_step([torch.tensor([1]), torch.tensor([2])]).skipped  # no next-token pair
    run = Path(ckpt).parent / "run"
    if rank == 0:
        (run / "tensorboard").mkdir(parents=True, exist_ok=True)
    trainer.save(str(run), step=1, data_position=1)
    trainer.save(str(run), step=2, data_position=2)
    version = run / (run / "LATEST").read_text().strip()
    dist.barrier()
    if rank == 0:
        file = version / "rank1.safetensors"
        raw = bytearray(file.read_bytes())
        raw[-1] ^= 0xFF  # inside the last tensor's data
        file.write_bytes(bytes(raw))
    dist.barrier()
    try:
        trainer.load(str(run))
    except CheckpointError as exc:
        say("refused", type(exc).__name__, "rank1.safetensors is damaged" in str(exc))
    assert (run / "tensorboard").is_dir() and len([p for p in run.iterdir() if p.name.startswith("v")]) == 1
    try:
        TokenBatches(Corpus(["a", "b"]), ByteTokenizer(), tokens_per_batch=64, max_len=8).next_batch()
    except DataError as exc:
        say("refused", type(exc).__name__)
    after = trainer.full_state_dict()
    say("unchanged", all(torch.equal(before[n], t) for n, t in after.items()))
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
if fault == "exit-code" and rank == 1:
    print("rank 1 gives up", file=sys.stderr, flush=True)
    sys.exit(3)
if fault == "refusals":
    refusals(trainer, ckpt, rank)
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
    ("exit-code", "hcompile launch: rank 1 failed (exit code 3): rank 1 gives up"),
    ("refusals", ""),
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
    if fault == "refusals":  # every refusal on both ranks, nothing changed, and a clean exit
        assert proc.returncode == 0 and proc.stdout.count("finished") == 2, out[-3000:]
        for line in ("refused BatchError", "refused CheckpointError True", "refused DataError", "unchanged True"):
            assert proc.stdout.count(line) == 2, out[-3000:]
    else:
        assert proc.returncode == (3 if fault == "exit-code" else proc.returncode) != 0, out[-3000:]
        assert "finished" not in proc.stdout and needle in out, out[-3000:]
    assert elapsed < 4 * TIMEOUT_S + 45, f"{fault}: took {elapsed:.0f}s"  # start-up, compile, one timeout
    version = ckpt / (ckpt / "LATEST").read_text().strip()
    meta = json.loads((version / "meta.json").read_text())
    assert meta["step"] == 1 and sorted(p.name for p in version.iterdir()) == [
        ".hydraulis-version", "meta.json", "rank0.safetensors", "rank1.safetensors"]
