"""Correct or refused: before a strategy's first step, every rank builds its lowering and checks it against the
user's own model; a lowering that cannot be built or computes anything else is the same error on every rank.

Owns :func:`prepare_strategy` (what the trainer calls for each strategy before warming it up) and
:func:`model_reference` (the model itself, eager, with given parameter values: the probe's reference). The
probe and the comparison are :func:`passes.graph.lowering_check.check_lowering`; this module places it on the
job (this rank's replica, stage and TP group), agrees on the verdict over all ranks, and words the refusal.
A lowering whose logits stay split by vocabulary (``Lowering.vocab_range``) is checked with its logits gathered
over the TP group (:func:`gather_vocab`, appended to the probe's program only): the check compares the whole
logits and, through the gather's backward (this rank's columns), every parameter's gradient, as for any other
lowering; the loss the runtime assembles from the split logits is ``runtime.loss.vocab_parallel_loss_sum``'s
(tested against ``F.cross_entropy`` in ``tests/test_vocab_parallel_loss.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

import torch
from torch import fx, nn
from torch.func import functional_call

from hcompile.capture import without_kv_cache
from passes.graph.collectives import TP_ALL_GATHER
from passes.graph.lowering import Lowered, Lowering, LoweringCache, lower_graph
from passes.graph.lowering_check import LoweringError, Reference, check_lowering, probe_lengths
from passes.plan.ir import StepPlan
from runtime import distributed as comm

if TYPE_CHECKING:
    from runtime.distributed import GroupCache

__all__ = ["check_strategy", "model_reference", "prepare_strategy", "probe_plan", "ProbePlan", "LoweringError",
           "SELF_CHECK_MAX_TOKENS", "self_check_cost", "gather_vocab", "with_gathered_logits"]

log = logging.getLogger("hcompile")

SELF_CHECK_MAX_TOKENS = 16384
"""Default bound on the tokens of the self-check's probe (``bucket * cp``): its cost grows with them."""


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


def _rank_place(plan: StepPlan, rank: int, groups: "GroupCache") -> tuple:
    """(scheme, stage, TP rank, CP rank, TP group name, CP group name or None) of ``rank`` in ``plan``."""
    place = plan.place_of(rank)
    stage, tp_rank, cp_rank = place.stage, place.tp_rank, place.cp_rank
    replica = plan.replicas[place.replica]
    scheme = replica.scheme
    group = comm.group_name(groups.get(replica.tp_group(stage, cp_rank)))
    cp_group = comm.group_name(groups.get(replica.cp_group(stage, tp_rank))) if scheme.cp > 1 else None
    return scheme, stage, tp_rank, cp_rank, group, cp_group


def prepare_strategy(plan: StepPlan, *, rank: int, groups: "GroupCache", lowerings: LoweringCache, model: nn.Module,
                     device: torch.device, dtype: torch.dtype, self_check: bool, checked: set,
                     vocab: int | None, probe_tokens: int = SELF_CHECK_MAX_TOKENS) -> None:
    """Build this rank's lowering of ``plan``'s strategy (deciding every attention's limits on the captures of
    every bucket it runs) and its variant at every token bucket it runs and, with ``self_check``, check the lowering
    on a probe at its largest bucket the first time this (scheme, TP rank) is met (``checked`` remembers them;
    ``probe_tokens`` bounds the probe, :func:`probe_plan`). ``plan``: the strategy placed (its data does not
    matter); ``groups``: its process groups. Collective; raises the same :class:`LoweringError` on every rank
    when any rank failed."""
    strategy = plan.strategy
    scheme, stage, tp_rank, cp_rank, group, cp_group = _rank_place(plan, rank, groups)
    error = None
    try:  # every bucket the scheme runs: a rewrite that fails at any of them fails here, on every rank alike
        for bucket in (b for b in lowerings.buckets.sizes if b <= lowerings.top_bucket(scheme)):
            lowerings.variant(scheme, stage, bucket, tp_rank, group, cp_rank, cp_group)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, whatever it is
        error = f"{scheme.describe()} on rank {rank}: {type(e).__name__}: {e}"
    _refuse(_agree(error), f"strategy {strategy.describe()} cannot be lowered")
    if self_check:
        check_strategy(plan, rank=rank, groups=groups, lowerings=lowerings, model=model, device=device, dtype=dtype,
                       checked=checked, vocab=vocab, probe_tokens=probe_tokens)


