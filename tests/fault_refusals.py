"""The cases of the fault matrix's ``round-three`` job (``tests/test_fault_matrix.py``), run on every rank of one
``hcompile launch --nproc 2`` job with a trained ``Trainer``: an export beside a user's files, an export that
meets a full disk, non-finite values, a model without parameters, a checkpoint piece of another dtype or
length, a checkpoint folder another save holds. Each case prints one line per rank, ``case <name> <rank>
<json>``, with the error it met and whether the files on disk and the weights are as they were."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import resource
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist


def say(case: str, rank: int, result: dict) -> None:
    """One write per line: two ranks share the launcher's stdout."""
    sys.stdout.write(f"case {case} {rank} {json.dumps(result, sort_keys=True)}\n")
    sys.stdout.flush()


def read_cases(stdout: str) -> dict[str, list]:
    """What :func:`say` wrote, read back: each case's result per rank, ``{case: [rank 0's, rank 1's]}``."""
    results: dict[str, list] = {}
    for line in stdout.splitlines():
        if line.startswith("case "):
            _, case, rank, value = line.split(" ", 3)
            results.setdefault(case, [None, None])[int(rank)] = json.loads(value)
    return results


def files(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (hidden ones too): its path relative to ``folder`` and its sha256."""
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


def refused(call: Callable[[], Any]) -> list[str] | None:
    """``[error type, message]`` of what ``call`` raised (None: it returned)."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test reads which one
        return [type(exc).__name__, str(exc)]
    return None


def unchanged(before: dict, trainer) -> bool:
    return all(torch.equal(before[n], t) for n, t in trainer.full_state_dict().items())


def export(trainer, tmp: Path, rank: int) -> dict:
    """A user's files beside three exports (one shard, shards, one shard again): each export touches only what
    it writes and what the export before it listed; a user's ``model.safetensors`` beside a sharded export is
    refused with nothing changed."""
    out, theirs = tmp / "out", tmp / "theirs"
    if rank == 0:
        out.mkdir()
        for name in ("model_backup.safetensors", "model-best.safetensors.bak", "notes.txt", "config.json"):
            (out / name).write_text(f"the user's {name}\n")
        theirs.mkdir()
        (theirs / "model.safetensors").write_text("a model someone else wrote\n")
    dist.barrier()
    user, theirs_before = files(out), files(theirs)
    written = [trainer.save_pretrained(str(out)), trainer.save_pretrained(str(out), max_shard_size="100KB"),
               trainer.save_pretrained(str(out))]
    present = [files(out)]
    error = refused(lambda: trainer.save_pretrained(str(theirs), max_shard_size="100KB"))
    kept = all(files(out).get(n) == h for n, h in user.items())
    return {"written": written, "user_kept": kept, "present": sorted(present[0]), "refused": error,
            "theirs_unchanged": files(theirs) == theirs_before,
            "left_over": sorted(p.name for p in tmp.iterdir() if ".export-" in p.name)}


def disk_full(trainer, tmp: Path, rank: int) -> dict:
    """An export into a folder holding an earlier export and a user's file, while rank 0 cannot write more than
    64 KB to a file (``RLIMIT_FSIZE``: the write fails as on a full disk): the same ``ExportError`` on both
    ranks, the folder as it was, nothing left beside it."""
    full = tmp / "full"
    if rank == 0:
        full.mkdir()
        (full / "notes.txt").write_text("mine\n")
    dist.barrier()
    trainer.save_pretrained(str(full))
    before = files(full)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG
    if rank == 0:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, limits[1]))
    try:
        error = refused(lambda: trainer.save_pretrained(str(full)))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    return {"refused": error, "unchanged": files(full) == before,
            "left_over": sorted(p.name for p in tmp.iterdir() if ".export-" in p.name)}


