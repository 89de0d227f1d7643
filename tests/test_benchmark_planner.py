"""The planner benchmark's --smoke mode: table, stamped JSON lines and the PNG."""

import json

from benchmarks.planner import main


def test_smoke_writes_stamped_json_and_plot(tmp_path, capsys):
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "hydraulis pool:" in out and "paper case-study pool" in out
    (line,) = (tmp_path / "planner.jsonl").read_text().splitlines()
    record = json.loads(line)
    for key in ("commit", "device", "config", "pool", "lower_bound_ms_mean", "policies"):
        assert key in record
    assert record["policies"]["hydraulis"]["est_step_ms_mean"] <= record["policies"]["homogeneous-token"][
        "est_step_ms_mean"]
    png = (tmp_path / "planner.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
