"""The K/V exchange of context-parallel attention pipelined with the attention, head group by head group.

Owns ``hydraulis::cp_pipelined_attention`` and its backward op. Unpipelined (``passes.graph.context_parallel``),
a CP rank all-gathers the whole group's keys and values, and only then can its attention start: the exchange is
exposed in full. Here the kv heads are cut into ``splits`` groups (each with the query heads it serves, so that
every group is a whole attention of its own: no log-sum-exp merging, the same kernel, the same numbers):

- forward: every group's K and V all-gathers are posted at once, in group order, and group g's attention waits
  only for group g's (``Work.wait``: on NCCL the compute stream waits on the collective, the host does not), so
  the gathers of later groups run while earlier groups compute; exposed: the first group's gather, and any
  group's that takes longer than the attention before it;
- backward: group g's attention backward runs, then its key and value gradients (every rank's queries' share)
  go back to the ranks that hold those tokens (reduce-scatter on NCCL; gloo has none: an all-reduce, each rank
  keeping its own rows), posted at once, while group g + 1's backward computes; every rank waits for them all
  at the end.

The collectives are ``passes.graph.collectives``' (the one graph module that calls torch.distributed), where
``tests/collective_order.py`` records them. Every rank of the group posts the same collectives in the same
order (K then V, group by group), so the exchange is NCCL-safe. The gathered K/V of every group are kept for
the backward, as the unpipelined path keeps its gathered copies: the memory is the same. Exactness is tested
against naive attention over whole sequences (``tests/test_context_parallel.py``) and in whole training steps
(``tests/test_regrouped_cp.py``, ``tests/test_cp_equivalence.py``).
"""

from __future__ import annotations

from typing import Any

import torch

import codegen
from passes.graph.collectives import post_cp_gather, post_cp_grad_return
from passes.plan.context_parallel import KV_SPLITS, kv_splits

__all__ = ["KV_SPLITS", "kv_splits", "cp_pipelined_attention", "CP_PIPELINED_ATTENTION"]


