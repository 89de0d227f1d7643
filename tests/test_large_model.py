"""What lets a model larger than one rank train: built on the meta device and initialised per parameter (or
streamed from rank 0), no rank allocates a tensor of the whole parameter count during a step unless it
computes with all of it, and compute copies in bf16 with fp32 master weights. 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_ranks
from test_equivalence import reference_sgd
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hcompile.init import normal_init
from hcompile.models import Llama, LlamaConfig
from passes.graph.variant import TokenBuckets

CFG = LlamaConfig(layers=2, heads=4, kv_heads=2, hidden=32, ffn_hidden=64, vocab=64)
BUCKETS = TokenBuckets.powers_of_two(32, 256)
LENS = [[14, 22, 15, 23, 13, 40, 30, 3], [9, 33, 21, 2, 17, 24, 11], [25, 4, 19, 40, 8, 16]]


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op returns (compiled variants run under it as compiled)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.largest = max(self.largest, t.numel())
        return out


def _batches():
    g = torch.Generator().manual_seed(11)
    return [[torch.randint(0, CFG.vocab, (n,), generator=g) for n in lens] for lens in LENS]


def _meta_train(rank, world, strategy, source):
    import hcompile

    with hcompile.empty_init():
        model = Llama(CFG)
    on_meta = all(p.device.type == "meta" for p in model.parameters())
    kwargs = {"init": normal_init(0.3, seed=2)} if source == "init" else {
        "state_dict": _reference_state() if rank == 0 else None}
    trainer = hcompile.compile(model, buckets=BUCKETS).trainer(
        loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.3}, strategies=[strategy],
        tokens_per_rank=24, calibrate=False, **kwargs)
    losses, largest = [], 0
    for i, batch in enumerate(_batches()):
        mode = LargestTensor()
        if i == 0:  # the first step compiles; the later ones are measured
            losses.append(trainer.train_step(batch, strategy=strategy).loss)
            continue
        with mode:
            losses.append(trainer.train_step(batch, strategy=strategy).loss)
        largest = max(largest, mode.largest)
    stage_numel = max(p.numel for p in trainer.executor.compute_copies())
    return losses, trainer.full_state_dict(), largest, stage_numel, on_meta


def _reference_state():
    model = Llama(CFG)
    init = normal_init(0.3, seed=2)
    for name, p in model.named_parameters():
        init(name, p.data)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


CASES = [("1x(tp4)", "init"), ("2x(tp2)", "state_dict")]


def _meta_cases(rank, world):
    return [_meta_train(rank, world, strategy, source) for strategy, source in CASES]


def test_meta_model_trains_from_its_shards(tmp_path):
    per_rank = run_ranks(4, tmp_path, _meta_cases)
    reference = Llama(CFG)
    reference.load_state_dict(_reference_state(), strict=False)
    losses, states = reference_sgd(reference, _batches(), 0.3)
    total = sum(p.numel() for p in reference.parameters())
    for case, results in zip(CASES, zip(*per_rank)):
        for got, state, largest, stage_numel, on_meta in results:
            assert on_meta, "the user's model stays on the meta device"
            assert got == pytest.approx(losses, rel=1e-5), case
            for n, p in states[-1].items():
                # this model's weights are large (normal 0.3): after three steps at lr 0.3 the runs' fp32 rounding
                # (summation orders vary with thread scheduling) reaches 2e-6 on a few elements, so the absolute
                # slack scales with the tensor; a wrong update moves it by lr x grad, about 1e-2
                atol = max(1e-6, 1e-5 * float(p.abs().max()))
                torch.testing.assert_close(state[n], p, rtol=1e-5, atol=atol, msg=f"{case} {n}")
            # no tensor of a step is larger than what the rank computes with, which is a part of the model
            assert largest <= stage_numel < total, (case, largest, stage_numel, total)


CONFIGS = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]


def _bf16(rank, world):
    import hcompile
    from hcompile.models import init_weights_

    out = []
    compiled = hcompile.compile(init_weights_(Llama(CFG), seed=3), buckets=BUCKETS)  # a trainer per config
    for param_dtype, reduce_dtype in CONFIGS:
        trainer = compiled.trainer(
            loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.3}, strategies=["1x(tp2)+2x(tp1)"],
            tokens_per_rank=24, calibrate=False, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        stats = [trainer.train_step(batch, strategy="1x(tp2)+2x(tp1)") for batch in _batches()]
        dtypes = {params.dtype for params in trainer.executor.compute_copies()}
        out.append(([s.loss for s in stats], stats[-1].traffic, trainer.layout.shard.dtype, dtypes,
                    trainer.full_state_dict()))
    return out


def test_bf16_compute_copies_with_fp32_master_weights(tmp_path):
    for fp32, bf16, both in run_ranks(4, tmp_path, _bf16):
        (l32, t32, _, _, s32), (l16, t16, master, compute, s16), (_, tb, _, _, _) = fp32, bf16, both
        assert master == torch.float32 and compute == {torch.bfloat16}
        assert l16 == pytest.approx(l32, rel=2e-2)
        for n in s32:
            torch.testing.assert_close(s16[n], s32[n], rtol=0.05, atol=0.02, msg=n)
        assert t16.params_received * 2 == t32.params_received and t16.grads_sent == t32.grads_sent
        assert tb.grads_sent * 2 == t32.grads_sent


def test_bad_dtypes_are_refused():
    from hcompile.train import TrainOptions

    with pytest.raises(ValueError, match="param_dtype must be torch.float32 or torch.bfloat16, got torch.float16"):
        TrainOptions(param_dtype=torch.float16)
    with pytest.raises(ValueError, match="reduce_dtype"):
        TrainOptions(reduce_dtype=torch.int32)