def non_finite(trainer, tmp: Path, rank: int) -> dict:
    """``lr=inf`` at construction; a scheduler's ``lr=nan`` on every rank and ``lr=inf`` on rank 1 alone; a
    weight so large that the loss overflows: each a ``NonFiniteError`` on every rank naming the step, with the
    weights and the files as they were; then a good step trains."""
    from hcompile import TrainOptions

    disk, before = files(tmp), trainer.full_state_dict()
    batch = [torch.arange(12) % 64, torch.arange(9) % 64]
    result: dict[str, Any] = {"construction": refused(lambda: TrainOptions(optimizer_kwargs={"lr": math.inf}))}
    group = trainer.optimizer.param_groups[0]
    lr = group["lr"]
    group["lr"] = math.nan
    result["nan_lr"] = refused(lambda: trainer.train_step(batch))
    group["lr"] = math.inf if rank == 1 else lr
    result["inf_lr_on_rank_1"] = refused(lambda: trainer.train_step(batch))
    group["lr"] = lr
    layout = trainer.layout
    spec = layout.specs["norm.weight"]
    saved = layout.shard.detach().clone()
    with torch.no_grad():
        for a, b in layout.in_shard([(spec.offset, spec.offset + spec.numel)], layout.rank):
            layout.shard[a:b] = 3e38  # finite, but the logits overflow
    huge = trainer.full_state_dict()
    result["loss_overflow"] = refused(lambda: trainer.train_step(batch))
    result["huge_unchanged"] = unchanged(huge, trainer)
    with torch.no_grad():
        layout.shard.copy_(saved)
    result["unchanged"] = unchanged(before, trainer)
    result["files_unchanged"] = files(tmp) == disk
    stats = trainer.train_step(batch)
    result["then_trains"] = math.isfinite(stats.loss) and not unchanged(before, trainer)
    return result


def no_parameters(trainer, tmp: Path, rank: int) -> dict:
    """A model without parameters: a one-line ``ValueError`` naming it, before anything is captured."""
    import hcompile

    class Constant(torch.nn.Module):
        def forward(self, ids):
            return torch.nn.functional.one_hot(ids, 64).float()

    return {"refused": refused(lambda: hcompile.compile(Constant()))}


def checkpoint_piece(trainer, tmp: Path, rank: int) -> dict:
    """A rank file whose first parameter piece is rewritten as float64, then with one element more, its
    checksum and size recomputed in ``meta.json``: a ``CheckpointError`` on every rank naming the piece, with
    the weights and the files as they were."""
    from safetensors.torch import load_file, save_file

    ckpt = tmp / "pieces"
    trainer.save(str(ckpt), step=5, data_position=5)
    version = ckpt / (ckpt / "LATEST").read_text().strip()
    before, result = trainer.full_state_dict(), {}
    for kind in ("dtype", "length"):
        dist.barrier()
        if rank == 0:
            file = version / "rank1.safetensors"
            tensors = load_file(str(file))
            key = next(k for k in sorted(tensors) if k.startswith("param/"))
            piece = tensors[key]
            piece = piece.float()  # as saved, before the other kind's change
            tensors[key] = piece.double() if kind == "dtype" else torch.cat([piece, piece[:1]])
            save_file(tensors, str(file))
            meta = json.loads((version / "meta.json").read_text())
            meta["files"]["rank1.safetensors"] = {"sha256": hashlib.sha256(file.read_bytes()).hexdigest(),
                                                  "bytes": file.stat().st_size}
            (version / "meta.json").write_text(json.dumps(meta))
        dist.barrier()
        disk = files(ckpt)
        result[kind] = refused(lambda: trainer.load(str(ckpt)))
        result[f"{kind}_files_unchanged"] = files(ckpt) == disk
    result["unchanged"] = unchanged(before, trainer)
    return result


def lock(trainer, tmp: Path, rank: int) -> dict:
    """A save into a folder whose lock another save holds (here rank 0 holds it through a file of its own): the
    same ``CheckpointError`` on every rank naming the holder, the folder unchanged; a lock file left by a process
    that is gone is taken over, and removed when the save ends."""
    from runtime.checkpoint import LOCK, folder_lock

    folder = tmp / "locked"
    trainer.save(str(folder), step=6, data_position=6)
    disk = files(folder)
    dist.barrier()
    with folder_lock(folder) if rank == 0 else contextlib.nullcontext():
        dist.barrier()
        error = refused(lambda: trainer.save(str(folder), step=7, data_position=7))
        dist.barrier()
    dist.barrier()  # rank 0 has let go of the lock
    unchanged_disk = files(folder) == disk
    if rank == 0:
        gone = subprocess.Popen(["true"])
        gone.wait()
        (folder / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": gone.pid, "since": 0}))
    dist.barrier()
    stale = refused(lambda: trainer.save(str(folder), step=8, data_position=8))
    return {"refused": error, "pid": os.getpid(), "host": socket.gethostname(), "unchanged": unchanged_disk,
            "stale_taken_over": stale, "latest": (folder / "LATEST").read_text().strip(),
            "lock_left": (folder / LOCK).exists()}


CASES = {"export": export, "disk-full": disk_full, "non-finite": non_finite, "no-parameters": no_parameters,
         "checkpoint-piece": checkpoint_piece, "lock": lock}


def run(trainer, tmp: str, rank: int) -> None:
    """Every case in order, on every rank (the collective ones in step), each printing its line."""
    for name, case in CASES.items():
        say(name, rank, case(trainer, Path(tmp), rank))
