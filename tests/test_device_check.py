"""``python -m benchmarks.device_check`` off a GPU: the command skips in one line and writes nothing; its table, JSON
line and exit code; each part's pass/fail rules on fake measurements; part (a)'s comparison against per-sequence
SDPA on the CPU (and that it catches wrong kernels); parts (c), (d) and (e) run end to end on the CPU, small (part
(e) on two gloo ranks)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import codegen
from benchmarks import device_check as dc
from benchmarks.attention import Row
from benchmarks.device_train import LLAMA_125M, TrainRun, TrainSetup, matmul_params, step_batches, step_flops
from hcompile.models import Llama, LlamaConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = dc.AttentionCase(name="tiny", lengths=(1, 5, 0, 12, 3, 9), heads_q=4, heads_kv=2, head_dim=16)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    return {**env, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}


def test_without_a_gpu_the_command_skips_in_one_line_and_writes_nothing(tmp_path):
    out = subprocess.run([sys.executable, "-m", "benchmarks.device_check"], capture_output=True, text=True,
                         timeout=120, env=_env(), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    (line,) = out.stdout.strip().splitlines()
    assert line.startswith("device_check: no CUDA GPU") and all(f"({p})" in line for p in "abcde")
    assert list(tmp_path.iterdir()) == []  # no results/ folder, no JSON line


def test_parts_option_is_checked():
    assert dc.parse_args(["--parts", "a, c"]).parts == "ac"
    for bad in ("a,f", "", "a,a"):
        with pytest.raises(SystemExit):
            dc.parse_args(["--parts", bad])
    assert "(b)" in dc.skip_line("b") and "(a)" not in dc.skip_line("b")


def _checks() -> list[dc.Check]:
    return [dc.Check(part="a", name="bf16 ragged", passed=True, numbers={"out": 0.00312345, "seqs": 10}),
            dc.Check(part="c", name="loss", passed=False, numbers={"worst_rel": 0.05, "mfu": None}, detail="too far")]


def test_table_json_line_and_exit_code():
    checks = _checks()
    table = dc.format_table(checks)
    header, rule, first, second = table.splitlines()
    assert header.split() == ["part", "check", "result", "numbers", "detail"] and set(rule) == {"-"}
    assert "pass" in first and "out=0.003123 seqs=10" in first
    assert "FAIL" in second and "mfu=-" in second and second.endswith("too far")
    record = dc.summary_record(checks, {"benchmark": "device_check", "commit": "abc"})
    assert json.loads(json.dumps(record)) == record
    assert record["passed"] is False and record["commit"] == "abc" and len(record["checks"]) == 2
    assert record["checks"][1] == {"part": "c", "name": "loss", "passed": False,
                                   "numbers": {"worst_rel": 0.05, "mfu": None}, "detail": "too far"}
    assert dc.exit_code(checks) == 1 and dc.exit_code(checks[:1]) == 0 and dc.exit_code([]) == 1


def test_a_part_that_raises_or_returns_nothing_is_one_failed_check():
    def broken():
        raise RuntimeError("CUDA error: an illegal memory access\nmore")

    (check,), seconds = dc.run_part("b", broken)
    assert not check.passed and check.part == "b" and seconds >= 0
    assert check.detail == "RuntimeError: CUDA error: an illegal memory access"
    (empty,), _ = dc.run_part("a", list)
    assert not empty.passed and "no checks" in empty.detail
    assert dc.run_part("c", _checks)[0] == _checks()


def test_main_on_a_gpu_runs_every_part_alone_and_appends_one_stamped_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    ok = dc.Check(part="a", name="fine", passed=True)
    monkeypatch.setattr(dc, "check_attention_correctness", lambda device, quick: [ok])
    monkeypatch.setattr(dc, "check_attention_speed", lambda quick: 1 / 0)
    monkeypatch.setattr(dc, "check_training", lambda quick, name: [dc.Check(part="c", name=name, passed=True)])
    monkeypatch.setattr(dc, "check_profile_on_gpu", lambda name: [dc.Check(part="d", name="p", passed=True)])
    monkeypatch.setattr(dc, "check_multi_gpu", lambda quick: [dc.Check(part="e", name="m", passed=True)])
    out = tmp_path / "results" / "device_check.jsonl"
    assert dc.main(["--out", str(out), "--quick"]) == 1
    printed = capsys.readouterr().out.strip().splitlines()
    record = json.loads(printed[-1])
    assert json.loads(out.read_text()) == record
    assert [c["part"] for c in record["checks"]] == ["a", "b", "c", "d", "e"]
    assert [c["passed"] for c in record["checks"]] == [True, False, True, True, True]
    assert record["checks"][1]["detail"].startswith("ZeroDivisionError")
    assert record["checks"][2]["name"] == "NVIDIA H200" and record["device"] == "NVIDIA H200"
    for key in ("commit", "torch", "triton", "cuda", "part_s"):
        assert key in record
    assert record["quick"] is True and set(record["part_s"]) == set("abcde")
    assert dc.main(["--out", str(out), "--parts", "a"]) == 0
    assert len(out.read_text().splitlines()) == 2


def test_attention_cases_cover_both_head_dims_grouped_queries_and_ragged_lengths():
    cases = dc.attention_cases(quick=False)
    assert {c.head_dim for c in cases} == {64, 128} and all(c.heads_q > c.heads_kv for c in cases)
    assert any(0 in c.lengths and 1 in c.lengths for c in cases) and max(max(c.lengths) for c in cases) >= 8192
    assert {c.head_dim for c in dc.attention_cases(quick=True)} == {64, 128}


def _reference(**kwargs):
    return functools.partial(codegen.packed_attention, kernel="reference", **kwargs)


def test_the_reference_kernel_agrees_with_sdpa_per_sequence_on_the_cpu():
    errors = dc.attention_errors(TINY, "fp32", torch.device("cpu"), _reference())
    assert set(errors) == {"out", "dq", "dk", "dv"} and max(errors.values()) < 1e-5
    check = dc.correctness_check(TINY, errors, None, dc.ATTENTION_TOLERANCE["fp32"], dtype="fp32")
    assert check.passed and check.numbers["tokens"] == 30 and check.numbers["heads"] == "4/2"


def test_the_bf16_limit_is_the_tolerance_or_twice_sdpas_own_error():
    errors = {"out": 0.004, "dq": 0.03, "dk": 0.01, "dv": 0.01}
    assert not dc.correctness_check(TINY, errors, None, 2e-2).passed
    assert not dc.correctness_check(TINY, errors, {"out": 0.003, "dq": 0.01}, 2e-2).passed
    loose = dc.correctness_check(TINY, errors, {"out": 0.003, "dq": 0.02}, 2e-2)
    assert loose.passed and loose.numbers["sdpa_bf16_worst"] == 0.02 and loose.name == "bf16 tiny"


def _across_sequences(q, k, v, cu_seqlens, max_seqlen):
    whole = cu_seqlens[[0, -1]]  # one sequence: tokens see the sequences before them
    return codegen.packed_attention(q, k, v, whole, q.shape[0], kernel="reference")


def _no_key_gradient(q, k, v, cu_seqlens, max_seqlen):
    return codegen.packed_attention(q, k.detach(), v, cu_seqlens, max_seqlen, kernel="reference") + 0.0 * k.sum()


@pytest.mark.parametrize("attend, wrong", [(_reference(causal=False), "out"), (_across_sequences, "out"),
                                           (_no_key_gradient, "dk")])
def test_the_comparison_catches_a_wrong_kernel(attend, wrong):
    errors = dc.attention_errors(TINY, "fp32", torch.device("cpu"), attend)
    assert errors[wrong] > 0.05
    check = dc.correctness_check(TINY, errors, None, dc.ATTENTION_TOLERANCE["fp32"], dtype="fp32")
    assert not check.passed and "worst error" in check.detail


def _row(method: str, tflops: float | None, note: str = "") -> Row:
    return Row(mix="m", method=method, num_seqs=3, total_tokens=96, max_seqlen=64, fwd_bwd_tflops=tflops, note=note)


def test_speed_check_needs_ours_and_one_torch_varlen_path():
    lengths = [64, 16, 16]
    good = dc.speed_check("m", lengths, [_row("hydraulis", 300.0), _row("varlen_attn", 400.0), _row("flex", 200.0),
                                         _row("sdpa_padded", 100.0)])
    assert good.passed and good.numbers["vs_varlen_attn"] == 0.75 and good.numbers["sdpa_padded_tflops"] == 100.0
    ours_failed = dc.speed_check("m", lengths, [_row("hydraulis", None, "RuntimeError: boom"), _row("flex", 200.0)])
    assert not ours_failed.passed and "ours was not timed" in ours_failed.detail and "boom" in ours_failed.detail
    alone = dc.speed_check("m", lengths, [_row("hydraulis", 300.0), _row("sdpa_padded", 100.0)])
    assert not alone.passed and "no torch varlen path" in alone.detail
    assert dc.speed_methods()[0] == "hydraulis" and dc.speed_methods()[-1] == "sdpa_padded"


def _run(**changes) -> TrainRun:
    fields = dict(losses=(10.4, 10.0, 9.6), reference=(10.41, 10.02, 9.61), compilations=(1, 1, 1),
                  step_s=(60.0, 0.5, 0.5), tokens=(8192, 8192, 8192), flops=(3e14, 3e14, 3e14), params=124_700_000,
                  kernel_calls=(("triton", 72), ("cpu-flash", 0), ("reference", 0)))
    return TrainRun(**{**fields, **changes})


def test_training_checks_pass_a_good_run_and_report_throughput_and_mfu():
    run = _run()
    assert run.tokens_per_s() == 16384 and run.achieved_tflops() == pytest.approx(600.0)
    loss, recompiles, speed = dc.training_checks(run, peak_tflops=1979.0)
    assert loss.passed and recompiles.passed and speed.passed, (loss, recompiles, speed)
    assert speed.numbers["mfu"] == pytest.approx(600 / 1979, abs=1e-4) and speed.numbers["tokens_per_s"] == 16384


@pytest.mark.parametrize("changes, failing", [
    ({"losses": (10.4, 10.0, 9.0)}, 0),  # 6% off fp32 eager
    ({"compilations": (1, 1, 2)}, 1),  # compiled again after warm-up
    ({"compilations": (0, 0, 0)}, 1),  # nothing was compiled: "no recompilation" would mean nothing
    ({"kernel_calls": (("triton", 72), ("reference", 12))}, 2),  # some attention ran elsewhere
    ({"kernel_calls": (("triton", 0),)}, 2),  # none ran: the attention was not packed
])
def test_training_checks_fail_what_is_wrong(changes, failing):
    checks = dc.training_checks(_run(**changes), peak_tflops=989.0)
    assert [c.passed for c in checks] == [i != failing for i in range(3)]


def test_an_mfu_above_one_fails_the_throughput():
    *_, speed = dc.training_checks(_run(), peak_tflops=312.0)
    assert not speed.passed and "MFU" in speed.detail


def test_preset_check_names_the_device_and_compares_its_memory():
    check, peak = dc.preset_check("NVIDIA H200", 139.8)
    assert check.passed and peak == 989.0 and check.numbers["preset"] == "h200-141g"
    check, _ = dc.preset_check("NVIDIA H100 80GB HBM3", 39.4)
    assert not check.passed and "off the device's" in check.detail
    check, peak = dc.preset_check("NVIDIA H100 PCIe", 79.2)
    assert not check.passed and peak is None and "'NVIDIA H100 PCIe'" in check.detail


def test_step_batches_cut_one_stream_into_varying_sequence_counts():
    setup = TrainSetup(model=LlamaConfig(), tokens=96, steps=5)
    batches = step_batches(setup)
    assert len(batches) == 5 and len({len(b) for b in batches}) == 5
    streams = [torch.cat(b) for b in batches]
    assert all(len(s) == 96 and torch.equal(s, streams[0]) for s in streams)
    assert all(len(seq) >= 2 for b in batches for seq in b)


def test_the_125m_model_and_its_flops():
    with torch.device("meta"):
        model = Llama(LLAMA_125M)
    params = sum(p.numel() for p in model.parameters())
    assert 120e6 < params < 130e6
    cfg, multiplying = LLAMA_125M, matmul_params(model)
    assert multiplying == params - cfg.vocab * cfg.hidden - (2 * cfg.layers + 1) * cfg.hidden  # table, norm scales
    attention = 4 * (100 * 100 + 28 * 28) / 2 * cfg.heads * cfg.head_dim
    assert step_flops(cfg, multiplying, [100, 28]) == pytest.approx(6 * multiplying * 128 + 3 * cfg.layers * attention)


TRAIN_SCRIPT = """
import json, torch
from benchmarks.device_train import TrainSetup, run_training
from hcompile.models import LlamaConfig
run = run_training(TrainSetup(model=LlamaConfig(), tokens=96, steps=3, compile_backend="aot_eager",
                              param_dtype=torch.float32))
