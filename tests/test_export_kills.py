"""A kill at any moment of an export leaves nothing that outlives the next export: ``save_pretrained`` runs in a
forked child that SIGKILLs itself before its k-th file-system step (a write is left torn), for k over the
export's steps; then ``hcompile.export.recover`` (or the next export alone) leaves the target equal to the export
before or the one killed, complete (every file its record lists, the config, the same tensors), the user's files
untouched and no hidden staging folder or lock file beside it. The default tier kills at a handful of moments
per case (the first step, a torn shard, the move into place); ``make test-full`` at every step."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402
from tiers import FULL  # noqa: E402

import hcompile.export as export  # noqa: E402
from hcompile.export import RECORD, ExportError, recover, save_pretrained  # noqa: E402
from runtime.fixed_layout import FixedLayout  # noqa: E402

USER = {"notes.txt": b"mine\n", "model_backup.safetensors": b"a backup of mine\n"}
STEPS = ("rename", "replace", "unlink", "rmdir", "mkdir", "fsync")
CASES = {  # name: (the export already in the target, or None: no target yet; the killed export's shard size)
    "fresh": (None, "20KB"),
    "shards-over-one": ("5GB", "20KB"),
    "one-over-shards": ("20KB", "5GB"),
}


def _model_and_layout():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=True, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg)
    return model, FixedLayout.from_tensors(dict(model.named_parameters()), 0, 1)


def _killed_export(model, layout, out: Path, size: str, kill_at: int, log: Path) -> int:
    """Export ``layout`` + 1 in a forked child that SIGKILLs itself before its ``kill_at``-th step (after
    writing half of a shard, for a shard write); the steps it took go to ``log``. Returns the child's status."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            steps = []

            def step(kind):
                steps.append(kind)
                log.write_text(json.dumps(steps))
                return len(steps) == kill_at

            def counted(kind, real):
                def call(*args, **kwargs):
                    if step(kind):
                        os.kill(os.getpid(), signal.SIGKILL)
                    return real(*args, **kwargs)
                return call

            for kind in STEPS:
                setattr(os, kind, counted(kind, getattr(os, kind)))
            real_save = export.save_file

            def save_file(tensors, file, metadata=None):
                killed = step("save_file")
                real_save(tensors, file, metadata=metadata)
                if killed:  # a torn write: half the shard on disk
                    os.truncate(file, os.path.getsize(file) // 2)
                    os.kill(os.getpid(), signal.SIGKILL)

            export.save_file = save_file
            with torch.no_grad():
                layout.shard.add_(1.0)
            save_pretrained(model, layout, out, max_shard_size=size)
            os._exit(0)
        except BaseException:  # noqa: BLE001
            os._exit(3)
    deadline = time.monotonic() + 120
    while True:  # a child that hangs (a lock held by a thread at the fork) fails the test, not the suite
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the exporting child did not end (killing before step {kill_at})")
        time.sleep(0.01)


def _held(out: Path, states: dict[str, dict], user: bool = True) -> str | None:
    """Which export ``out`` holds whole (every file its record lists, of that size, the config, exactly
    those tensors, nothing else of an export's; the ``user``'s files beside them), or None."""
    record = json.loads((out / RECORD).read_text())["files"]
    expected = sorted([*record, RECORD, *(USER if user else ())])
    assert sorted(p.name for p in out.iterdir()) == expected, sorted(os.listdir(out))
    assert all((out / f).stat().st_size == n for f, n in record.items())
    assert {"config.json", "generation_config.json"} <= set(record)
    tensors = {}
    for name in record:
        if name.endswith(".safetensors"):
            tensors.update(load_file(out / name))
    if "model.safetensors.index.json" in record:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(tensors) and set(index["weight_map"].values()) <= set(record)
    for which, state in states.items():
        if set(tensors) == set(state) and all(torch.equal(tensors[k], v) for k, v in state.items()):
            return which
    return None


def _beside(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith(".out.export-"))


def _moves(steps: list[str]) -> list[int]:
    """The steps (1-based) of the move into place: the renames after the last shard was written."""
    last_shard = max(i + 1 for i, s in enumerate(steps) if s == "save_file")
    return [i + 1 for i, s in enumerate(steps) if s == "rename" and i + 1 > last_shard]


def _moments(steps: list[str]) -> list[tuple[int, bool]]:
    """(step to kill before, whether ``recover`` runs before the next export): at every step, alternately
    (``make test-full``); or at a handful, each both ways: the first step, a torn last shard, the first, a
    middle and the last rename of the move into place, the step after it, the last step."""
    if FULL:
        return [(k, bool(k % 2)) for k in range(1, len(steps) + 1)]
    moves = _moves(steps)
    last_shard = max(i + 1 for i, s in enumerate(steps) if s == "save_file")
    picked = sorted({1, last_shard, moves[0], moves[len(moves) // 2], moves[-1], moves[-1] + 2, len(steps)})
    return [(k, first) for k in picked for first in (True, False)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_kill_at_any_moment_leaves_the_old_or_the_new_export(tmp_path, case):
    before, size = CASES[case]
    model, layout = _model_and_layout()
    a = layout.full_state_dict()
    states = {"old": a, "new": {k: v + 1.0 for k, v in a.items()}, "next": {k: v + 3.0 for k, v in a.items()}}

    def trial(folder: Path, kill_at: int) -> tuple[int, list[str]]:
        folder.mkdir()
        out = folder / "out"
        if before is not None:
            out.mkdir()
            for name, data in USER.items():
                (out / name).write_bytes(data)
            save_pretrained(model, layout, out, max_shard_size=before)
        log = folder / "steps.json"
        status = _killed_export(model, layout, out, size, kill_at, log)
        steps = json.loads(log.read_text()) if log.exists() else []
        log.unlink(missing_ok=True)
        return status, steps

    status, steps = trial(tmp_path / "count", 10 ** 9)
    assert os.WEXITSTATUS(status) == 0 and len(steps) > 10, (status, steps)
    moves = _moves(steps)
    # the old export stays until the journal exists (written after the folder .replaced is made); from then on
    # the new one is finished; with no target before, the one rename of the staging folder makes it
    switch = moves[0] if before is None else max(i + 1 for i, s in enumerate(steps[:moves[0]]) if s == "mkdir")
    finished = 0
    for k, recover_first in _moments(steps):
        folder = tmp_path / f"k{k:03d}-{int(recover_first)}"
        status, _ = trial(folder, k)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (k, status)
        out = folder / "out"
        if recover_first:  # recover alone (as before a load): the old export or the new one, whole
            done = recover(out)
            finished += any("finished" in line for line in done)
            assert _beside(folder) == [], (k, steps[k - 1])
            if before is None and k <= switch:
                assert not out.exists(), k  # killed before the folder was moved into place: still no export
            else:
                assert _held(out, states, before is not None) == ("new" if k > switch else "old"), (k, steps[k - 1])
        saved = layout.shard.detach().clone()
        with torch.no_grad():  # the next export, alone, settles what was left and writes its own
            layout.shard.add_(3.0)
        try:
            save_pretrained(model, layout, out, max_shard_size=size)
        finally:
            with torch.no_grad():
                layout.shard.copy_(saved)
        assert _held(out, states, before is not None) == "next" and _beside(folder) == [], (k, steps[k - 1])
        assert before is None or all((out / n).read_bytes() == d for n, d in USER.items())
    assert before is None or finished  # an interrupted move was rolled forward
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert torch.equal(loaded.model.norm.weight.detach(), states["next"]["model.norm.weight"])


def test_live_exports_are_left_alone_and_dead_ones_removed(tmp_path):
    model, layout = _model_and_layout()
    out = tmp_path / "out"
    save_pretrained(model, layout, out)
    live = tmp_path / ".out.export-1-abc"  # a live export: its lock file's flock is held
    live.mkdir()
    (live / "model.safetensors").write_bytes(b"being written")
    fd = os.open(tmp_path / ".out.export-1-abc.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f".out.export-{int(gone.stdout)}-1f"  # an earlier version's, without a lock file
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"a whole model copy")
    other = tmp_path / ".other.export-1-abc"  # another target's: not this one's to settle
    other.mkdir()
    save_pretrained(model, layout, out)
    assert _beside(tmp_path) == [".out.export-1-abc", ".out.export-1-abc.lock"] and other.is_dir()
    os.close(fd)  # its process is gone: the flock goes with it
    assert len(recover(out)) == 1 and _beside(tmp_path) == [] and other.is_dir()


def test_symbolic_links_are_refused_by_name(tmp_path):
    model, layout = _model_and_layout()
    out = tmp_path / "out"
    save_pretrained(model, layout, out)
    mine = tmp_path / "my_config.json"
    mine.write_text("the user's own")
    (out / "config.json").unlink()
    (out / "config.json").symlink_to(mine)
    before = sorted(os.listdir(out))
    with pytest.raises(ExportError, match=r"config.json' is a symbolic link where the export writes its own"):
        save_pretrained(model, layout, out)
    assert sorted(os.listdir(out)) == before and mine.read_text() == "the user's own"
    assert _beside(tmp_path) == []
    (out / "config.json").unlink()
    elsewhere = tmp_path / "data"
    elsewhere.mkdir()
    (elsewhere / "keep.bin").write_bytes(b"keep")
    (tmp_path / ".out.export-1-ab").symlink_to(elsewhere)
    with pytest.raises(ExportError, match=r"\.out\.export-1-ab' is not a folder an export made"):
        save_pretrained(model, layout, out)
    assert (elsewhere / "keep.bin").read_bytes() == b"keep" and (tmp_path / ".out.export-1-ab").is_symlink()


def test_without_flock_the_lock_file_names_the_owner(tmp_path, monkeypatch):
    """On a file system without ``flock`` (Lustre without it, some FUSE ones) the lock file alone decides: its
    owner on this host running with the start time it recorded keeps its folder; a dead pid, a pid reused by
    a later process (another start time) or an unreadable lock file left over a minute does not; an owner on
    another host cannot be asked, so it does."""
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(export.fcntl, "flock", no_flock)
    model, layout = _model_and_layout()
    out = tmp_path / "out"
    save_pretrained(model, layout, out)  # the export itself works without flock
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host, me = socket.gethostname(), os.getppid()  # pytest's parent: alive for the whole test
    owners = {"live": {"host": host, "pid": me, "start": export._start_time(me)},
              "other-host": {"host": host + "-elsewhere", "pid": 1, "start": None},
              "dead": {"host": host, "pid": int(gone.stdout), "start": None},
              "reused": {"host": host, "pid": me, "start": "another-boot:1"}}
    for i, owner in enumerate([*owners.values(), None]):
        stem = tmp_path / f".out.export-{i + 1}-a{i}"
        stem.mkdir()
        (stem / "model.safetensors").write_bytes(b"partial")
        Path(f"{stem}.lock").write_text(json.dumps(owner) if owner else "")
    old = time.time() - 120
    os.utime(tmp_path / ".out.export-5-a4.lock", (old, old))
    assert len(recover(out)) == 3
    assert _beside(tmp_path) == [".out.export-1-a0", ".out.export-1-a0.lock", ".out.export-2-a1",
                                 ".out.export-2-a1.lock"]
