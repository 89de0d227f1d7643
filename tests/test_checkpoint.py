"""Checkpoints: a resumed run continues exactly (same losses, same parameters), on another number of ranks too
(4 -> 2); a damaged file, a missing checkpoint or one of another model is the same error on every rank with
nothing changed; a crash while saving leaves the previous checkpoint current; loading runs no pickle."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from dist_util import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def _trainer(strategies=("4x(tp1)", "2x(tp2)", "1x(tp2)+2x(tp1)"), **kwargs):
    import hcompile
    from hcompile.models import Llama, LlamaConfig, init_weights_

    options = {"optimizer_kwargs": {"lr": 1e-2, "weight_decay": 0.1}, **kwargs}
    return hcompile.compile(init_weights_(Llama(LlamaConfig(vocab=64)), seed=0)).trainer(loss="causal_lm",
                            optimizer=torch.optim.AdamW, strategies=strategies if strategies == "auto" else
                            list(strategies), tokens_per_rank=48, calibrate=False, **options)


def _batches(n=6):
    g = torch.Generator().manual_seed(3)
    return [[torch.randint(0, 64, (int(k),), generator=g) for k in torch.randint(2, 60, (7,), generator=g)]
            for _ in range(n)]


def _save_and_continue(rank, world, ckpt):
    data, trainer = _batches(), _trainer()
    losses = [trainer.train_step(b).loss for b in data[:3]]
    trainer.save(ckpt, step=3, data_position=3)
    saved = trainer.full_state_dict()
    losses += [trainer.train_step(b).loss for b in data[3:]]
    return losses, saved, trainer.full_state_dict()


def _resume(rank, world, ckpt, strategies):
    data, trainer = _batches(), _trainer(strategies)
    meta = trainer.load(ckpt)
    state = trainer.full_state_dict()
    losses = [trainer.train_step(b).loss for b in data[meta["data_position"]:]]
    return meta["step"], state, losses, trainer.full_state_dict()


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """A checkpoint saved on 4 ranks after 3 steps, and the run's losses and parameters (one run for the module's
    tests; they read it, or damage their own copies)."""
    tmp = tmp_path_factory.mktemp("four")
    ckpt = str(tmp / "ckpt")
    return ckpt, run_ranks(4, tmp, _save_and_continue, ckpt)[0]


def test_exact_continuation_and_resharding_to_fewer_ranks(tmp_path, four_ranks):
    ckpt, (losses, saved, final) = four_ranks
    step, _, resumed, resumed_final = run_ranks(4, tmp_path, _resume, ckpt, "auto")[0]
    assert step == 3 and resumed == losses[3:]  # the checkpoint's pool, the same plans: bit for bit
    for n, p in final.items():
        assert torch.equal(resumed_final[n], p), n
    for _, state, two_ranks, two_final in run_ranks(2, tmp_path, _resume, ckpt, ("2x(tp1)", "1x(tp2)")):
        assert all(torch.equal(state[n], p) for n, p in saved.items())  # re-cut for 2 ranks: the same values
        assert two_ranks == pytest.approx(losses[3:], rel=1e-5)  # other ranks, other plans: the same training
        for n, p in final.items():
            torch.testing.assert_close(two_final[n], p, rtol=1e-4, atol=1e-5)
    meta = json.loads((Path(ckpt) / (Path(ckpt) / "LATEST").read_text().strip() / "meta.json").read_text())
    assert meta["world_size"] == 4 and set(meta["extra"]) == {"pool", "fixed"}


def _damaged_then_override(rank, world, ckpt):
    """Loads of damaged and missing checkpoints (errors, whether anything changed), then a checkpoint of this
    run resumed with other explicit arguments (what the second trainer runs with, what was logged)."""
    from runtime.checkpoint import CheckpointError

    trainer = _trainer(("2x(tp1)",))
    trainer.train_step(_batches(1)[0])
    before = trainer.full_state_dict()
    errors = []
    for target in (ckpt, ckpt + "-missing", ckpt + "-flipped"):
        try:
            trainer.load(target)
            errors.append(None)
        except CheckpointError as exc:
            errors.append(str(exc))
    unchanged = all(torch.equal(before[n], t) for n, t in trainer.full_state_dict().items())
    return (errors, unchanged), _override(trainer, ckpt + "-own")


@pytest.fixture(scope="module")
def two_ranks(four_ranks, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two")
    ckpt = str(tmp / "ckpt")
    shutil.copytree(four_ranks[0], ckpt)
    shutil.copytree(ckpt, ckpt + "-flipped")
    version = Path(ckpt) / (Path(ckpt) / "LATEST").read_text().strip()
    victim = version / "rank2.safetensors"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    flipped = Path(ckpt + "-flipped") / version.name / "rank1.safetensors"
    _flip(flipped, next(k for k in _keys(flipped) if k.startswith("param/")), bits=1)
    return ckpt, run_ranks(2, tmp, _damaged_then_override, ckpt, timeout_s=180)


def test_a_truncated_file_fails_every_rank_fast_and_changes_nothing(two_ranks):
    _, ((e0, unchanged0), _), ((e1, unchanged1), _) = two_ranks[0], *two_ranks[1]
    assert e0 == e1 and unchanged0 and unchanged1
    assert "loading the checkpoint failed on rank" in e0[0] and "rank2" not in e0[1]
    assert "no checkpoint at" in e0[1]
    assert "rank1.safetensors is damaged: its sha256 is" in e0[2], e0[2]  # one bit flipped in a weight


CRASH = textwrap.dedent("""
    import os, sys, torch
    import runtime.checkpoint as ckpt_mod
    from runtime.fixed_layout import FixedLayout
    layout = FixedLayout.from_tensors({"w": torch.arange(10.0)}, 0, 1)
    opt = torch.optim.SGD([layout.shard], lr=0.1)
    ckpt_mod.save_checkpoint(sys.argv[1], layout, opt, step=1, data_position=1)
    with torch.no_grad():
        layout.shard.add_(100.0)
    real_replace = os.replace
    def crash(*args):  # the new version is written and flushed; the process dies before LATEST moves
        os._exit(9)
    os.replace = crash
    ckpt_mod.save_checkpoint(sys.argv[1], layout, opt, step=2, data_position=2)
