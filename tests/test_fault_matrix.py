"""Fault injection under the real launcher (`hcompile launch --nproc 2`, gloo): a rank that raises, a rank that
hangs, a planner that raises, a planner that hangs, a collective that times out, a rank that exits with its own
code, a rank another process sends SIGTERM. Every case ends the whole job with a non-zero status within the
configured timeouts (the failing rank's own exit code where it chose one, the rank the signal hit named), and
the checkpoint written before the fault is intact. Two more jobs meet what must be refused with nothing changed
and finish with exit 0: ``refusals`` (a batch that differs on one rank, a checkpoint with a flipped byte, a
batch with no next-token pair, a corpus that gives no sequence, a save into a run folder) and ``round-three``
(``tests/fault_refusals.py``, one test per case below: an export beside a user's files, a full disk during an
export, non-finite values, a model without parameters, a checkpoint piece of another dtype or length, a
checkpoint folder another save holds), each with the expected error on every rank and the files on disk
compared before and after. Two trainers saving into one folder at once are two plain processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from fault_refusals import read_cases

from runtime.checkpoint import load_checkpoint
from runtime.fixed_layout import FixedLayout

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
if fault == "sigterm":  # rank 0 sends rank 1 a SIGTERM, as a shell's kill or a scheduler would
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    if rank == 0:
        import signal
        os.kill(pids[1], signal.SIGTERM)
    time.sleep(10_000)  # rank 0 is ended by the launcher once rank 1 has died
if fault == "refusals":
    refusals(trainer, ckpt, rank)
if fault == "round-three":
    import fault_refusals
    fault_refusals.run(trainer, os.path.dirname(ckpt), rank)
for step in range(3):
    trainer.train_step([torch.arange(12 + step) % 64, torch.arange(9) % 64])
print("finished", flush=True)
"""
TIMEOUT_S = 10  # every collective (HCOMPILE_TIMEOUT_S); planning waits plan_timeout_s = 8


def _launch(tmp_path: Path, fault: str) -> tuple[subprocess.CompletedProcess, float]:
    """The job under ``hcompile launch --nproc 2`` with ``fault``: its process and its duration (s)."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "HCOMPILE_TIMEOUT_S": str(TIMEOUT_S),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hcompile.cli", "launch", "--nproc", "2", str(script), fault,
                           str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    return proc, time.monotonic() - started


def _checkpoint_intact(ckpt: Path) -> None:
    version = ckpt / (ckpt / "LATEST").read_text().strip()
    meta = json.loads((version / "meta.json").read_text())
    assert meta["step"] == 1 and sorted(p.name for p in version.iterdir()) == [
        ".hydraulis-version", "meta.json", "rank0.safetensors", "rank1.safetensors"]


@pytest.mark.parametrize("fault, needle", [
    ("raise", "rank 1 broke on purpose"),
    ("hang", ""),
    ("planner-raises", "the planner broke on purpose"),
    ("planner-hangs", "planning a step took more than 8 s"),
    ("collective", ""),
    ("exit-code", "hcompile launch: rank 1 failed (exit code 3): rank 1 gives up"),
    ("sigterm", "hcompile launch: rank 1 failed (signal SIGTERM, not sent by the launcher)"),
    ("refusals", ""),
])
def test_every_fault_ends_the_job_in_time_with_the_checkpoint_intact(tmp_path, fault, needle):
    proc, elapsed = _launch(tmp_path, fault)
    out = proc.stdout + proc.stderr
    if fault == "refusals":  # every refusal on both ranks, nothing changed, and a clean exit
        assert proc.returncode == 0 and proc.stdout.count("finished") == 2, out[-3000:]
        for line in ("refused BatchError", "refused CheckpointError True", "refused DataError", "unchanged True"):
            assert proc.stdout.count(line) == 2, out[-3000:]
    else:
        code = {"exit-code": 3, "sigterm": 128 + 15}.get(fault, proc.returncode)
        assert proc.returncode == code != 0, out[-3000:]
        assert "finished" not in proc.stdout and needle in out, out[-3000:]
    assert elapsed < 4 * TIMEOUT_S + 45, f"{fault}: took {elapsed:.0f}s"  # start-up, compile, one timeout
    _checkpoint_intact(tmp_path / "ckpt")


@pytest.fixture(scope="module")
def round_three(tmp_path_factory) -> dict[str, list[dict]]:
    """The ``round-three`` job, run once for the tests below: every case's result on rank 0 and rank 1."""
    tmp = tmp_path_factory.mktemp("round-three")
    proc, _ = _launch(tmp, "round-three")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and proc.stdout.count("finished") == 2, out[-4000:]
    _checkpoint_intact(tmp / "ckpt")
    return read_cases(proc.stdout)


def _on_every_rank(results: list[dict], key: str, kind: str, *needles: str) -> None:
    """Both ranks met the same error of type ``kind`` whose message holds every needle."""
    assert results[0][key] == results[1][key], results
    assert results[0][key] is not None and results[0][key][0] == kind, results[0][key]
    for needle in needles:
        assert needle in results[0][key][1], (needle, results[0][key][1])


