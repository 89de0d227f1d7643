"""Checkpoints: a resumed run continues exactly (same losses, same parameters), on another number of ranks too
(4 -> 2); a damaged file, a missing checkpoint or one of another model is the same error on every rank with
nothing changed; a crash while saving leaves the previous checkpoint current; loading runs no pickle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from dist_util import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def _trainer(strategies=("4x(tp1)", "2x(tp2)", "1x(tp2)+2x(tp1)")):
    import hcompile
    from hcompile.models import Llama, LlamaConfig, init_weights_

    return hcompile.compile(init_weights_(Llama(LlamaConfig(vocab=64)), seed=0)).trainer(loss="causal_lm",
                            optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1},
                            strategies=list(strategies), tokens_per_rank=48, calibrate=False)


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


def test_exact_continuation_and_resharding_to_fewer_ranks(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    (losses, saved, final), *_ = run_ranks(4, tmp_path, _save_and_continue, ckpt)
    step, _, resumed, resumed_final = run_ranks(4, tmp_path, _resume, ckpt, ("4x(tp1)",))[0]
    assert step == 3 and resumed == losses[3:]  # the same pool and plans: bit for bit
    for n, p in final.items():
        assert torch.equal(resumed_final[n], p), n
    for _, state, two_ranks, two_final in run_ranks(2, tmp_path, _resume, ckpt, ("2x(tp1)", "1x(tp2)")):
        assert all(torch.equal(state[n], p) for n, p in saved.items())  # re-cut for 2 ranks: the same values
        assert two_ranks == pytest.approx(losses[3:], rel=1e-5)  # other ranks, other plans: the same training
        for n, p in final.items():
            torch.testing.assert_close(two_final[n], p, rtol=1e-4, atol=1e-5)
    meta = json.loads((Path(ckpt) / (Path(ckpt) / "LATEST").read_text().strip() / "meta.json").read_text())
    assert meta["world_size"] == 4 and set(meta["extra"]) == {"pool", "fixed"}


def _damaged(rank, world, ckpt):
    from runtime.checkpoint import CheckpointError

    trainer = _trainer(("2x(tp1)",))
    trainer.train_step(_batches(1)[0])
    before = trainer.full_state_dict()
    errors = []
    for target in (ckpt, ckpt + "-missing"):
        try:
            trainer.load(target)
            errors.append(None)
        except CheckpointError as exc:
            errors.append(str(exc))
    unchanged = all(torch.equal(before[n], t) for n, t in trainer.full_state_dict().items())
    return errors, unchanged


def test_a_truncated_file_fails_every_rank_fast_and_changes_nothing(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_ranks(4, tmp_path, _save_and_continue, ckpt)
    version = Path(ckpt) / (Path(ckpt) / "LATEST").read_text().strip()
    victim = version / "rank2.safetensors"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    results = run_ranks(2, tmp_path, _damaged, ckpt, timeout_s=120)
    (e0, unchanged0), (e1, unchanged1) = results
    assert e0 == e1 and unchanged0 and unchanged1
    assert "loading the checkpoint failed on rank" in e0[0] and "rank2" not in e0[1]
    assert "no checkpoint at" in e0[1]


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
