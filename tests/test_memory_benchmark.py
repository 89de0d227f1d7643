"""``python -m benchmarks.memory --smoke``: every (strategy, rank) row, bytes moved equal to the slices'
(against the ideal counted independently from the plan's ranges), the movement peak under its target, the
stamped JSON lines; a file given as the output folder exits 2."""

from __future__ import annotations

import json

import pytest

from benchmarks.memory import main


def test_smoke_meets_the_targets_and_writes_stamped_lines(tmp_path, capsys):
    assert main(["--smoke", "--json", "--out", str(tmp_path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    rows = summary["rows"]
    assert {(r["strategy"], r["rank"]) for r in rows} == {(s, r) for s in ("4x(tp1)", "1x(tp2,pp2)") for r in range(4)}
    for r in rows:
        assert r["received"] == r["ideal_received"] and r["sent"] == r["ideal_sent"], r
        assert 0 < r["peak_movement"] <= 3 * r["slice_bytes"] + r["shard_bytes"], r
        assert r["peak_movement"] <= r["peak_step"]
        if r["strategy"] == "1x(tp2,pp2)":  # a quarter of the model: the full-vector movement received far more
            assert r["received"] < r["before_received"] / 2 and r["peak_movement"] < r["before_peak_movement"]
    assert summary["max_moved_over_ideal"] <= 1.1 and summary["max_peak_over_target"] <= 1.0
    # movement time: predicted from the probed links, measured around the phases (the 25% target is the full
    # benchmark's: this tiny model's messages are a few kB, all start-up)
    assert summary["links"]["gbps"] > 0
    assert [m["strategy"] for m in summary["movement_time"]] == ["4x(tp1)", "1x(tp2,pp2)"]
    for m in summary["movement_time"]:
        assert m["pred_move_ms"] > 0 and m["measured_move_ms"] > 0
        assert m["pred_over_measured"] == pytest.approx(m["pred_move_ms"] / m["measured_move_ms"], rel=1e-2)
    for r in rows:
        assert r["pred_move_ms"] == pytest.approx(r["pred_pull_ms"] + r["pred_push_ms"])
    lines = [json.loads(line) for line in (tmp_path / "memory.jsonl").read_text().splitlines()]
    assert len(lines) == len(rows) and all({"commit", "device", "model", "strategy"} <= set(x) for x in lines)


def test_a_file_as_output_folder_exits_2(tmp_path, capsys):
    file = tmp_path / "f"
    file.write_text("x")
    assert main(["--smoke", "--out", str(file)]) == 2
    assert "is a file" in capsys.readouterr().err