def test_export_touches_only_what_it_writes(round_three):
    rank0, rank1 = round_three["export"]
    record = ".hydraulis-export.json"
    assert rank0["written"] == [["model.safetensors"],
                                ["model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
                                 "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors",
                                 "model.safetensors.index.json"],
                                ["model.safetensors"]]  # no config.json: the model has none, the user's stays
    assert rank1["written"] == [None, None, None]
    assert rank0["user_kept"] and rank0["present"] == sorted(
        [record, "config.json", "model-best.safetensors.bak", "model.safetensors", "model_backup.safetensors",
         "notes.txt"])  # the sharded export's files went with the next export, the user's stayed
    _on_every_rank(round_three["export"], "refused", "ExportError", "model.safetensors' was not written by an "
                   "export and would be loaded instead of the shards")
    assert rank0["theirs_unchanged"] and rank0["left_over"] == []


def test_a_full_disk_during_export_is_the_same_error_on_every_rank(round_three):
    results = round_three["disk-full"]
    _on_every_rank(results, "refused", "ExportError", "failed on rank 0", "File too large",
                   "was changed")
    assert all(r["unchanged"] and r["left_over"] == [] for r in results)


def test_training_stops_on_non_finite_values_on_every_rank(round_three):
    results = round_three["non-finite"]
    for r in results:
        assert r["construction"] == ["ValueError", "optimizer_kwargs must be finite numbers, got lr=inf: every "
                                     "weight would become NaN at the first step"]
    _on_every_rank(results, "nan_lr", "NonFiniteError", "step 2: the optimiser's settings are not finite on rank 0 "
                   "(param group 0: lr=nan)", "nothing changed")
    _on_every_rank(results, "inf_lr_on_rank_1", "NonFiniteError", "step 3:", "on rank 1 (param group 0: lr=inf)")
    _on_every_rank(results, "loss_overflow", "NonFiniteError", "step 4: the loss is nan and the gradient norm nan",
                   "non_finite='skip'")
    assert all(r["huge_unchanged"] and r["unchanged"] and r["files_unchanged"] and r["then_trains"]
               for r in results), results


def test_a_model_without_parameters_is_a_one_line_error(round_three):
    _on_every_rank(round_three["no-parameters"], "refused", "ValueError", "Constant has no parameters")
    assert "\n" not in round_three["no-parameters"][0]["refused"][1]


def test_a_checkpoint_piece_of_another_dtype_or_length_is_refused(round_three):
    results = round_three["checkpoint-piece"]
    _on_every_rank(results, "dtype", "CheckpointError", "rank1.safetensors: 'param/", "is F64 of shape",
                   "the layout expects F32")
    _on_every_rank(results, "length", "CheckpointError", "rank1.safetensors: 'param/", "is F32 of shape")
    assert all(r["unchanged"] and r["dtype_files_unchanged"] and r["length_files_unchanged"] for r in results)


def test_a_save_into_a_folder_another_save_holds_is_refused(round_three):
    results = round_three["lock"]
    holder = f"is being saved by another process (host {socket.gethostname()}, pid {results[0]['pid']}"
    _on_every_rank(results, "refused", "CheckpointError", holder, ".hydraulis-lock")
    assert all(r["unchanged"] and r["stale_taken_over"] is None and not r["lock_left"] for r in results), results
    assert results[0]["latest"] == results[1]["latest"] and results[0]["latest"].startswith("v00000008-")


RACER = textwrap.dedent("""
    import os, sys, time, torch
    from runtime.checkpoint import CheckpointError, save_checkpoint
    from runtime.fixed_layout import FixedLayout
    folder, value, go = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    layout = FixedLayout.from_tensors({"w": torch.full((64, 64), value)}, 0, 1)
    optimizer = torch.optim.SGD([layout.shard], lr=0.1)
    print("ready", flush=True)
    while not os.path.exists(go):  # both start saving at once
        time.sleep(0.001)
    saved = refused = 0
    while saved < 5 and refused < 2000:
        try:
            save_checkpoint(folder, layout, optimizer, step=saved, data_position=saved)
            saved += 1
        except CheckpointError as exc:
            assert "is being saved by another process" in str(exc), exc
            refused += 1
        time.sleep(0.001)
    print(saved, refused, flush=True)
""")


def test_two_trainers_saving_into_one_folder_never_break_it(tmp_path):
    """Two processes save into one folder 5 times each, at once: every save is made whole or refused by the
    lock (never another error), and the folder ends with ``LATEST`` naming a complete version that loads, and
    nothing else beside it."""
    folder, go = tmp_path / "shared", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(folder), str(v), str(go)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for v in (1, 2)]
    try:
        assert all(p.stdout.readline().strip() == "ready" for p in procs)
        go.touch()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    counts = [tuple(map(int, out.split())) for out, _ in outs]
    assert all(saved == 5 for saved, _ in counts) and sum(r for _, r in counts) > 0, counts  # they met
    layout = FixedLayout.from_tensors({"w": torch.zeros(64, 64)}, 0, 1)
    meta = load_checkpoint(folder, layout, torch.optim.SGD([layout.shard], lr=0.1))
    shard = layout.shard.detach()
    assert float(shard[0]) in (1.0, 2.0) and bool((shard == shard[0]).all()) and meta["step"] == 4
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["LATEST", (folder / "LATEST").read_text().strip()], names  # no lock, no temporary left
