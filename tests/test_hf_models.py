"""Unmodified Hugging Face models (transformers from the package index, sdpa attention where the family has it)
train on 4 gloo ranks under 4x(tp1), 1x(tp2)+2x(tp1), 2x(tp2) and 1x(tp2,pp2), replicas running several
micro-batches, equal to plain single-process SGD at 1e-5, every parameter compared.

The default tier trains the families whose attention is limited, on sequences longer than their window or
chunk (up to 44 tokens): Mistral (a sliding window of 8 on every layer, GQA through repeat_kv, rotary positions,
a position-built mask), Gemma 2 (eager attention with a soft cap, sliding and full layers), Gemma 3 (sliding and
full layers by ``layer_types``), Qwen2 with ``use_sliding_window`` (one layer each), Phi-3 (a window of 20:
longer than the sequences of the old 16-token probe, shorter than those trained), Llama 4 (chunks of 8, a
NoPE full layer, attention temperature from positions) and GraniteMoE-SWA's dense sibling (learned sinks
folded from its log-sum-exp form, windows); GPT-OSS (sinks in the concatenated form, a mixture of experts)
trains under tp1 and pipeline stages and is refused by name under tp2; Phi-3's real window (2047) trains with
4096-token micro-batches. ``make test-full`` adds LLaMA, Qwen2, GPT-2 (Conv1D as addmm, a fused qkv split in
three, learned positions, tied embeddings), Qwen3 (per-head q/k norms), GPT-NeoX (a chunk after a per-head view,
partial rotary) and OLMo 2 (an RMSNorm over the whole q and k projections). The configs are those of
``benchmarks.hf_families``, which checks more families."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dist_util import run_ranks  # noqa: E402
from test_equivalence import reference_sgd  # noqa: E402
from tiers import FULL  # noqa: E402

from benchmarks import hf_families as families  # noqa: E402
from passes.graph.variant import TokenBuckets  # noqa: E402

STRATEGIES = ["4x(tp1)", "1x(tp2)+2x(tp1)", "2x(tp2)", "1x(tp2,pp2)"]
BUCKETS = TokenBuckets(sizes=(32, 64))  # a tp1 replica's micro-batches (24 tokens) and a tp2 replica's (48)
LENS = [[14, 22, 15, 23, 13, 20, 24, 3, 9], [9, 33, 21, 2, 17, 24, 11, 6], [25, 4, 19, 40, 8, 16, 12],
        [7, 18, 44, 5, 21, 13, 2, 20]]
VOCAB = families.VOCAB


def make_model(name: str) -> torch.nn.Module:
    """A small model of the named family (``benchmarks.hf_families``' config), seeded, no dropout."""
    return families.make_model(name)


def _batches() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(21)
    return [[torch.randint(0, VOCAB, (n,), generator=g) for n in lens] for lens in LENS]


def _train(rank, world, name, strategies=tuple(STRATEGIES), batches=None):
    import hcompile

    trainer = hcompile.compile(make_model(name),
                               buckets=BUCKETS).trainer(loss="causal_lm", optimizer=torch.optim.SGD,
                               optimizer_kwargs={"lr": 0.5}, strategies=list(strategies), tokens_per_rank=24,
                               calibrate=False)
    out = []
    for strategy, batch in zip(strategies, batches or _batches()):
        stats = trainer.train_step(batch, strategy=strategy)
        micro = [len(r.micro_batches) for r in trainer.last_plan.plan.replicas]
        out.append((stats.loss, stats.strategy, micro, trainer.full_state_dict()))
    return out


LIMITED = ("mistral", "gemma2", "gemma3", "qwen2_swa", "phi3_swa", "llama4_chunked", "granite_swa")
MORE = ("llama", "qwen2", "gpt2", "qwen3", "gpt_neox", "olmo2")
FAMILIES = [*LIMITED, *(pytest.param(name, marks=[pytest.mark.slow]) for name in MORE)]


def _train_all(rank, world, names):
    """Every family in one job (one spawn of the ranks for all of them): its steps, or the error it raised."""
    out = {}
    for name in names:
        try:
            out[name] = _train(rank, world, name)
        except Exception as e:  # noqa: BLE001 - reported by that family's test
            out[name] = f"{type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Each family of this tier trained under the four strategies on 4 gloo ranks, per rank."""
    names = [*LIMITED, *(MORE if FULL else ())]
    return run_ranks(4, tmp_path_factory.mktemp("families"), _train_all, names, timeout_s=900)


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_model_matches_single_process_sgd(trained, name):
    results = [per_rank[name] for per_rank in trained]
    for result in results:
        assert not isinstance(result, str), f"{name}: {result}"
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


def test_the_batches_cross_every_window_and_chunk():
    """The default tier proves something only if its sequences are longer than the limits it trains."""
    longest = max(max(lens) for lens in LENS)
    for name in LIMITED:
        config = families.FAMILIES[name][1]
        assert longest > max(config.get("sliding_window") or 0, config.get("attention_chunk_size") or 0) + 8, name


def _expert_batches() -> list[list[torch.Tensor]]:
    """Two batches within a tp1 replica's 24 tokens (a pipeline stage holds no more than one rank)."""
    return [_batches()[0], [s[:20] for s in _batches()[1]]]


def _train_experts(rank, world):
    import hcompile

    out = _train(rank, world, "gpt_oss", ("4x(tp1)", "2x(pp2)"), _expert_batches())
    trainer = hcompile.compile(make_model("gpt_oss"), buckets=BUCKETS).trainer(
        loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.5}, strategies=["2x(tp2)"],
        tokens_per_rank=24, calibrate=False)
    before = trainer.full_state_dict()
    try:
        trainer.train_step(_batches()[0], strategy="2x(tp2)")
    except hcompile.LoweringError as e:
        refusal = str(e)
    else:
        refusal = None
    unchanged = all(torch.equal(before[n], p) for n, p in trainer.full_state_dict().items())
    return out, refusal, unchanged


