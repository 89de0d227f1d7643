"""`hcompile plan` and `hcompile profile` on bad input: exit status 2 and one line that names the value, checked
before any planning or profiling; outputs written atomically."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from hcompile.cli import main

FAST = ["plan", "--gpus", "64", "--global-tokens", "40000", "--steps", "2"]


def _profile(tmp_path, change) -> str:
    data = json.loads(resources.files("passes.plan").joinpath("data/profiles/a800-llama-7b.json").read_text())
    change(data)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data).replace("NaN", "NaN"))
    return str(path)


def _set(path: list, value):
    def change(data):
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return change


CASES = {
    "non-integer layers": (lambda t: ["--profile", _profile(t, _set(["model", "layers"], 2.5))], "layers"),
    "layers text": (lambda t: ["--profile", _profile(t, _set(["model", "layers"], "many"))], "layers"),
    "activation table as a list": (lambda t: ["--profile", _profile(t, _set(
        ["memory", "activation_bytes_per_token_hidden_layer"], [36, 37]))], "activation"),
    "NaN memory": (lambda t: ["--profile", _profile(t, _set(["hardware", "memory_bound_mib"], float("nan")))],
                   "memory_bound_mib"),
    "profile is a folder": (lambda t: ["--profile", str(t)], "is a folder"),
    "negative seed": (lambda t: ["--seed", "-1"], "-1"),
    "plans-out is a folder": (lambda t: ["--plans-out", str(t)], "is a folder"),
    "plans-out in a missing folder": (lambda t: ["--plans-out", str(t / "no" / "p.jsonl")], "does not exist"),
    "huge histogram count": (lambda t: ["--lengths", _write(t / "h.json", '{"lengths": {"5": 100000000000}}')],
                             "100000000000"),
}


def _write(path, text) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_bad_input_exits_2_with_one_line(tmp_path, capsys, case):
    build, needle = CASES[case]
    assert main([*FAST, *build(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def test_profile_out_is_checked_before_profiling(tmp_path, capsys):
    assert main(["profile", "--smoke", "--out", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert main(["profile", "--smoke", "--out", str(tmp_path / "missing" / "p.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a machine with GPUs can profile on them")
def test_profile_on_cuda_without_gpus_is_refused_before_profiling(tmp_path, capsys):
    assert main(["profile", "--smoke", "--device", "cuda", "--out", str(tmp_path / "p.json")]) == 2
    assert "--device cuda needs 2 GPUs for tp 2, this machine has 0" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()
