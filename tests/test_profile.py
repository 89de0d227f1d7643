"""hcompile profile: the non-negative fit, the sweep, job validation, and the CLI's smoke run writing a
profile that ``hcompile plan --profile`` accepts."""

import json

import numpy as np
import pytest

from hcompile.cli import main
from hcompile.tools.profile import ProfileJob, default_cps, fit_nonnegative, sweep_packs, token_buckets
from passes.plan.cost_model import build_cost_model, load_profile_file
from passes.plan.ir import ParallelScheme, PlanError, Strategy


def test_fit_recovers_coefficients_and_stays_nonnegative():
    rng = np.random.default_rng(0)
    x = np.column_stack([rng.uniform(0, 1e6, 40), rng.uniform(0, 2e3, 40), np.ones(40)])
    y = x @ np.array([2e-5, 0.3, 4.0])
    got = fit_nonnegative(x, y, 1.0 / y)
    np.testing.assert_allclose(got, [2e-5, 0.3, 4.0], rtol=1e-6)
    # data that an unconstrained fit would explain with a negative intercept
    y2 = x[:, 1] * 0.5 - 3.0 + 1e-9 * x[:, 0]
    y2 = np.maximum(y2, 1.0)
    got2 = fit_nonnegative(x, y2, np.ones_like(y2))
    assert np.all(got2 >= 0)


def test_sweep_packs_fill_buckets_and_hold_out_other_lengths():
    buckets = token_buckets(512)
    assert buckets.sizes[0] == 64 and buckets.sizes[-1] >= 512
    packs = sweep_packs(512, buckets, seed=1)
    assert {sum(lens) for lens, _ in packs} <= set(buckets.sizes)
    fitted = {s for lens, held in packs if not held for s in lens}
    held = [lens for lens, h in packs if h]
    assert held and all(len(lens) >= 2 for lens in held)
    assert any(s not in fitted for lens in held for s in lens)


@pytest.mark.parametrize("kwargs, needle", [
    ({"model": "gpt-9"}, "gpt-9"), ({"tps": (3,)}, "3"), ({"tokens_per_rank": 100}, "100"),
    ({"gpus": 6, "tps": (4,)}, "6"), ({"cps": (1,)}, "got 1"), ({"cps": (3,)}, "tp1,cp3"),
    ({"cps": (2, 2)}, "twice"),
])
def test_bad_jobs_quote_the_value(kwargs, needle):
    with pytest.raises(PlanError, match=needle):
        ProfileJob(**kwargs)


def test_cp2_is_profiled_by_default_only_where_the_cluster_holds_it():
    assert default_cps((1, 2, 4), gpus=4) == (2,)
    assert default_cps((1,), gpus=1) == () and default_cps((2, 4), gpus=4) == (2,) and default_cps((4,), gpus=4) == ()


def test_cli_bad_model_exits_2(capsys):
    assert main(["profile", "--model", "nope", "--out", "/dev/null"]) == 2
    assert "nope" in capsys.readouterr().err


def test_smoke_profile_is_accepted_by_plan(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    assert main(["profile", "--smoke", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(s["tp"], s.get("cp", 1)) for s in data["schemes"]] == [(1, 1), (2, 1), (1, 2)]
    for s in data["schemes"]:
        assert min(s["a"], s["b"], s["c"]) >= 0 and "r2" in s and "mape_held_out" in s
    cp_entry = data["schemes"][2]  # (tp1,cp2) on 2 ranks, packs of up to twice tp1's cap
    assert cp_entry["derived_mape"] >= 0 and "derived_mape" not in data["schemes"][0]
    cp_packs = [m["seq_lens"] for m in data["measurements"] if m["cp"] == 2]
    assert max(sum(lens) for lens in cp_packs) == 2 * max(sum(m["seq_lens"]) for m in data["measurements"]
                                                          if (m["tp"], m["cp"]) == (1, 1))
    assert any(m["held_out"] for m in data["measurements"])
    profile = load_profile_file(out)
    assert profile.layers == 2 and profile.hidden == 32
    cost = build_cost_model(profile, Strategy.homogeneous(ParallelScheme(tp=1), 4))
    measured = cost.cost(ParallelScheme(tp=1, cp=2))  # the planner takes the measured CP cost, not a derived one
    assert (measured.a, measured.b, measured.c, measured.exchange) == (cp_entry["a"], cp_entry["b"], cp_entry["c"], 0)
    assert measured.max_tokens > cost.max_tokens(ParallelScheme(tp=1))
    probe = data["link_probe"]  # gloo between local processes: one node, the same links both ways
    assert profile.links is not None and profile.links.intra_gbps == profile.links.inter_gbps > 0
    assert profile.links.intra_gbps == pytest.approx(probe["pair_gbps"], rel=1e-3)  # a transfer alone
    assert profile.links.host_gbps == pytest.approx(2 * probe["gbps"], rel=1e-3)  # 2 probing ranks at once
    # probed: compute beside transfers is slower where the ranks share cores (0 would mean not probed)
    assert profile.links.overlap_slowdown == pytest.approx(probe["overlap_slowdown"], abs=1e-4)
    assert profile.links.overlap_slowdown > 0
    sizes = [n for n, _ in probe["round_ms"]]
    assert sizes == sorted(sizes) and len(sizes) >= 2 and all(ms > 0 for _, ms in probe["round_ms"])
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [60, 12, 40, 128, 7, 33]) + "\n")
    capsys.readouterr()
    assert main(["plan", "--profile", str(out), "--gpus", "4", "--lengths", str(lengths),
                 "--global-tokens", "200", "--steps", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["policies"]) >= {"hydraulis", "homogeneous-token"}
    assert report["movement"]["links"]["intra_gbps"] == profile.links.intra_gbps  # the measured links charged
    assert all(p["est_comm_ms_mean"] > 0 for p in report["policies"].values())
