"""`hcompile launch`: N local ranks with the torchrun environment, and clear errors."""

import subprocess
import sys

SCRIPT = """
import sys, torch, torch.distributed as dist
from runtime.distributed import init_distributed
ctx = init_distributed(timeout_s=60)
t = torch.tensor([float(ctx.rank + 1)])
dist.all_reduce(t)
open(sys.argv[1] + f".{ctx.rank}", "w").write(f"{ctx.world_size} {ctx.dist_backend} {int(t.item())}")
dist.destroy_process_group()
"""


def test_launch_two_ranks(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "hcompile.cli", "launch", "--nproc", "2", str(script), str(out)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [(tmp_path / f"out.{r}").read_text() for r in range(2)] == ["2 gloo 3", "2 gloo 3"]


def test_failing_rank_exits_nonzero(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("raise SystemExit(3)\n")
    proc = subprocess.run([sys.executable, "-m", "hcompile.cli", "launch", "--nproc", "2", str(script)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1 and "a rank failed" in proc.stdout


def test_launch_errors_exit_2(tmp_path):
    for argv, message in ([["--nproc", "2", str(tmp_path / "missing.py")], "does not exist"],
                          [["--nproc", "100000", str(tmp_path / "missing.py")], "more ranks than this machine"]):
        proc = subprocess.run([sys.executable, "-m", "hcompile.cli", "launch", *argv], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr
