"""benchmarks.e2e: the --smoke run (2 steps of a tiny model on local gloo ranks) prints a JSON object with
every field per policy, writes stamped JSON lines; bad input exits 2 with a clear message."""

import json

import pytest

from benchmarks.e2e import FIELDS, E2EConfig, format_cost_model, main, scale_dataset, text_batches
from passes.plan.datasets import load_dataset
from passes.plan.ir import PlanError


def test_scale_dataset_keeps_counts_and_hits_the_context():
    data = load_dataset("python-code")
    scaled = scale_dataset(data, 1024)
    assert scaled.max_len == 1024 and scaled.num_seqs == data.num_seqs and min(scaled.lengths) >= 1


def test_text_batches_are_real_bytes_within_the_budget():
    from hcompile.data import python_stdlib

    cfg = E2EConfig(model="llama-tiny", context=128, tokens_per_rank=64, global_tokens=256, steps=2, warmup=1)
    data, batches = text_batches(cfg)
    assert len(batches) == 3 and data.max_len <= 128 and data.num_seqs > 1000
    for batch in batches:
        assert sum(map(len, batch)) <= 256 and all(0 <= t < 256 for seq in batch for t in seq)
    text = bytes(t for seq in batches[0] for t in seq).decode("utf-8", errors="replace")
    assert any(word in text for word in ("def ", "class ", "return", "self")), text[:200]
    assert python_stdlib()


def test_smoke_json_has_every_field(tmp_path, capsys):
    out = tmp_path / "results"
    assert main(["--smoke", "--ranks", "2", "--json", "--out", str(out),
                 "--policy", "hydraulis", "--policy", "homogeneous-token"]) == 0
    summary = json.loads(capsys.readouterr().out)
    pngs = sorted(p.name for p in out.glob("e2e_*.png"))
    assert pngs == ["e2e_loss.png", "e2e_throughput.png", "e2e_timeline.png"], pngs  # what make run draws
    assert summary["config"]["steps"] == 2 and summary["config"]["model"] == "llama-tiny"
    assert summary["config"]["dataset"] == "stdlib"  # real text by default
    assert summary["loss_spread"] < 1e-4  # the same batches, exact gradients: the loss curves coincide
    assert set(summary["policies"]) == {"hydraulis", "homogeneous-token"}
    for name, metrics in summary["policies"].items():
        assert set(FIELDS) <= set(metrics), name
        assert metrics["tokens_per_s"] > 0 and metrics["step_ms_one_core_per_rank"] > 0
        assert 0 < metrics["step_ms_compute_thread"] <= metrics["step_ms_one_core_per_rank"] * 1.05
        assert metrics["balance"] >= 1.0 and metrics["pred_over_measured"] > 0
        assert len(metrics["pred_over_measured_per_step"]) == 2
        # the prediction includes the movement, replayed on the links the profile probed, and it is measured
        assert metrics["pred_over_measured_compute"] > 0 and metrics["movement_ms"] > 0
        assert metrics["movement_pred_over_measured"] > 0
        assert metrics["compilations_after_warmup"] == 0
        assert metrics["param_bytes_received"] > 0 and metrics["grad_bytes_sent"] > 0
    lines = [json.loads(line) for line in (out / "e2e.jsonl").read_text().splitlines()]
    assert {line["kind"] for line in lines} == {"step", "summary"}
    assert all({"commit", "device", "config"} <= set(line) for line in lines)
    steps = [line for line in lines if line["kind"] == "step"]
    for step in steps:
        assert len(step["pull_ms"]) == len(step["push_ms"]) == 2 and min(step["pull_ms"]) > 0
        assert step["pred_pull_ms"] > 0 and step["pred_push_ms"] > 0
        # the default runtime overlaps: its predicted exposure is under the whole movement, and it is measured
        assert step["movement_mode"] == "overlapped" and len(step["wait_ms"]) == 2
        assert 0 < step["pred_move_ms"] < step["pred_pull_ms"] + step["pred_push_ms"] + step["pred_ms"]
    # the same batches for every policy
    tokens = {p: [s["tokens"] for s in steps if s["policy"] == p] for p in summary["policies"]}
    assert tokens["hydraulis"] == tokens["homogeneous-token"]


def test_long_context_trains_on_context_parallel_replicas(tmp_path, capsys):
    """Documents longer than any TP replica holds (``long-context`` scaled to 128 tokens, 32 per rank, tp2 at
    most) train on (cp2) replicas, every policy from the same listed pool, the loss curves equal; ``dynamic-cp``
    runs for real beside them, its CP groups re-forming within every step."""
    assert main(["--smoke", "--dataset", "long-context", "--max-cp", "2", "--json", "--no-plots",
                 "--out", str(tmp_path), "--policy", "hydraulis", "--policy", "homogeneous-token",
                 "--policy", "dynamic-cp"]) == 0
    summary = json.loads(capsys.readouterr().out)
    lines = [json.loads(line) for line in (tmp_path / "e2e.jsonl").read_text().splitlines()]
    steps = [r for r in lines if r["kind"] == "step" and r["policy"] == "dynamic-cp"]
    assert steps and all(r["regrouped"] for r in steps)
    assert all(r["pred_ms"] > 0 for r in steps)
    assert "1x(tp2,pp1,cp2)" in summary["config"]["strategies"] and summary["config"]["max_cp"] == 2
    assert summary["loss_spread"] < 1e-4
    used = {s for p in summary["policies"].values() for s in p["strategies"]}
    assert any("cp2" in s for s in used), used
    for metrics in summary["policies"].values():
        assert metrics["compilations_after_warmup"] == 0


@pytest.mark.parametrize("argv, needle", [
    (["--model", "gpt-huge"], "gpt-huge"),
    (["--dataset", "wikipedia"], "wikipedia"),
    (["--dataset", "python-code", "--tokens-per-rank", "64", "--context", "1048576", "--cost", "analytic"],
     "shortest sequence"),
    (["--context", "8192", "--cost", "analytic"], "more than the batch budget 4096"),
    (["--tokens-per-rank", "64", "--context", "4096", "--max-tp", "4", "--cost", "analytic"], "longest sequence"),
    (["--ranks", "100000"], "more than this machine can start"),
    (["--policy", "magic"], "magic"),
    (["--max-cp", "3"], "max_cp must be a power of two"),
])
def test_bad_input_exits_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_config_validation_quotes_the_value():
    with pytest.raises(PlanError, match="-3"):
        E2EConfig(steps=-3)


def test_cost_model_line_reports_the_fit_per_scheme():
    profiled = {"config": {"cost_model": "m", "profile_file": "p.json",
                           "fit": {"(tp1,pp1)": {"r2": 0.9841, "mape_held_out": 0.0647},
                                   "(tp2,pp1)": {"r2": 0.9479, "mape_held_out": 0.0828}}}}
    assert format_cost_model(profiled) == ("cost model: profiled here (p.json): (tp1,pp1) R^2 0.984, held-out MAPE "
                                           "6.5%, (tp2,pp1) R^2 0.948, held-out MAPE 8.3%")
    assert format_cost_model({"config": {"cost_model": "analytic-cpu"}}) == "cost model: analytic-cpu"
