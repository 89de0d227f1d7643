"""Context parallelism (CP): the sequences of a micro-batch spread over the ranks of a CP group, attention exact.

Owns two things.

- The layout, decided on the host (:func:`cp_layout`): a sequence of at least ``split_at`` tokens is cut into
  ``2 * cp`` chunks and rank r holds chunks r and 2cp-1-r, so every rank gets the same causal attention work (the
  per-document sharding of Megatron-Core's CP and WLB-LLM); a shorter sequence goes whole to the rank with the
  least work so far (longest first). Each token keeps its position in its whole sequence (``positions``), which
  is what rotary or learned positions must read. A :class:`CpLayout` is plain data, the same on every rank.
- The attention over the group (:func:`cp_attention`): every rank all-gathers the keys and values of the group
  once per attention layer (``collectives.cp_all_gather``, padded to the widest rank; its backward sums every
  token's key and value gradient over the ranks that read it and leaves it with the rank that holds it), picks each
  query chunk's keys, its sequence from the start to the chunk's end (``index_select``, whose backward adds the
  copies back), and runs the packed kernel with key spans (causal aligned at the bottom right). All-gather, not a
  ring: with grouped-query attention K/V are a small part of the activations (Llama 3 makes the same choice),
  one collective per layer instead of cp - 1 dependent steps, and the backward is the kernel's own with no
  log-sum-exp merging; the price is every rank holding one whole sequence's K/V per layer during attention.
  With ``kv_splits`` > 1 the exchange is pipelined over groups of the rank's kv heads, each group's attention
  waiting only for its own K/V (``passes.graph.kv_exchange``): the same numbers, the exchange beside the
  attention.

The index tensors (:class:`CpAttentionInputs`) are built once per micro-batch on the host and moved to the
device with the tokens: nothing here reads a device tensor back. ``rewrite_context_parallel_pass`` turns a
packed graph into one CP rank's: its attention calls become :func:`cp_packed_attention` and its per-sequence
positions a graph input (``CP_INPUTS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import fx

import codegen
from passes.graph.collectives import CP_ALL_GATHER
from passes.graph.kv_exchange import KV_SPLITS, cp_pipelined_attention
from passes.graph.kv_exchange import kv_splits as kv_splits_for
from passes.graph.packed_attention import packed_positions
from passes.graph.pass_runner import PassContext, PassError, PassResult, fill_vals

__all__ = ["CpPiece", "CpLayout", "CpAttentionInputs", "CpShare", "cp_layout", "cp_attention", "cp_packed_attention",
           "whole_sequence_positions", "CP_INPUTS", "rewrite_context_parallel_pass"]


@dataclass(frozen=True, slots=True)
class CpPiece:
    """Tokens ``start .. stop`` of sequence ``seq`` (an index into the layout's lengths)."""

    seq: int
    start: int
    stop: int

    @property
    def tokens(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class CpLayout:
    """Which pieces of which sequences each CP rank holds, in its local token order."""

    lengths: tuple[int, ...]
    """Every sequence's whole length."""
    ranks: tuple[tuple[CpPiece, ...], ...]
    """Per CP rank, its pieces in local order."""

    @property
    def cp(self) -> int:
        return len(self.ranks)

    @property
    def width(self) -> int:
        """Tokens of the widest rank: every rank's keys are padded to it for the all-gather."""
        return max((self.tokens(r) for r in range(self.cp)), default=0)

    def tokens(self, rank: int) -> int:
        return sum(p.tokens for p in self.ranks[rank])

    def positions(self, rank: int) -> list[int]:
        """Each local token's position in its whole sequence."""
        return [i for p in self.ranks[rank] for i in range(p.start, p.stop)]

    def token_ids(self, rank: int, sequences: Sequence[torch.Tensor]) -> torch.Tensor:
        """This rank's tokens, cut from the whole ``sequences`` (one 1-D tensor per sequence)."""
        parts = [sequences[p.seq][p.start:p.stop] for p in self.ranks[rank]]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)

    def gathered_rows(self, width: int | None = None) -> list[list[int]]:
        """Per sequence, the row of each of its tokens in the gathered (cp * width) key buffer (``width``: the
        rows each rank contributes, at least :attr:`width`)."""
        width = self.width if width is None else width
        rows: list[list[int]] = [[0] * n for n in self.lengths]
        for rank, pieces in enumerate(self.ranks):
            at = rank * width
            for p in pieces:
                rows[p.seq][p.start:p.stop] = range(at, at + p.tokens)
                at += p.tokens
        return rows


def cp_layout(lengths: Sequence[int], cp: int, split_at: int | None = None) -> CpLayout:
    """Spread sequences of ``lengths`` over ``cp`` ranks, longest first. A sequence shorter than ``split_at``
    tokens (default: half a rank's even share) goes whole to the rank holding the fewest tokens, when that keeps
    it within the even share ``ceil(total / cp)``; any other is cut into 2 * cp chunks, rank r taking chunks r
    and 2cp-1-r, each rank's two chunks sized by water-filling the ranks' token counts (equal counts give equal
    chunks, so equal causal work). No rank holds more than ``ceil(total / cp)`` tokens: a micro-batch within a
    CP replica's cap puts no rank above its own."""
    if cp < 1:
        raise ValueError(f"cp={cp} must be >= 1")
    if any(n < 0 for n in lengths):
        raise ValueError(f"sequence lengths must be >= 0; got {list(lengths)}")
    total = sum(lengths)
    even = -(-total // cp)
    split_at = max(1, -(-total // (2 * cp))) if split_at is None else split_at
    pieces: list[list[CpPiece]] = [[] for _ in range(cp)]
    load = [0] * cp
    for seq in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[seq]
        least = min(range(cp), key=lambda r: (load[r], r))
        if n == 0:
            continue
        if cp == 1 or (n < split_at and load[least] + n <= even):
            pieces[least].append(CpPiece(seq, 0, n))
            load[least] += n
            continue
        shares = _water_fill(load, n)
        sizes = [0] * (2 * cp)
        for rank, share in enumerate(shares):
            sizes[rank], sizes[2 * cp - 1 - rank] = share - share // 2, share // 2
            load[rank] += share
        at = 0
        for chunk, size in enumerate(sizes):
            rank = chunk if chunk < cp else 2 * cp - 1 - chunk
            if size:
                pieces[rank].append(CpPiece(seq, at, at + size))
            at += size
    ordered = tuple(tuple(sorted(p, key=lambda x: (x.seq, x.start))) for p in pieces)
    return CpLayout(lengths=tuple(int(n) for n in lengths), ranks=ordered)


def _water_fill(load: Sequence[int], n: int) -> list[int]:
    """How many of ``n`` tokens each rank takes so that the ranks' counts rise from the lowest, as evenly as
    tokens allow (ties to the lower rank)."""
    shares = [0] * len(load)
    level = sorted(range(len(load)), key=lambda r: (load[r], r))
    left = n
    while left:
        low = min(load[r] + shares[r] for r in level)
        bottom = [r for r in level if load[r] + shares[r] == low]
        above = [load[r] + shares[r] for r in level if load[r] + shares[r] > low]
        step = (min(above) - low) if above else -(-left // len(bottom))
        for r in bottom:
            give = min(step, left)
            shares[r] += give
            left -= give
            if not left:
                break
    return shares


@dataclass(frozen=True, slots=True)
class CpAttentionInputs:
    """One CP rank's index tensors for one micro-batch: which gathered rows are each query piece's keys."""

    key_rows: torch.Tensor
    """int64, the gathered key buffer's rows, piece by piece: each piece's sequence from 0 to its end."""
    cu_seqlens_q: torch.Tensor
    """int32 offsets of the local pieces (the query spans)."""
    cu_seqlens_k: torch.Tensor
    """int32 offsets into ``key_rows`` (the key spans)."""
    max_seqlen_q: int
    max_seqlen_k: int
    width: int
    """Rows each rank contributes to the gather (the widest rank's tokens)."""
    cp: int
    rank: int

    @classmethod
    def build(cls, layout: CpLayout, rank: int, device: torch.device | str = "cpu",
              width: int | None = None) -> "CpAttentionInputs":
        """Rank ``rank``'s inputs, built on the host and copied to ``device``. ``width`` (None: the widest rank's
        tokens, and this rank's tensors hold just its own): the rows every rank gathers, when every rank's
        tensors are padded to it (a compiled bucket); this rank's rows past its tokens are then one more span
        whose keys are its own rows (finite values nobody reads)."""
        padded = width is not None
        width = layout.width if width is None else width
        if width < layout.width:
            raise ValueError(f"width={width} is below the widest rank's {layout.width} tokens")
        rows = layout.gathered_rows(width)
        pieces = layout.ranks[rank]
        key_rows = [r for p in pieces for r in rows[p.seq][:p.stop]]
        cu_q, cu_k = [0], [0]
        for p in pieces:
            cu_q.append(cu_q[-1] + p.tokens)
            cu_k.append(cu_k[-1] + p.stop)
        padding = width - cu_q[-1]
        if padded and padding > 0:
            key_rows.extend(range(rank * width + cu_q[-1], (rank + 1) * width))
            cu_q.append(width)
            cu_k.append(cu_k[-1] + padding)
        lengths = [b - a for a, b in zip(cu_q, cu_q[1:])]
        return cls(key_rows=torch.tensor(key_rows, dtype=torch.long).to(device),
                   cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32).to(device),
                   cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32).to(device),
                   max_seqlen_q=max(lengths, default=0),
                   max_seqlen_k=max((b - a for a, b in zip(cu_k, cu_k[1:])), default=0),
                   width=width, cp=layout.cp, rank=rank)




def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: CpAttentionInputs, group: str, *,
                 softmax_scale: float | None = None, softcap: float | None = None, kernel: str = "auto",
                 window: int | None = None, chunk: int | None = None,
                 sinks: torch.Tensor | None = None, kv_splits: int = KV_SPLITS) -> torch.Tensor:
    """Causal attention of this CP rank's queries (T_local, heads, dim) over their whole sequences, whose keys
    and values are spread over the group named ``group``; differentiable in q, k and v (k and v's gradients
    include what the other ranks' queries contribute). ``window``, ``chunk``, ``sinks``: as the packed op takes
    them, positions counted over the whole sequence (each query piece's keys start at its sequence's start).
    ``kv_splits``: the head groups the K/V exchange is pipelined over, at most (``passes.graph.kv_exchange``;
    1: one all-gather before the attention)."""
    return cp_packed_attention(q, k, v, inputs.key_rows, inputs.cu_seqlens_q, inputs.cu_seqlens_k,
                               inputs.max_seqlen_q, inputs.max_seqlen_k, group=group, width=inputs.width,
                               cp=inputs.cp, rank=inputs.rank, softmax_scale=softmax_scale, softcap=softcap,
                               kernel=kernel, window=window, chunk=chunk, sinks=sinks, kv_splits=kv_splits)


@dataclass(frozen=True, slots=True)
class CpShare:
    """One CP rank's share of a micro-batch, padded to ``width`` tokens, on the host: what its program takes."""

    ids: torch.Tensor
    """(width,) token ids, padding 0."""
    next_ids: torch.Tensor
    """(width,) each token's next token in its whole sequence, ``ignore`` where it has none or is padding."""
    positions: torch.Tensor
    """(width,) each token's position in its whole sequence (0 in padding)."""
    inputs: CpAttentionInputs
    """The attention's index tensors (with the padding span)."""
    tokens: int
    """Real tokens (the rest is padding)."""
    rows: torch.Tensor
    """(tokens,) each real token's row in the micro-batch's sequences concatenated (for checks)."""

    @classmethod
    def build(cls, sequences: Sequence[torch.Tensor], cp: int, rank: int, width: int | Callable[[int], int],
              ignore: int = -100) -> "CpShare":
        """Rank ``rank``'s share of 1-D host ``sequences`` spread over ``cp`` ranks by :func:`cp_layout`, padded
        to ``width`` tokens (or to ``width(widest rank's tokens)``, a bucket: the same on every rank)."""
        layout = cp_layout([int(t.numel()) for t in sequences], cp)
        width = width(layout.width) if callable(width) else width
        inputs = CpAttentionInputs.build(layout, rank, width=width)
        starts = [0]
        for n in layout.lengths:
            starts.append(starts[-1] + n)
        ids = torch.zeros(width, dtype=torch.long)
        next_ids = torch.full((width,), ignore, dtype=torch.long)
        positions = torch.zeros(width, dtype=torch.long)
        rows, at = [], 0
        for p in layout.ranks[rank]:
            seq = sequences[p.seq].cpu()
            ids[at:at + p.tokens] = seq[p.start:p.stop]
            following = seq[p.start + 1:p.stop + 1]  # the last one's next token is in the next piece, or none
            next_ids[at:at + following.numel()] = following
            positions[at:at + p.tokens] = torch.arange(p.start, p.stop)
            rows.extend(range(starts[p.seq] + p.start, starts[p.seq] + p.stop))
            at += p.tokens
        return cls(ids=ids, next_ids=next_ids, positions=positions, inputs=inputs, tokens=at,
                   rows=torch.tensor(rows, dtype=torch.long))

    def graph_inputs(self, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        """The values of ``CP_INPUTS`` on ``device``."""
        return tuple(t.to(device, non_blocking=True) for t in (self.positions, self.inputs.key_rows,
                                                               self.inputs.cu_seqlens_k))


def cp_packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_rows: torch.Tensor,
                        cu_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen: int, max_seqlen_k: int, *,
                        group: str, width: int, cp: int, rank: int, causal: bool = True,
                        softmax_scale: float | None = None, softcap: float | None = None, kernel: str = "auto",
                        window: int | None = None, chunk: int | None = None,
                        sinks: torch.Tensor | None = None, kv_splits: int = 1) -> torch.Tensor:
    """:func:`cp_attention` with its inputs spelled out, as the rewritten graph calls it (the name says packed
    attention, so graph analysis costs it as attention). ``width``: the rows every rank gathers (its token
    count, padding included); ``causal`` must be True (a context-parallel chunk sees its sequence's start);
    ``kv_splits``: as :func:`cp_attention` takes it."""
    if not causal:
        raise ValueError("context-parallel attention is causal only")
    splits = kv_splits_for(k.shape[1], kv_splits)
    if splits > 1:
        return cp_pipelined_attention(q, k, v, key_rows, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k,
                                      group=group, width=width, cp=cp, rank=rank, splits=splits,
                                      softmax_scale=softmax_scale, softcap=softcap, kernel=kernel, window=window,
                                      chunk=chunk, sinks=sinks)
    k_all = CP_ALL_GATHER(k, group, width, cp, rank)
    v_all = CP_ALL_GATHER(v, group, width, cp, rank)
    return codegen.packed_attention(q, k_all.index_select(0, key_rows), v_all.index_select(0, key_rows), cu_seqlens,
                                    max_seqlen, causal=True, softmax_scale=softmax_scale, softcap=softcap,
                                    kernel=kernel, validate=False, cu_seqlens_k=cu_seqlens_k,
                                    max_seqlen_k=max_seqlen_k, window=window, chunk=chunk, sinks=sinks)


def whole_sequence_positions(positions: torch.Tensor, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Each token's position in its whole sequence (a graph input under context parallelism), in ``dtype``."""
    return positions.to(dtype)


CP_INPUTS = ("cp_positions", "cp_key_rows", "cp_cu_seqlens_k")
"""The inputs the context-parallel rewrite adds after the packed graph's, in order: each token's position in its
whole sequence (T,), the gathered rows each query piece attends (int64), the key spans' offsets (int32)."""


def rewrite_context_parallel_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Under cp > 1, on a packed graph: every packed attention becomes :func:`cp_packed_attention` over the CP
    group (option ``group``; this rank's index: option ``rank``) and every per-sequence position becomes the
    ``positions`` input; the nodes keep their names, so a pipeline cut decided on the result applies. cp = 1:
    unchanged."""
    cp = ctx.scheme.cp
    if cp == 1:
        return PassResult(graph_module=gm, modified=False)
    group, rank = ctx.option("rewrite_context_parallel_pass.group"), ctx.option("rewrite_context_parallel_pass.rank")
    splits = ctx.option("rewrite_context_parallel_pass.kv_splits", 1)
    if not group or not isinstance(rank, int) or not 0 <= rank < cp:
        raise PassError(f"context parallel: cp={cp} needs options group (a process group name) and rank in "
                        f"[0, {cp}); got group={group!r}, rank={rank!r}")
    graph = gm.graph
    attention = [n for n in graph.nodes if n.op == "call_function" and n.target is codegen.packed_attention]
    if not attention:
        raise PassError("context parallel: the graph has no packed attention; run rewrite_packed_attention_pass "
                        "first")
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    total = int(placeholders[0].meta["val"].shape[-1])
    with graph.inserting_after(placeholders[-1]):
        cu_k = graph.placeholder(CP_INPUTS[2], type_expr=torch.Tensor)
    with graph.inserting_after(placeholders[-1]):
        key_rows = graph.placeholder(CP_INPUTS[1], type_expr=torch.Tensor)
    with graph.inserting_after(placeholders[-1]):
        positions = graph.placeholder(CP_INPUTS[0], type_expr=torch.Tensor)
    if (positions.name, key_rows.name, cu_k.name) != CP_INPUTS:
        raise PassError(f"context parallel: the graph already has nodes named like the inputs {CP_INPUTS}")
    replaced = []  # (the val a node had, the node computing it anew)
    for node in attention:
        replaced.append((node.meta.pop("val", None), node))
        q, k, v, cu, max_seqlen = node.args[:5]
        kwargs = {key: value for key, value in node.kwargs.items() if key != "validate"}
        node.target = cp_packed_attention
        node.args = (q, k, v, key_rows, cu, cu_k, max_seqlen, cp * total)
        node.kwargs = {**kwargs, "group": group, "width": total, "cp": cp, "rank": rank, "kv_splits": splits}
    swapped = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target is packed_positions:
            replaced.append((node.meta.pop("val", None), node))
            node.target, node.args = whole_sequence_positions, (positions,)
            node.kwargs = {"dtype": node.kwargs.get("dtype", torch.long)}
            swapped += 1
    graph.lint()
    gm.recompile()
    # the rewritten nodes anew; the rest keep theirs where those kept shape, dtype, strides
    fill_vals(gm, {positions: torch.zeros(total, dtype=torch.long), key_rows: torch.arange(total),
                   cu_k: torch.tensor([0, total], dtype=torch.int32)}, replaced)
    return PassResult(graph_module=gm, modified=True,
                      info={"attention_sites": len(attention), "positions": swapped, "cp": cp})