""")


def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MASTER_ADDR", None)
    proc = subprocess.run([sys.executable, "-c", CRASH, str(ckpt)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 9, proc.stderr[-2000:]
    from runtime.checkpoint import load_checkpoint
    from runtime.fixed_layout import FixedLayout

    layout = FixedLayout({"w": (10,)}, 0, 1)
    meta = load_checkpoint(ckpt, layout, torch.optim.SGD([layout.shard], lr=0.1))
    assert meta["step"] == 1 and torch.equal(layout.shard.detach(), torch.arange(10.0))


def test_loading_executes_no_pickle(tmp_path):
    """The files are safetensors and JSON: a pickle planted as a rank file is a load error, not code run."""
    from runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from runtime.fixed_layout import FixedLayout

    layout = FixedLayout.from_tensors({"w": torch.ones(4)}, 0, 1)
    opt = torch.optim.SGD([layout.shard], lr=0.1)
    save_checkpoint(tmp_path, layout, opt, step=1, data_position=0)
    version = tmp_path / (tmp_path / "LATEST").read_text().strip()
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    import pickle

    (version / "rank0.safetensors").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match="loading the checkpoint failed on rank 0"):
        load_checkpoint(tmp_path, layout, opt)
    assert not marker.exists()


def test_another_model_is_refused():
    from runtime.checkpoint import CheckpointError, _check_layout
    from runtime.fixed_layout import FixedLayout

    layout = FixedLayout({"w": (4, 2)}, 0, 1)
    meta = {"params": {"w": {"shape": [2, 4], "split_dim": None}}, "optimizer": {"class": "SGD"}}
    with pytest.raises(CheckpointError, match="parameter 'w' is \\(2, 4\\)"):
        _check_layout(meta, layout, torch.optim.SGD([layout.shard], lr=0.1), "x")
    meta["params"] = {"v": {"shape": [4, 2], "split_dim": None}}
    with pytest.raises(CheckpointError, match="missing \\['w'\\], unknown \\['v'\\]"):
        _check_layout(meta, layout, torch.optim.SGD([layout.shard], lr=0.1), "x")
    # the same parameters in another flat order (a checkpoint of the layout before its regions): pieces are named
    two = FixedLayout({"w": (4, 2), "n": (3,)}, 0, 1, split_dims={"w": 1})
    assert list(two.specs) == ["n", "w"]
    meta["params"] = {"w": {"shape": [4, 2], "split_dim": 1}, "n": {"shape": [3], "split_dim": None}}
    _check_layout(meta, two, torch.optim.SGD([two.shard], lr=0.1), "x")


# --- world-of-one checks of what save and load refuse, on a layout and optimiser of their own ---------------


def _keys(file: Path) -> list[str]:
    raw = file.read_bytes()
    return [k for k in json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")]) if k != "__metadata__"]


def _flip(file: Path, key: str, bits: int = 0, nbytes: int = 0) -> None:
    """Flip the lowest bit of the first byte (``bits=1``) or every bit of the first ``nbytes`` bytes of the
    data of tensor ``key`` inside a safetensors file; the header stays intact."""
    raw = bytearray(file.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    a, b = json.loads(raw[8:8 + n])[key]["data_offsets"]
    assert b - a >= max(nbytes, 1)
    for i in range(8 + n + a, 8 + n + a + max(nbytes, bits)):
        raw[i] ^= 0x01 if bits else 0xFF
    file.write_bytes(bytes(raw))


def _adamw():
    from runtime.fixed_layout import FixedLayout

    g = torch.Generator().manual_seed(0)
    layout = FixedLayout.from_tensors({"w": torch.randn(16, 8, generator=g), "b": torch.randn(24, generator=g)}, 0, 1)
    opt = torch.optim.AdamW([layout.shard], lr=0.1, weight_decay=0.1)
    layout.shard.grad = torch.randn(layout.shard_numel, generator=g)
    opt.step()
    return layout, opt


def _version(path: Path) -> Path:
    return path / (path / "LATEST").read_text().strip()


@pytest.mark.parametrize("key, bits, nbytes", [("param/w/0", 1, 0), ("exp_avg_sq/w/0", 0, 64)])
def test_flipped_bytes_in_tensor_data_are_refused_with_nothing_changed(tmp_path, key, bits, nbytes):
    from runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    layout, opt = _adamw()
    save_checkpoint(tmp_path, layout, opt, step=1, data_position=0)
    _flip(_version(tmp_path) / "rank0.safetensors", key, bits=bits, nbytes=nbytes)
    fresh, fresh_opt = _adamw()
    with torch.no_grad():
        fresh.shard.mul_(2.0)
    before, state = fresh.shard.detach().clone(), fresh_opt.state_dict()["state"][0]["exp_avg_sq"].clone()
    with pytest.raises(CheckpointError, match="rank0.safetensors is damaged: its sha256 is"):
        load_checkpoint(tmp_path, fresh, fresh_opt)
    assert torch.equal(fresh.shard.detach(), before)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg_sq"], state)


def test_non_finite_values_are_refused_at_save_and_at_load(tmp_path):
    from safetensors.torch import load_file, save_file

    from runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    layout, opt = _adamw()
    save_checkpoint(tmp_path, layout, opt, step=1, data_position=0)
    first = _version(tmp_path)
    with torch.no_grad():
        layout.shard[20] = float("nan")  # inside 'w'
    with pytest.raises(CheckpointError, match="master weight of 'w' holds nan .*not saved"):
        save_checkpoint(tmp_path, layout, opt, step=2, data_position=0)
    assert _version(tmp_path) == first and sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", first.name]
    # a file written with an infinity and a checksum that matches it: the load still refuses it
    file = first / "rank0.safetensors"
    tensors = load_file(file)
    tensors["exp_avg_sq/b/0"][3] = float("inf")
    save_file(tensors, file)
    meta = json.loads((first / "meta.json").read_text())
    meta["files"]["rank0.safetensors"] = {"sha256": hashlib.sha256(file.read_bytes()).hexdigest(),
                                          "bytes": file.stat().st_size}
    (first / "meta.json").write_text(json.dumps(meta))
    fresh, fresh_opt = _adamw()
    before = fresh.shard.detach().clone()
    with pytest.raises(CheckpointError, match="optimizer state 'exp_avg_sq' of 'b' holds inf"):
        load_checkpoint(tmp_path, fresh, fresh_opt)
    assert torch.equal(fresh.shard.detach(), before)


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m.update(step="3"), "'step' is '3'"),
    (lambda m: m["pieces"].update(w=[["0", 0, 128]]), "'pieces.w' is"),
    (lambda m: m["pieces"].update(w=[[0, 0, 100]]), "'pieces.w' covers 100 of the parameter's 128 elements"),
    (lambda m: m["params"]["w"].update(shape="16x8"), "'params.w' is"),
    (lambda m: m["optimizer"]["param_groups"][0].update(lr="fast"), "param group 0 has lr='fast'"),
    (lambda m: m["optimizer"]["param_groups"][0].update(betas=[0.9]), "param group 0 has betas=\\[0.9\\]"),
    (lambda m: m["files"].pop("rank0.safetensors"), "lists no checksum for rank0.safetensors"),
    (lambda m: m["extra"].update(pool=["2x(tp1"], fixed="2x(tp1)"), None),  # the trainer's own, not this layer's
])
def test_an_edited_meta_json_is_a_checkpoint_error_at_load(tmp_path, edit, needle):
    from runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    layout, opt = _adamw()
    save_checkpoint(tmp_path, layout, opt, step=3, data_position={"epoch": 0})
    meta_file = _version(tmp_path) / "meta.json"
    meta = json.loads(meta_file.read_text())
    edit(meta)
    meta_file.write_text(json.dumps(meta))
    fresh, fresh_opt = _adamw()
    with torch.no_grad():
        fresh.shard.zero_()
    groups = [dict(g) for g in fresh_opt.param_groups]
    if needle is None:
        load_checkpoint(tmp_path, fresh, fresh_opt)
        return
    with pytest.raises(CheckpointError, match=needle):
        load_checkpoint(tmp_path, fresh, fresh_opt)
    assert not fresh.shard.detach().any() and [dict(g) for g in fresh_opt.param_groups] == groups


@pytest.mark.parametrize("position, needle", [
    ((3, 4), "data_position is a tuple, which JSON does not give back as it is; pass a list"),
    ({"epoch": float("nan")}, "data_position\\['epoch'\\] is nan"),
    ({1: 2}, "data_position has the key 1 \\(int\\)"),
    ({"cursor": torch.tensor(3)}, "data_position\\['cursor'\\] is a Tensor"),
])
def test_a_data_position_json_would_not_give_back_is_refused_at_save(tmp_path, position, needle):
    from runtime.checkpoint import CheckpointError, save_checkpoint

    layout, opt = _adamw()
    with pytest.raises(CheckpointError, match=needle):
        save_checkpoint(tmp_path / "ckpt", layout, opt, step=1, data_position=position)
    assert not (tmp_path / "ckpt").exists()


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_save_removes_only_its_own_versions(tmp_path, monkeypatch):
    from runtime.checkpoint import MARKER, save_checkpoint

    run = tmp_path / "run"
    for folder in ("tensorboard/events", "corpus", "v00000001-abc"):  # the last: a user's, without the marker
        (run / folder).mkdir(parents=True)
        (run / folder / "data.txt").write_text("keep me")
    (run / "notes.txt").write_text("keep me too")
    stale = run / ".v00000000-1.tmp"  # what a save that crashed left: its own
    stale.mkdir()
    (stale / MARKER).write_text("{}")
    theirs = _tree(run) - {stale.name, f"{stale.name}/{MARKER}"}
    layout, opt = _adamw()
    for step in range(1, 5):
        save_checkpoint(run, layout, opt, step=step, data_position=step)
    versions = sorted(p.name for p in run.iterdir() if (p / MARKER).is_file())
    assert len(versions) == 1 and versions[0] == _version(run).name  # keep=1: the current one
    assert theirs <= _tree(run) and not stale.exists()
    for step in range(5, 8):
        save_checkpoint(run, layout, opt, step=step, data_position=step, keep=2)
    versions = sorted(p.name for p in run.iterdir() if (p / MARKER).is_file())
    assert [v[:9] for v in versions] == ["v00000006", "v00000007"] and versions[-1] == _version(run).name
    assert theirs <= _tree(run)
    monkeypatch.chdir(run / "corpus")  # save(".") into a working directory with folders of its own
    before = _tree(run / "corpus")
    for step in range(3):
        save_checkpoint(".", layout, opt, step=step, data_position=step)
    assert before <= _tree(run / "corpus") and theirs <= _tree(run)
    with pytest.raises(Exception, match="keep must be a positive integer"):
        save_checkpoint(".", layout, opt, step=9, data_position=0, keep=0)


def _override(first, ckpt):
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("hcompile").addHandler(Keep())
    first.save(ckpt, step=1, data_position=1)  # 2x(tp1), lr 1e-2, weight decay 0.1
    second = _trainer(("1x(tp2)",), optimizer_kwargs={"lr": 5e-3})
    second.load(ckpt)
    group = second.optimizer.param_groups[0]
    stats = second.train_step(_batches(2)[1])
    return group["lr"], group["weight_decay"], stats.strategy, records


def test_explicit_arguments_win_over_the_checkpoint_with_one_logged_line(two_ranks):
    ckpt, results = two_ranks
    for rank, (_, (lr, weight_decay, strategy, records)) in enumerate(results):
        assert lr == 5e-3 and weight_decay == 0.1  # asked lr wins; weight decay, not asked, restored
        assert strategy == "1x(tp2,pp1)"  # asked, not the checkpoint's 2x(tp1)
        assert records == ([] if rank else ["resuming from %s: the explicit arguments replace what the checkpoint "
                                            "held (lr=0.01, strategies ['2x(tp1,pp1)'])" % (ckpt + "-own")])


def test_a_lock_file_without_flock_is_held_while_its_owner_may_run(tmp_path):
    """On a file system without ``flock`` the lock file alone decides: a process of this host that is gone, or
    this process, does not hold it; a live one or one on another host does."""
    import socket

    from runtime.checkpoint import LOCK, _held_elsewhere

    gone = subprocess.Popen(["true"])
    gone.wait()
    file, host = tmp_path / LOCK, socket.gethostname()
    for owner, held in (({"host": host, "pid": gone.pid}, False), ({"host": host, "pid": os.getpid()}, False),
                        ({"host": host, "pid": os.getppid()}, True), ({"host": host + "-other", "pid": 1}, True),
                        (None, False)):
        file.write_text(json.dumps(owner) if owner is not None else "")
        assert _held_elsewhere(file) is held, owner


# --- links where a save writes, kills during the clean-up, loads racing saves (issue 56) ------------------------


def _sgd(value: float = 1.0):
    from runtime.fixed_layout import FixedLayout

    layout = FixedLayout.from_tensors({"w": torch.full((8, 8), value)}, 0, 1)
    return layout, torch.optim.SGD([layout.shard], lr=0.1)


def _snapshot(root: Path) -> dict[str, str | bytes]:
    """Every entry under ``root`` (links not followed): a link's target, a file's bytes, a folder's mark."""
    out: dict[str, str | bytes] = {}
    for p in sorted(root.rglob("*")):
        key = str(p.relative_to(root))
        out[key] = ("-> " + os.readlink(p)) if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"
    return out


