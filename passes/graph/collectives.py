"""Autograd-aware tensor-parallel collectives as ``torch.library`` custom ops (opaque to torch.compile).

Owns the communication points the tensor-parallel rewrite inserts, each named by its process
group's ``group_name`` so that the graph stays printable and compilable:

- ``tp_all_reduce``: forward all-reduce (sum), backward identity (after a row-parallel linear);
- ``tp_copy``: forward identity, backward all-reduce (before a column-parallel linear);
- ``tp_grad_share``: forward identity, backward sums a weight's gradient over the ranks that hold the same
  replicated slice (key/value heads replicated because there are fewer than tp);
- ``tp_all_gather``: forward concatenation of every rank's block along a dim, backward this rank's block
  (after a vocab-parallel LM head);
- ``sp_all_gather``: forward concatenation of every rank's token block along a dim, backward the reduce-scatter
  of the gradient (before a column-parallel linear under sequence parallelism);
- ``sp_reduce_scatter``: forward the sum over the group of this rank's token block, backward the all-gather of
  the gradient (after a row-parallel linear under sequence parallelism);
- ``sp_split``: forward this rank's token block of a whole value, backward the all-gather of the gradient (a
  replicated value entering the sequence-parallel region: every rank's producer gets the whole gradient);
- ``cp_all_gather``: forward every context-parallel rank's keys or values padded to one width and stacked,
  backward the sum over the group of this rank's rows (``passes.graph.context_parallel``);
- ``post_cp_gather`` / ``post_cp_grad_return``: those two exchanges posted, each returning the work to wait on:
  what ``cp_all_gather`` waits on at once and the K/V exchange pipelined over head groups
  (``passes.graph.kv_exchange``) waits on group by group;

and :func:`vocab_parallel_embedding`, the lookup in a table split by vocabulary rows; :func:`all_reduce_tensor`,
a plain (not autograd) sum or max over a named group; :func:`is_nccl` / :func:`uses_nccl`, whether a backend
string (``nccl``, or ``cpu:gloo,cuda:nccl`` as the runtime makes its groups on GPUs) puts device tensors on
NCCL.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

__all__ = ["is_nccl", "uses_nccl", "all_reduce_tensor", "tp_all_reduce", "tp_copy", "tp_grad_share", "tp_all_gather",
           "vocab_parallel_embedding", "cp_all_gather", "post_cp_gather", "post_cp_grad_return",
           "sp_all_gather", "sp_reduce_scatter", "sp_split",
           "TP_ALL_REDUCE", "TP_COPY", "TP_GRAD_SHARE", "TP_ALL_GATHER", "SP_ALL_GATHER", "SP_REDUCE_SCATTER",
           "SP_SPLIT", "CP_ALL_GATHER"]


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""Single-tensor gather and reduce-scatter (renamed in torch 2.13; the old names where the new are missing)."""


def is_nccl(backend: str) -> bool:
    """Whether a process group's backend string runs some device's tensors on NCCL: ``nccl``, or a per-device
    list such as ``cpu:gloo,cuda:nccl`` (what ``dist.get_backend`` returns for the groups the runtime makes on
    GPUs, so comparing it with ``"nccl"`` is always false); ``gloo`` and ``cpu:gloo`` are not."""
    if not isinstance(backend, str):
        raise TypeError(f"a backend is a string such as 'nccl' or 'cpu:gloo,cuda:nccl', got {backend!r}")
    for entry in backend.lower().split(","):
        name = entry.rpartition(":")[2].strip()
        if name == "nccl":
            return True
    return False


