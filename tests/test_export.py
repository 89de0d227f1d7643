"""The way back out: ``Trainer.save_pretrained`` writes a Hugging Face folder that ``from_pretrained`` loads with
the trained parameters (same logits), from a run on 2 gloo ranks under tensor parallelism; shards and their
index above a size; bad destinations and non-finite weights refused with the target unchanged."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dist_util import run_ranks  # noqa: E402

import hcompile  # noqa: E402
from hcompile.export import parse_size, save_pretrained  # noqa: E402
from passes.graph.variant import TokenBuckets  # noqa: E402
from runtime.fixed_layout import FixedLayout  # noqa: E402


def _model(tie: bool = True):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=tie, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


def _train_and_export(rank, world, out, max_shard_size):
    import hcompile

    trainer = hcompile.compile(_model(), buckets=TokenBuckets.powers_of_two(16, 64)).trainer(
        optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.5}, strategies=["1x(tp2)"], tokens_per_rank=32)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        trainer.train_step([torch.randint(0, 64, (n,), generator=g) for n in (9, 14, 5)])
    files = trainer.save_pretrained(out, max_shard_size=max_shard_size)
    return files, trainer.full_state_dict()


def test_save_pretrained_loads_back_with_the_trained_parameters(tmp_path):
    out = tmp_path / "exported"
    (files, state), _ = run_ranks(2, tmp_path, _train_and_export, str(out), "5GB", timeout_s=300)
    assert files == ["config.json", "generation_config.json", "model.safetensors"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    params = dict(loaded.named_parameters())
    assert set(params) - {"lm_head.weight"} == set(state)  # tied: written once, tied again on load
    for name, value in state.items():
        torch.testing.assert_close(params[name].detach(), value, rtol=0, atol=0, msg=name)
    reference = _model()
    reference.load_state_dict(state, strict=False)
    ids = torch.randint(0, 64, (1, 11), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(loaded(ids).logits, reference(ids).logits)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir()), "the staging folder was left behind"


def test_large_models_are_written_in_shards_with_an_index(tmp_path):
    out = tmp_path / "sharded"
    (files, state), _ = run_ranks(2, tmp_path, _train_and_export, str(out), "20KB", timeout_s=300)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted({f for f in index["weight_map"].values()})
    assert len(shards) > 1 and set(shards) <= set(files) and set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(4 * v.numel() for v in state.values())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    for name, value in state.items():
        torch.testing.assert_close(loaded.get_parameter(name).detach(), value, rtol=0, atol=0, msg=name)


def test_sizes_and_destinations_are_checked(tmp_path):
    assert parse_size("5GB") == 5 * 10 ** 9 and parse_size("500MiB") == 500 * 2 ** 20 and parse_size(7) == 7
    for bad in ("lots", 0, -3, "0KB", True):
        with pytest.raises(ValueError, match="max_shard_size must be a positive byte count"):
            parse_size(bad)
    model = _model()
    layout = FixedLayout.from_tensors(dict(model.named_parameters()), 0, 1)
    (tmp_path / "a_file").write_text("keep me")
    with pytest.raises(ValueError, match="it is a file"):
        save_pretrained(model, layout, tmp_path / "a_file")
    with pytest.raises(ValueError, match="does not exist"):
        save_pretrained(model, layout, tmp_path / "missing" / "out")
    assert (tmp_path / "a_file").read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    assert save_pretrained(model, layout, tmp_path / "out") == ["config.json", "generation_config.json",
                                                                "model.safetensors"]
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"  # what the export does not write is left alone
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    with torch.no_grad():
        layout.shard[3] = float("nan")
    with pytest.raises(hcompile.NonFiniteError, match="holds 1 non-finite values .*; nothing in it was changed"):
        save_pretrained(model, layout, tmp_path / "out")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "out"]  # no staging folder left
