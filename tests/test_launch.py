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


def _launch(tmp_path, text: str, *args: str) -> subprocess.CompletedProcess:
    """``hcompile launch --nproc 2`` of a script holding ``text``, with ``args``."""
    script = tmp_path / "job.py"
    script.write_text(text)
    return subprocess.run([sys.executable, "-m", "hcompile.cli", "launch", "--nproc", "2", str(script), *args],
                          capture_output=True, text=True, timeout=180)


def test_launch_two_ranks(tmp_path):
    proc = _launch(tmp_path, SCRIPT, str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [(tmp_path / f"out.{r}").read_text() for r in range(2)] == ["2 gloo 3", "2 gloo 3"]


BAD = """
import os, sys, time
if os.environ["RANK"] == "1":
    print("fatal: rank 1 cannot go on", file=sys.stderr, flush=True)
    sys.exit(3)
time.sleep(30)  # ended by the launcher once rank 1 has failed
"""


def test_a_failing_rank_gives_its_own_exit_code_and_last_error_line(tmp_path):
    proc = _launch(tmp_path, BAD)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "hcompile launch: rank 1 failed (exit code 3): fatal: rank 1 cannot go on")
    proc = _launch(tmp_path, "import os, signal\nif os.environ['RANK'] == '0':\n    os.kill(os.getpid(), "
                             "signal.SIGKILL)\nimport time; time.sleep(30)\n")
    assert proc.returncode == 137 and ("rank 0 failed (signal SIGKILL, not sent by the launcher): (nothing on its "
                                       "stderr)") in proc.stderr


EXIT = """
import atexit, os, sys, torch, torch.distributed as dist
def report():  # registered first, so it runs after the runtime's own handler
    open(sys.argv[1] + "." + os.environ["RANK"], "w").write(str(dist.is_initialized()))
atexit.register(report)
from runtime.distributed import init_distributed
ctx = init_distributed(timeout_s=60)
t = torch.ones(4)
dist.all_reduce(t)
"""


def test_the_process_group_is_destroyed_before_the_interpreter_finalizes(tmp_path):
    """A job that ends without destroy_process_group: the runtime destroys it at exit, while the interpreter is
    alive (that alone does not stop gloo's worker threads: see the tests of a clean end below)."""
    proc = _launch(tmp_path, EXIT, str(tmp_path / "initialized"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [(tmp_path / f"initialized.{r}").read_text() for r in range(2)] == ["False", "False"]


def test_launch_errors_exit_2(tmp_path):
    for argv, message in ([["--nproc", "2", str(tmp_path / "missing.py")], "does not exist"],
                          [["--nproc", "100000", str(tmp_path / "missing.py")], "more ranks than this machine"]):
        proc = subprocess.run([sys.executable, "-m", "hcompile.cli", "launch", *argv], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr


def test_the_rank_that_failed_first_is_named_even_within_one_second():
    """Two failures in the same whole second: the one whose rank wrote the earlier exit time is named (the peer
    whose collective it broke fails a moment later); ranks the launcher stopped come last whatever their time."""
    from types import SimpleNamespace

    from runtime.launch import _first_failure

    def failure(pid, code=1):
        return SimpleNamespace(pid=pid, exitcode=code, timestamp=1000, local_rank=pid)

    failures = {0: failure(10), 1: failure(11, 3)}
    assert _first_failure(failures, set(), {10: 1000.7, 11: 1000.2})[0] == 1
    assert _first_failure(failures, set(), {10: 1000.1, 11: 1000.2})[0] == 0
    assert _first_failure(failures, {11}, {10: 1000.7, 11: 1000.2})[0] == 0


def test_rank_entry_keeps_the_scripts_exit_status_and_message(tmp_path):
    """``python -m runtime.rank_entry script`` runs the script as ``__main__`` with its own argv and ends with
    the status it chose: 0, sys.exit(3), sys.exit("message") (1, the message on stderr), an exception (1, its
    traceback)."""
    script = tmp_path / "job.py"
    script.write_text("import sys\nprint(__name__, sys.argv[1:])\nmode = sys.argv[1]\n"
                      "if mode == 'code': sys.exit(3)\nif mode == 'text': sys.exit('stopped here')\n"
                      "if mode == 'raise': raise RuntimeError('broke')\n")
    expected = {"ok": (0, ""), "code": (3, ""), "text": (1, "stopped here"), "raise": (1, "RuntimeError: broke")}
    for mode, (code, err) in expected.items():
        proc = subprocess.run([sys.executable, "-m", "runtime.rank_entry", str(script), mode], capture_output=True,
                              text=True, timeout=60, cwd=tmp_path)
        assert proc.returncode == code, (mode, proc.stderr)
        assert proc.stdout.strip() == f"__main__ ['{mode}']"
        assert (proc.stderr.strip().splitlines() or [""])[-1] == err


DAEMON_IN_AN_OP = """
import threading, time, torch
a = torch.randn(384, 384)
def spin():  # a daemon thread that is inside a torch op (the GIL released) almost all the time
    while True:
        a @ a
threading.Thread(target=spin, daemon=True).start()
time.sleep(0.2)
print("done", flush=True)
"""


def test_a_clean_end_is_exit_0_whatever_thread_is_still_inside_torch(tmp_path):
    """Run by plain ``python``, this script aborts at finalization ("terminate called without an active
    exception", exit 134: 5 of 5 runs here), as a gloo worker releasing a finished collective's tensors did at
    the end of finished jobs. A rank ends without finalization (``runtime.rank_entry``), so it exits 0."""
    script = tmp_path / "job.py"
    script.write_text(DAEMON_IN_AN_OP)
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-m", "runtime.rank_entry", str(script)], capture_output=True,
                              text=True, timeout=60, cwd=tmp_path)
        assert proc.returncode == 0 and proc.stdout == "done\n", proc.stderr[-2000:]


WHAT_EXIT_DOES = """
import atexit, sys, threading, time, weakref
from concurrent.futures import ThreadPoolExecutor
import torch.distributed  # its deprecated aliases warn when their class is read
class Gone:
    pass
gone = Gone()
proxies = [weakref.proxy(gone)]
del gone  # a dead weak proxy: reading its class raises
out = sys.argv[1]
log = open(out + ".open", "w")  # left open: the exit flushes it
log.write("written, never closed")
atexit.register(lambda: open(out + ".atexit", "w").write("ran"))
def late():
    time.sleep(0.3)
    open(out + ".thread", "w").write("joined")
threading.Thread(target=late).start()  # not a daemon: the exit waits for it
pool = ThreadPoolExecutor(2)  # idle workers: the exit stops them instead of waiting forever
pool.submit(lambda: None).result()
print("end of script")
"""


def test_a_clean_end_still_does_what_pythons_exit_does(tmp_path):
    """Skipping finalization keeps the rest of the exit: non-daemon threads joined, idle executors stopped,
    ``atexit`` handlers run, files left open flushed, stdout flushed; nothing else on stderr (a dead weak proxy
    or torch's deprecated aliases among the objects looked at for open files neither raise nor warn)."""
    script = tmp_path / "job.py"
    script.write_text(WHAT_EXIT_DOES)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "runtime.rank_entry", str(script), str(out)], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout == "end of script\n" and proc.stderr == "", proc.stderr[-2000:]
    assert [(tmp_path / f"out.{k}").read_text() for k in ("open", "atexit", "thread")] == [
        "written, never closed", "ran", "joined"]