@pytest.mark.parametrize("name", [".hydraulis-lock", "LATEST"])
def test_a_symlink_where_a_save_writes_is_refused_by_name(tmp_path, name):
    """A link as the lock or as ``LATEST`` (to a user's file, or to a file that does not exist): the save is
    refused naming the link, the folder, the link and the user's file are unchanged and nothing is created."""
    import re

    from runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    ckpt, layout, opt = tmp_path / "ckpt", *_sgd()
    save_checkpoint(ckpt, layout, opt, step=1, data_position=1)
    victim, missing = tmp_path / "victim.txt", tmp_path / "missing.txt"
    victim.write_text("the user's notes\n")
    link = ckpt / name
    for target in (victim, missing):
        link.unlink(missing_ok=True)
        link.symlink_to(target)
        before = _snapshot(ckpt)
        with pytest.raises(CheckpointError, match=re.escape(f"'{link}' is a symbolic link; hydraulis does not write "
                                                            f"through links")):
            save_checkpoint(ckpt, layout, opt, step=2, data_position=2)
        assert _snapshot(ckpt) == before and os.readlink(link) == str(target)
        assert victim.read_text() == "the user's notes\n" and not missing.exists()
    if name == "LATEST":  # a load does not read through it either (nor quotes the file it points to)
        with pytest.raises(CheckpointError, match="is a symbolic link; hydraulis does not read LATEST through"):
            load_checkpoint(ckpt, layout, opt)


