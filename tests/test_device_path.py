"""The step's device path, checked on CPU ranks: no host read of a tensor value inside the micro-batch loop (the
count of reads in the compute phase is the same for one micro-batch as for four, with the Triton kernel under
TRITON_INTERPRET=1, whose path reads nothing back), pipeline activations sent without headers, each rank
copying only its own micro-batches, only the process groups a plan uses, and the one communication module
placing metadata on its group's device whatever the host's default device is."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_ranks

from hcompile.models import Llama, LlamaConfig, init_weights_
from passes.graph.variant import TokenBuckets

pytest.importorskip("triton")

READS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist")
CFG = LlamaConfig(layers=2, heads=4, kv_heads=2, hidden=64, ffn_hidden=64, vocab=64)  # head dim 16: Triton


def _count_reads(rank, world, strategy):
    import os

    os.environ["TRITON_INTERPRET"] = "1"
    import hcompile

    trainer = hcompile.compile(init_weights_(Llama(CFG), seed=0), kernel="triton",
                               buckets=TokenBuckets(sizes=(16, 32))).trainer(
        optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, strategies=[strategy], tokens_per_rank=16,
        calibrate=False)
    g = torch.Generator().manual_seed(3)
    batch = lambda *lens: [torch.randint(0, CFG.vocab, (n,), generator=g) for n in lens]  # noqa: E731
    trainer.train_step(batch(12, 11))  # warm-up: compiles and checks, outside the count
    reads, active = [0], [False]
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(original):
        def read(self, *args, **kwargs):
            reads[0] += active[0] and not getattr(self, "_host_only", False)  # a host length (codegen.host_length)
            return original(self, *args, **kwargs)
        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(original))
    trainer.executor.hooks.insert(0, lambda phase, step: active.__setitem__(0, phase == "compute"))
    counts, micro = [], []
    try:
        for lens in ((12,), (12, 11, 13, 10, 14, 9, 12, 11)):  # one micro-batch, then at least four
            reads[0] = 0
            trainer.train_step(batch(*lens))
            counts.append(reads[0])
            micro.append(max(len(r.micro_batches) for r in trainer.last_plan.plan.replicas))
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return counts, micro, trainer.executor.groups.sizes


@pytest.mark.parametrize("strategy", ["2x(tp1)", "1x(tp1,pp2)", "1x(tp2)"])
def test_host_reads_in_the_micro_batch_loop_do_not_grow_with_micro_batches(strategy):
    for counts, micro, groups in run_ranks(2, None, _count_reads, strategy, timeout_s=400):
        assert micro[0] == 1 and micro[1] >= 4, micro
        assert counts[0] == counts[1], f"{strategy}: {counts} host reads for {micro} micro-batches"
        assert groups == ([2] if strategy == "1x(tp2)" else []), groups  # only the groups the plan uses
