"""The planner benchmark's --smoke mode: table, stamped JSON lines and the PNG."""

import json

from benchmarks.planner import main


def test_smoke_writes_stamped_json_and_plot(tmp_path, capsys):
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "hydraulis pool:" in out and "paper case-study pool" in out
    ignored, charged = (json.loads(line) for line in (tmp_path / "planner.jsonl").read_text().splitlines())
    for record in (ignored, charged):
        for key in ("commit", "device", "config", "pool", "lower_bound_ms_mean", "policies", "movement"):
            assert key in record
        assert record["policies"]["hydraulis"]["est_step_ms_mean"] <= record["policies"]["homogeneous-token"][
            "est_step_ms_mean"]
    assert ignored["config"].endswith("movement ignored")
    assert charged["config"].endswith("movement charged (overlapped)")  # as the default runtime moves
    assert (ignored["movement"]["charged"], charged["movement"]["charged"]) == (False, True)
    fixed = [r["policies"]["homogeneous-token"] for r in (ignored, charged)]  # the same strategy and batches
    # overlapped: more than the compute, less than the compute plus the whole (plain) movement
    assert fixed[0]["est_step_ms_mean"] < fixed[1]["est_step_ms_mean"] < (fixed[0]["est_step_ms_mean"]
                                                                           + fixed[0]["est_comm_ms_mean"])
    png = (tmp_path / "planner.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_a_setting_the_planner_refuses_is_recorded_and_the_rest_run(tmp_path, capsys):
    """32B on 64 GPUs cannot hold the long-context set's 160K-token documents without recomputation since
    gradients accumulate in fp32 (longest 146816, a piece's gradients and NCCL buffers charged): that setting is
    a record with its reason, and the next setting
    still runs."""
    from benchmarks.planner import SMOKE, run
    from hcompile.tools.simulate import PlanJob

    refused = PlanJob(model="llama-32b", gpus=64, dataset="long-context", global_tokens=1_000_000, steps=2,
                      recompute="off")
    records = run((refused, SMOKE[0]), tmp_path, plot=False)
    assert "longer than every scheme can hold" in records[0]["refused"]
    assert "refused" not in records[1] and "policies" in records[1]
    assert "refused: a sequence of 160000 tokens" in capsys.readouterr().out
