"""``python -m benchmarks.overlap --smoke``: both movement modes train the same (equal losses), every timing is
there and positive, the prediction is made on the probed links (the host's cores shared where the probe found
fewer compute slots than ranks), the rows are stamped; bad arguments exit 2."""

from __future__ import annotations

import json

import pytest

from benchmarks.overlap import main


def test_smoke_rows_have_both_modes_training_alike(tmp_path, capsys):
    assert main(["--smoke", "--json", "--steps", "1", "--out", str(tmp_path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    (row,) = summary["rows"]
    assert row["strategy"] == "1x(tp2)+2x(tp1)"
    assert row["overlap_losses"] == pytest.approx(row["rounds_losses"], rel=1e-5)
    for mode in ("rounds", "overlap"):
        assert row[f"{mode}_wall_ms"] > 0 and row[f"{mode}_exposed_ms"] > 0
        assert row[f"{mode}_exposed_ms"] >= row[f"{mode}_pull_ms"]
    assert row["rounds_wait_ms"] == 0.0  # nothing waits inside the compute when the pull is done before it
    assert row["exposed_ratio"] == pytest.approx(row["overlap_exposed_ms"] / row["rounds_exposed_ms"])
    # the planner's overlapped charge on the probed links, beside what overlapping measurably added
    assert row["pred_added_ms"] > 0 and row["compute_ms"] > 0 and row["slowdown"] > 0 and row["windows"] >= 1
    assert row["pred_over_measured"] == pytest.approx(row["pred_added_ms"] / row["measured_added_ms"])
    assert row["links"]["overlap_slowdown"] == row["slowdown"]
    # the ranks share the host's cores in the model only where fewer than the 4 ranks compute at once
    probed = row["links"]["compute_slots"]
    assert 1 <= probed <= 4 and row["compute_slots"] == (probed if probed < 4 else None)
    assert row["pred_added_unshared_ms"] > 0
    (line,) = [json.loads(x) for x in (tmp_path / "overlap.jsonl").read_text().splitlines()]
    assert {"commit", "device", "model", "strategy", "exposed_ratio"} <= set(line)


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--out", "FILE"], ["--strategy", "2x(tp1)"],
                                  ["--strategy", "4x(tq1)"]])
def test_bad_arguments_exit_2(tmp_path, capsys, argv):
    file = tmp_path / "f"
    file.write_text("")
    argv = [str(file) if a == "FILE" else a for a in argv]
    assert main(["--smoke", *argv]) == 2
    assert "--" in capsys.readouterr().err
