"""Faults end the whole job quickly: a rank that raises stops every rank with a non-zero status."""

import subprocess
import sys
import time

SCRIPT = """
import sys, torch, torch.distributed as dist
from runtime.distributed import init_distributed
ctx = init_distributed(timeout_s=30)
if ctx.rank == 1:
    raise RuntimeError("rank 1 broke on purpose")
t = torch.ones(1)
dist.all_reduce(t)  # rank 0 waits here for a peer that is gone
dist.all_reduce(t)
"""


def test_a_raising_rank_ends_every_rank_within_60s(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text(SCRIPT)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hcompile.cli", "launch", "--nproc", "2", str(script)],
                          capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    assert proc.returncode != 0
    assert "rank 1 broke on purpose" in proc.stdout + proc.stderr
    assert elapsed < 60, f"took {elapsed:.0f}s"