def check_strategy(plan: StepPlan, *, rank: int, groups: "GroupCache", lowerings: LoweringCache, model: nn.Module,
                   device: torch.device, dtype: torch.dtype, checked: set, vocab: int | None,
                   probe_tokens: int = SELF_CHECK_MAX_TOKENS, miniature: int | None = None) -> None:
    """The self-check of :func:`prepare_strategy` alone: this rank's lowering of ``plan``'s strategy, from
    ``lowerings`` (of ``model``), on a probe the first time this (scheme, TP rank) is met. ``miniature``: the
    parameters of ``model`` when it is a miniature of the trained model (``hcompile.miniature``), which the
    refusal says. Collective; raises the same :class:`LoweringError` on every rank when any rank failed."""
    scheme, stage, tp_rank, cp_rank, group, cp_group = _rank_place(plan, rank, groups)
    error = None
    key = (scheme, tp_rank, cp_rank)
    if key not in checked:  # the ranks that checked before still take part in the agreement below
        checked.add(key)
        try:
            report = _check(lowerings, lowerings.lowering(scheme, stage, tp_rank, group, cp_rank, cp_group), group,
                            vocab, model, device, dtype, probe_tokens)
            error = None if report.ok else report.describe()
            log.debug("lowering check%s: %s", "" if miniature is None else " (miniature)", report.describe())
        except Exception as e:  # noqa: BLE001
            error = f"{scheme.describe()} on rank {rank}: the probe failed: {type(e).__name__}: {e}"
    where = ("" if miniature is None else
             f" (the check ran on a miniature of {miniature} parameters of the same architecture, "
             "hcompile.miniature: the model itself is above self_check_max_params)")
    _refuse(_agree(error),
            f"strategy {plan.strategy.describe()} does not train this model correctly: its lowering, run on a probe, "
            f"computes something else than the model{where} (self_check=False turns this check off; please report "
            "the model)")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbePlan:
    """Where the self-check probes one scheme's lowering: which bucket, which sequences, and what it leaves out."""

    bucket: int
    """Tokens per rank of the probe's micro-batch (the scheme's largest bucket, unless bounded)."""
    lens: tuple[int, ...]
    """The probe's sequence lengths."""
    skipped: str | None
    """What the bound left unprobed (None: the probe covers what the scheme trains)."""


def self_check_cost(params: int, tokens: int, compute_bytes: int) -> tuple[float, float]:
    """(bytes, FLOPs) a rank spends on its self-check probe, activations left out: the probe's values of every
    parameter, the reference model's parameters and gradients (three whole copies of the model in the compute
    dtype) and the lowered program's slices with their gradients (at most two more), and a forward and backward
    pass of the whole model over the probe's ``tokens`` for the reference and again for the lowering (6 FLOPs
    per parameter per token each). At 16384 tokens in bf16: 7B parameters, 70 GB and 1.4 PFLOP; 32B, 320 GB and
    6.3 PFLOP; hence ``self_check_max_params``."""
    return 5.0 * params * compute_bytes, 12.0 * params * tokens


def probe_plan(lowerings: LoweringCache, lowering: Lowering, max_tokens: int = SELF_CHECK_MAX_TOKENS) -> ProbePlan:
    """The probe for ``lowering``'s scheme: at the largest bucket a rank of it runs, a long sequence filling
    most of the micro-batch and longer than every window and chunk the model keeps (where the scheme trains
    such sequences), plus short ones. ``max_tokens`` bounds ``bucket * cp``: above it the probe moves to the
    largest bucket within it and says what it skipped."""
    scheme = lowering.scheme
    top = lowerings.top_bucket(scheme)
    longest = lowerings.longest_sequence(scheme)
    limit = max((limits.longest for _, limits in lowering.attention), default=0)
    within = [b for b in lowerings.buckets.sizes if b <= top and b * scheme.cp <= max_tokens]
    bucket = within[-1] if within else lowerings.buckets.sizes[0]
    lens = probe_lengths(bucket, scheme.cp, longest=longest, limit=limit)
    skipped = []
    if bucket < top:
        skipped.append(f"buckets {bucket * 2 if bucket * 2 <= top else top}..{top} tokens per rank")
    if limit + 1 < longest and lens[0] <= limit:
        skipped.append(f"sequences longer than its longest window or chunk ({limit} tokens)")
    return ProbePlan(bucket=bucket, lens=lens, skipped=", ".join(skipped) or None)


