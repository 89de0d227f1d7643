"""Length datasets: presets, user files, batch sampling, validation."""

import json

import pytest

from passes.plan.datasets import LengthDataset, load_dataset, read_lengths_file, sample_batches
from passes.plan.ir import PlanError


@pytest.mark.parametrize("name", ["commoncrawl", "github", "python-code"])
def test_presets_load(name):
    d = load_dataset(name)
    assert d.num_seqs > 1000 and 1 <= min(d.lengths) and d.max_len <= 32768


def test_batches_exact_budget_deterministic_and_truncated():
    d = load_dataset("commoncrawl")
    a = sample_batches(d, 50_000, 3, seed=7)
    assert a == sample_batches(d, 50_000, 3, seed=7)
    assert a != sample_batches(d, 50_000, 3, seed=8)
    assert all(sum(b) == 50_000 and min(b) >= 1 for b in a)
    tiny = LengthDataset.from_lengths("t", [1000])
    assert sample_batches(tiny, 2500, 1, 0) == [[1000, 1000, 500]]


def test_text_file_is_a_batch(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("5\n\n17\n3\n")
    assert read_lengths_file(f) == [5, 17, 3]


def test_json_file_is_a_histogram(tmp_path):
    f = tmp_path / "h.json"
    f.write_text(json.dumps({"lengths": {"10": 2, "3": 1}}))
    d = read_lengths_file(f)
    assert d.lengths == (3, 10) and d.counts == (1, 2) and d.name == "h"


@pytest.mark.parametrize("content,message", [
    ("5\n0\n", "line 2: a sequence length must be a positive integer, got '0'"),
    ("5\n-3\n", "got '-3'"),
    ("5\n2.5\n", "got '2.5'"),
    ("abc\n", "got 'abc'"),
    ("\n\n", "the batch is empty"),
    ('{"lengths": {"4": 0}}', "a count must be a positive integer, got 0"),
    ('{"counts": {}}', "expected a JSON object with a 'lengths' histogram"),
])
def test_bad_files(tmp_path, content, message):
    f = tmp_path / "bad.txt"
    f.write_text(content)
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_lengths_file(f)


def test_unknown_dataset_and_bad_budget():
    with pytest.raises(PlanError, match="unknown dataset 'wiki'"):
        load_dataset("wiki")
    with pytest.raises(PlanError, match="global tokens must be a positive integer, got 0"):
        sample_batches(load_dataset("github"), 0, 1, 0)
