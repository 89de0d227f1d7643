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
from passes.graph.lowering import Lowering, LoweringCache, lower_graph
from passes.graph.lowering_check import LoweringError, Reference, check_lowering
from passes.plan.ir import StepPlan
from runtime import distributed as comm

if TYPE_CHECKING:
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


def prepare_strategy(plan: StepPlan, *, rank: int, groups: "GroupCache", lowerings: LoweringCache, model: nn.Module,
                     device: torch.device, dtype: torch.dtype, self_check: bool, checked: set,
                     vocab: int | None) -> None:
    """Build this rank's lowering of ``plan``'s strategy and its variant at the first token bucket and, with
    ``self_check``, check the lowering on a probe the first time this (scheme, TP rank) is met (``checked``
    remembers them). ``plan``: the strategy placed (its data does not matter); ``groups``: its process groups.
    Collective; raises the same :class:`LoweringError` on every rank when any rank failed."""
    strategy = plan.strategy
    place = plan.place_of(rank)
    stage, tp_rank, cp_rank = place.stage, place.tp_rank, place.cp_rank
    replica = plan.replicas[place.replica]
    scheme = replica.scheme
    group = comm.group_name(groups.get(replica.tp_group(stage, cp_rank)))
    cp_group = comm.group_name(groups.get(replica.cp_group(stage, tp_rank))) if scheme.cp > 1 else None
    error = None
    try:
        lowerings.variant(scheme, stage, lowerings.buckets.sizes[0], tp_rank, group, cp_rank, cp_group)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, whatever it is
        error = f"{scheme.describe()} on rank {rank}: {type(e).__name__}: {e}"
    _refuse(_agree(error), f"strategy {strategy.describe()} cannot be lowered")
    if not self_check:
        return
    key = (scheme, tp_rank, cp_rank)
    if key not in checked:  # the ranks that checked before still take part in the agreement below
        checked.add(key)
        try:
            report = _check(lowerings, lowerings.lowering(scheme, stage, tp_rank, group, cp_rank, cp_group), group,
                            vocab, model, device, dtype)
            error = None if report.ok else report.describe()
            log.debug("lowering check: %s", report.describe())
        except Exception as e:  # noqa: BLE001
            error = f"{scheme.describe()} on rank {rank}: the probe failed: {type(e).__name__}: {e}"
    _refuse(_agree(error),
            f"strategy {strategy.describe()} does not train this model correctly: its lowering, run on a probe, "
            "computes something else than the model (self_check=False turns this check off; please report the "
            "model)")


def _check(lowerings: LoweringCache, lowering: Lowering, group: str | None, vocab: int | None, model: nn.Module,
           device: torch.device, dtype: torch.dtype):
    """The decided lowering of (scheme, TP rank, CP rank), every stage of it, on a probe at the first bucket."""
    scheme, tp_rank = lowering.scheme, lowering.tp_rank
    lower: Callable = lambda gm: lower_graph(gm, scheme, tp_rank=tp_rank, tp_group=group,  # noqa: E731
                                             attention_kernel=lowerings.kernel,
                                             tensor_parallel=lowering.tensor_parallel, pipeline=lowering.pipeline,
                                             cp_rank=lowering.cp_rank, cp_group=lowering.cp_group)
    return check_lowering(lowerings.capture(lowerings.buckets.sizes[0]), scheme, tp_rank=tp_rank, tp_group=group,
                          lower=lower, reference=model_reference(model, device),
                          buffer=lambda n, v: lowerings.buffer(n) if v.device.type == "meta" else v,
                          vocab=vocab or 2, device=device, dtype=dtype, cp_rank=lowering.cp_rank,
                          cp_group=lowering.cp_group)
