"""benchmarks/train_tiny.py, the user example: an unmodified Hugging Face LLaMA on the standard library's text
in a plain process; the loss falls, and a resumed run continues at the next step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, cwd: Path) -> list[tuple[int, float]]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_tiny.py"), *args], capture_output=True,
                         text=True, timeout=300, env=env, cwd=cwd)
    assert out.returncode == 0, out.stderr[-2000:]
    return [(int(m[1]), float(m[2])) for m in re.finditer(r"^step (\d+): loss ([\d.]+)", out.stdout, re.M)]


def test_loss_falls_and_a_resumed_run_continues(tmp_path):
    steps = _run("--steps", "6", "--tokens", "1024", "--save", str(tmp_path / "ckpt"), cwd=tmp_path)
    assert [s for s, _ in steps] == list(range(6))
    assert steps[-1][1] < steps[0][1] - 1.0, steps  # from about 5.6 (uniform over 256 bytes is 5.55)
    resumed = _run("--steps", "1", "--tokens", "1024", "--resume", str(tmp_path / "ckpt"), cwd=tmp_path)
    assert [s for s, _ in resumed] == [6] and resumed[0][1] < steps[0][1]
