"""TP collectives on 2 gloo ranks: forward sums, backward identities, shared-slice gradients, gathers,
vocabulary-split lookups; and their fake implementations under torch.compile."""

import torch
import torch.distributed as dist
from dist_util import run_ranks

from passes.graph.collectives import TP_ALL_GATHER, TP_ALL_REDUCE, TP_COPY, TP_GRAD_SHARE, vocab_parallel_embedding


def _worker(rank, world):
    group = dist.group.WORLD.group_name
    x = torch.full((3,), float(rank + 1), requires_grad=True)
    y = TP_ALL_REDUCE(x, group)  # forward: sum over ranks, backward: identity
    assert y.tolist() == [3.0, 3.0, 3.0]
    (y * (rank + 1)).sum().backward()
    assert x.grad.tolist() == [float(rank + 1)] * 3

    x = torch.ones(2, requires_grad=True)
    z = TP_COPY(x, group)  # forward: identity, backward: sum over ranks
    assert z.tolist() == [1.0, 1.0]
    (z * (rank + 1)).sum().backward()
    assert x.grad.tolist() == [3.0, 3.0]

    w = torch.ones(2, requires_grad=True)  # two ranks share one slice (parts=1, index 0): grads are summed
    (TP_GRAD_SHARE(w, group, 1, 0) * (rank + 1)).sum().backward()
    assert w.grad.tolist() == [3.0, 3.0]
    w = torch.ones(2, requires_grad=True)  # each rank its own slice (parts=2): grads stay apart
    (TP_GRAD_SHARE(w, group, 2, rank) * (rank + 1)).sum().backward()
    assert w.grad.tolist() == [float(rank + 1)] * 2

    x = torch.full((2, 1), float(rank), requires_grad=True)  # gather along dim 1, gradient: own block
    gathered = TP_ALL_GATHER(x, group, 1, world, rank)
    assert gathered.tolist() == [[0.0, 1.0], [0.0, 1.0]]
    (gathered * torch.tensor([[1.0, 2.0], [3.0, 4.0]])).sum().backward()
    assert x.grad.flatten().tolist() == ([1.0, 3.0] if rank == 0 else [2.0, 4.0])

    table = torch.arange(8.0).view(4, 2)  # rows 0-1 on rank 0, rows 2-3 on rank 1
    rows = vocab_parallel_embedding(torch.tensor([3, 0, 2]), table[2 * rank: 2 * rank + 2], 2 * rank, group)
    assert rows.tolist() == table[[3, 0, 2]].tolist()

    compiled = torch.compile(lambda t: TP_ALL_REDUCE(t * 2, group), backend="aot_eager", fullgraph=True)
    assert compiled(torch.ones(2)).tolist() == [4.0, 4.0]


def test_collectives_on_two_gloo_ranks(tmp_path):
    run_ranks(2, tmp_path, _worker, timeout_s=120)
