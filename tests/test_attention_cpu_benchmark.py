"""benchmarks.attention_cpu: runs and prints both kernels; bad sizes exit 2."""

from benchmarks.attention_cpu import main


def test_cpu_attention_benchmark_prints_both_kernels(capsys):
    assert main(["--totals", "32", "--repeats", "1", "--heads", "2", "--head-dim", "8"]) == 0
    out = capsys.readouterr().out
    assert "reference ms" in out and "cpu-flash ms" in out and out.count("x\n") == 2


def test_cpu_attention_benchmark_rejects_bad_sizes(capsys):
    assert main(["--totals", "4,abc"]) == 2
    assert "--totals '4,abc'" in capsys.readouterr().err