@pytest.mark.parametrize("planted", ["LATEST temporary", "version temporary", "version"])
def test_a_symlink_where_a_save_puts_its_temporaries_or_version_is_refused(tmp_path, monkeypatch, planted):
    """A link planted under the name the next save writes (``.LATEST.<v>.tmp``, ``.<v>.tmp``, ``<v>``), to a
    user's file or folder: refused naming it, the link and its target unchanged, the previous version current."""
    import re
    import time

    from runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    ckpt, layout, opt = tmp_path / "ckpt", *_sgd()
    save_checkpoint(ckpt, layout, opt, step=1, data_position=1)
    current = _version(ckpt).name
    user = tmp_path / "user"
    user.mkdir()
    (user / "data.txt").write_text("keep me")
    (tmp_path / "victim.txt").write_text("keep me too")
    monkeypatch.setattr(time, "time_ns", lambda: 0xABC)  # the next save's version: v00000002-abc
    link, target = {"LATEST temporary": (".LATEST.v00000002-abc.tmp", tmp_path / "victim.txt"),
                    "version temporary": (".v00000002-abc.tmp", user),
                    "version": ("v00000002-abc", user)}[planted]
    link = ckpt / link
    link.symlink_to(target)
    before, theirs = _snapshot(ckpt), _snapshot(tmp_path / "user")
    with pytest.raises(CheckpointError, match=re.escape(f"'{link}' is a symbolic link; hydraulis does not write")):
        save_checkpoint(ckpt, layout, opt, step=2, data_position=2)
    monkeypatch.undo()
    assert _snapshot(ckpt) == before and _snapshot(tmp_path / "user") == theirs
    assert (tmp_path / "victim.txt").read_text() == "keep me too" and _version(ckpt).name == current
    assert load_checkpoint(ckpt, layout, opt)["step"] == 1
    save_checkpoint(ckpt, layout, opt, step=3, data_position=3)  # a later save leaves the link alone
    assert link.is_symlink() and _snapshot(tmp_path / "user") == theirs


