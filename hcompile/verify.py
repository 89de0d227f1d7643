"""Correct or refused: before a strategy's first step, every rank builds its lowering and checks it against the
user's own model; a lowering that cannot be built or computes anything else is the same error on every rank.

Owns :func:`prepare_strategy` (what the trainer calls for each strategy before warming it up) and
:func:`model_reference` (the model itself, eager, with given parameter values: the probe's reference). The
probe and the comparison are :func:`passes.graph.lowering_check.check_lowering`; this module places it on the
job (this rank's replica, stage and TP group), agrees on the verdict over all ranks, and words the refusal.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.func import functional_call

from hcompile.capture import without_kv_cache
from passes.graph.lowering_check import LoweringError, Reference, check_lowering
from passes.graph.variant import lower_graph
from passes.plan.ir import ParallelScheme, Strategy
from runtime import distributed as comm
from runtime.topology import Cluster, place

if TYPE_CHECKING:
    from hcompile.train import CompiledProvider
    from runtime.distributed import GroupCache

__all__ = ["model_reference", "prepare_strategy", "LoweringError"]

log = logging.getLogger("hcompile")


def model_reference(model: nn.Module, device: torch.device) -> Reference:
    """``reference(params, sequences)``: ``model`` (in eval mode, so without dropout; without its inference
    cache) computing with ``params`` and its own buffers, on each sequence alone; the logits concatenated."""
    buffers = {name: b.to(device) for name, b in model.named_buffers()}

    def run(params: Mapping[str, torch.Tensor], sequences: Sequence[torch.Tensor]) -> torch.Tensor:
        training = model.training
        model.eval()
        try:
            with without_kv_cache(model):
                outs = [functional_call(model, {**buffers, **params}, (s[None],)) for s in sequences]
        finally:
            model.train(training)
        return torch.cat([(o if isinstance(o, torch.Tensor) else o.logits)[0] for o in outs])

    return run


def _agree(error: str | None) -> list[str]:
    """Every rank's error message (those that failed), the same list on every rank."""
    return [e for _, e in comm.agree_errors(error)]


def _refuse(errors: list[str], what: str) -> None:
    if errors:
        unique = list(dict.fromkeys(errors))
        raise LoweringError(f"{what}: " + " | ".join(unique[:4]) + (f" | and {len(unique) - 4} more"
                                                                     if len(unique) > 4 else ""))


def prepare_strategy(strategy: Strategy, *, rank: int, cluster: Cluster, groups: "GroupCache",
                     provider: "CompiledProvider", self_check: bool, checked: set, vocab: int | None) -> None:
    """Build this rank's stage program of ``strategy`` (its first token bucket) and, with ``self_check``, check
    its lowering on a probe the first time this (scheme, TP rank) is met (``checked`` remembers them).
    Collective; raises the same :class:`LoweringError` on every rank when any rank failed."""
    placement = place(strategy, cluster)
    groups.prepare(placement)
    replica, stage, tp_rank = placement.stage_of(rank)
    scheme = strategy.replicas()[replica]
    tp_group = groups.get(placement.tp_groups(replica)[stage])
    error = None
    try:
        provider.stage(scheme, stage, tp_rank, tp_group)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, whatever it is
        error = f"{scheme.describe()} on rank {rank}: {type(e).__name__}: {e}"
    _refuse(_agree(error), f"strategy {strategy.describe()} cannot be lowered")
    if not self_check:
        return
    key = (scheme, tp_rank)
    if key not in checked:  # the ranks that checked before still take part in the agreement below
        checked.add(key)
        name = comm.group_name(tp_group)
        try:
            report = _check(provider, scheme, tp_rank, name, vocab)
            error = None if report.ok else report.describe()
            log.debug("lowering check: %s", report.describe())
        except Exception as e:  # noqa: BLE001
            error = f"{scheme.describe()} on rank {rank}: the probe failed: {type(e).__name__}: {e}"
    _refuse(_agree(error),
            f"strategy {strategy.describe()} does not train this model correctly: its lowering, run on a probe, "
            "computes something else than the model (self_check=False turns this check off; please report the "
            "model)")


def _check(provider: "CompiledProvider", scheme: ParallelScheme, tp_rank: int, group: str | None,
           vocab: int | None):
    bucket = provider.buckets.sizes[0]
    captured = provider.captured(bucket)
    lower: Callable = lambda gm: lower_graph(gm, scheme, tp_rank=tp_rank, tp_group=group,  # noqa: E731
                                             attention_kernel=provider.compiled.kernel)
    device = torch.device(provider.device) if provider.device is not None else torch.device("cpu")
    dtype = provider.dtype or torch.float32
    return check_lowering(captured.graph_module, scheme, tp_rank=tp_rank, tp_group=group, lower=lower,
                          reference=model_reference(provider.compiled.model, device),
                          buffer=lambda n, v: provider.buffer(n) if v.device.type == "meta" else v,
                          vocab=vocab or 2, device=device, dtype=dtype, output_index=captured.output_index)
