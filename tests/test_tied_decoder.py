"""A small decoder written by hand with its LM head tied to the token embedding (``head.weight = emb.weight``,
SDPA attention) trains as single-process PyTorch does: loss and every parameter after two SGD steps, on one rank
(the shape that was refused with ``split (7296), embedding (2048) and head (0) parameters are more than all
7328``: its one-linear MLP leaves the residual stream split, so the head reads a split input and tensor
parallelism has no form for the tied weight; on two ranks ``auto`` plans it without tensor parallelism) and
under ``1x(tp2)`` (the usual shape: an output projection, a final norm, a replicated head, as nanoGPT's and
Hugging Face's tied models)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_util import run_ranks
from test_equivalence import reference_sgd
from torch import nn

VOCAB, HIDDEN, HEADS = 64, 32, 4


class _Block(nn.Module):
    """Attention (fused QKV, an output projection) and an MLP of one linear or two, residual, optional norms."""

    def __init__(self, full: bool) -> None:
        super().__init__()
        self.full = full
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        if full:
            self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
            self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)
        else:
            self.ff = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.norm1(x) if self.full else x
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in self.qkv(h).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        if self.full:
            return x + self.down(F.gelu(self.up(self.norm2(x))))
        return x + F.relu(self.ff(x))


class TiedDecoder(nn.Module):
    """``input_ids`` (B, T) -> logits (B, T, VOCAB), the head's weight the embedding's. ``full=False``: one block,
    no norms, a one-linear MLP (7328 parameters); ``full=True``: two blocks of the usual shape and a final norm."""

    def __init__(self, full: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(_Block(full) for _ in range(2 if full else 1))
        self.norm = nn.LayerNorm(HIDDEN) if full else nn.Identity()
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _model(full: bool) -> TiedDecoder:
    torch.manual_seed(3)
    return TiedDecoder(full)


def _batches() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [[torch.randint(0, VOCAB, (n,), generator=g) for n in lens] for lens in ((30, 17, 9), (24, 12))]


def _reference(full: bool, lr: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch (``test_equivalence.reference_sgd``): the losses, and the parameters after the last step."""
    losses, states = reference_sgd(_model(full), _batches(), lr)
    return losses, states[-1]


def _train(rank, world, full, strategy, lr):
    import hcompile

    trainer = hcompile.compile(_model(full)).trainer(
        loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": lr}, strategies=strategy,
        tokens_per_rank=64, calibrate=False)
    losses = [trainer.train_step(batch).loss for batch in _batches()]
    schemes = sorted({e.scheme.describe() for e in trainer.cost_model.entries})
    return losses, trainer.full_state_dict(), trainer.last_plan.plan.strategy.describe(), schemes


def _both(rank, world, lr):
    """The usual tied decoder under ``1x(tp2)``; the one without a tensor-parallel form under ``auto``."""
    return _train(rank, world, True, "1x(tp2)", lr), _train(rank, world, False, "auto", lr)


def _check(results, full, lr) -> None:
    losses, state = _reference(full, lr)
    assert set(state) == {n for n, _ in _model(full).named_parameters()} and "head.weight" not in state
    for got, params, _, _ in results:
        assert got == pytest.approx(losses, rel=1e-5)
        assert set(params) == set(state)
        for name, value in state.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_tied_decoder_whose_head_reads_a_split_input_trains_on_one_rank(tmp_path):
    import hcompile
    from hcompile.memory import model_memory
    from passes.graph.normalize import canonical_graph
    from passes.graph.pass_runner import PassError
    from passes.graph.tensor_parallel import decide_tensor_parallel

    graph = hcompile.compile(_model(False)).captured(64).graph_module
    memory = model_memory(graph, 64)  # was a PlanError: the tied weight counted as split and as embedding
    assert (memory.params, memory.split_params, memory.embed_params, memory.head_params) == (7328, 0, 2048, 0)
    with pytest.raises(PassError, match="parameter 'emb.weight' is read whole by .*'emb'.* and split along dim 1 "
                                        "by the row-parallel .*'head'.*no tensor-parallel form"):
        decide_tensor_parallel(canonical_graph(graph), 2, 0)
    _check(run_ranks(1, tmp_path, _train, False, "1x(tp1)", 0.5), False, 0.5)


def test_a_tied_decoder_trains_on_two_ranks_under_tensor_parallelism_where_it_has_a_form(tmp_path):
    """The usual shape under ``1x(tp2)``; the shape without a tensor-parallel form under ``auto``, which then
    plans tp1 schemes only (it refused the job at the first tp2 lowering before)."""
    full, split = zip(*run_ranks(2, tmp_path, _both, 0.5))
    _check(full, True, 0.5)
    _check(split, False, 0.5)
    assert [(plan, schemes) for _, _, plan, schemes in split] == [("2x(tp1,pp1)", ["(tp1,pp1)"])] * 2