class _Killed(BaseException):
    """What stops a simulated kill: not an Exception, so no handler of the save catches it."""


def _kill_clean_up_at(monkeypatch, k: int | None) -> list[str]:
    """Make every save's clean-up (``_remove_old_versions``) stop dead at its ``k``-th change of the folder (a
    rename, unlink or rmdir), as a kill would (None: never). Returns the changes it made, in order."""
    import runtime.checkpoint as mod

    done: list[str] = []
    armed = [False]
    real = {n: getattr(os, n) for n in ("rename", "unlink", "rmdir")}

    def counted(name):
        def change(*args, **kwargs):
            if armed[0]:
                if k is not None and len(done) + 1 == k:
                    armed[0] = False
                    raise _Killed(f"killed at change {k}")
                done.append(f"{name} {args[0]}")
            return real[name](*args, **kwargs)
        return change

    for name in real:
        monkeypatch.setattr(os, name, counted(name))
    clean_up = mod._remove_old_versions

    def armed_clean_up(*args):
        armed[0] = True
        try:
            clean_up(*args)
        finally:
            armed[0] = False

    monkeypatch.setattr(mod, "_remove_old_versions", armed_clean_up)
    return done


def _old_versions(ckpt: Path, old: int):
    """A checkpoint with ``old`` versions (saved with keep=old) and a user's entries of deletion names (a
    non-empty ``.del`` folder without the marker, a link of that name) and a file: layout, optimiser, entries."""
    from runtime.checkpoint import save_checkpoint

    layout, opt = _sgd()
    for step in range(old):
        save_checkpoint(ckpt, layout, opt, step=step, data_position=step, keep=old)
    user = ckpt / ".v00000000-1.del"
    user.mkdir()
    (user / "data.txt").write_text("keep me")
    (ckpt / ".v00000000-2.del").symlink_to(user)
    (ckpt / "notes.txt").write_text("keep me too")
    return layout, opt, [user.name, ".v00000000-2.del", "notes.txt"]


