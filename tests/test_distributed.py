"""The one communication module (``runtime.distributed``): every call places its tensors where the group works,
whatever the host's default device is; objects and errors agree across ranks; point-to-point exchanges pair
up; only the tensor-parallel groups a strategy uses are made."""

from __future__ import annotations

import torch
from dist_util import run_ranks


def _with_meta_default(rank, world):
    """The host's default device is meta (as code that forgets ``device=`` would create); the module still puts
    every tensor where the group works (the CPU, under gloo)."""
    from runtime import distributed as comm
    from runtime.batch_check import agree_on_batch

    torch.set_default_device("meta")
    try:
        device = comm.group_device()
        total = comm.all_reduce(torch.tensor([rank + 1.0], device="cpu"))
        peak = comm.all_reduce(torch.tensor([float(rank)], device="cpu"), "max")
        parts = comm.all_gather(torch.full((2,), float(rank), device="cpu"))
        lengths = agree_on_batch([torch.arange(5, device="cpu"), torch.arange(3, device="cpu")], 64)
        errors = comm.agree_errors("rank 1 broke" if rank == 1 else None)
        got = torch.empty(3, device="cpu")
        comm.exchange([(torch.full((3,), float(rank), device="cpu"), 1 - rank)], [(got, 1 - rank)])
    finally:
        torch.set_default_device(None)
    return (str(device), total.device.type, total.item(), peak.item(), [p.tolist() for p in parts], lengths, errors,
            got.tolist())


def test_tensors_go_where_the_group_works_whatever_the_default_device():
    for rank, result in enumerate(run_ranks(2, None, _with_meta_default)):
        device, placed, total, peak, parts, lengths, errors, got = result
        assert device == "cpu" and placed == "cpu"
        assert total == 3.0 and peak == 1.0 and parts == [[0.0, 0.0], [1.0, 1.0]]
        assert lengths == [5, 3] and errors == [(1, "rank 1 broke")]
        assert got == [float(1 - rank)] * 3


def _groups(rank, world):
    from passes.plan.ir import Strategy
    from passes.plan.placement import placed_replicas
    from runtime.distributed import GroupCache

    cache = GroupCache()
    for text in ("4x(tp1)", "2x(tp1,pp2)", "2x(tp2)", "1x(tp2,pp2)"):
        cache.prepare(placed_replicas(Strategy.parse(text), world))
    return sorted(cache.sizes)


def test_only_the_tensor_parallel_groups_a_strategy_uses_are_made():
    # 2x(tp2): {0,1}, {2,3}; 1x(tp2,pp2): its two stages' TP pairs (the same two); pipelines and replicas none
    assert run_ranks(4, None, _groups)[0] == [2, 2]
