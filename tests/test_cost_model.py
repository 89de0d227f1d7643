"""Cost-model presets and the memory model against hand-computed values (docs/design.md, section 9)."""

import json
from importlib import resources

import pytest

from passes.plan.cost_model import (
    HCOMPILE_RUNTIME,
    RuntimeMemory,
    build_cost_model,
    default_optimizer_layout,
    hcompile_runtime,
    load_profile,
    load_profile_file,
    max_tokens_for,
    state_bytes,
)
from passes.plan.ir import ParallelScheme, PlanError, Strategy

P32 = load_profile("llama-32b")
LAYOUT_32B_64 = Strategy.parse("4x(tp16)")


@pytest.mark.parametrize("tp,expected", [(16, 43520), (8, 21888), (4, 7808)])
def test_32b_longest_sequences_match_design(tp, expected):
    # docs/design.md, section 9: TP16 43.5K, TP8 21.9K, TP4 7.8K under the 4x(tp16) layout.
    assert max_tokens_for(P32, ParallelScheme(tp=tp), LAYOUT_32B_64) == expected


def test_state_bytes_hand_computed():
    L, H, V, B, alpha = 60, 6656, 30592, 201, 0.75
    # tp4 pp1 under 4x(tp16,pp1): os_dp=4, os_tp=16, os_pp=1
    expected = ((L / 1) * (H * H / 16) * B * alpha / 4 + (L / 1) * (H * H / 4) * B * (1 - alpha)
                + (H * V / 16) * 32 * alpha / 4 + (H * V / 4) * 32 * (1 - alpha))
    assert state_bytes(P32, ParallelScheme(tp=4), LAYOUT_32B_64) == pytest.approx(expected)


def test_hcompile_runtime_state_bytes_hand_computed():
    """This runtime: 16 bytes per parameter (fp32 master, Adam m and v, fp32 shard gradient) over all 64 GPUs,
    the rank's bf16 parameter and fp32 accumulated gradient of its slice, one send and one receive chunk of 16M
    fp32, and the bf16 gradients one of the stage's 4 compiled pieces hands out at once."""
    L, H, V, B = 60, 6656, 30592, 201
    per_h2 = B / 16  # the profiled runtime keeps 16 bytes per parameter
    total = L * H * H * per_h2 + 2 * H * V
    tp4 = (L * H * H * per_h2 + 2 * H * V) / 4  # one stage: every layer, embedding and head
    assert state_bytes(P32, ParallelScheme(tp=4), LAYOUT_32B_64, HCOMPILE_RUNTIME) == pytest.approx(
        total * 16 / 64 + tp4 * (2 + 4 + 2 / 4) + 2 * 2**24 * 4)
    stage = (L / 2) * H * H * per_h2 / 8 + H * V / 8  # (tp8, pp2): half the layers, one H x V matrix
    assert state_bytes(P32, ParallelScheme(tp=8, pp=2), LAYOUT_32B_64, HCOMPILE_RUNTIME) == pytest.approx(
        total * 16 / 64 + stage * (6 + 2 / 4) + 2 * 2**24 * 4)


@pytest.mark.parametrize("tp,expected", [(16, 36608), (8, 15232), (4, 1152)])
def test_hcompile_runtime_longest_sequences(tp, expected):
    """A quarter more sharded state, the fp32 gradient buffer, the transfer chunks, a piece's bf16 gradients and
    the movement's point-to-point buffers to the 63 other GPUs: shorter than the paper's runtime holds."""
    got = max_tokens_for(P32, ParallelScheme(tp=tp), LAYOUT_32B_64, HCOMPILE_RUNTIME)
    assert got == expected < max_tokens_for(P32, ParallelScheme(tp=tp), LAYOUT_32B_64)
    assert "hcompile memory" in build_cost_model(P32, LAYOUT_32B_64, HCOMPILE_RUNTIME).name


def test_runtime_memory_values():
    fp32 = hcompile_runtime(param_bytes=4, reduce_bytes=4, optimizer_bytes=0, chunk_numel=10)
    assert (fp32.sharded_bytes, fp32.compute_bytes, fp32.buffer_bytes) == (8, 8, 80)
    # bf16 compute copies: the parameter in bf16, its gradient accumulated in fp32 unless asked otherwise
    assert hcompile_runtime(param_bytes=2).compute_bytes == 6
    assert hcompile_runtime(param_bytes=2, grad_bytes=2).compute_bytes == 4
    with pytest.raises(PlanError, match="sharded_bytes must be a finite number >= 0, got -1"):
        RuntimeMemory(name="x", sharded_bytes=-1, compute_bytes=0)


def test_4k_sequence_gpu_ms_asymmetry():
    model = build_cost_model(P32, LAYOUT_32B_64)
    tp4, tp16 = model.cost(ParallelScheme(tp=4)), model.cost(ParallelScheme(tp=16))
    assert 4 * tp4.seq_ms(4096) == pytest.approx(4175, abs=1)
    assert 16 * tp16.seq_ms(4096) == pytest.approx(7083, abs=1)


@pytest.mark.parametrize("model,gpus,longest,expected", [
    ("llama-32b", 64, 32768, "4x(tp16,pp1)"),
    ("llama-32b", 1024, 32768, "64x(tp16,pp1)"),
    ("llama-13b", 32, 32768, "4x(tp8,pp1)"),
    ("llama-32b", 64, 4000, "16x(tp4,pp1)"),
])
def test_default_optimizer_layout(model, gpus, longest, expected):
    assert default_optimizer_layout(load_profile(model), gpus, longest).describe() == expected


def test_layout_errors():
    with pytest.raises(PlanError, match="longer than every scheme .*longest supported: 43520"):
        default_optimizer_layout(P32, 64, 50000)
    with pytest.raises(PlanError, match="fills 3 GPUs"):
        default_optimizer_layout(P32, 3, 100)
    with pytest.raises(PlanError, match="must be homogeneous"):
        state_bytes(P32, ParallelScheme(tp=4), Strategy.parse("1x(tp16)+12x(tp4)"))


def test_unknown_presets():
    with pytest.raises(PlanError, match="unknown model 'gpt-5'"):
        load_profile("gpt-5")
    with pytest.raises(PlanError, match="unknown hardware 'h100'"):
        load_profile("llama-7b", "h100")


def test_profile_file_round_trip_and_validation(tmp_path):
    data = json.loads(resources.files("passes.plan").joinpath("data/profiles/a800-llama-7b.json").read_text())
    good = tmp_path / "mine.json"
    good.write_text(json.dumps(data))
    assert load_profile_file(good).schemes == load_profile("llama-7b").schemes
    data["schemes"][0]["b"] = -0.1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="must be a finite number >= 0, got -0.1"):
        load_profile_file(bad)
    with pytest.raises(PlanError, match="does not exist"):
        load_profile_file(tmp_path / "missing.json")
