"""The step's device path, checked on CPU ranks: no host read of a tensor value inside the micro-batch loop (the
count of reads in the compute phase is the same for one micro-batch as for four, with the Triton kernel under
TRITON_INTERPRET=1, whose path reads nothing back) and no host-to-device copy that blocks (none in the compute
phase: a ``.to``/``copy_``/``.cuda`` from the host to a device without ``non_blocking``, a ``new_tensor`` or a
``torch.tensor(..., device=)`` on the rank's device, which a GPU serves with a blocking copy from pageable memory;
and the micro-batches and their padding built for the meta device copy nothing that way), pipeline activations
sent without headers, each rank copying only its own micro-batches, only the process groups a plan uses, the one
communication module placing metadata on its group's device whatever the host's default device is, and warm-up
under its own collective timeout."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_ranks

from hcompile.models import Llama, LlamaConfig, init_weights_
from passes.graph.variant import TokenBuckets

pytest.importorskip("triton")

READS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist")


class BlockingCopies:
    """Counts, while ``active[0]``, the host-to-device copies that would block the host: ``.to``, ``.cuda`` and
    ``copy_`` from a CPU tensor to another device without ``non_blocking``, and a tensor made from host data on
    ``device`` (``Tensor.new_tensor`` on a tensor there, ``torch.tensor``/``torch.as_tensor`` with that
    ``device=``): on a GPU each copies from pageable memory and waits. On CPU ranks ``device`` is the host, so
    the last two count there too. ``count``: how many; ``where``: what each was."""

    def __init__(self, device: torch.device, active: list):
        self.device, self.active, self.count, self.where = torch.device(device), active, 0, []
        self._saved: list[tuple] = []

    def __enter__(self) -> "BlockingCopies":
        def to(original):
            def call(t, *args, **kwargs):
                target = kwargs.get("device")
                for a in args:
                    if isinstance(a, (torch.device, str)):
                        target = a
                    elif isinstance(a, torch.Tensor):
                        target = a.device
                blocking = not kwargs.get("non_blocking", any(a is True for a in args if isinstance(a, bool)))
                self._host_to_device(t, target, blocking, "to")
                return original(t, *args, **kwargs)
            return call

        def copy_(original):
            def call(t, src, non_blocking=False, **kwargs):
                if isinstance(src, torch.Tensor):
                    self._host_to_device(src, t.device, not non_blocking, "copy_")
                return original(t, src, non_blocking, **kwargs)
            return call

        def cuda(original):
            def call(t, device=None, non_blocking=False, **kwargs):
                self._host_to_device(t, "cuda", not non_blocking, "cuda")
                return original(t, device, non_blocking, **kwargs)
            return call

        def new_tensor(original):
            def call(t, data, *args, **kwargs):
                self._made_here(kwargs.get("device") or t.device, "new_tensor")
                return original(t, data, *args, **kwargs)
            return call

        def factory(original, name):
            def call(data, *args, **kwargs):
                if kwargs.get("device") is not None:
                    self._made_here(kwargs["device"], name)
                return original(data, *args, **kwargs)
            return call

        for owner, name, wrap in ((torch.Tensor, "to", to), (torch.Tensor, "copy_", copy_),
                                  (torch.Tensor, "cuda", cuda), (torch.Tensor, "new_tensor", new_tensor),
                                  (torch, "tensor", lambda f: factory(f, "torch.tensor")),
                                  (torch, "as_tensor", lambda f: factory(f, "torch.as_tensor"))):
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, wrap(original))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)

    def _host_to_device(self, src: torch.Tensor, target, blocking: bool, how: str) -> None:
        if self.active[0] and blocking and target is not None and src.device.type == "cpu" \
                and torch.device(target).type != "cpu":
            self.count += 1
            self.where.append(f"{how} {tuple(src.shape)} to {target}")

    def _made_here(self, device, how: str) -> None:
        if self.active[0] and torch.device(device).type == self.device.type:
            self.count += 1
            self.where.append(f"{how} on {device}")
CFG = LlamaConfig(layers=2, heads=4, kv_heads=2, hidden=64, ffn_hidden=64, vocab=64)  # head dim 16: Triton


def _count_reads(rank, world, strategy):
    import os

    os.environ["TRITON_INTERPRET"] = "1"
    import hcompile
    from runtime import distributed as comm

    trainer = hcompile.compile(init_weights_(Llama(CFG), seed=0), kernel="triton",
                               buckets=TokenBuckets(sizes=(16, 32))).trainer(
        optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, strategies=[strategy], tokens_per_rank=16,
        calibrate=False, warmup_timeout_s=1234.0)
    timeouts: dict[bool, set[float]] = {True: set(), False: set()}  # dry run (warm-up) or not: the timeouts seen
    trainer.executor.hooks.insert(0, lambda phase, step: timeouts[step.dry_run].add(comm.timeout_of())
                                  if phase == "compute" else None)
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
    counts, copies, micro = [], [], []
    try:
        with BlockingCopies(trainer.ctx.device, active) as blocking:
            for lens in ((12,), (12, 11, 13, 10, 14, 9, 12, 11)):  # one micro-batch, then at least four
                reads[0] = 0
                trainer.train_step(batch(*lens))
                counts.append(reads[0])
                copies.append(blocking.where[:])
                micro.append(max(len(r.micro_batches) for r in trainer.last_plan.plan.replicas))
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return counts, copies, micro, trainer.executor.groups.sizes, timeouts


@pytest.mark.parametrize("strategy", ["2x(tp1)", "1x(tp1,pp2)", "1x(tp2)"])
def test_host_reads_in_the_micro_batch_loop_do_not_grow_with_micro_batches(strategy):
    for counts, copies, micro, groups, timeouts in run_ranks(2, None, _count_reads, strategy, timeout_s=400):
        assert micro[0] == 1 and micro[1] >= 4, micro
        assert counts[0] == counts[1], f"{strategy}: {counts} host reads for {micro} micro-batches"
        assert copies == [[], []], f"{strategy}: host-to-device copies that block: {copies}"
        assert groups == ([2] if strategy == "1x(tp2)" else []), groups  # only the groups the plan uses
        assert timeouts == {True: {1234.0}, False: {400.0}}, timeouts  # warm-up's own, then the job's


def test_micro_batches_and_their_padding_copy_nothing_that_blocks():
    """The meta device stands for a GPU: building a step's micro-batches (whole sequences and a CP share) and
    padding them to a bucket copies from the host only without blocking; ``new_tensor`` (what the padding used
    to append its offset with) is seen."""
    from passes.graph.variant import pad_to_bucket
    from runtime import micro_batch

    meta, active = torch.device("meta"), [True]
    batch = [torch.arange(n) for n in (5, 9, 3, 12)]
    with BlockingCopies(meta, active) as blocking:
        packed = micro_batch.packed(batch, [0, 1, 2], meta)
        share = micro_batch.context_parallel(batch, [1, 3], 2, 1, lambda n: 16, meta)
        for mb in (packed, share):
            ids, cu = pad_to_bucket(mb.ids, mb.cu_seqlens, 32)
            assert ids.device == meta and cu.device == meta and tuple(cu.shape) == (mb.cu_seqlens.numel() + 1,)
        assert all(t.device == meta for t in (share.targets, *share.cp_inputs))
        assert blocking.where == []
        packed.cu_seqlens.new_tensor([32])
        torch.arange(3).to(meta)
        assert blocking.where == ["new_tensor on meta", "to (3,) to meta"]
    on_cpu = micro_batch.packed(batch, [0, 1, 2], torch.device("cpu"))
    assert on_cpu.ids.tolist() == torch.cat(batch[:3]).tolist() and on_cpu.cu_seqlens.tolist() == [0, 5, 14, 17]
