"""Real compilers train like the eager graphs: ``aot_eager`` and ``inductor`` (on the CPU here) under tensor and
pipeline parallelism on 2 gloo ranks (``aot_eager`` also under context parallelism, its K/V exchange pipelined),
every parameter equal to plain single-process SGD at 1e-5, and no compilation after the warm-up (the sequence count
varies; each bucket's variant compiles once)."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_ranks
from test_equivalence import reference_sgd

from hcompile.models import GPT, GPTConfig, init_weights_
from passes.graph.variant import TokenBuckets

CFG = GPTConfig(layers=2, heads=4, hidden=32, vocab=64, block_size=64)
STRATEGIES = ["1x(tp2)", "1x(tp1,pp2)"]
LENS = [[9, 14, 5], [3, 11, 7, 6, 2], [13, 12], [4, 8, 10, 1]]


def _batches() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [[torch.randint(0, CFG.vocab, (n,), generator=g) for n in lens] for lens in LENS]


def _strategies(backend: str) -> list[str]:
    """aot_eager also compiles a CP replica whose K/V exchange is pipelined over 4 head groups (the custom ops of
    ``passes.graph.kv_exchange`` inside a compiled graph)."""
    return STRATEGIES + ["1x(cp2)"] if backend == "aot_eager" else STRATEGIES


def _train(rank, world, backend, overlap):
    import hcompile

    strategies = _strategies(backend)
    trainer = hcompile.compile(init_weights_(GPT(CFG), seed=2), buckets=TokenBuckets(sizes=(32,)),
                               compile_backend=backend).trainer(
        optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.3}, strategies=strategies, tokens_per_rank=16,
        calibrate=False, overlap_movement=overlap, kv_splits=4)
    out = []
    for step, batch in enumerate(_batches()):
        stats = trainer.train_step(batch, strategy=strategies[step % len(strategies)])
        out.append((stats.loss, stats.compilations, trainer.full_state_dict()))
    return out


# aot_eager with the movement overlapped: a compiled variant gets every window before its first micro-batch
@pytest.mark.parametrize(("backend", "overlap"), [("aot_eager", True), ("inductor", False)])
def test_compiled_variants_train_like_single_process_sgd_without_recompiling(backend, overlap):
    losses, states = reference_sgd(init_weights_(GPT(CFG), seed=2), _batches(), 0.3)
    for per_rank in run_ranks(2, None, _train, backend, overlap, timeout_s=900):
        compilations = [c for _, c, _ in per_rank]
        assert compilations[0] > 0 and len(set(compilations)) == 1, f"{backend} compiled after warm-up: {compilations}"
        for step, (loss, _, state) in enumerate(per_rank):
            assert loss == pytest.approx(losses[step], rel=1e-5), (backend, step)
            for name, want in states[step].items():
                torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6, msg=f"{backend} {step} {name}")