def _killed_clean_ups(tmp_path, monkeypatch, old: int, kills: list[tuple[int, ...]] | None = None) -> int:
    """For each kill sequence (None: one kill at every change the clean-up makes): a folder of ``old`` versions,
    a save whose clean-up is killed at change ``k1``, a save killed at ``k2`` (...), then a save that runs; each
    killed save's version is current and loads, and the folder ends holding exactly ``LATEST``, its version and
    the user's entries. Returns the number of changes one clean-up makes."""
    from runtime.checkpoint import load_checkpoint, save_checkpoint

    layout, opt, _ = _old_versions(tmp_path / "dry", old)
    changes = _kill_clean_up_at(monkeypatch, None)
    save_checkpoint(tmp_path / "dry", layout, opt, step=old, data_position=old)
    monkeypatch.undo()
    for n, moments in enumerate(kills or [(k,) for k in range(1, len(changes) + 1)]):
        ckpt = tmp_path / f"k{n}"
        layout, opt, theirs = _old_versions(ckpt, old)
        step = old
        for k in moments:
            with torch.no_grad():
                layout.shard.fill_(step)
            _kill_clean_up_at(monkeypatch, k)
            with pytest.raises(_Killed):
                save_checkpoint(ckpt, layout, opt, step=step, data_position=step)
            monkeypatch.undo()
            fresh, fresh_opt = _sgd(0.0)  # published before the clean-up: the killed save's version is current
            assert load_checkpoint(ckpt, fresh, fresh_opt)["step"] == step
            assert bool((fresh.shard.detach() == step).all()), (moments, k)
            step += 1
        save_checkpoint(ckpt, layout, opt, step=step, data_position=step)
        names = sorted(p.name for p in ckpt.iterdir())
        assert names == sorted(["LATEST", _version(ckpt).name, *theirs]), (moments, names)
        assert (ckpt / theirs[0] / "data.txt").read_text() == "keep me" and (ckpt / theirs[1]).is_symlink()
    return len(changes)


def test_a_kill_at_any_moment_of_the_clean_up_is_finished_by_the_next_save(tmp_path, monkeypatch):
    """Removing an old version (keep=) killed before each of its changes (the rename to ``.<v>.del``, each
    file, the marker, the folder, and the attempts on the user's entries): the killed save's version is current
    and loads, and the next save removes the rest, so the folder holds only ``LATEST``, the current version and
    the user's entries. Every moment of one old version here; under ``tests/tiers.py`` FULL, every moment of
    three old versions and two kills in a row."""
    from tiers import FULL

    from runtime.checkpoint import save_checkpoint

    ckpt, layout, opt = tmp_path / "plain", *_sgd()
    save_checkpoint(ckpt, layout, opt, step=0, data_position=0)
    changes = _kill_clean_up_at(monkeypatch, None)
    save_checkpoint(ckpt, layout, opt, step=1, data_position=1)
    monkeypatch.undo()
    assert len(changes) == 5 and changes[0].startswith("rename") and changes[-1].startswith("rmdir"), changes
    assert changes[-2] == "unlink .hydraulis-version", changes  # the marker last: the folder stays recognisable
    assert _killed_clean_ups(tmp_path / "one", monkeypatch, 1) == 7  # 5, and rmdir tried on the user's two
    if FULL:
        assert _killed_clean_ups(tmp_path / "three", monkeypatch, 3) == 17
        _killed_clean_ups(tmp_path / "twice", monkeypatch, 3, [(a, b) for a in (1, 4, 7, 12, 17) for b in (1, 3, 5)])


KILLER = textwrap.dedent("""
    import os, signal, sys, torch
    import runtime.checkpoint as mod
    from runtime.fixed_layout import FixedLayout
    layout = FixedLayout.from_tensors({"w": torch.ones(64)}, 0, 1)
    opt = torch.optim.SGD([layout.shard], lr=0.1)
    mod.save_checkpoint(sys.argv[1], layout, opt, step=1, data_position=1)
    k, changes, real = int(sys.argv[2]), [0], os.unlink
    def unlink(*args, **kwargs):  # a SIGKILL before the k-th file of the old version is removed
        changes[0] += 1
        if changes[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    clean_up = mod._remove_old_versions
    def killing(*args):
        os.unlink = unlink
        clean_up(*args)
    mod._remove_old_versions = killing
    mod.save_checkpoint(sys.argv[1], layout, opt, step=2, data_position=2)
""")


