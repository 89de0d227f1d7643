"""`hcompile plan`: the table, --json, --plans-out, an exact batch, and exit status 2 for bad input."""

import json
import subprocess
import sys

import pytest

from hcompile.cli import main

FAST = ["--gpus", "64", "--global-tokens", "40000", "--steps", "2"]


def test_json_summary_has_every_field(capsys):
    assert main(["plan", *FAST, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("model", "hardware", "gpus", "dataset", "global_tokens", "steps", "seed", "memory_model",
                "max_tokens", "pool", "lower_bound_ms_mean", "any_schedule_bound_ms_mean", "policies", "per_step"):
        assert key in out
    assert out["any_schedule_bound_ms_mean"] <= out["lower_bound_ms_mean"]
    assert out["memory_model"] == "hcompile" and out["max_tokens"]["(tp16,pp1)"] == 36608
    assert out["movement"] == {"charged": True, "mode": "overlapped", "windows": 423, "param_bytes": 2,
                               "reduce_bytes": 4, "floor_ms": out["movement"]["floor_ms"],
                               "links": {"gpus_per_node": 8, "intra_gbps": 200.0, "inter_gbps": 25.0,
                                         "latency_us": 10.0, "overlap_slowdown": 0.05}}
    assert set(out["policies"]) == {"padding", "fixed-packing", "homogeneous-token", "homogeneous-per-step",
                                    "hydraulis"}
    for numbers in out["policies"].values():
        assert set(numbers) == {"est_step_ms_mean", "tokens_per_s", "solve_ms_p50", "solve_ms_p95", "vs_bound",
                                "costliest", "bytes_per_rank_max", "bytes_per_rank_median",
                                "est_comm_ms_mean"}
        assert 0 < numbers["bytes_per_rank_median"] <= numbers["bytes_per_rank_max"]
        assert numbers["est_step_ms_mean"] >= out["lower_bound_ms_mean"] * (1 - 1e-9)
        assert 0 < numbers["est_comm_ms_mean"] < numbers["est_step_ms_mean"]
        assert set(numbers["vs_bound"]) == {"mean", "p50", "p90", "max"} and numbers["vs_bound"]["p50"] >= 1
        assert sum(numbers["costliest"].values()) == 2
    assert out["steps"] == 2 and [s["step"] for s in out["per_step"]] == [0, 1]
    fixed = out["policies"]["homogeneous-token"]  # every step runs the fixed strategy
    assert (fixed["bytes_per_rank_max"], fixed["bytes_per_rank_median"]) == _busiest(out["fixed_strategy"])
    for step in out["per_step"]:
        assert set(step["bounds"]) == {"area", "latency", "pipeline", "long", "binding"}
        compute = max(v for k, v in step["bounds"].items() if k != "binding")
        assert step["lower_bound_ms"] == pytest.approx(compute + step["movement_floor_ms"], abs=2e-3)
        for d in step["policies"].values():
            assert set(d) == {"est_step_ms", "est_move_ms", "vs_bound", "gap_ms", "unavoidable_ms", "costliest",
                              "replicas"}
            assert set(d["gap_ms"]) == {"strategy", "dispatch", "packing", "movement"}
            assert d["est_move_ms"] >= step["movement_floor_ms"] - 1e-3
            assert min(r["slack_ms"] for r in d["replicas"]) == 0
            assert d["unavoidable_ms"] >= 0 and d["costliest"] in d["gap_ms"]


def test_movement_ignored_estimates_compute_only(capsys):
    plain = ["--movement-mode", "plain"]  # the plain runtime's movement adds to the compute
    assert main(["plan", *FAST, "--json", "--movement", "ignored", "--policy", "homogeneous-token", *plain]) == 0
    blind = json.loads(capsys.readouterr().out)
    assert main(["plan", *FAST, "--json", "--policy", "homogeneous-token", *plain]) == 0
    charged = json.loads(capsys.readouterr().out)
    assert blind["movement"]["charged"] is False and charged["movement"]["charged"] is True
    a, b = blind["policies"]["homogeneous-token"], charged["policies"]["homogeneous-token"]
    assert a["est_comm_ms_mean"] == b["est_comm_ms_mean"] > 0  # the fixed strategy moves the same either way
    assert b["est_step_ms_mean"] == pytest.approx(a["est_step_ms_mean"] + a["est_comm_ms_mean"], abs=2e-3)
    assert charged["lower_bound_ms_mean"] == pytest.approx(blind["lower_bound_ms_mean"]
                                                           + charged["movement"]["floor_ms"], abs=2e-3)


def _default_and(capsys, *extra: str) -> tuple[dict, dict]:
    """``hcompile plan --json`` of homogeneous-token with the defaults, and with ``extra`` flags."""
    args = ["plan", *FAST, "--json", "--policy", "homogeneous-token"]
    outs = []
    for argv in (args, [*args, *extra]):
        assert main(argv) == 0
        outs.append(json.loads(capsys.readouterr().out))
    return outs[0], outs[1]


def test_overlapped_movement_mode_charges_what_the_micro_batches_do_not_cover(capsys):
    overlapped, plain = _default_and(capsys, "--movement-mode", "plain")  # the default runtime overlaps
    assert (plain["movement"]["mode"], overlapped["movement"]["mode"]) == ("plain", "overlapped")
    a, b = plain["policies"]["homogeneous-token"], overlapped["policies"]["homogeneous-token"]
    assert 0 < b["est_comm_ms_mean"] < a["est_comm_ms_mean"]  # the same strategy, most of its movement hidden
    # llama-32b's 32.5G elements in the runtime's windows of at most 33.5M (one per large parameter): 423
    assert overlapped["movement"]["windows"] == 423 and "windows" not in plain["movement"]
    assert overlapped["movement"]["floor_ms"] == pytest.approx(plain["movement"]["floor_ms"] / 423, abs=2e-3)
    assert overlapped["lower_bound_ms_mean"] <= b["est_step_ms_mean"]


def test_bf16_gradients_halve_the_push_in_the_charge(capsys):
    fp32, bf16 = _default_and(capsys, "--reduce-dtype", "bf16")
    assert (fp32["movement"]["reduce_bytes"], bf16["movement"]["reduce_bytes"]) == (4, 2)
    a, b = fp32["policies"]["homogeneous-token"], bf16["policies"]["homogeneous-token"]
    assert b["bytes_per_rank_max"] < a["bytes_per_rank_max"] and b["est_comm_ms_mean"] < a["est_comm_ms_mean"]


def _busiest(strategy: str) -> tuple[int, int]:
    """The busiest and the median rank's bytes per step of llama-32b on 64 A800s under ``strategy``, counted
    independently: the profile's shape laid out as hcompile's LLaMA, the owners' equal shards, bf16 parameters
    and fp32 gradients."""
    from passes.plan.cost_model import load_profile
    from passes.plan.ir import Strategy
    from passes.plan.movement import llama_compute_layout, movement_bytes

    profile = load_profile("llama-32b")
    parsed = Strategy.parse(strategy)
    layout = llama_compute_layout(layers=profile.layers, hidden=profile.hidden, ffn_hidden=profile.ffn_hidden,
                                  heads=profile.heads, kv_heads=profile.heads, vocab=profile.vocab,
                                  schemes=list(parsed.schemes))
    totals = sorted(m.total for m in movement_bytes(layout, parsed, profile.gpus_per_node, param_bytes=2,
                                                    reduce_bytes=4))
    middle = len(totals) // 2  # 64 ranks: the median is the mean of the two middle ones
    return totals[-1], int((totals[middle - 1] + totals[middle]) / 2)


def test_paper_memory_model(capsys):
    assert main(["plan", *FAST, "--json", "--memory-model", "paper"]) == 0
    assert json.loads(capsys.readouterr().out)["max_tokens"]["(tp16,pp1)"] == 43520


def test_progress_of_the_pool_and_of_every_step_and_policy(capsys):
    from hcompile.tools.simulate import PlanJob, run_plan_job

    seen: dict[str, list[tuple[int, int]]] = {}
    job = PlanJob(model="llama-32b", hardware="a800-80g", gpus=64, dataset="commoncrawl", global_tokens=40000,
                  steps=2, seed=0, policies=("hydraulis", "padding"))
    run_plan_job(job, progress=lambda label, done, total: seen.setdefault(label, []).append((done, total)))
    assert list(seen) == ["building the strategy pool", "planning steps x policies"]  # the pool comes first
    tiers = seen["building the strategy pool"]
    assert [d for d, _ in tiers] == list(range(1, len(tiers) + 1)) and tiers[-1][0] == tiers[-1][1] >= 2
    assert seen["planning steps x policies"] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert main(["plan", *FAST, "--policy", "hydraulis"]) == 0
    err = capsys.readouterr().err
    assert "building the strategy pool" in err and "planning steps x policies" in err
    assert main(["plan", *FAST, "--policy", "padding"]) == 0  # only hydraulis plans from the pool: none is built
    out, err = capsys.readouterr()
    assert "building the strategy pool" not in err and "planning steps x policies" in err
    assert "hydraulis pool: not built (hydraulis not planned)" in out


def test_table_and_plans_out(tmp_path, capsys):
    plans = tmp_path / "plans.jsonl"
    assert main(["plan", *FAST, "--policy", "hydraulis", "--policy", "homogeneous-token",
                 "--plans-out", str(plans)]) == 0
    table = capsys.readouterr().out
    assert "hydraulis" in table and "hydraulis pool:" in table and "lower bound" in table
    lines = [json.loads(line) for line in plans.read_text().splitlines()]
    assert [(d["step"], d["policy"]) for d in lines] == [
        (0, "hydraulis"), (0, "homogeneous-token"), (1, "hydraulis"), (1, "homogeneous-token")]
    for d in lines:
        assert set(d) == {"step", "policy", "strategy", "num_gpus", "seq_lens", "replicas", "est_step_ms",
                          "est_move_ms", "lower_bound_ms", "solve_ms", "diagnosis"}
        assert len(d["diagnosis"]["replicas"]) == len(d["replicas"])
        assert d["diagnosis"]["lower_bound_ms"] == d["lower_bound_ms"]
        assert sum(d["seq_lens"]) == 40000
        assert set(d["replicas"][0]) == {"tp", "pp", "cp", "ranks", "max_tokens", "micro_batches", "est_ms"}


def test_exact_batch_from_a_text_file(tmp_path, capsys):
    batch = tmp_path / "batch.txt"
    batch.write_text("\n".join(["30000", "7", "5000", "123"]) + "\n")
    plans = tmp_path / "p.jsonl"
    assert main(["plan", "--lengths", str(batch), "--steps", "1", "--global-tokens", "10",
                 "--policy", "hydraulis", "--plans-out", str(plans), "--json"]) == 0
    (line,) = plans.read_text().splitlines()
    assert json.loads(line)["seq_lens"] == [30000, 7, 5000, 123]  # untruncated, in order
    assert json.loads(capsys.readouterr().out)["dataset"] == "batch"


@pytest.mark.parametrize("args,contents,message", [
    (["--lengths", "{f}", "--steps", "1"], "100\n500000\n",
     "a sequence of 500000 tokens is longer than every scheme"),
    (["--lengths", "{f}", "--steps", "1", "--context-parallel", "off"], "100\n50000\n",
     "a sequence of 50000 tokens is longer than every scheme"),
    (["--lengths", "{f}", "--steps", "1"], "\n", "the batch is empty"),
    (["--lengths", "{f}", "--steps", "1"], "10\n0\n", "got '0'"),
    (["--lengths", "{f}", "--steps", "1"], "10\n-4\n", "got '-4'"),
    (["--lengths", "{f}", "--steps", "1"], "10\n3.5\n", "got '3.5'"),
    (["--model", "llama-70b"], None, "unknown model 'llama-70b'"),
    (["--dataset", "wiki"], None, "unknown dataset 'wiki'"),
    (["--policy", "greedy"], None, "unknown policy 'greedy'"),
    (["--gpus", "3"], None, "no strategy of llama-32b@a800-80g fills 3 GPUs"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, args, contents, message):
    f = tmp_path / "lengths.txt"
    if contents is not None:
        f.write_text(contents)
    plans = tmp_path / "plans.jsonl"
    argv = [a.replace("{f}", str(f)) for a in args]
    proc = subprocess.run([sys.executable, "-m", "hcompile.cli", "plan", *argv, "--steps", "1",
                           "--plans-out", str(plans)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert not plans.exists() and list(tmp_path.iterdir()) == ([f] if contents is not None else [])
