"""hcompile.compile(...).trainer(optimizer=...).train_step on 4 gloo ranks: heterogeneous strategies of the compiled
GPT and LLaMA models give the single-process losses and parameters."""

import math

import pytest
import torch
import torch.nn.functional as F
from dist_util import run_ranks

from hcompile.models import GPT, GPTConfig, Llama, LlamaConfig, init_weights_

MODELS = {
    "gpt": (GPT, GPTConfig(layers=2, heads=4, hidden=32, vocab=64, block_size=128)),
    "llama": (Llama, LlamaConfig(layers=2, heads=4, kv_heads=2, hidden=32, ffn_hidden=64, vocab=64)),
}
STRATEGIES = ["4x(tp1)", "1x(tp2)+2x(tp1)", "1x(tp2,pp2)"]


def batches(vocab):
    g = torch.Generator().manual_seed(3)
    lens = [[5, 9, 17, 3, 30, 2, 11], [40, 8, 8, 8, 1, 25], [13, 13, 13, 13, 60, 7, 2, 9]]
    return [[torch.randint(0, vocab, (n,), generator=g) for n in step] for step in lens]


def make(name):
    cls, cfg = MODELS[name]
    return init_weights_(cls(cfg), seed=4), cfg


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _train(rank, world, name, lr):
    import hcompile

    model, cfg = make(name)
    compiled = hcompile.compile(model)  # both trainers start from the model's weights: training leaves it as it is
    trainer = compiled.trainer(loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": lr},
                               strategies=STRATEGIES, tokens_per_rank=64)
    out = []
    data = batches(cfg.vocab)
    for strategy, batch in zip(STRATEGIES, data):
        stats = trainer.train_step(batch, strategy=strategy)
        out.append((stats.loss, stats.strategy, stats.compilations, trainer.full_state_dict()))
    adam = compiled.trainer(loss="causal_lm", optimizer=torch.optim.AdamW,
                            optimizer_kwargs={"lr": 1e-2}, strategies=STRATEGIES, tokens_per_rank=64)
    adam_losses = [adam.train_step(batch, strategy=s).loss for s, batch in zip(STRATEGIES, data)]
    return out, adam_losses


# GPT's strategies are also trained by test_equivalence's fixed case in the default tier.
@pytest.mark.parametrize("name", [pytest.param("gpt", marks=pytest.mark.slow), "llama"])
def test_train_step_matches_single_process(tmp_path, name):
    lr = 0.3
    results = run_ranks(4, tmp_path, _train, name, lr)
    model, cfg = make(name)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step, batch in enumerate(batches(cfg.vocab)):
        loss = _reference_step(model, opt, batch)
        expected = dict(model.named_parameters())
        for rank_result, _ in results:
            got, strategy, _, state = rank_result[step]
            assert got == pytest.approx(float(loss), rel=1e-5)
            for n, p in expected.items():
                torch.testing.assert_close(state[n], p.detach(), rtol=1e-5, atol=1e-6, msg=n)
    model, _ = make(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    adam_expected = [float(_reference_step(model, opt, batch)) for batch in batches(cfg.vocab)]
    for _, adam_losses in results:
        assert adam_losses == pytest.approx(adam_expected, rel=1e-4)


def _reference_step(model, opt, batch):
    """Plain single-process training: mean next-token loss over the batch, one optimiser step."""
    pairs = sum(len(s) - 1 for s in batch)
    loss = sum(F.cross_entropy(_logits(model(s[None]))[0, :-1], s[1:], reduction="sum") for s in batch) / pairs
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _auto(rank, world):
    import hcompile
    from passes.plan.ir import PlanError

    model, cfg = make("llama")
    trainer = hcompile.compile(model).trainer(loss="causal_lm", optimizer=torch.optim.AdamW,
                               optimizer_kwargs={"lr": 1e-3}, strategies="auto", tokens_per_rank=48)
    g = torch.Generator().manual_seed(5)
    lengths = [[int(x) for x in torch.randint(1, 48, (9,), generator=g)] + [90] for _ in range(23)]
    data = [[torch.randint(0, cfg.vocab, (n,), generator=g) for n in step] for step in lengths]
    forced = ["1x(tp2)+2x(tp1)", "2x(tp2)", "1x(tp4)"]  # each holds the 90-token sequence
    adam = [trainer.train_step(data[i], strategy=s).loss for i, s in enumerate(forced)]
    before = trainer.full_state_dict()
    try:  # 200 tokens > 4 ranks x 48: no scheme holds it; rejected before any work
        trainer.train_step([torch.zeros(200, dtype=torch.long)])
        rejected = None
    except PlanError as exc:
        rejected = str(exc)
    unchanged = all(torch.equal(before[n], t) for n, t in trainer.full_state_dict().items())
    stats = []  # 20 steps, the planner choosing, each planned while the previous one ran
    trainer.fit(data[3:23], on_step=lambda step, s: stats.append(s))
    calibration = None
    if trainer.calibration is not None:  # rank 0 plans with the cost model corrected by the measured steps
        calibration = ({s.describe(): f for s, f in trainer.calibration.factors.items()},
                       trainer._service.planner.cost_model.name)
    return (adam, rejected, unchanged, [(s.strategy, s.compilations, s.plan_hidden, s.loss) for s in stats],
            calibration)


def test_adamw_auto_strategies_and_rejection(tmp_path):
    results = run_ranks(4, tmp_path, _auto)
    model, cfg = make("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(5)
    lengths = [[int(x) for x in torch.randint(1, 48, (9,), generator=g)] + [90] for _ in range(23)]
    data = [[torch.randint(0, cfg.vocab, (n,), generator=g) for n in step] for step in lengths]
    expected = []
    for batch in data[:3]:
        expected.append(float(_reference_step(model, opt, batch)))
    factors, planned_with = results[0][4]
    assert planned_with.endswith("(calibrated)")
    assert all(math.isfinite(f) and f > 0 and f != 1.0 for f in factors.values()), factors
    assert all(r[4] is None for r in results[1:])
    for adam, rejected, unchanged, auto, _ in results:
        assert adam == pytest.approx(expected, rel=1e-4)
        assert rejected is not None and "200 tokens" in rejected and unchanged
        strategies = {s for s, *_ in auto}
        assert all("tp4" in s or "tp2" in s for s in strategies)  # the 90-token sequence needs tp >= 2
        assert all(loss == loss and loss > 0 for *_, loss in auto)
        assert len(auto) == 20 and sum(hidden for _, _, hidden, _ in auto) >= 1
        warm = auto[0][1]
        assert [r for _, r, _, _ in auto] == [warm] * len(auto), "no graph is built after warm-up"
    assert [a[3] for a in results[0][3]] == [a[3] for a in results[1][3]]  # every rank reports the same loss
