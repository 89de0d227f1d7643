"""Parameters that do not require a gradient stay as they are, bit for bit, whatever the self-check does (issue 56,
findings 5.15-5.17): their gradients count in no norm and reach no optimiser, weight decay and momentum leave them
alone, on any strategy (replicas, tensor and pipeline parallelism) and on one rank; the trainable parameters train
as plain PyTorch trains them with the frozen ones left out of its optimiser. An integer parameter is refused by name
when the model is compiled."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from dist_util import run_ranks
from torch import nn

from hcompile.models import Llama, LlamaConfig, init_weights_
from runtime.fixed_layout import FixedLayout

CFG = LlamaConfig(layers=2, heads=4, kv_heads=2, hidden=32, ffn_hidden=64, vocab=64)
ADAMW = ("AdamW", {"lr": 1e-2, "weight_decay": 0.1})
SGD = ("SGD", {"lr": 0.2, "momentum": 0.9, "weight_decay": 0.1})


def _model() -> Llama:
    """The tiny Llama with its embedding and its first layer frozen."""
    model = init_weights_(Llama(CFG), seed=4)
    for name, p in model.named_parameters():
        if name.startswith(("embed_tokens.", "layers.0.")):
            p.requires_grad_(False)
    return model


def _frozen(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if not p.requires_grad}


def _batches() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    lens = [[5, 9, 17, 3, 30, 2, 11], [40, 8, 8, 8, 1, 25], [13, 13, 13, 13, 60, 7, 2, 9]]
    return [[torch.randint(0, CFG.vocab, (n,), generator=g) for n in step] for step in lens]


def _train(rank, world, runs):
    """Per run (optimizer, kwargs, self_check, strategies, overlapped movement): every step's (loss, grad norm) and
    the final parameters."""
    import hcompile

    out = []
    for name, kwargs, self_check, strategies, overlap in runs:
        trainer = hcompile.compile(_model()).trainer(
            loss="causal_lm", optimizer=getattr(torch.optim, name), optimizer_kwargs=kwargs, strategies=strategies,
            tokens_per_rank=64, self_check=self_check, calibrate=False, overlap_movement=overlap)
        stats = [trainer.train_step(batch, strategy=s) for s, batch in zip(strategies, _batches())]
        out.append(([(s.loss, s.grad_norm) for s in stats], trainer.full_state_dict()))
    return out


def _reference(name, kwargs):
    """Plain single-process training, the frozen parameters left out of the optimiser: every step's (loss, norm of
    the trainable gradients) and the final parameters."""
    model = _model()
    opt = getattr(torch.optim, name)([p for p in model.parameters() if p.requires_grad], **kwargs)
    steps = []
    for batch in _batches():
        pairs = sum(len(s) - 1 for s in batch)
        loss = sum(F.cross_entropy(model(s[None])[0, :-1], s[1:], reduction="sum") for s in batch) / pairs
        loss.backward()
        norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None))
        opt.step()
        opt.zero_grad()
        steps.append((float(loss.detach()), norm))
    return steps, {n: p.detach() for n, p in model.named_parameters()}


def _check(run, result):
    name, kwargs = run[:2]
    steps, state = result
    want_steps, want = _reference(name, kwargs)
    initial = dict(_model().named_parameters())
    frozen = _frozen(_model())
    assert len(frozen) == 10
    for n, p in want.items():
        if n in frozen:
            assert torch.equal(state[n], initial[n].detach()), f"frozen {n} changed"
        else:
            torch.testing.assert_close(state[n], p, rtol=1e-5, atol=1e-6, msg=n)
            assert not torch.equal(state[n], initial[n].detach()), f"trainable {n} did not train"
    for (loss, norm), (want_loss, want_norm) in zip(steps, want_steps):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        assert norm == pytest.approx(want_norm, rel=1e-4)  # the frozen gradients count in no norm


TWO = [(*ADAMW, False, ["2x(tp1)", "1x(tp2)", "1x(tp1,pp2)"], True),  # no self-check: as above 2^28 parameters
       (*SGD, True, ["1x(tp2)", "2x(tp1)", "1x(tp2)"], False)]  # the self-check on (finding 5.15), plain movement


def test_frozen_parameters_stay_fixed_on_two_ranks(tmp_path):
    for rank_result in run_ranks(2, tmp_path, _train, TWO, timeout_s=300):
        for run, result in zip(TWO, rank_result):
            _check(run, result)


def test_frozen_parameters_stay_fixed_on_one_rank(tmp_path):
    runs = [(*ADAMW, False, ["1x(tp1)"] * 3, True)]
    (result,), = run_ranks(1, tmp_path, _train, runs, timeout_s=200)
    _check(runs[0], result)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("opt", [ADAMW, SGD, ("Adam", {"lr": 1e-2, "weight_decay": 0.1})])
def test_layout_keeps_frozen_ranges(rank, opt):
    """Each rank's part of a frozen parameter (``b`` spans both ranks' shares, rank 1's shard ends in padding): no
    gradient, no state, the same values after the optimiser stepped; the other parameters step as before."""
    tensors = {"a": torch.randn(5), "b": torch.randn(7, 3), "c": torch.randn(4, 2), "d": torch.randn(3)}
    layout = FixedLayout.from_tensors(tensors, rank, 2)
    plain = FixedLayout.from_tensors(tensors, rank, 2)
    layout.freeze(["b", "d"])
    name, kwargs = opt
    optimizer = getattr(torch.optim, name)([layout.shard], **kwargs)
    reference = getattr(torch.optim, name)([plain.shard], **kwargs)
    frozen = torch.zeros(layout.shard_numel, dtype=torch.bool)
    for pos in range(layout.shard_numel):
        at = layout.flat_index(pos)
        frozen[pos] = at is not None and any(s.offset <= at < s.offset + s.numel for n, s in layout.specs.items()
                                             if n in ("b", "d"))
    assert frozen.any() and (~frozen).any()
    before = layout.shard.detach().clone()
    for _ in range(3):
        grad = torch.randn(layout.shard_numel)
        layout.shard.grad, plain.shard.grad = grad.clone(), grad.clone()
        layout.drop_frozen_grads()
        assert torch.equal(layout.shard.grad[frozen], torch.zeros(int(frozen.sum())))
        with layout.keep_frozen(optimizer):
            optimizer.step()
        plain.shard.grad[frozen] = 0
        reference.step()
    assert torch.equal(layout.shard.detach()[frozen], before[frozen])
    assert torch.equal(layout.shard.detach()[~frozen], plain.shard.detach()[~frozen])
    for value in optimizer.state[layout.shard].values():
        if value.shape == layout.shard.shape:
            assert not value[frozen].any()


def test_freezing_an_unknown_parameter_is_refused():
    with pytest.raises(KeyError, match="nope"):
        FixedLayout({"w": (3,)}, 0, 1).freeze(["nope"])


class _Indexed(nn.Module):
    """A model holding an integer Parameter it indexes with (finding 5.17)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.order = nn.Parameter(torch.arange(64), requires_grad=False)
        self.head = nn.Linear(16, 64)

    def forward(self, ids):
        return self.head(self.emb(self.order[ids]))


def test_an_integer_parameter_is_refused_by_name():
    import hcompile

    with pytest.raises(ValueError, match=r"'order' is torch\.int64.*register_buffer\('order'"):
        hcompile.compile(_Indexed())
