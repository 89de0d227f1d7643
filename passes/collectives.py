"""Autograd-aware tensor-parallel collectives as ``torch.library`` custom ops (opaque to torch.compile).

Owns the three communication points the tensor-parallel rewrite inserts, each named by its process
group's ``group_name`` so that the graph stays printable and compilable:

- ``tp_all_reduce``: forward all-reduce (sum), backward identity (after a row-parallel linear);
- ``tp_copy``: forward identity, backward all-reduce (before a column-parallel linear);
- ``tp_grad_share``: forward identity, backward sums a weight's gradient over the ranks that hold the same
  replicated slice (key/value heads replicated because there are fewer than tp).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

__all__ = ["tp_all_reduce", "tp_copy", "tp_grad_share", "TP_ALL_REDUCE", "TP_COPY", "TP_GRAD_SHARE"]


def _all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=_resolve_process_group(group))
    return out


@torch.library.custom_op("hydraulis::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group; the gradient passes through unchanged."""
    return _all_reduce(x, group)


@tp_all_reduce.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)


def _identity_grad(ctx: Any, grad: torch.Tensor) -> tuple:
    return grad, None


tp_all_reduce.register_autograd(_identity_grad)


@torch.library.custom_op("hydraulis::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, group: str) -> torch.Tensor:
    """``x`` unchanged; its gradient is summed over the tensor-parallel group."""
    return x.clone()


@tp_copy.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)


def _setup_group(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.group = inputs[1]


def _reduce_grad(ctx: Any, grad: torch.Tensor) -> tuple:
    return tp_all_reduce(grad.contiguous(), ctx.group), None


tp_copy.register_autograd(_reduce_grad, setup_context=_setup_group)


@torch.library.custom_op("hydraulis::tp_grad_share", mutates_args=())
def tp_grad_share(w: torch.Tensor, group: str, parts: int, index: int) -> torch.Tensor:
    """``w`` unchanged; its gradient is summed over the ranks whose slice has the same ``index``."""
    return w.clone()


@tp_grad_share.register_fake
def _(w: torch.Tensor, group: str, parts: int, index: int) -> torch.Tensor:
    return torch.empty_like(w)


def _setup_share(ctx: Any, inputs: tuple, output: Any) -> None:
    _, ctx.group, ctx.parts, ctx.index = inputs


def _share_grad(ctx: Any, grad: torch.Tensor) -> tuple:
    buf = grad.new_zeros((ctx.parts, *grad.shape))  # one row per distinct slice; ranks add into their own
    buf[ctx.index] = grad
    return _all_reduce(buf, ctx.group)[ctx.index], None, None, None


tp_grad_share.register_autograd(_share_grad, setup_context=_setup_share)


# The op overloads, as graph targets (the graph prints them as ``hydraulis.tp_copy.default``).
TP_ALL_REDUCE = torch.ops.hydraulis.tp_all_reduce.default
TP_COPY = torch.ops.hydraulis.tp_copy.default
TP_GRAD_SHARE = torch.ops.hydraulis.tp_grad_share.default