def uses_nccl(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` (None: the default group) runs device tensors on NCCL (:func:`is_nccl` of its backend)."""
    return is_nccl(str(dist.get_backend(group)))


def all_reduce_tensor(x: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
    """A new tensor: ``x`` reduced (``sum`` or ``max``) over the process group named ``group`` (no autograd)."""
    out = x.clone()
    dist.all_reduce(out, op=_OPS[op], group=_resolve_process_group(group))
    return out


@torch.library.custom_op("hydraulis::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group; the gradient passes through unchanged."""
    return all_reduce_tensor(x, group)


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
    return tp_all_reduce(buf, ctx.group)[ctx.index], None, None, None  # the op, opaque to a tracing compiler


tp_grad_share.register_autograd(_share_grad, setup_context=_setup_share)


@torch.library.custom_op("hydraulis::tp_all_gather", mutates_args=())
def tp_all_gather(x: torch.Tensor, group: str, dim: int, world: int, rank: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order; the gradient is this rank's (``rank``'s)
    block. The rank is an argument, not asked of the group, so the backward needs no process group object
    (a compiler tracing it could not copy one)."""
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=_resolve_process_group(group))
    return torch.cat(parts, dim=dim)


@tp_all_gather.register_fake
def _(x: torch.Tensor, group: str, dim: int, world: int, rank: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] *= world
    return x.new_empty(shape)


def _setup_gather(ctx: Any, inputs: tuple, output: Any) -> None:
    _, ctx.group, ctx.dim, ctx.world, ctx.rank = inputs


def _gather_grad(ctx: Any, grad: torch.Tensor) -> tuple:
    return grad.chunk(ctx.world, dim=ctx.dim)[ctx.rank].contiguous(), None, None, None, None


tp_all_gather.register_autograd(_gather_grad, setup_context=_setup_gather)


def _gather_blocks(x: torch.Tensor, group: str, dim: int, world: int) -> torch.Tensor:
    """Every rank's ``x`` (the same shape on every rank) concatenated along ``dim`` in rank order, by one
    single-tensor all-gather along dim 0."""
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((world * moved.shape[0], *moved.shape[1:]))
    _ALL_GATHER_SINGLE(out, moved, group=_resolve_process_group(group))
    return out.movedim(0, dim).contiguous()


def _scatter_blocks(x: torch.Tensor, group: str, dim: int, world: int, rank: int) -> torch.Tensor:
    """Block ``rank`` (of ``world`` equal blocks along ``dim``) of the sum of ``x`` over the group: a reduce-
    scatter on NCCL; gloo has none, so an all-reduce and this rank's block of it."""
    if x.shape[dim] % world:
        raise ValueError(f"sequence parallel: dim {dim} of size {x.shape[dim]} does not split into {world} blocks")
    pg = _resolve_process_group(group)
    moved = x.movedim(dim, 0).clone(memory_format=torch.contiguous_format)  # gloo sums in place; never x itself
    width = moved.shape[0] // world
    if uses_nccl(pg):
        mine = moved.new_empty((width, *moved.shape[1:]))
        _REDUCE_SCATTER_SINGLE(mine, moved, group=pg)
    else:
        dist.all_reduce(moved, group=pg)
        mine = moved[rank * width:(rank + 1) * width]
    return mine.movedim(0, dim).contiguous()


def _local_block(x: torch.Tensor, dim: int, world: int, rank: int) -> torch.Tensor:
    if x.shape[dim] % world:
        raise ValueError(f"sequence parallel: dim {dim} of size {x.shape[dim]} does not split into {world} blocks")
    return x.chunk(world, dim=dim)[rank].clone(memory_format=torch.contiguous_format)  # not a view of x


@torch.library.custom_op("hydraulis::sp_all_gather", mutates_args=())
def sp_all_gather(x: torch.Tensor, group: str, dim: int, world: int, rank: int) -> torch.Tensor:
    """Every rank's token block ``x`` concatenated along ``dim`` in rank order; the gradient is reduce-scattered
    (each rank gets the group's sum of its own block's gradient)."""
    return _gather_blocks(x, group, dim, world)


@torch.library.custom_op("hydraulis::sp_reduce_scatter", mutates_args=())
def sp_reduce_scatter(x: torch.Tensor, group: str, dim: int, world: int, rank: int) -> torch.Tensor:
    """This rank's block ``rank`` along ``dim`` of the sum of ``x`` over the group; the gradient is all-gathered."""
    return _scatter_blocks(x, group, dim, world, rank)


@torch.library.custom_op("hydraulis::sp_split", mutates_args=())
def sp_split(x: torch.Tensor, group: str, dim: int, world: int, rank: int) -> torch.Tensor:
    """This rank's block ``rank`` along ``dim`` of a value every rank holds whole; the gradient is all-gathered,
    so every rank's producer gets the whole gradient (the same on every rank)."""
    return _local_block(x, dim, world, rank)


def _fake_gather(x: torch.Tensor, group: str, dim: int, world: int, rank: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] *= world
    return x.new_empty(shape)


def _fake_block(x: torch.Tensor, group: str, dim: int, world: int, rank: int) -> torch.Tensor:
    shape = list(x.shape)
    if shape[dim] % world:
        raise ValueError(f"sequence parallel: dim {dim} of size {shape[dim]} does not split into {world} blocks")
    shape[dim] //= world
    return x.new_empty(shape)


sp_all_gather.register_fake(_fake_gather)
sp_reduce_scatter.register_fake(_fake_block)
sp_split.register_fake(_fake_block)


def _sp_scatter_grad(ctx: Any, grad: torch.Tensor) -> tuple:
    return sp_reduce_scatter(grad, ctx.group, ctx.dim, ctx.world, ctx.rank), None, None, None, None


def _sp_gather_grad(ctx: Any, grad: torch.Tensor) -> tuple:
    return sp_all_gather(grad, ctx.group, ctx.dim, ctx.world, ctx.rank), None, None, None, None


sp_all_gather.register_autograd(_sp_scatter_grad, setup_context=_setup_gather)
sp_reduce_scatter.register_autograd(_sp_gather_grad, setup_context=_setup_gather)
sp_split.register_autograd(_sp_gather_grad, setup_context=_setup_gather)


def post_cp_gather(out: torch.Tensor, mine: torch.Tensor, group: str) -> dist.Work:
    """Post the all-gather of every rank's contiguous ``mine`` (the same shape on every rank) into ``out`` (the
    ranks' blocks in rank order) over the group named ``group``; wait on the returned work before reading
    ``out`` (on NCCL that makes the current stream wait, not the host)."""
    return _ALL_GATHER_SINGLE(out, mine, group=_resolve_process_group(group), async_op=True)


def post_cp_grad_return(full: torch.Tensor, group: str, rank: int) -> tuple[dist.Work, torch.Tensor]:
    """Post the sum over the group named ``group`` of ``full`` (every rank's equal blocks in rank order) and
    return (the work, this rank's block ``rank`` of the sum, to read after the work is waited on): a reduce-
    scatter on NCCL; gloo has none, so an all-reduce of ``full`` in place, this rank's rows a view of it."""
    pg = _resolve_process_group(group)
    world = dist.get_world_size(pg)
    width = full.shape[0] // world
    if uses_nccl(pg):
        mine = full.new_empty((width, *full.shape[1:]))
        return _REDUCE_SCATTER_SINGLE(mine, full, group=pg, async_op=True), mine
    return dist.all_reduce(full, group=pg, async_op=True), full[rank * width:(rank + 1) * width]


@torch.library.custom_op("hydraulis::cp_all_gather", mutates_args=())
def cp_all_gather(x: torch.Tensor, group: str, width: int, world: int, rank: int) -> torch.Tensor:
    """Every rank's ``x`` (tokens first, at most ``width`` of them) padded to ``width`` rows and stacked in rank
    order: (world * width, ...). The gradient of this rank's rows is summed over the group and returned to it."""
    padded = x.new_zeros((width, *x.shape[1:]))
    padded[:x.shape[0]] = x
    out = x.new_empty((world * width, *x.shape[1:]))
    post_cp_gather(out, padded, group).wait()
    return out


@cp_all_gather.register_fake
def _(x: torch.Tensor, group: str, width: int, world: int, rank: int) -> torch.Tensor:
    return x.new_empty((world * width, *x.shape[1:]))


def _setup_cp_gather(ctx: Any, inputs: tuple, output: Any) -> None:
    x, ctx.group, ctx.width, ctx.world, ctx.rank = inputs
    ctx.tokens = x.shape[0]


def _cp_gather_grad(ctx: Any, grad: torch.Tensor) -> tuple:
    work, mine = post_cp_grad_return(grad.contiguous(), ctx.group, ctx.rank)  # each rank's own rows, summed
    work.wait()
    return mine[:ctx.tokens].contiguous(), None, None, None, None


cp_all_gather.register_autograd(_cp_gather_grad, setup_context=_setup_cp_gather)


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int, group: str,
                             padding_idx: int | None = None) -> torch.Tensor:
    """Embedding lookup in rows ``start .. start + weight.shape[0]`` of a vocabulary split over the group:
    ids outside this rank's rows contribute zeros, and the all-reduce assembles every token's row.
    ``padding_idx``: the whole table's padding row (no gradient), as ``F.embedding`` takes it; the rank holding
    it keeps its row out of the gradient."""
    local = ids - start
    outside = (local < 0) | (local >= weight.shape[0])
    pad = padding_idx - start if padding_idx is not None and start <= padding_idx < start + weight.shape[0] else None
    rows = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight, padding_idx=pad)
    return torch.ops.hydraulis.tp_all_reduce.default(rows.masked_fill(outside.unsqueeze(-1), 0.0), group)


# The op overloads, as graph targets (the graph prints them as ``hydraulis.tp_copy.default``).
TP_ALL_REDUCE = torch.ops.hydraulis.tp_all_reduce.default
TP_COPY = torch.ops.hydraulis.tp_copy.default
TP_GRAD_SHARE = torch.ops.hydraulis.tp_grad_share.default
TP_ALL_GATHER = torch.ops.hydraulis.tp_all_gather.default
SP_ALL_GATHER = torch.ops.hydraulis.sp_all_gather.default
SP_REDUCE_SCATTER = torch.ops.hydraulis.sp_reduce_scatter.default
SP_SPLIT = torch.ops.hydraulis.sp_split.default
CP_ALL_GATHER = torch.ops.hydraulis.cp_all_gather.default