def test_sinks_and_experts_train_under_tp1_and_pipelines_and_tp2_is_refused_by_name(tmp_path):
    """GPT-OSS: sinks concatenated to the scores, a window on one layer, a mixture of experts. Under 4x(tp1) and
    2x(pp2) every parameter equals single-process SGD (the sinks' gradients included); under 2x(tp2) the same
    LoweringError on every rank names the experts, before anything changes."""
    results = run_ranks(4, tmp_path, _train_experts, timeout_s=400)
    losses, states = reference_sgd(_HFLogits(make_model("gpt_oss")), _expert_batches(), 0.5)
    for out, refusal, unchanged in results:
        for step, (loss, strategy, _, state) in enumerate(out):
            assert loss == pytest.approx(losses[step], rel=1e-5), strategy
            for n, p in states[step].items():
                torch.testing.assert_close(state[n], p, rtol=1e-5, atol=1e-6, msg=f"gpt_oss {strategy} {n}")
        assert refusal is not None and "routes tokens to experts" in refusal and "tp1" in refusal, refusal
        assert unchanged
    assert len({refusal for _, refusal, _ in results}) == 1


PHI3_REAL = dict(families._LLAMA_LIKE, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, sliding_window=2047,
                 max_position_embeddings=4096)
REAL_LENS = [[3000, 37, 2600, 300]]


def _phi3_real() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Phi3Config(vocab_size=VOCAB, attn_implementation="sdpa", pad_token_id=0, bos_token_id=1,
                                     eos_token_id=2, **PHI3_REAL)
    return transformers.Phi3ForCausalLM(config)


def _real_batches() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [[torch.randint(0, VOCAB, (n,), generator=g) for n in lens] for lens in REAL_LENS]


def _train_phi3_real(rank, world):
    import hcompile

    trainer = hcompile.compile(_phi3_real(), buckets=TokenBuckets(sizes=(512, 4096))).trainer(
        loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.5}, strategies=["2x(tp1)"],
        tokens_per_rank=4096, calibrate=False)
    stats = trainer.train_step(_real_batches()[0], strategy="2x(tp1)")
    windows = {limits.window for _, limits in trainer.lowerings.lowering(
        trainer.last_plan.plan.replicas[0].scheme, 0).attention}
    return stats.loss, trainer.full_state_dict(), windows


def test_phi3_real_window_with_4096_token_micro_batches(tmp_path):
    """Phi-3-mini's window (sliding_window 2047: keys i - 2046 .. i) on sequences of 3000 and 2600 tokens in
    4096-token micro-batches at tp1: what once trained with the loss right to 6e-6 and weights off by 1e-3."""
    results = run_ranks(2, tmp_path, _train_phi3_real, timeout_s=500)
    losses, states = reference_sgd(_HFLogits(_phi3_real()), _real_batches(), 0.5)
    for loss, state, windows in results:
        assert windows == {2046}
        assert loss == pytest.approx(losses[0], rel=1e-5)
        for n, p in states[0].items():
            torch.testing.assert_close(state[n], p, rtol=1e-5, atol=1e-6, msg=n)