def test_a_process_killed_while_removing_an_old_version_leaves_what_the_next_save_removes(tmp_path):
    """A real SIGKILL after the old version was renamed and one of its files removed (the lock file stays): the
    next save takes the lock over and leaves ``LATEST`` and its version only."""
    from runtime.checkpoint import LOCK, MARKER, save_checkpoint

    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MASTER_ADDR", None)
    proc = subprocess.run([sys.executable, "-c", KILLER, str(ckpt), "2"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    left = sorted(p.name for p in ckpt.iterdir())
    deleting = [n for n in left if n.endswith(".del")]
    assert len(deleting) == 1 and LOCK in left and (ckpt / deleting[0] / MARKER).is_file(), left
    layout, opt = _sgd()
    save_checkpoint(ckpt, layout, opt, step=3, data_position=3)
    assert sorted(p.name for p in ckpt.iterdir()) == ["LATEST", _version(ckpt).name]


def _racing_saves(read_meta, ckpt, saves, last, per_read=1):
    """``_read_meta`` that, after reading, runs ``per_read`` saves (keep=1) into ``ckpt`` as another process
    would between a load's reading meta.json and its rank files: steps ``saves[0]``, ``saves[0] + 1``, ... up to
    ``last[0]``, every value equal to the step (both lists may be changed by the caller between loads)."""
    from runtime.checkpoint import save_checkpoint

    def racing(folder):
        meta = read_meta(folder)
        for _ in range(per_read):
            if saves[0] <= last[0]:
                other, other_opt = _sgd(float(saves[0]))
                save_checkpoint(ckpt, other, other_opt, step=saves[0], data_position=saves[0])
                saves[0] += 1
        return meta
    return racing


def test_a_save_leaves_the_version_a_load_reads_to_the_next_save(tmp_path, monkeypatch):
    """A load holds a shared ``flock`` on its version's marker while it reads: saves (keep=1) that run meanwhile
    leave that version in place, the load reads it whole, and the next save removes it."""
    import runtime.checkpoint as mod
    from runtime.checkpoint import load_checkpoint, save_checkpoint

    ckpt, layout, opt = tmp_path / "ckpt", *_sgd(1.0)
    save_checkpoint(ckpt, layout, opt, step=1, data_position=1)
    first = _version(ckpt).name
    monkeypatch.setattr(mod, "_read_meta", _racing_saves(mod._read_meta, ckpt, [2], [3], per_read=2))
    fresh, fresh_opt = _sgd(0.0)
    assert load_checkpoint(ckpt, fresh, fresh_opt)["step"] == 1 and bool((fresh.shard.detach() == 1.0).all())
    monkeypatch.undo()
    assert first in {p.name for p in ckpt.iterdir()}  # kept while it was read
    save_checkpoint(ckpt, layout, opt, step=4, data_position=4)
    assert sorted(p.name for p in ckpt.iterdir()) == ["LATEST", _version(ckpt).name]


def _without_flock(folder, how):
    """``_marker_lock`` on a file system without ``flock``: the marker opened and nothing held."""
    os.close(os.open(folder / ".hydraulis-version", os.O_RDONLY | os.O_NOFOLLOW))
    return None


def test_a_load_whose_version_a_save_removes_meanwhile_loads_the_new_one(tmp_path, monkeypatch):
    """Without ``flock`` (nothing holds the version a load reads), a save (keep=1) that runs while a load reads
    ``meta.json`` removes the version being read: the load reads the version ``LATEST`` names now. A rank file
    missing while ``LATEST`` still names its version is damage, reported as before; a version removed on every
    try is a bounded error that says to load again."""
    import runtime.checkpoint as mod
    from runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    monkeypatch.setattr(mod, "_marker_lock", _without_flock)
    ckpt, layout, opt = tmp_path / "ckpt", *_sgd(1.0)
    save_checkpoint(ckpt, layout, opt, step=1, data_position=1)
    read_meta, saves, last = mod._read_meta, [2], [3]
    racing = _racing_saves(read_meta, ckpt, saves, last)
    monkeypatch.setattr(mod, "_read_meta", racing)
    fresh, fresh_opt = _sgd(0.0)
    assert load_checkpoint(ckpt, fresh, fresh_opt)["step"] == 3  # lost to the saves of 2 and 3, then read 3
    assert bool((fresh.shard.detach() == 3.0).all())
    monkeypatch.setattr(mod, "_read_meta", read_meta)
    (_version(ckpt) / "rank0.safetensors").unlink()
    with pytest.raises(CheckpointError, match="loading the checkpoint failed on rank 0: reading .*FileNotFound"):
        load_checkpoint(ckpt, fresh, fresh_opt)
    assert bool((fresh.shard.detach() == 3.0).all())
    save_checkpoint(ckpt, layout, opt, step=4, data_position=4)
    saves[0], last[0] = 5, 10**6  # every try loses
    monkeypatch.setattr(mod, "_read_meta", racing)
    with pytest.raises(CheckpointError, match="8 versions in a row were removed by concurrent saves while being "
                                              "read; load again"):
        load_checkpoint(ckpt, fresh, fresh_opt)
    assert bool((fresh.shard.detach() == 3.0).all())


def _load_while_rank1_sees_its_version_replaced(rank, world, ckpt, newer):
    """Load on 2 ranks; rank 1, once it read ``meta.json``, points ``LATEST`` at ``newer`` and removes the
    version being read, as a concurrent save would: (step, every value equal to it, the versions tried)."""
    import runtime.checkpoint as mod
    from runtime.fixed_layout import FixedLayout

    read_meta, tries, real = mod._read_meta, [0], mod._load_version

    def racing(folder):
        meta = read_meta(folder)
        if rank == 1 and tries[0] == 1:
            (Path(ckpt) / ".LATEST.swap").write_text(newer + "\n")
            os.replace(Path(ckpt) / ".LATEST.swap", Path(ckpt) / "LATEST")
            os.rename(folder, folder.parent / f".{folder.name}.del")
            mod._remove_own(folder.parent / f".{folder.name}.del")
        return meta

    def counted(*args):
        tries[0] += 1
        return real(*args)

    mod._read_meta, mod._load_version = racing, counted
    layout = FixedLayout.from_tensors({"w": torch.zeros(8, 8)}, rank, world)
    meta = mod.load_checkpoint(ckpt, layout, torch.optim.SGD([layout.shard], lr=0.1))
    return meta["step"], bool((layout.shard.detach() == meta["step"]).all()), tries[0]


def test_every_rank_loads_the_same_version_when_one_sees_it_replaced(tmp_path):
    """Two ranks load while, on rank 1 only, the version is replaced mid-read: both ranks retry together and
    load the newer version (never one rank the old and the other the new)."""
    from runtime.checkpoint import save_checkpoint

    ckpt, layout, opt = tmp_path / "ckpt", *_sgd(1.0)
    save_checkpoint(ckpt, layout, opt, step=1, data_position=1, keep=2)
    first = _version(ckpt).name
    with torch.no_grad():
        layout.shard.fill_(2.0)
    save_checkpoint(ckpt, layout, opt, step=2, data_position=2, keep=2)
    newer = _version(ckpt).name
    (ckpt / "LATEST").write_text(first + "\n")
    results = run_ranks(2, tmp_path, _load_while_rank1_sees_its_version_replaced, str(ckpt), newer)
    assert results == [(2, True, 2), (2, True, 2)], results


SAVER = textwrap.dedent("""
    import os, sys, time, torch
    from runtime.checkpoint import save_checkpoint
    from runtime.fixed_layout import FixedLayout
    folder, stop = sys.argv[1], sys.argv[2]
    layout = FixedLayout.from_tensors({"w": torch.zeros(64, 64), "b": torch.zeros(30)}, 0, 1)
    opt = torch.optim.SGD([layout.shard], lr=0.1)
    step = 0
    while not os.path.exists(stop):
        with torch.no_grad():
            layout.shard.fill_(step)
        save_checkpoint(folder, layout, opt, step=step, data_position=step)  # keep=1: the previous one removed
        step += 1
        if step == 1:
            print("saved", flush=True)
    print(step, flush=True)
""")


def test_loads_racing_a_saving_process_all_succeed_with_one_version(tmp_path, monkeypatch):
    """One process saves in a loop (keep=1, every value equal to the step) while this one loads in a loop for
    3 s, each load pausing 10 ms after ``meta.json`` (a slow file system): every load succeeds and gives one
    version's values (each equal to the step it returns), at most a few of them on a second try (``LATEST``
    moved between reading it and holding the version's marker), the saver's versions read meanwhile left to
    its next saves. (Before loads held the marker, a load lost to a busy saver 8 times in a row in one CI
    run; the retries without ``flock`` are ``test_a_load_whose_version_a_save_removes_meanwhile_...``.)"""
    import time

    import runtime.checkpoint as mod
    from runtime.checkpoint import load_checkpoint
    from runtime.fixed_layout import FixedLayout

    folder, stop = tmp_path / "ckpt", tmp_path / "stop"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MASTER_ADDR", None)
    saver = subprocess.Popen([sys.executable, "-c", SAVER, str(folder), str(stop)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    tries, real, read_meta = [0], mod._load_version, mod._read_meta

    def counted(*args):
        tries[0] += 1
        return real(*args)

    def slow(folder):
        meta = read_meta(folder)
        time.sleep(0.01)
        return meta

    monkeypatch.setattr(mod, "_load_version", counted)
    monkeypatch.setattr(mod, "_read_meta", slow)
    layout = FixedLayout.from_tensors({"w": torch.zeros(64, 64), "b": torch.zeros(30)}, 0, 1)
    opt = torch.optim.SGD([layout.shard], lr=0.1)
    try:
        assert saver.stdout.readline().strip() == "saved", saver.stderr.read()[-2000:]
        loads, steps, start = 0, set(), time.monotonic()
        while time.monotonic() - start < 3:
            meta = load_checkpoint(folder, layout, opt)
            shard = layout.shard.detach()
            assert meta["data_position"] == meta["step"] and bool((shard == meta["step"]).all()), meta["step"]
            loads += 1
            steps.add(meta["step"])
        stop.touch()
        out, err = saver.communicate(timeout=60)
    finally:
        saver.kill()
    assert saver.returncode == 0, err[-2000:]
    assert loads > 5 and len(steps) > 2 and tries[0] < 2 * loads, (loads, len(steps), tries[0], out)
