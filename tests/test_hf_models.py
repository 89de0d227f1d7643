"""Unmodified Hugging Face models (transformers from the package index, sdpa attention) train with the decorator
on 4 gloo ranks under 4x(tp1), 1x(tp2)+2x(tp1), 2x(tp2) and 1x(tp2,pp2), replicas running several micro-batches,
equal to plain single-process SGD at 1e-5: LLaMA and Mistral (GQA through repeat_kv, rotary embeddings from
position ids, a position-built causal mask, sliding window in Mistral), Qwen2 (q/k/v biases) and GPT-2 (Conv1D
as addmm, a fused qkv projection split in three, learned positions, tied embeddings)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dist_util import run_ranks  # noqa: E402
from test_equivalence import reference_sgd  # noqa: E402

from passes.graph.variant import TokenBuckets  # noqa: E402

STRATEGIES = ["4x(tp1)", "1x(tp2)+2x(tp1)", "2x(tp2)", "1x(tp2,pp2)"]
BUCKETS = TokenBuckets.powers_of_two(16, 128)
LENS = [[14, 22, 15, 23, 13, 20, 24, 3, 9], [9, 33, 21, 2, 17, 24, 11, 6], [25, 4, 19, 40, 8, 16, 12],
        [7, 18, 44, 5, 21, 13, 2, 20]]
VOCAB = 64


def make_model(name: str) -> torch.nn.Module:
    """A small model of the named family, seeded, no dropout."""
    T = transformers
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, max_position_embeddings=256, attn_implementation="sdpa")
    if name == "gpt2":
        cfg = T.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0,
                           attn_pdrop=0.0, **common)
        return T.GPT2LMHeadModel(cfg)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, **common)
    cls = {"llama": (T.LlamaConfig, T.LlamaForCausalLM), "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
           "mistral": (T.MistralConfig, T.MistralForCausalLM)}[name]
    return cls[1](cls[0](**sizes))


def _batches() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(21)
    return [[torch.randint(0, VOCAB, (n,), generator=g) for n in lens] for lens in LENS]


def _train(rank, world, name):
    import hcompile

    trainer = hcompile.compile(make_model(name),
                               buckets=BUCKETS).trainer(loss="causal_lm", optimizer=torch.optim.SGD,
                               optimizer_kwargs={"lr": 0.5}, strategies=STRATEGIES, tokens_per_rank=24, calibrate=False)
    out = []
    for strategy, batch in zip(STRATEGIES, _batches()):
        stats = trainer.train_step(batch, strategy=strategy)
        micro = [len(r.micro_batches) for r in trainer.last_plan.plan.replicas]
        out.append((stats.loss, stats.strategy, micro, trainer.full_state_dict()))
    return out


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "gpt2"])
def test_hf_model_matches_single_process_sgd(tmp_path, name):
    results = run_ranks(4, tmp_path, _train, name, timeout_s=400)
    losses, states = reference_sgd(_HFLogits(make_model(name)), _batches(), 0.5)
    for per_rank in results:
        for step, (loss, strategy, _, state) in enumerate(per_rank):
            assert loss == pytest.approx(losses[step], rel=1e-5), (name, strategy)
            for n, p in states[step].items():
                torch.testing.assert_close(state[n], p, rtol=1e-5, atol=1e-6, msg=f"{name} {strategy} {n}")
    micro = [m for _, _, micro, _ in results[0] for m in micro]
    assert max(micro) >= 3, f"replicas should run several micro-batches, got {micro}"


class _HFLogits(torch.nn.Module):
    """The model returning its logits tensor, as the reference loss reads it; parameters keep their names."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).logits

    def named_parameters(self, *args, **kwargs):
        return self.model.named_parameters(*args, **kwargs)
