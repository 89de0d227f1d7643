"""The way back out: ``Trainer.save_pretrained`` writes a Hugging Face folder that ``from_pretrained`` loads with
the trained parameters (same logits), from a run on 2 gloo ranks under tensor parallelism; shards and their
index above a size; bad destinations, non-floating dtypes and non-finite weights refused with the target unchanged;
persistent buffers written as ``state_dict()`` holds them. Kills during an export: ``test_export_kills.py``."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dist_util import run_ranks  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import hcompile  # noqa: E402
from hcompile.export import export_dtype, parse_size, save_pretrained  # noqa: E402
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


def test_only_floating_dtypes_are_written_and_refusals_write_nothing(tmp_path):
    model = _model()
    layout = FixedLayout.from_tensors(dict(model.named_parameters()), 0, 1)
    for bad in (torch.int64, torch.bool, torch.float8_e4m3fn, "int64", "bfloat", None, True, 16):
        with pytest.raises(ValueError, match=r"dtype must be a floating dtype: torch.float32, .*got " + repr(bad)[:5]):
            save_pretrained(model, layout, tmp_path / "out", dtype=bad)
    assert list(tmp_path.iterdir()) == []  # nothing written, not even beside the target
    for name, dtype in (("bfloat16", torch.bfloat16), ("torch.float16", torch.float16), ("fp32", torch.float32)):
        out = tmp_path / name
        save_pretrained(model, layout, out, dtype=name)
        tensors = load_file(out / "model.safetensors")
        assert {t.dtype for t in tensors.values()} == {dtype}
        assert json.loads((out / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
        assert export_dtype(dtype) is dtype


class _Scaled(torch.nn.Module):
    """A model with a persistent buffer used in forward, a non-persistent one, an integer one, and one
    buffer under two names."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 0.5))
        self.register_buffer("cache", torch.ones(4), persistent=False)
        self.register_buffer("seen", torch.tensor([7], dtype=torch.int64))
        self.inner = torch.nn.Module()
        self.inner.register_buffer("scale", self.scale)

    def forward(self, x):
        return self.proj(x) * self.scale * self.cache


def test_persistent_buffers_are_exported_as_state_dict_holds_them(tmp_path):
    torch.manual_seed(0)
    model = _Scaled()
    layout = FixedLayout.from_tensors(dict(model.named_parameters()), 0, 1)
    assert save_pretrained(model, layout, tmp_path / "out") == ["model.safetensors"]
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert set(tensors) == set(model.state_dict()) == {"proj.weight", "proj.bias", "scale", "seen", "inner.scale"}
    for name, value in model.state_dict().items():
        assert torch.equal(tensors[name], value), name
    fresh = _Scaled()
    fresh.load_state_dict(tensors)  # strict: nothing missing, nothing unexpected
    save_pretrained(model, layout, tmp_path / "half", dtype="bfloat16")
    half = load_file(tmp_path / "half" / "model.safetensors")
    assert half["scale"].dtype == torch.bfloat16 and half["seen"].dtype == torch.int64 and half["seen"].item() == 7
