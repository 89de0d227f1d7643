"""The planner gap benchmark's --smoke mode: both planners on the same batches, stamped JSON lines."""

import json

from benchmarks.planner_gap import main


def test_smoke_compares_before_and_after_on_the_same_steps(tmp_path, capsys):
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "before" in out and "after" in out and "per step:" in out
    (line,) = (tmp_path / "planner_gap.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert record["commit"] and record["steps"] == 3
    assert sum(record["after_vs_before_steps"].values()) == 3
    assert record["bound_over_area_latency_bound"]["p50"] >= 1 - 1e-12
    for name in ("before", "after"):
        for key in ("vs_bound", "vs_area_latency_bound"):
            ratio = record[name][key]
            assert 1 - 1e-9 <= ratio["p50"] <= ratio["max"]
        assert record[name]["vs_bound"]["mean"] <= record[name]["vs_area_latency_bound"]["mean"] + 1e-9
        assert sum(record[name]["costliest"].values()) == 3


def test_the_search_never_beats_the_bound_and_is_reported(tmp_path, capsys):
    assert main(["--smoke", "--search", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "planner_gap.jsonl").read_text().splitlines()[0])
    search = record["search"]
    assert search["strategies"] > 100 and search["vs_bound"]["p50"] >= 1 - 1e-9
    assert 0 <= search["steps_search_better_by_1pct"] <= 3
