"""TP collectives on 2 gloo ranks: forward sums, backward identities, shared-slice gradients; and their fake
implementations under torch.compile."""

import torch
import torch.distributed as dist

from dist_helpers import run_ranks
from passes.collectives import TP_ALL_REDUCE, TP_COPY, TP_GRAD_SHARE


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

    compiled = torch.compile(lambda t: TP_ALL_REDUCE(t * 2, group), backend="aot_eager", fullgraph=True)
    assert compiled(torch.ones(2)).tolist() == [4.0, 4.0]


def test_collectives_on_two_gloo_ranks(tmp_path):
    run_ranks(_worker, 2, tmp_path, timeout=120)