def _check(lowerings: LoweringCache, lowering: Lowering, group: str | None, vocab: int | None, model: nn.Module,
           device: torch.device, dtype: torch.dtype, max_tokens: int = SELF_CHECK_MAX_TOKENS):
    """The decided lowering of (scheme, TP rank, CP rank), every stage of it, on a probe at its largest bucket
    (:func:`probe_plan`)."""
    scheme, tp_rank = lowering.scheme, lowering.tp_rank
    last = lowering if lowering.stage == scheme.pp - 1 else lowerings.lowering(scheme, scheme.pp - 1, tp_rank, group,
                                                                                lowering.cp_rank, lowering.cp_group)
    vocab_range = getattr(last, "vocab_range", None)  # the program's logits are the last stage's
    if vocab_range is not None and group is None:
        raise ValueError(f"{last.describe()}: logits split by vocabulary {vocab_range} need a TP group to gather over")

    def lower(gm: fx.GraphModule) -> Lowered:
        lowered = lower_graph(gm, scheme, tp_rank=tp_rank, tp_group=group, attention_kernel=lowerings.kernel,
                              tensor_parallel=lowering.tensor_parallel, pipeline=lowering.pipeline,
                              cp_rank=lowering.cp_rank, cp_group=lowering.cp_group,
                              attention=lowering.attention_limits)
        return lowered if vocab_range is None else with_gathered_logits(lowered, group, vocab_range, scheme.tp)

    probe = probe_plan(lowerings, lowering, max_tokens)
    if probe.skipped and tp_rank == 0 and lowering.cp_rank == 0:
        log.warning("lowering self-check of %s: the probe (%s tokens in buckets of %d) leaves out %s "
                    "(self_check_max_tokens=%d bounds it)", scheme.describe(), list(probe.lens), probe.bucket,
                    probe.skipped, max_tokens)
    return check_lowering(lowerings.capture(probe.bucket), scheme, tp_rank=tp_rank, tp_group=group,
                          lower=lower, reference=model_reference(model, device),
                          buffer=lambda n, v: lowerings.buffer(n) if v.device.type == "meta" else v,
                          vocab=vocab or 2, device=device, dtype=dtype, cp_rank=lowering.cp_rank,
                          cp_group=lowering.cp_group, lens=probe.lens)


def gather_vocab(x: torch.Tensor, group: str, start: int, stop: int, tp: int) -> torch.Tensor:
    """``x`` (..., stop - start), this rank's columns ``[start, stop)`` of logits split by vocabulary in ``tp``
    equal blocks over the process group named ``group`` (as the vocab-parallel head splits them), assembled with
    every other rank's into (..., vocab) by the graph's own ``tp_all_gather``, whose gradient is this rank's
    columns of the incoming one. Collective over the group."""
    width = stop - start
    if x.shape[-1] != width or width < 1 or start % width:
        raise ValueError(f"gathering vocabulary columns [{start}, {stop}) of {tp} equal blocks: the logits have "
                         f"{x.shape[-1]} columns")
    return TP_ALL_GATHER(x, group, x.dim() - 1, tp, start // width)


def _gathered_first(out, group: str, start: int, stop: int, tp: int):  # noqa: ANN001, ANN202
    """A program's outputs with the first (the logits, or the only output) gathered by :func:`gather_vocab`."""
    if isinstance(out, (tuple, list)):
        return type(out)([gather_vocab(out[0], group, start, stop, tp), *out[1:]])
    return gather_vocab(out, group, start, stop, tp)


def with_gathered_logits(lowered: Lowered, group: str, vocab_range: tuple[int, int], tp: int) -> Lowered:
    """``lowered`` with its program's first output (the logits, split by vocabulary as ``vocab_range`` says)
    replaced by the whole logits (:func:`gather_vocab` over ``group``), so that a check made for whole logits
    can compare them; the graph is changed in place (the program is the probe's own copy) and returned."""
    gm = lowered.graph_module
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        gathered = gm.graph.call_function(_gathered_first,
                                          (output.args[0], group, int(vocab_range[0]), int(vocab_range[1]), tp))
    output.args = (gathered,)
    gm.graph.lint()
    gm.recompile()
    return lowered
