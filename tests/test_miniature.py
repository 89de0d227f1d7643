"""The self-check at any size: a ``transformers`` model above ``self_check_max_params`` is checked on its miniature
(``hcompile.miniature``). The shrinker keeps every layer and its kind (LLaMA; Gemma 2 and 3's sliding and global
layers; Qwen 3 MoE's and Mixtral's experts, interleaved) with far fewer parameters and the heads' divisibility by
every TP degree; a LLaMA above the bound trains after its miniature passed, and a lowering made wrong on purpose
(packed attention made non-causal) is refused through the miniature before the first step, nothing changed; a
model without a miniature is not checked, with a warning saying why."""

from __future__ import annotations

import logging

import pytest
import torch

import hcompile
from hcompile.miniature import NotShrinkable, build_miniature, shrink_config
from passes.graph.variant import TokenBuckets

transformers = pytest.importorskip("transformers")

TPS = (1, 2, 4, 8)


def _on_meta(cls, config):
    with torch.device("meta"):
        return cls(config)


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _kinds(model) -> list[tuple]:
    """Per layer: its attention kind and the classes of its attention and MLP."""
    return [(getattr(layer, "attention_type", None), type(layer.self_attn).__name__,
             type(getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)).__name__)
            for layer in model.model.layers]


CONFIGS = {
    "llama": (transformers.LlamaForCausalLM, lambda: transformers.LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4, num_hidden_layers=3,
        vocab_size=32000, bos_token_id=31999, eos_token_id=[31998, 31999])),
    "gemma2": (transformers.Gemma2ForCausalLM, lambda: transformers.Gemma2Config(
        hidden_size=768, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
        num_hidden_layers=4, vocab_size=32000, sliding_window=512)),
    "gemma3": (transformers.Gemma3ForCausalLM, lambda: transformers.Gemma3TextConfig(
        hidden_size=1024, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
        num_hidden_layers=7, vocab_size=32000, sliding_window=512)),
    "qwen3_moe": (transformers.Qwen3MoeForCausalLM, lambda: transformers.Qwen3MoeConfig(
        hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_experts=64, num_experts_per_tok=8,
        num_attention_heads=16, num_key_value_heads=4, num_hidden_layers=4, vocab_size=32000, decoder_sparse_step=2,
        mlp_only_layers=[0])),
    "mixtral": (transformers.MixtralForCausalLM, lambda: transformers.MixtralConfig(
        hidden_size=1024, intermediate_size=2048, num_local_experts=8, num_experts_per_tok=2, num_attention_heads=16,
        num_key_value_heads=8, num_hidden_layers=3, vocab_size=32000, sliding_window=256)),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_miniature_keeps_every_layer_and_its_kind_with_far_fewer_parameters(name):
    cls, make = CONFIGS[name]
    config = make()
    model = _on_meta(cls, config)
    mini = build_miniature(model, TPS)
    c = mini.config
    assert _count(mini) * 10 < _count(model), (_count(mini), _count(model))
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in mini.parameters())
    assert _kinds(mini) == _kinds(model)
    for key in ("num_hidden_layers", "layer_types", "sliding_window", "max_position_embeddings", "num_experts_per_tok",
                "decoder_sparse_step", "mlp_only_layers", "tie_word_embeddings", "rope_parameters"):
        assert getattr(c, key, None) == getattr(config, key, None), key
    kv = config.num_key_value_heads
    assert c.num_attention_heads // c.num_key_value_heads == config.num_attention_heads // kv
    assert all((c.num_key_value_heads % t == 0) == (kv % t == 0) for t in (*TPS, 16))
    assert c.intermediate_size % 8 == 0 and c.vocab_size % 8 == 0
    for key in ("num_experts", "num_local_experts"):
        if getattr(config, key, None):
            assert config.num_experts_per_tok < getattr(c, key) <= getattr(config, key)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        ids = getattr(c, key, None)
        assert all(i < c.vocab_size for i in (ids if isinstance(ids, list) else [ids]) if i is not None)
    again = build_miniature(model, TPS)  # the same on every rank
    assert all(torch.equal(a, b) for a, b in zip(mini.parameters(), again.parameters()))


def test_a_70b_llama_has_a_miniature_of_well_under_a_tenth_of_a_percent():
    config = transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                                      num_key_value_heads=8, num_hidden_layers=80, vocab_size=128256)
    model = _on_meta(transformers.LlamaForCausalLM, config)
    mini = shrink_config(config, (1, 2, 4, 8, 16))
    assert (mini.num_hidden_layers, mini.num_attention_heads, mini.num_key_value_heads) == (80, 64, 8)
    mini_model = _on_meta(transformers.LlamaForCausalLM, mini)
    assert _count(mini_model) < _count(model) / 1000


def test_what_has_no_miniature_says_why():
    with pytest.raises(NotShrinkable, match="not a transformers PreTrainedModel"):
        build_miniature(torch.nn.Linear(4, 4))
    with pytest.raises(NotShrinkable, match="composite config"):
        shrink_config(transformers.Gemma3Config())


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=8,
                                      num_key_value_heads=4, head_dim=16, num_hidden_layers=2, vocab_size=512,
                                      max_position_embeddings=256, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