def _padded_groups(x: torch.Tensor, width: int, splits: int) -> torch.Tensor:
    """(tokens, heads, dim) -> (splits, width, heads / splits, dim), contiguous, zero rows past the tokens."""
    tokens, heads, dim = x.shape
    out = x.new_zeros((splits, width, heads // splits, dim))
    out[:, :tokens] = x.reshape(tokens, splits, heads // splits, dim).transpose(0, 1)
    return out


@torch.library.custom_op("hydraulis::cp_pipelined_attention", mutates_args=())
def cp_pipelined_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_rows: torch.Tensor, cu_seqlens: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen: int, max_seqlen_k: int, group: str, width: int, cp: int, rank: int,
    splits: int, softmax_scale: float, softcap: float | None, kernel: str, window: int, chunk: int,
    sinks: torch.Tensor | None = None, seqlen_grid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward (module docstring): (out, lse, gathered K, gathered V), the gathered as (splits, cp * width,
    kv_heads / splits, dim) for the backward. The arguments after ``splits`` are the packed op's, encoded."""
    k_all = k.new_empty((splits, cp * width, k.shape[1] // splits, k.shape[2]))
    v_all = torch.empty_like(k_all)
    k_mine, v_mine = _padded_groups(k, width, splits), _padded_groups(v, width, splits)
    works = [(post_cp_gather(k_all[g], k_mine[g], group), post_cp_gather(v_all[g], v_mine[g], group))
             for g in range(splits)]
    hq = q.shape[1] // splits
    outs, lses = [], []
    for g, (wk, wv) in enumerate(works):
        wk.wait()
        wv.wait()
        heads = slice(g * hq, (g + 1) * hq)
        out, lse = codegen.packed_attention_op(
            q[:, heads].contiguous(), k_all[g].index_select(0, key_rows), v_all[g].index_select(0, key_rows),
            cu_seqlens, max_seqlen, True, softmax_scale, softcap, kernel, cu_seqlens_k, max_seqlen_k, window, chunk,
            None if sinks is None else sinks[heads], seqlen_grid)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=0), k_all, v_all


@cp_pipelined_attention_op.register_fake
def _(q, k, v, key_rows, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, group, width, cp, rank, splits,
      softmax_scale, softcap, kernel, window, chunk, sinks=None, seqlen_grid=None):
    gathered = k.new_empty((splits, cp * width, k.shape[1] // splits, k.shape[2]))
    return (torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32), gathered,
            torch.empty_like(gathered))


@torch.library.custom_op("hydraulis::cp_pipelined_attention_backward", mutates_args=())
def cp_pipelined_attention_backward_op(
    grad_out: torch.Tensor, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, key_rows: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen: int, max_seqlen_k: int, group: str, width: int, cp: int, rank: int, tokens: int,
    softmax_scale: float, softcap: float | None, kernel: str, window: int, chunk: int,
    sinks: torch.Tensor | None = None, seqlen_grid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward (module docstring): gradients of (q, k, v, sinks) for this rank's ``tokens`` local rows (the
    sinks' an empty tensor when there are none)."""
    splits, rows, hk, dim = k_all.shape
    hq = q.shape[1] // splits
    grad_q, grad_sinks, pending = [], [], []
    for g in range(splits):
        heads = slice(g * hq, (g + 1) * hq)
        dq, dk, dv, ds = codegen.packed_attention_backward_op(
            grad_out[:, heads].contiguous(), q[:, heads].contiguous(), k_all[g].index_select(0, key_rows),
            v_all[g].index_select(0, key_rows), out[:, heads].contiguous(), lse[heads].contiguous(), cu_seqlens,
            max_seqlen, True, softmax_scale, softcap, kernel, cu_seqlens_k, max_seqlen_k, window, chunk,
            None if sinks is None else sinks[heads], seqlen_grid)
        grad_q.append(dq)
        grad_sinks.append(ds)
        for grad in (dk, dv):  # every key row this rank's queries read, summed back to the rank that holds it
            pending.append(post_cp_grad_return(grad.new_zeros((rows, hk, dim)).index_add_(0, key_rows, grad),
                                               group, rank))
    for work, _ in pending:
        work.wait()
    grad_k = torch.cat([mine[:tokens] for _, mine in pending[0::2]], dim=1)
    grad_v = torch.cat([mine[:tokens] for _, mine in pending[1::2]], dim=1)
    return (torch.cat(grad_q, dim=1), grad_k, grad_v,
            torch.cat(grad_sinks) if sinks is not None else q.new_empty(0))


@cp_pipelined_attention_backward_op.register_fake
def _(grad_out, q, k_all, v_all, out, lse, key_rows, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, group,
      width, cp, rank, tokens, softmax_scale, softcap, kernel, window, chunk, sinks=None, seqlen_grid=None):
    splits, _, hk, dim = k_all.shape
    grad_k = k_all.new_empty((tokens, splits * hk, dim))
    return (torch.empty_like(q), grad_k, torch.empty_like(grad_k),
            q.new_empty(0) if sinks is None else torch.empty_like(sinks))


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    (q, k, _, key_rows, cu_seqlens, cu_seqlens_k, ctx.max_seqlen, ctx.max_seqlen_k, ctx.group, ctx.width, ctx.cp,
     ctx.rank, _, ctx.softmax_scale, ctx.softcap, ctx.kernel, ctx.window, ctx.chunk, sinks, seqlen_grid) = inputs
    out, lse, k_all, v_all = output
    ctx.tokens = k.shape[0]
    ctx.save_for_backward(q, k_all, v_all, out, lse, key_rows, cu_seqlens, cu_seqlens_k, sinks, seqlen_grid)


def _backward(ctx: Any, grad_out: torch.Tensor, *_unused: Any) -> tuple:
    q, k_all, v_all, out, lse, key_rows, cu_seqlens, cu_seqlens_k, sinks, seqlen_grid = ctx.saved_tensors
    grad_q, grad_k, grad_v, grad_sinks = cp_pipelined_attention_backward_op(
        grad_out, q, k_all, v_all, out, lse, key_rows, cu_seqlens, cu_seqlens_k, ctx.max_seqlen, ctx.max_seqlen_k,
        ctx.group, ctx.width, ctx.cp, ctx.rank, ctx.tokens, ctx.softmax_scale, ctx.softcap, ctx.kernel, ctx.window,
        ctx.chunk, sinks, seqlen_grid)
    return (grad_q, grad_k, grad_v, *([None] * 15), None if sinks is None else grad_sinks, None)


cp_pipelined_attention_op.register_autograd(_backward, setup_context=_setup)


def cp_pipelined_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_rows: torch.Tensor,
                           cu_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen: int | torch.Tensor,
                           max_seqlen_k: int, *, group: str, width: int, cp: int, rank: int, splits: int,
                           softmax_scale: float | None = None, softcap: float | None = None, kernel: str = "auto",
                           window: int | None = None, chunk: int | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``passes.graph.context_parallel.cp_packed_attention`` with its exchange pipelined over ``splits`` head
    groups (``splits`` must divide the rank's kv heads; :func:`kv_splits` picks one); the arguments and the
    result are that function's."""
    if splits < 1 or k.shape[1] % splits:
        raise ValueError(f"splits={splits} must be >= 1 and divide the rank's {k.shape[1]} kv heads")
    (q, k, v, cu_seqlens, max_seqlen, _, scale, softcap, kernel, cu_seqlens_k, max_seqlen_k, window_, chunk_, sinks,
     grid) = codegen.packed_attention_args(
        q, k, v, cu_seqlens, max_seqlen, causal=True, softmax_scale=softmax_scale, softcap=softcap, kernel=kernel,
        validate=False, cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k, window=window, chunk=chunk,
        sinks=sinks)
    return CP_PIPELINED_ATTENTION(q, k, v, key_rows, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, group,
                                  width, cp, rank, splits, scale, softcap, kernel, window_, chunk_, sinks, grid)[0]


CP_PIPELINED_ATTENTION = torch.ops.hydraulis.cp_pipelined_attention.default
