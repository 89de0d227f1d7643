"""benchmarks.attention: its --smoke mode end to end, and the CPU-checkable parts of the GPU path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from codegen_cases import make_batch, relative_error

import codegen
from benchmarks import attention

ROOT = Path(__file__).resolve().parent.parent


def test_smoke_mode_checks_correctness_and_writes_stamped_json_lines(tmp_path):
    out = tmp_path / "attention.jsonl"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-m", "benchmarks.attention", "--smoke", "--out", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert row["commit"] and row["device"] and row["config"]["dtype"] == "fp32"
        assert max(row["extra"]["max_relative_error"].values()) < 1e-4
    if not torch.cuda.is_available():
        assert "no GPU timing was taken" in result.stdout
        assert all(row["fwd_ms"] is None for row in rows)


def test_without_gpu_the_timed_mode_refuses_instead_of_claiming_speeds():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert attention.main(["--out", os.devnull]) == 2


def test_flops_formula():
    # one sequence of 1024 tokens, 32 heads of 128: 4 * 1024^2 / 2 * 32 * 128
    assert attention.attention_flops([1024], 32, 128) == 4 * 1024**2 / 2 * 32 * 128
    assert attention.attention_flops([3, 5], 1, 1, causal=False) == 4 * (9 + 25)


def test_length_mixes_fill_the_budget():
    mixes = attention.length_mixes(65536, seed=0)
    assert set(mixes) == {"short-64-512", "uniform-512-8k", "long-tail", "one-32k"}
    assert sum(mixes["short-64-512"]) == sum(mixes["uniform-512-8k"]) == sum(mixes["long-tail"]) == 65536
    assert max(mixes["short-64-512"]) <= 512
    assert mixes["one-32k"] == [32768]
    assert all(length <= 8192 for length in mixes["uniform-512-8k"])
    assert min(mixes["long-tail"]) < 512 and max(mixes["long-tail"]) > 4096


def test_padded_sdpa_baseline_computes_packed_attention():
    batch = make_batch([5, 12, 1], heads_q=4, heads_kv=2, head_dim=16)
    case = attention.make_case("sdpa_padded", *batch.inputs())
    assert case.leaves[0].shape == (3, 4, 12, 16)  # (batch, heads, max_seqlen, d)
    got = attention.unpad(case.forward(), batch.cu_seqlens.tolist())
    want = codegen.packed_attention(*batch.inputs(), kernel="reference")
    assert relative_error(got, want) < 1e-5


def test_hydraulis_case_runs_the_triton_op(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    batch = make_batch([7, 3], heads_q=2, heads_kv=1, head_dim=16)
    case = attention.make_case("hydraulis", *batch.inputs())
    out = case.forward()
    grads = torch.autograd.grad(out, case.leaves, torch.ones_like(out))
    assert [g.shape for g in grads] == [x.shape for x in (batch.q, batch.k, batch.v)]
    assert relative_error(out, codegen.packed_attention(*batch.inputs(), kernel="reference")) < 1e-4


def test_bad_config_names_the_value():
    with pytest.raises(ValueError, match="heads_q=6 is not a multiple of heads_kv=4"):
        attention.BenchConfig(heads_q=6, heads_kv=4)
    with pytest.raises(ValueError, match="'nope'"):
        attention.BenchConfig(methods=("nope",))


def test_flex_document_mask_baseline_computes_packed_attention():
    batch = make_batch([5, 12, 1, 14], heads_q=4, heads_kv=2, head_dim=16)
    run = attention.flex_runner(batch.cu_seqlens, total=32, compiled=False)
    q, k, v = (x.detach() for x in (batch.q, batch.k, batch.v))  # flex has no CPU backward
    got = run(q, k, v, batch.cu_seqlens, batch.max_seqlen)
    want = codegen.packed_attention(*batch.inputs(), kernel="reference")
    assert relative_error(got, want) < 1e-5
