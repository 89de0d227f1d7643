"""Unmodified Hugging Face models (transformers from the package index, sdpa attention where the family has it)
train on 4 gloo ranks under 4x(tp1), 1x(tp2)+2x(tp1), 2x(tp2) and 1x(tp2,pp2), replicas running several
micro-batches, equal to plain single-process SGD at 1e-5, every parameter compared: LLaMA and Mistral (GQA
through repeat_kv, rotary embeddings from position ids, a position-built causal mask), Qwen2 (q/k/v biases),
GPT-2 (Conv1D as addmm, a fused qkv projection split in three, learned positions, tied embeddings), and the
families whose forms tensor parallelism once trained wrong or refused: Qwen3 (per-head q/k norms), Phi-3 (a
fused qkv sliced by getitem), GPT-NeoX (a chunk after a per-head view, partial rotary), OLMo 2 (an RMSNorm over
the whole q and k projections) and Gemma 2 (eager attention with a soft cap). The configs are those of
``benchmarks.hf_families``, which checks more families."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dist_util import run_ranks  # noqa: E402
from test_equivalence import reference_sgd  # noqa: E402

from benchmarks import hf_families as families  # noqa: E402
from passes.graph.variant import TokenBuckets  # noqa: E402

STRATEGIES = ["4x(tp1)", "1x(tp2)+2x(tp1)", "2x(tp2)", "1x(tp2,pp2)"]
BUCKETS = TokenBuckets.powers_of_two(16, 128)
LENS = [[14, 22, 15, 23, 13, 20, 24, 3, 9], [9, 33, 21, 2, 17, 24, 11, 6], [25, 4, 19, 40, 8, 16, 12],
        [7, 18, 44, 5, 21, 13, 2, 20]]
VOCAB = families.VOCAB


def make_model(name: str) -> torch.nn.Module:
    """A small model of the named family (``benchmarks.hf_families``' config), seeded, no dropout."""
    return families.make_model(name)


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


# The default tier trains LLaMA, GPT-2 and GPT-NeoX (GQA and rotary; Conv1D, learned positions and tied
# embeddings; a fused qkv chunked after a per-head view); `make test-full` trains every family.
FAMILIES = [pytest.param(name, marks=[] if name in ("llama", "gpt2", "gpt_neox") else [pytest.mark.slow])
            for name in ["llama", "mistral", "qwen2", "gpt2", "qwen3", "phi3", "gpt_neox", "olmo2", "gemma2"]]


@pytest.mark.parametrize("name", FAMILIES)
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