print(json.dumps({"losses": run.losses, "reference": run.reference, "compilations": run.compilations,
                  "step_s": run.step_s, "tokens": run.tokens, "flops": run.flops, "params": run.params,
                  "kernel_calls": run.kernel_calls}))
"""


def test_part_c_trains_on_the_cpu_equal_to_fp32_eager_without_recompiling(tmp_path):
    out = subprocess.run([sys.executable, "-c", TRAIN_SCRIPT], capture_output=True, text=True, timeout=300,
                         env=_env(), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout.strip().splitlines()[-1])
    data["kernel_calls"] = [tuple(pair) for pair in data["kernel_calls"]]
    run = TrainRun(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
    assert run.kernels_run() == ("cpu-flash",)
    assert max(run.loss_errors()) < 1e-5 and run.losses[-1] < run.losses[0]
    checks = dc.training_checks(run, peak_tflops=None, kernel="cpu-flash", tolerance=1e-5)
    assert all(c.passed for c in checks), checks


def test_part_d_profiles_and_plans_on_the_cpu(tmp_path):
    written, planned = dc.check_profile(tmp_path, device=None, measured_on="cpu")
    assert written.passed and planned.passed, (written, planned)
    assert written.numbers["b"] > 0 and planned.numbers["policies"] >= 2


def test_part_d_fails_on_a_profile_that_does_not_run_or_does_not_plan(tmp_path):
    (failed,) = dc.check_profile(tmp_path, device="no-such-device", measured_on="x", timeout_s=120)
    assert not failed.passed and "exited" in failed.detail
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": {}}')
    check = dc.plan_check(bad, tmp_path, gpus=1, timeout_s=120)
    assert not check.passed and "exited 2" in check.detail


def test_part_e_trains_every_strategy_equal_to_one_device_on_two_cpu_ranks(tmp_path):
    """Part (e)'s job on gloo CPU ranks: tp2 and a two-stage pipeline with several micro-batches equal to
    single-process SGD, plain and overlapped movement timed, the compute's slowdown beside transfers probed; its
    lines pass (no memory line off a GPU)."""
    from dist_util import run_ranks

    from benchmarks.device_multi import multi_gpu_checks, multi_gpu_job

    results = run_ranks(2, tmp_path, multi_gpu_job, 2, timeout_s=400)
    checks = multi_gpu_checks(results, 2)
    assert [c.name for c in checks] == ["1x(tp2) equals one device", "1x(pp2) equals one device",
                                        "movement overlapped with compute"]
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    assert checks[1].numbers["micro_batches"] >= 2
    # the slowdown the GPU presets assume, probed where the job runs (2 ranks sharing this host's cores)
    assert checks[2].numbers["slowdown"] > 0 and checks[2].numbers["slowdown_assumed"] == 0.05
