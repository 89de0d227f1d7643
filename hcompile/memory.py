"""What one rank can hold: the token cap a trainer may use on this machine, checked before anything is captured
at that size.

Owns :func:`tokens_a_rank_holds` (the memory a rank may use, less what the runtime keeps besides activations,
over an upper estimate of a training step's bytes per token read from the captured graph) and
:func:`bound_caps` (every scheme's cap lowered to what its ranks hold; an explicit ``tokens_per_rank`` beyond
it is refused with one line). A rank's memory is its GPU's, or its share of the host's available memory
(ranks on one host share it); every rank takes the smallest figure of the job, so every rank decides alike.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import fx

from passes.plan.cost_model import RuntimeMemory
from passes.plan.ir import CostModel
from runtime import distributed as comm

__all__ = ["MemoryCapError", "rank_memory_bytes", "step_bytes_per_token", "tokens_a_rank_holds", "bound_caps"]

USABLE = 0.9
"""Fraction of a rank's memory a step may fill (the rest: the framework, fragmentation)."""
LOSS_COPIES = 3
"""fp32 copies of the logits the loss keeps per token (the logits, their log-softmax, its gradient)."""


class MemoryCapError(ValueError):
    """A token cap that this machine cannot hold; the message names the cap and what fits."""


def rank_memory_bytes(device: torch.device, local_ranks: int) -> int:
    """Memory one rank may use: its GPU's total memory, or its share of the host's available memory."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    available = None
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return available // max(1, local_ranks)


def step_bytes_per_token(graph: fx.GraphModule, tokens: int) -> float:
    """An upper estimate of a training step's bytes per token: every floating intermediate of the forward
    (``graph`` captured on ``tokens`` tokens), kept for the backward, twice (the backward's own), and the
    loss's fp32 copies of the logits."""
    forward, logits = 0, 0
    for node in graph.graph.nodes:
        value = node.meta.get("val")
        if node.op in ("call_function", "call_method") and isinstance(value, torch.Tensor):
            if value.is_floating_point():
                forward += value.numel() * value.element_size()
        elif node.op == "output":
            out = node.args[0][0] if isinstance(node.args[0], (tuple, list)) else node.args[0]
            logits = out.meta["val"].numel() if isinstance(out, fx.Node) and "val" in out.meta else 0
    return (2 * forward + LOSS_COPIES * 4 * logits) / tokens


def tokens_a_rank_holds(graph: fx.GraphModule, tokens: int, device: torch.device, local_ranks: int,
                        params: int, world_size: int, runtime: RuntimeMemory) -> tuple[int, float, int]:
    """(tokens, bytes per token, usable bytes): how many tokens of one micro-batch a rank without tensor
    parallelism holds beside ``runtime``'s states of ``params`` parameters on ``world_size`` ranks; the
    smallest over the job's ranks (collective when there are several)."""
    memory = rank_memory_bytes(device, local_ranks) * USABLE
    states = params * runtime.sharded_bytes / world_size + params * runtime.compute_bytes + runtime.buffer_bytes
    per_token = step_bytes_per_token(graph, tokens)
    free = comm.all_reduce(torch.tensor([memory - states], dtype=torch.float64, device="cpu"), "min")
    usable = max(0, int(free.item()))
    return int(usable // per_token), per_token, usable


def bound_caps(model: CostModel, holds: tuple[int, float, int], tokens_per_rank: int | None) -> CostModel:
    """``model`` with each scheme's cap at most what its ranks hold (``tp * cp`` times one rank's); an explicit
    ``tokens_per_rank`` above one rank's is a :class:`MemoryCapError`."""
    tokens, per_token, usable = holds
    what = (f"about {tokens} tokens fit in a rank's {usable / 2**30:.1f} GiB at {per_token / 1024:.1f} KiB per "
            "token of this model")
    if tokens_per_rank is not None and tokens_per_rank > tokens:
        raise MemoryCapError(f"tokens_per_rank={tokens_per_rank} is more than this machine holds: {what}; pass "
                             f"tokens_per_rank <= {tokens}")
    entries = tuple(dataclasses.replace(e, max_tokens=min(e.max_tokens, tokens * e.scheme.tp * e.scheme.cp))
                    for e in model.entries)
    if max(e.max_tokens for e in entries) < 1:
        raise MemoryCapError(f"this model does not fit: {what}")
    return dataclasses.replace(model, entries=entries)
