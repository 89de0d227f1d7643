"""Reference models: configs validate and quote, RoPE positions from arange equal explicit position_ids."""

import pytest
import torch

from hcompile.models import GPT, GPTConfig, Llama, LlamaConfig, init_weights_, llama_preset


def test_configs_validate_and_quote():
    with pytest.raises(ValueError, match="hidden 30 is not a multiple of heads 4"):
        GPTConfig(hidden=30)
    with pytest.raises(ValueError, match="heads 4 is not a multiple of kv_heads 3"):
        LlamaConfig(kv_heads=3)
    with pytest.raises(ValueError, match="unknown llama preset '70b'"):
        llama_preset("70b")


def test_llama_builds_its_own_positions_or_takes_position_ids():
    model = init_weights_(Llama())
    ids = torch.randint(0, 96, (2, 7))
    torch.testing.assert_close(model(ids), model(ids, torch.arange(7).expand(2, 7)))


def test_gpt_ties_embeddings_and_is_causal():
    model = init_weights_(GPT())
    assert model.lm_head.weight is model.wte.weight
    ids = torch.randint(0, 96, (1, 9))
    torch.testing.assert_close(model(ids)[:, :5], model(ids[:, :5]), rtol=0, atol=1e-5)