def _trainer(model):
    return hcompile.compile(model, buckets=TokenBuckets(sizes=(64,))).trainer(
        loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.5}, strategies=["1x(tp1)"],
        tokens_per_rank=64, self_check_max_params=1000, calibrate=False)


BATCH_LENS = (40, 9, 14)


def _batch():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 512, (n,), generator=g) for n in BATCH_LENS]


def test_a_model_above_the_bound_is_checked_on_its_miniature(caplog):
    with caplog.at_level(logging.INFO, logger="hcompile"):
        trainer = _trainer(_llama())
        trainer.train_step(_batch(), strategy="1x(tp1)")
    mini = trainer._miniature
    assert mini is not None and mini.params < 200_000
    assert {(key[0].describe(), key[1]) for key in mini.checked} == {("(tp1,pp1)", 0)}
    assert not trainer._checked  # the model itself was not probed
    assert any("runs on a miniature of LlamaForCausalLM" in r.getMessage() for r in caplog.records)


def _non_causal(original):
    def broken(graph, node, *args, **kwargs):
        out4 = original(graph, node, *args, **kwargs)
        attention = out4.args[0].args[0]  # unsqueeze(transpose(packed_attention(...)))
        attention.kwargs = {**attention.kwargs, "causal": False}
        return out4
    return broken


def test_a_wrong_lowering_is_refused_through_the_miniature_before_the_first_step(monkeypatch):
    from passes.graph import packed_attention

    monkeypatch.setattr(packed_attention, "_rewrite_sdpa", _non_causal(packed_attention._rewrite_sdpa))
    trainer = _trainer(_llama())
    before = trainer.full_state_dict()
    with pytest.raises(hcompile.LoweringError) as refused:
        trainer.train_step(_batch(), strategy="1x(tp1)")
    message = str(refused.value)
    assert "does not train this model correctly" in message and "(tp1,pp1)" in message, message
    assert f"the check ran on a miniature of {trainer._miniature.params} parameters" in message, message
    assert all(torch.equal(before[n], p) for n, p in trainer.full_state_dict().items())


def test_a_model_without_a_miniature_is_skipped_with_the_reason(caplog):
    from forms_lm import FormsLM

    with caplog.at_level(logging.WARNING, logger="hcompile"):
        trainer = hcompile.compile(FormsLM(), buckets=TokenBuckets(sizes=(16,))).trainer(
            optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.5}, strategies=["1x(tp1)"], tokens_per_rank=16,
            self_check_max_params=10, calibrate=False)
    assert trainer._miniature is None
    warning = next(r.getMessage() for r in caplog.records if "self-check is skipped" in r.getMessage())
    assert "no miniature" in warning and "not a transformers PreTrainedModel" in warning, warning
    assert "refused at every size" in warning


def _qwen3_tp2_run():
    torch.manual_seed(0)
    config = transformers.Qwen3Config(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                                      num_key_value_heads=4, head_dim=32, num_hidden_layers=2, vocab_size=1024,
                                      max_position_embeddings=256, attn_implementation="sdpa")
    trainer = hcompile.compile(transformers.Qwen3ForCausalLM(config), buckets=TokenBuckets(sizes=(64,))).trainer(
        loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.5}, strategies=["1x(tp2)"],
        tokens_per_rank=64, self_check_max_params=100_000, calibrate=False)
    before = trainer.full_state_dict()
    try:
        trainer.train_step(_batch(), strategy="1x(tp2)")
    except hcompile.LoweringError as e:
        return str(e), all(torch.equal(before[n], p) for n, p in trainer.full_state_dict().items())
    return None, sorted((k[0].describe(), k[1]) for k in trainer._miniature.checked)


def _qwen3_tp2(rank, world):
    from passes.graph import tensor_parallel

    right = _qwen3_tp2_run()
    # Qwen 3's silent defect put back: per-head q/k norm weights without their gradient sum under tp2
    tensor_parallel._Rewriter.reduce_replicated_grads = lambda self, node, new: None
    return right, _qwen3_tp2_run()


def test_a_wrong_tp2_rule_is_refused_on_every_rank_through_the_miniature():
    """Two gloo ranks, a Qwen 3 above the bound under 1x(tp2): its miniature passes each TP rank's check; with
    the q/k norms' gradient sum switched off, the same refusal on both ranks names them, nothing changed."""
    from dist_util import run_ranks

    results = run_ranks(2, None, _qwen3_tp2, timeout_s=300)
    for rank, ((message, checked), _) in enumerate(results):
        assert message is None and ("(tp2,pp1)", rank) in checked, (message, checked)
    wrong = [w for _, w in results]
    assert len({message for message, _ in wrong}) == 1 and all(unchanged for _, unchanged in wrong), wrong
    message = wrong[0][0]
    assert "(tp2,pp1)" in message and "the check ran on a miniature of" in message, message
    assert "model.layers.0.self_attn.q_norm.weight" in message and "k_norm.weight" in message, message
