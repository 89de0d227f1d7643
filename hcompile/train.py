"""Heterogeneous training: ``hcompile.compile(model).trainer(loss="causal_lm", optimizer=...)`` returns a
``Trainer``; ``trainer.fit(batches)`` trains on an iterable of global batches, planning each step while the
previous one runs, and ``train_step(batch)`` trains on one.

Owns :class:`TrainOptions` and :class:`Trainer`. One step flows one way: the trainer checks the batch
(``runtime.batch_check``), takes the plan from the planning service (``runtime.planning``), asks its lowering
cache (``passes.graph.lowering``) for the stage program of this rank's place in the plan, and hands plan,
batch and program to the executor (``runtime.executor``), which never calls back.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping, Sequence

import torch

from hcompile.api import CompiledModel
from hcompile.capture import CaptureError
from hcompile.cost import (
    ANALYSIS_TOKENS,
    add_listed_cp_schemes,
    add_needed_cp_schemes,
    cap_tokens,
    check_strategies,
    compute_layout,
    default_cost_model,
    refuse_context_parallel_model,
    token_ranks,
)
from hcompile.data import DataError
from hcompile.export import save_pretrained
from hcompile.memory import bound_caps, model_memory, prefer_expandable_segments, trainer_runtime, usable_memory
from hcompile.miniature import MiniatureCheck, NotShrinkable, miniature_check
from hcompile.verify import SELF_CHECK_MAX_TOKENS, check_strategy, prepare_strategy, self_check_cost
from passes.graph.analyze import token_vocab
from passes.graph.attention_masks import attention_shape
from passes.graph.lowering import LoweringCache, StageVariants
from passes.graph.normalize import canonical_graph
from passes.graph.pass_runner import PassError
from passes.graph.tensor_parallel import split_dims
from passes.graph.variant import TokenBuckets
from passes.plan.context_parallel import KV_SPLITS
from passes.plan.cost_model import TOKEN_ROUNDING
from passes.plan.datasets import LengthDataset
from passes.plan.ir import CostModel, ParallelScheme, Place, PlanError, StepPlan, Strategy
from passes.plan.links import Links
from passes.plan.movement import MovementCost
from passes.plan.placement import assign_ranks, placed_replicas
from passes.plan.policies import ALL_POLICIES, CP_POLICIES, Planner, sized_homogeneous
from passes.plan.pool import build_pool
from runtime import distributed as comm
from runtime.batch_check import SourceError, agree_on_batch, agree_on_call
from runtime.calibration import OnlineCalibration
from runtime.checkpoint import DEFAULT_KEEP, load_checkpoint, save_checkpoint
from runtime.distributed import DistContext, init_distributed
from runtime.executor import NON_FINITE_POLICIES, Executor, setting_problem
from runtime.fixed_layout import FixedLayout, Init, fill_layout
from runtime.loss import global_pair_count
from runtime.measure import StepStats, TakeTurns
from runtime.overlap import DEFAULT_INFLIGHT_BYTES, check_inflight_bytes, largest_unit_numel
from runtime.planning import PlanService, plan_timeout_s
from runtime.redistribute import Traffic
from runtime.topology import Cluster

__all__ = ["TrainOptions", "Trainer", "ELEMENTWISE_OPTIMIZERS"]

log = logging.getLogger("hcompile")

ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.ASGD, torch.optim.Rprop)
"""Optimisers that update each element from its own gradient and state alone, so that a shard of the fixed
layout steps exactly as the whole vector would (and their subclasses)."""

@dataclass(frozen=True, slots=True, kw_only=True)
class TrainOptions:
    """How to train a compiled model."""

    loss: str = "causal_lm"
    """The loss; ``causal_lm`` (next-token cross-entropy within each sequence, mean over the global batch)."""
    optimizer: type = torch.optim.AdamW
    """Optimiser class, applied to this rank's shard of the fixed layout: one of ``ELEMENTWISE_OPTIMIZERS`` (or
    a subclass), others only with ``elementwise_optimizer=True``."""
    elementwise_optimizer: bool = False
    """True: ``optimizer`` is not a supported class but updates every element from that element's gradient
    and state alone (its results would otherwise depend on how the layout is sharded); the trainer takes it."""
    optimizer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of the optimiser, checked against its ``__init__`` when the options are built (keywords it
    takes, each of its default's type, finite; torch's own optimisers also build on them)."""
    strategies: str | tuple[str, ...] = "auto"
    """``auto`` (a pool built from the data; each step may also use another mix of the pool's schemes, which
    compiles nothing new; where the data's longest sequence, or the first batch's without a dataset, is longer
    than every scheme holds, context-parallel schemes ``(tp, cp)`` join the pool, ``hcompile.cost.
    add_needed_cp_schemes``) or strategies such as ``("4x(tp1)", "1x(tp2)+2x(tp1)", "1x(tp2,cp2)")`` (or one,
    ``"4x(tp1)"``), used as listed."""
    tokens_per_rank: int | None = None
    """Per-rank memory cap in tokens (a scheme with tensor-parallel degree tp holds tp times as many);
    None: the given cost model's caps, or 1024 tokens per rank with the default CPU cost model."""
    policy: str = "hydraulis"
    """Planner policy (the baselines are available for side-by-side runs, ``dynamic-cp`` and
    ``homogeneous-cp`` too: their TP is chosen on the first batch)."""
    regroup: bool = True
    """Whether hydraulis may plan regrouped steps where the job has context-parallel schemes: CP groups that
    re-form sequence by sequence inside groups of same-scheme replicas (``passes.plan.regrouped``)."""
    buckets: TokenBuckets | None = None
    """Token buckets micro-batches are padded to (token counts such as ``(64, 128, 256)`` become
    ``TokenBuckets``); default: the compiled model's, else powers of two from 64 tokens. The trainer keeps its
    own and leaves the compiled model's alone."""
    replicas_take_turns: bool = False
    """Replicas compute one after the other within a step (``runtime.measure.TakeTurns``): for measuring
    per-rank busy times on a host with fewer cores than ranks; slower in wall-clock time."""
    calibrate: bool = True
    """Scale each scheme's cost by its measured-over-predicted ratio (median of the last 8 steps,
    ``runtime.calibration``) when planning later steps; False plans with the given cost model throughout.
    A rank's busy time is its compute phase timed by CUDA events on GPUs, its CPU time on the CPU."""

    param_dtype: torch.dtype | None = None
    """dtype of the compute copies of the parameters (and of their gradients): None is bfloat16 on GPUs and
    float32 on the CPU. Master weights and optimiser state are float32 whatever it is."""
    reduce_dtype: torch.dtype = torch.float32
    """dtype gradients travel to their owners in (summed there in float32)."""
    grad_accum_dtype: torch.dtype = torch.float32
    """dtype each rank's micro-batches accumulate their gradients in (Megatron's ``main_grad``): float32 whatever
    ``param_dtype`` is, so many micro-batches add up as exactly as one; ``torch.bfloat16`` saves 2 bytes per
    parameter of a rank's compute copy at that cost. The memory model counts it."""
    plan_timeout_s: float | None = None
    """How long a step waits for rank 0's plan before every rank raises ``PlanTimeout``; None: env
    ``HCOMPILE_PLAN_TIMEOUT_S`` when the trainer is built, else 120 s."""
    self_check: bool = True
    """Before a strategy's first step, run each rank's lowering (tensor parallel, packed attention, pipeline
    split) on a small random probe against the model itself, eager, and refuse the strategy with a
    ``LoweringError`` naming every parameter whose gradient differs (``hcompile.verify``). Once per (scheme,
    TP rank). Above ``self_check_max_params`` parameters (the probe holds the whole model twice on every rank) it
    runs, for the same schemes and TP ranks, on a miniature of the model instead: a ``transformers`` model rebuilt
    from its config with tiny widths and the same layers (``hcompile.miniature``; a refusal then says so); a
    model without one (not a ``transformers`` model, or its miniature cannot be built) is not checked, with a
    warning saying why. Ops that mix the tokens of packed sequences (``passes.graph.token_mixing``) are refused
    at every size, with or without this check."""
    self_check_max_params: int = 1 << 28
    """The largest model (in parameters) the self-check runs on itself; above it, on its miniature."""
    self_check_max_tokens: int = SELF_CHECK_MAX_TOKENS
    """Bound on the self-check's probe, in tokens of one micro-batch (``bucket * cp``): each scheme is probed at its
    largest bucket within it, with a sequence longer than every window and chunk of the model; what the bound
    leaves out is logged as a warning (``hcompile.verify.probe_plan``)."""
    overlap_movement: bool = True
    """Move parameters and gradients window by window of the fixed layout, overlapped with compute
    (``runtime.overlap``): each stage is cut into ``movement_pieces`` pieces (each compiled on its own), a piece
    waits for its parameters' windows just before it runs, and each window of gradients goes to its owners as
    soon as the step's last backward has finished it. A progress thread per rank posts the messages, with at
    most ``movement_inflight_bytes`` of buffers in flight (or one window's messages with one peer, when that is
    more), which the memory model charges (``runtime.overlap.overlap_buffer_bytes``).
    The default, as Megatron-Core's distributed optimizer and FSDP overlap theirs; ``False`` runs the plain
    runtime (``runtime.redistribute``: the whole pull before the compute, the whole push after it)."""
    movement_pieces: int = 4
    """With ``overlap_movement``: the pieces each stage is cut into (at most one per linear or attention)."""
    kv_splits: int | None = None
    """Under context parallelism, the head groups each attention's K/V exchange is pipelined over, at most
    (``passes.graph.kv_exchange``: group g's attention waits only for group g's K/V; 1: one all-gather before
    the attention). None: ``passes.plan.context_parallel.KV_SPLITS`` on GPUs (what the planner's CP cost
    assumes), 1 on the CPU, where ``python -m benchmarks.kv_exchange`` found no consistent gain (ranks sharing
    cores gain little from overlap, and each group adds kernel calls and collectives)."""
    recompute: bool = False
    """Activation recomputation as the planner's choice: every scheme's recomputing twin (``(tp2,rc)``: each layer
    keeps only its input, its forward runs again in its backward, about 4/3 of the compute) is planned beside it,
    with the cap the memory model gives it, so a step recomputes only on the replicas that hold what would not
    fit otherwise. A listed strategy may name ``rc`` schemes without it."""
    vocab_parallel: bool = True
    """Under tensor parallelism (tp > 1), the token embedding and the LM head split by vocabulary over the TP
    group, and the logits left split: each TP rank holds (tokens, vocab/tp) logits and the cross-entropy is
    assembled over the group (``runtime.loss.vocab_parallel_loss_sum``: two all-reduces of per-token values, one
    fp32 (tokens, vocab/tp) copy kept for the backward), instead of every rank holding the whole (tokens, vocab)
    logits and the loss's fp32 copies of them: with bf16 logits the loss's peak goes from 12 bytes per token per
    vocabulary entry (an fp32 copy, its log-softmax, their gradients) to 6 per entry of this rank's vocab/tp
    (the fp32 softmax and the bf16 gradient), the logits themselves from 2 x vocab to 2 x vocab/tp bytes per token
    (LLaMA-2's 32000 at tp2: 438 KiB per token down to 125 KiB). The embedding and head weights, their gradients
    and optimiser state are split too. ``False``: both replicated on every TP rank. Nothing changes at tp == 1;
    a lowering that cannot split the head (a vocabulary tp does not divide, a head with a bias, a tied embedding
    read whole elsewhere: ``passes.graph.tensor_parallel``) keeps it replicated."""
    movement_inflight_bytes: int = DEFAULT_INFLIGHT_BYTES
    """With ``overlap_movement``: the most bytes of movement buffers (cast sends, gradient receives) a rank keeps
    in flight; its messages with one peer in one window (``runtime.overlap.largest_unit_numel``) when that is
    more."""
    non_finite: str = "raise"
    """A step whose loss or gradient norm is NaN or infinite: ``"raise"`` (a ``NonFiniteError`` on every rank
    naming the step, before the optimiser changes anything) or ``"skip"`` (no optimiser step, as mixed-precision
    loss scalers do; counted in ``StepStats.non_finite_skips``). Non-finite optimiser settings (an ``lr`` a
    scheduler set to NaN) and non-finite master weights are a ``NonFiniteError`` either way."""

    warmup_timeout_s: float | None = None
    """The collective timeout during warm-up (``Trainer.warm_up``: the lowering self-check and the dry-run steps
    that compile every variant inside collectives, where a rank still compiling, e.g. a 32B stage under
    inductor, keeps the others waiting); None: env ``HCOMPILE_WARMUP_TIMEOUT_S`` when the trainer is built,
    else 3600 s. Outside warm-up the job's timeout applies (``HCOMPILE_TIMEOUT_S``, 300 s)."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "grad_accum_dtype"):
            value = getattr(self, name)
            if value is not None and value not in (torch.float32, torch.bfloat16):
                raise ValueError(f"{name} must be torch.float32 or torch.bfloat16, got {value!r}")
        if self.grad_accum_dtype is None:
            raise ValueError("grad_accum_dtype must be torch.float32 or torch.bfloat16, got None")
        for name in ("plan_timeout_s", "warmup_timeout_s"):
            timeout = getattr(self, name)
            if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                        or not timeout > 0):
                raise ValueError(f"{name} must be a positive number of seconds or None, got {timeout!r}")
        if not isinstance(self.recompute, bool):
            raise ValueError(f"recompute must be True or False, got {self.recompute!r}")
        if isinstance(self.movement_pieces, bool) or not isinstance(self.movement_pieces, int) \
                or self.movement_pieces < 1:
            raise ValueError(f"movement_pieces must be a positive integer, got {self.movement_pieces!r}")
        if self.kv_splits is not None and (isinstance(self.kv_splits, bool) or not isinstance(self.kv_splits, int)
                                           or self.kv_splits < 1):
            raise ValueError(f"kv_splits must be a positive integer or None, got {self.kv_splits!r}")
        check_inflight_bytes(self.movement_inflight_bytes, "movement_inflight_bytes")
        if not isinstance(self.loss, str) or self.loss != "causal_lm":
            raise ValueError(f"unknown loss {self.loss!r}; supported: 'causal_lm'")
        if not isinstance(self.policy, str) or self.policy not in ALL_POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known: {', '.join(ALL_POLICIES)}")
        value = self.tokens_per_rank
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"tokens_per_rank must be a positive integer or None, got {value!r}")
        for name in ("self_check_max_params", "self_check_max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("elementwise_optimizer", "regroup", "replicas_take_turns", "calibrate", "self_check",
                     "overlap_movement", "vocab_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        _check_optimizer(self.optimizer, self.elementwise_optimizer)
        _check_optimizer_kwargs(self.optimizer, self.optimizer_kwargs)
        if not isinstance(self.non_finite, str) or self.non_finite not in NON_FINITE_POLICIES:
            raise ValueError(f"non_finite must be one of {NON_FINITE_POLICIES}, got {self.non_finite!r}")
        if self.buckets is not None and not isinstance(self.buckets, TokenBuckets):
            object.__setattr__(self, "buckets", _buckets(self.buckets))
        if isinstance(self.strategies, str) and self.strategies != "auto":  # one strategy, not its characters
            object.__setattr__(self, "strategies", (self.strategies,))
        if not isinstance(self.strategies, str):
            if not isinstance(self.strategies, (list, tuple)) or not self.strategies:
                raise ValueError(f"strategies must be 'auto' or strategies such as ('4x(tp1)',), got "
                                 f"{self.strategies!r}")
            object.__setattr__(self, "strategies", tuple(self.strategies))
            for text in self.strategies:
                if not isinstance(text, str):
                    raise ValueError(f"strategies must be 'auto' or strings such as '4x(tp1)', got {text!r} "
                                     f"({type(text).__name__}) in {self.strategies!r}")
                Strategy.parse(text)


def _split_dims(analysed) -> tuple[dict, PassError | None]:
    """Tensor parallelism's split dim of every parameter it splits, and None; or no dims and why the model has
    no tensor-parallel form at all (a tied embedding whose head reads a split input, ...)."""
    try:
        return split_dims(canonical_graph(analysed)), None
    except PassError as exc:
        return {}, exc


def _without_tensor_parallel(model: CostModel, no_tp_form: PassError, rank: int) -> CostModel:
    """``model`` without its tensor-parallel schemes, for a model with no tensor-parallel form (``no_tp_form``
    says why), so that ``auto`` plans what can run instead of refusing the job at the first tp > 1 lowering;
    unchanged when it has no tp1 scheme to plan with, or no other."""
    kept = tuple(e for e in model.entries if e.scheme.tp == 1)
    if not kept or len(kept) == len(model.entries):
        return model
    if rank == 0:
        log.info("strategies='auto' plans without tensor parallelism: %s", no_tp_form)
    return dataclasses.replace(model, entries=kept)


def buckets_cut_to_caps(model: CostModel, buckets: TokenBuckets,
                        schemes: Collection[ParallelScheme] | None = None) -> tuple[CostModel, TokenBuckets]:
    """The caps of ``schemes`` (default: every scheme's) made token buckets, so that no micro-batch runs (and
    allocates) beyond what the memory model charged: a cap's share per CP rank that falls between two buckets is
    rounded down to a multiple of ``min(TOKEN_ROUNDING, smallest bucket)`` (so every TP degree up to it divides
    it) and added as a bucket, the cap lowered to it; a cap on a bucket, or beyond the largest, is left as it is.
    Returns the capped model and the buckets."""
    sizes, caps = set(buckets.sizes), {}
    granule = min(TOKEN_ROUNDING, buckets.sizes[0])
    for e in model.entries:
        share = e.max_tokens // e.scheme.cp
        if (schemes is not None and e.scheme not in schemes) or share in sizes \
                or not buckets.sizes[0] < share < buckets.sizes[-1]:
            continue
        cut = share // granule * granule
        sizes.add(cut)
        caps[e.scheme] = cut * e.scheme.cp
    if not caps:
        return model, buckets
    return cap_tokens(model, caps), TokenBuckets(sizes=tuple(sorted(sizes)))


def _lists_recomputation(strategies: str | tuple[str, ...]) -> bool:
    """Whether a listed strategy names a recomputing scheme (``rc``)."""
    return strategies != "auto" and any(s.rc for text in strategies for s in Strategy.parse(text).schemes)


def _buckets(value: Any) -> TokenBuckets:
    """``TrainOptions.buckets`` given as token counts (a list or tuple of positive integers, ascending) as the
    :class:`TokenBuckets` they name; anything else a ValueError saying what is expected."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"buckets must be TokenBuckets, token counts such as (64, 128, 256), or None; got {value!r} "
                         f"({type(value).__name__})")
    try:
        return TokenBuckets(sizes=tuple(value))
    except ValueError as exc:
        raise ValueError(f"buckets {value!r}: {exc}") from None


_BOOL_OR_NONE = ("foreach", "fused")
"""Keyword arguments of torch's optimisers that take True, False or None (None: torch chooses)."""


def _check_optimizer_kwargs(optimizer: type, kwargs: Any) -> None:
    """``optimizer_kwargs`` as ``optimizer`` takes them, checked before anything is captured: a mapping of
    keyword names (``params`` is the trainer's), each one a keyword of the class's ``__init__`` unless it takes
    ``**kwargs``; a value whose default says its type has that type: True or False where the default is a bool,
    a real number (not a bool or a string) or a one-element floating tensor (as torch takes ``lr``) where it is a
    number, a tuple of such numbers of the default's length (``betas``), True, False or None for ``foreach`` and
    ``fused``; every number finite. torch's own optimisers are then built on a one-element tensor, so that what
    their ``__init__`` refuses (a negative ``lr``, a beta of 1.5) is refused here too. A ValueError names the
    key, the value and what is expected."""
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"optimizer_kwargs must be a mapping of keyword arguments such as {{'lr': 1e-3}}, got "
                         f"{kwargs!r} ({type(kwargs).__name__})")
    name = optimizer.__name__
    try:
        params = dict(inspect.signature(optimizer.__init__).parameters)
    except (TypeError, ValueError):  # no signature to read: torch says at construction
        params = {}
    open_ended = not params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    for key, value in kwargs.items():
        if not isinstance(key, str):
            raise ValueError(f"optimizer_kwargs keys must be keyword names, got {key!r} ({type(key).__name__})")
        if key == "params":
            raise ValueError("optimizer_kwargs must not hold 'params': the trainer passes the optimiser its shard "
                             "of the fixed layout")
        param = params.get(key)
        if param is None or param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            if open_ended:
                continue
            known = ", ".join(k for k, p in params.items() if k not in ("self", "params")
                              and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
            raise ValueError(f"optimizer_kwargs: {name} takes no keyword argument {key!r} (it takes {known})")
        expected = _kwarg_problem(key, value, param)
        if expected is not None:
            raise ValueError(f"optimizer_kwargs[{key!r}] must be {expected} for {name}, got {value!r} "
                             f"({type(value).__name__})")
    if (problem := setting_problem(kwargs)) is not None:
        raise ValueError(f"optimizer_kwargs must be finite numbers, got {problem}: every weight would become NaN at "
                         f"the first step")
    if optimizer in ELEMENTWISE_OPTIMIZERS:  # torch's own class: its __init__ checks the values' ranges
        try:
            optimizer([torch.zeros(1, requires_grad=True)], **dict(kwargs))
        except (ValueError, TypeError, RuntimeError) as exc:
            raise ValueError(f"optimizer_kwargs {dict(kwargs)!r} are refused by {name}: {exc}") from None


def _kwarg_problem(key: str, value: Any, param: inspect.Parameter) -> str | None:
    """What an optimiser keyword ``key`` must be, when ``value`` is not that (None: it is, or the keyword's
    default says nothing of its type)."""
    default = param.default
    if isinstance(default, bool) or (default is None and key in _BOOL_OR_NONE):
        if isinstance(value, bool) or (value is None and default is None):
            return None
        return "True or False" + (" or None" if default is None else "")
    if isinstance(default, numbers.Real):
        return None if _is_number(value) else "a real number (or a one-element floating tensor)"
    if isinstance(default, tuple) and default and all(isinstance(d, numbers.Real) for d in default):
        if isinstance(value, (tuple, list)) and len(value) == len(default) and all(_is_number(v) for v in value):
            return None
        return f"a tuple of {len(default)} real numbers such as {default!r}"
    if isinstance(default, str) and not isinstance(value, str):
        return f"a string such as {default!r}"
    return None


def _is_number(value: Any) -> bool:
    """A real number (not a bool), or a one-element floating tensor."""
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() and value.numel() == 1
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_optimizer(optimizer: Any, trusted: bool) -> None:
    """A supported optimiser class, or one the user vouches for; otherwise a ValueError naming them."""
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer class, got {optimizer!r}")
    if not trusted and not issubclass(optimizer, ELEMENTWISE_OPTIMIZERS):
        names = ", ".join(o.__name__ for o in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(f"optimizer {optimizer.__name__} is not supported: the fixed layout steps each rank's "
                         f"shard alone, so only elementwise optimisers give the same result on any number of "
                         f"ranks ({names}); pass elementwise_optimizer=True if {optimizer.__name__} is one")


class Trainer:
    """Data-parallel replicas of any strategy, planned per step, on every rank of the job."""

    def __init__(self, compiled: CompiledModel, options: TrainOptions, *, cost_model: CostModel | None = None,
                 dataset: LengthDataset | None = None, cluster: Cluster | None = None, init: Init | None = None,
                 state_dict: Mapping[str, torch.Tensor] | None = None):
        """``init``: a deterministic per-parameter initialiser (``init(name, full_fp32_tensor)``, called on
        every rank for the parameters its shard holds); ``state_dict``: initial values on rank 0 (other ranks
        may pass None), streamed to the owners. Neither: the model's own values (every rank's model must
        then hold the same ones). A model built on the meta device needs one of them."""
        self.options, self.dataset, self.compiled = options, dataset, compiled
        self.ctx = _context()
        self.plan_timeout_s = options.plan_timeout_s or plan_timeout_s()
        """How long a step waits for its plan (read when the trainer is built)."""
        self.warmup_timeout_s = options.warmup_timeout_s or comm.warmup_timeout_s()
        """The collective timeout while warming up (read when the trainer is built)."""
        self.buckets = options.buckets or compiled.buckets or TokenBuckets.powers_of_two(64, 1 << 20)
        """The token buckets micro-batches are padded to (the compiled model's are left alone)."""
        self.param_dtype = options.param_dtype or (torch.bfloat16 if self.ctx.device.type == "cuda" else torch.float32)
        """The compute copies' dtype (the master weights and optimiser state stay fp32)."""
        analysed = self._captured(ANALYSIS_TOKENS)
        dims, no_tp_form = _split_dims(analysed)
        if no_tp_form is not None:  # every tp > 1 strategy is then refused by its lowering, with this reason
            log.info("tensor parallelism has no form for this model (%s); the fixed layout stores parameters whole",
                     no_tp_form)
        self.layout = _layout(compiled, dims, self.ctx, init=init, state_dict=state_dict)
        self.vocab_size = token_vocab(analysed)
        """Token ids of a batch must be below it (None: the graph's token table was not found; unchecked)."""
        self.optimizer = options.optimizer([self.layout.shard], **dict(options.optimizer_kwargs))
        self.cluster = cluster or Cluster.local(self.ctx.world_size)
        self.executor = Executor(self.ctx, self.cluster, self.layout, self.optimizer, param_dtype=self.param_dtype,
                                 reduce_dtype=options.reduce_dtype, overlap=options.overlap_movement,
                                 inflight_bytes=options.movement_inflight_bytes,
                                 hooks=[TakeTurns()] if options.replicas_take_turns else [],
                                 non_finite=options.non_finite, grad_dtype=options.grad_accum_dtype)
        memory = trainer_runtime(self.param_dtype, options.reduce_dtype, options.grad_accum_dtype,
                                 self.executor.chunk_numel,
                                 options.movement_inflight_bytes if options.overlap_movement else None,
                                 largest_unit_numel(self.layout, self.executor.windows),
                                 options.movement_pieces if options.overlap_movement else 1)
        self.runtime_memory = memory
        """What each rank holds per parameter and in movement buffers, as the memory model charges it."""
        if cost_model is not None:
            refuse_context_parallel_model(cost_model)
        # the ranks sharing this machine's memory: as the launcher says (Cluster.local checks LOCAL_WORLD_SIZE),
        # also when the cluster passed in describes the job otherwise
        local = min(Cluster.local(self.ctx.world_size).gpus_per_node, self.ctx.world_size)
        prefer_expandable_segments(self.ctx.device)
        usable = usable_memory(self.ctx.device, local, self.ctx.world_size)  # collective: the smallest rank's
        held = model_memory(analysed, ANALYSIS_TOKENS, vocab_parallel=options.vocab_parallel,
                            measure=self.ctx.device.type == "cuda",
                            twice=self._captured(2 * ANALYSIS_TOKENS) if self.ctx.device.type == "cuda" else None)
        recompute = options.recompute or _lists_recomputation(options.strategies)
        model = cost_model or default_cost_model(analysed, type(compiled.model).__name__, self.ctx.world_size,
                                                 options.tokens_per_rank, memory, self.ctx.device, memory=held,
                                                 memory_bytes=usable, recompute=recompute)
        model = add_listed_cp_schemes(model, options.strategies)
        if options.strategies == "auto" and no_tp_form is not None:
            model = _without_tensor_parallel(model, no_tp_form, self.ctx.rank)
        if cost_model is not None and options.tokens_per_rank is not None:
            model = cap_tokens(model, {e.scheme: options.tokens_per_rank * token_ranks(e.scheme)
                                       for e in model.entries})
        unbound = {e.scheme: e.max_tokens for e in model.entries}
        model = bound_caps(model, held, memory, usable, self.ctx.world_size,  # before any capture there
                           options.tokens_per_rank)
        memory_bound = {e.scheme for e in model.entries if e.max_tokens < unbound[e.scheme]}
        check_strategies(options.strategies, model, analysed, self.ctx.world_size)
        capturable = self._largest_capturable(max(e.max_tokens // e.scheme.cp for e in model.entries))
        model, self.buckets = buckets_cut_to_caps(  # the memory model's caps; the user's run in their buckets
            cap_tokens(model, {e.scheme: capturable * e.scheme.cp for e in model.entries}), self.buckets, memory_bound)
        self.cost_model = dataclasses.replace(model, buckets=self.buckets.sizes)
        """What the planner plans with: capped at the largest capturable bucket (a CP rank's share of it), each
        cap a bucket (a micro-batch runs, and allocates, at its bucket), each micro-batch charged the padding up
        to its bucket, as the variants run it."""
        self.lowerings: LoweringCache = compiled.lowerings(
            *self._compute_copies(), buckets=self.buckets, cost_tokens=self.cost_model.max_tokens,
            pieces=options.movement_pieces if options.overlap_movement else 1,
            kv_splits=options.kv_splits or (KV_SPLITS if self.ctx.device.type == "cuda" else 1),
            vocab_parallel=options.vocab_parallel)
        """This trainer's lowerings, variants and stage programs (bound to its compute copies)."""
        self.cost_model = self._shaped(self.cost_model, analysed)
        params = sum(p.numel() for p in compiled.model.parameters())
        self._self_check = options.self_check and params <= options.self_check_max_params
        self._miniature: MiniatureCheck | None = None
        """Where the model is above ``self_check_max_params``: the miniature the self-check runs on instead."""
        if options.self_check and not self._self_check:
            self._miniature = self._miniature_check(params)
        calibrate = options.calibrate and self.ctx.rank == 0  # busy times: CUDA events on GPUs, CPU time here
        self.calibration = OnlineCalibration(self.cost_model) if calibrate else None
        """Rank 0's per-scheme correction of the cost model from measured steps (None: not calibrating)."""
        self._service: PlanService | None = None
        self._restored_pool: tuple[list[Strategy], Strategy] | None = None
        self._warm: set[Strategy] = set()
        self._warm_places: set[tuple[ParallelScheme, tuple[int, ...]]] = set()
        """(scheme, ranks) of every replica of the warmed strategies: where compiled variants exist."""
        self._checked: set[tuple[ParallelScheme, int]] = set()
        """(scheme, TP rank) whose lowering this rank has checked."""
        self._submitted: tuple[tuple[int, ...], str | None] | None = None
        self._ahead: tuple[Iterator, Sequence[torch.Tensor], tuple[int, ...], Any] | None = None
        """(iterator, its next batch, that batch's checked lengths, the iterator's ``state_dict()`` before that
        batch, None when it has none): the batch ``fit`` or ``train_step(iterator)`` holds for the next step."""
        self.untrained: list[Sequence[torch.Tensor]] = []
        """The batches the last ``fit`` or ``train_step(iterator)`` took from an iterator without a position
        (``state_dict``/``load_state_dict``) and no step trained, when it ended by an exception, in order (a
        source with a position is put back before them instead); empty otherwise."""
        self._compute_end: float | None = None
        """When the last step's compute phase ended (rank 0's clock): what the next plan may hide behind."""
        self.last_plan = None

    def _miniature_check(self, params: int) -> MiniatureCheck | None:
        """The self-check's miniature of a model of ``params`` parameters, above ``self_check_max_params``
        (``hcompile.miniature``); None, with a warning saying why, where the model has none."""
        options = self.options
        tps = {e.scheme.tp for e in self.cost_model.entries}
        if options.strategies != "auto":
            tps.update(s.tp for name in options.strategies for s in Strategy.parse(name).replicas())
        try:
            mini = miniature_check(self.compiled, sorted(tps), self.lowerings, *self._compute_copies(),
                                   cost_tokens=lambda scheme: self.cost_model.max_tokens(scheme))
        except NotShrinkable as e:
            if self.ctx.rank == 0:
                need, flops = self_check_cost(params, options.self_check_max_tokens, _bytes(self.param_dtype))
                log.warning("the lowering self-check is skipped: the model has %d parameters, more than "
                            "self_check_max_params=%d (its probe would hold about %.0f GB per rank and run %.2g "
                            "FLOP), and it has no miniature to check instead: %s (ops that mix packed sequences' "
                            "tokens are refused at every size all the same)",
                            params, options.self_check_max_params, need / 1e9, flops, e)
            return None
        if self.ctx.rank == 0:
            log.info("the lowering self-check runs on a miniature of %s of %d parameters (the model has %d, more "
                     "than self_check_max_params=%d)", type(self.compiled.model).__name__, mini.params, params,
                     options.self_check_max_params)
        return mini

    def _shaped(self, model: CostModel, analysed) -> CostModel:
        """``model`` with each sequence's attention work shaped by the model's windows and chunks, as decided for
        the scheme with the largest micro-batches; unchanged when they cannot be decided here (that scheme's
        lowering is then refused with a ``LoweringError`` on every rank before its first step)."""
        widest = max(model.entries, key=lambda e: (self.lowerings.top_bucket(e.scheme), e.max_tokens))
        try:
            limits = self.lowerings.attention_limits(widest.scheme)
        except PassError as exc:
            log.debug("attention limits not decided for the cost model: %s", exc)
            return model
        return model.limited(attention_shape(canonical_graph(analysed), limits))

    def _compute_copies(self) -> tuple[torch.dtype | None, torch.device | None]:
        """(dtype, device) the model is captured for: those of the compute copies."""
        return self.param_dtype, self.ctx.device

    def _captured(self, tokens: int):
        return self.compiled.captured(tokens, *self._compute_copies()).graph_module

    def _largest_capturable(self, up_to: int) -> int:
        """The largest bucket (up to the first >= ``up_to``) the model can be captured at: capture runs the
        model on one packed row, so a learned position table bounds a micro-batch's tokens. A bucket that
        cannot be captured (a ``CaptureError``) ends the search; the smallest one must be."""
        largest = 0
        for bucket in self.buckets.sizes:
            try:
                self._captured(bucket)
            except CaptureError as exc:
                if largest == 0:
                    raise
                log.debug("micro-batches stop at %d tokens: capturing %d fails (%s)", largest, bucket, exc)
                break
            largest = bucket
            if bucket >= up_to:
                break
        return largest

    def _placement(self, strategy: Strategy) -> tuple[tuple[int, ...], ...]:
        """Where the planner places ``strategy``'s replicas (the ranks every plan of it carries)."""
        return assign_ranks(strategy, self.cost_model.gpus_per_node)

    def _planner(self, seq_lens: Sequence[int]) -> PlanService:
        if self._service is None:
            data = self.dataset or LengthDataset.from_lengths("first-batch", list(seq_lens))
            longest = max(data.max_len, max(seq_lens))
            if self._restored_pool is not None:  # resumed: the pool the run started with
                pool, fixed = self._restored_pool
                self._extend_cost_model(add_listed_cp_schemes(self.cost_model, [s.describe() for s in [*pool, fixed]]))
            else:
                if self.options.strategies == "auto":  # CP where a sequence is longer than every scheme holds
                    self._extend_cost_model(add_needed_cp_schemes(self.cost_model, self.ctx.world_size, longest))
                fixed = sized_homogeneous(self.cost_model, self.ctx.world_size, longest)
                if self.options.strategies == "auto":
                    pool = build_pool(self.cost_model, self.ctx.world_size, data, sum(seq_lens), fixed)
                else:
                    pool = [Strategy.parse(s) for s in self.options.strategies]
            cp = any(s.cp > 1 for s in self.cost_model.schemes)
            planner = Planner(self.cost_model, self.ctx.world_size, list(pool), fixed,
                              refine=self.options.strategies == "auto",  # a listed pool is kept as listed
                              allow=self._compiled_placement, regroup=cp and self.options.regroup)
            if self.options.policy in CP_POLICIES:  # the baselines' TP, chosen on the first batch
                planner.choose_cp_baselines(longest, [list(seq_lens)])
            self._service = PlanService(planner, self.ctx.rank, self.options.policy, self.executor.cpu_clock,
                                        timeout_s=self.plan_timeout_s)
            if self.calibration is not None and self.calibration.state_dict():  # resumed with measured ratios
                self._service.set_cost_model(self.calibration.model())
            self.warm_up([*pool, fixed])
        return self._service

    def _extend_cost_model(self, model: CostModel) -> None:
        """Plan with ``model``, this trainer's cost model with context-parallel schemes added: the lowerings cost
        and the calibration scales its schemes too."""
        if model is self.cost_model:
            return
        self.cost_model = model
        self.lowerings.cost_tokens = model.max_tokens
        if self.calibration is not None:
            self.calibration.base = model

    def _compiled_placement(self, strategy: Strategy) -> bool:
        """Whether every replica of ``strategy`` lands on ranks where a warmed strategy has the same scheme's
        replica: then every variant, TP group and compute copy it needs exists already (no new compilation)."""
        return all(place in self._warm_places for place in zip(strategy.replicas(), self._placement(strategy)))

    def movement_cost(self, schemes: Iterable[ParallelScheme], links: Links) -> MovementCost:
        """The planner's model of this trainer's movement (``passes.plan.movement.MovementCost``) for strategies of
        ``schemes`` on ``links``: its layout, dtypes and chunk, and its runtime (overlapped, with its windows and
        ``links.overlap_slowdown``, or plain)."""
        executor = self.executor
        overlapped = executor.overlap
        return MovementCost(compute_layout(self.lowerings, self.layout, sorted(set(schemes))), links,
                            param_bytes=_bytes(executor.param_dtype), reduce_bytes=_bytes(executor.reduce_dtype),
                            chunk_numel=executor.chunk_numel, mode="overlapped" if overlapped else "plain",
                            windows=max(1, len(executor.windows)),
                            slowdown=links.overlap_slowdown if overlapped else 0.0)

    def program(self, plan: StepPlan) -> StageVariants | list[StageVariants]:
        """This rank's stage program in ``plan`` (collective the first time a placement is met: its process
        groups are made on every rank); in a regrouped plan, a list: one per place of this rank
        (``StepPlan.places_of``), in the order it runs them."""
        groups = self.executor.groups_for(plan)
        if not plan.regrouped:
            return self._program_at(plan, plan.place_of(self.ctx.rank), groups)
        return [self._program_at(plan, place, groups) for place in plan.places_of(self.ctx.rank)]

    def _program_at(self, plan: StepPlan, place: Place, groups) -> StageVariants:
        ranks = plan.replicas[place.replica]
        group = comm.group_name(groups.get(ranks.tp_group(place.stage, place.cp_rank)))
        cp_group = (comm.group_name(groups.get(ranks.cp_group(place.stage, place.tp_rank)))
                    if ranks.scheme.cp > 1 else None)
        return self.lowerings.program(ranks.scheme, place.stage, place.tp_rank, group, place.cp_rank, cp_group)

    def train_plan(self, plan: StepPlan, batch: Sequence[torch.Tensor]) -> StepStats:
        """Train one step of ``batch`` as ``plan`` says, a plan made elsewhere: by ``passes.plan.policies.Planner``
        under any policy (``dynamic-cp``'s regrouped plans included, to compare real runs), or by hand (CP groups
        of any size re-forming group after group on the ranks of one slot layout, ``StepPlan.regrouped``).
        Every rank passes the same plan and batch; the batch's lengths must be the plan's ``seq_lens``. The
        schemes the plan runs are warmed first, once each (lowered, self-checked on a probe and compiled on every
        rank: a regrouped plan's schemes as the homogeneous strategies whose aligned groups it uses)."""
        lens = self._check(batch, call="train_plan")
        if lens != tuple(plan.seq_lens):
            raise ValueError(f"the batch's sequence lengths {list(lens)[:8]} are not the plan's "
                             f"{list(plan.seq_lens)[:8]}")
        if global_pair_count(lens) == 0:
            return self._skip(lens, None)
        self._warm_for(plan)
        stats = self.executor.run_step(plan, batch, self.program(plan))
        return dataclasses.replace(stats, compilations=self.lowerings.compilations(),
                                   non_finite_skips=self.executor.non_finite_skips)

    def _warm_for(self, plan: StepPlan) -> None:
        """Warm what ``plan`` runs, once (collective: every rank has the plan): its strategy, or for a regrouped
        plan the homogeneous strategy of each scheme its groups use, whose aligned groups its own are; the cost
        model learns the CP schemes first."""
        schemes = sorted(set(r.scheme for r in plan.replicas))
        warm = ([Strategy.homogeneous(s, self.ctx.world_size) for s in schemes] if plan.regrouped
                else [plan.strategy])
        if all(s in self._warm for s in warm):
            return
        self._extend_cost_model(add_listed_cp_schemes(self.cost_model, [s.describe() for s in warm]))
        self.warm_up(warm)

    def warm_up(self, strategies: Sequence[Strategy]) -> None:
        """Lower, check and compile, before the first step, every variant these strategies can need: for each
        strategy, this rank's lowering is built and checked on a probe (``hcompile.verify``: a strategy that
        cannot be lowered or computes anything else is the same ``LoweringError`` on every rank); then for each
        token bucket up to its replicas' caps, a dry-run step (forward and backward, parameters untouched)
        with one micro-batch of that bucket on every replica that can hold it (collective; a context-parallel
        replica gets a sequence cp times as long, so that each of its ranks runs that bucket). Compiling
        happens inside those collective steps, so they run under ``warmup_timeout_s``, not the job's timeout
        (``runtime.distributed.collective_timeout``)."""
        with comm.collective_timeout(self.warmup_timeout_s):
            self._warm_up(strategies)

    def _warm_up(self, strategies: Sequence[Strategy]) -> None:
        for strategy in strategies:
            if strategy in self._warm:
                continue
            replicas = strategy.replicas()
            top = [self.buckets.bucket_for(self.cost_model.max_tokens(s) // s.cp) for s in replicas]
            dry = _dry_plan(strategy, [0] * len(replicas), self.cost_model.gpus_per_node)
            prepare_strategy(dry, rank=self.ctx.rank, groups=self.executor.groups_for(dry), lowerings=self.lowerings,
                             model=self.compiled.model, device=self.ctx.device, dtype=self.param_dtype,
                             self_check=self._self_check, checked=self._checked, vocab=self.vocab_size,
                             probe_tokens=self.options.self_check_max_tokens)
            if self._miniature is not None:  # the model is too large for the check: its miniature is checked
                mini = self._miniature
                check_strategy(dry, rank=self.ctx.rank, groups=self.executor.groups_for(dry), lowerings=mini.lowerings,
                               model=mini.compiled.model, device=self.ctx.device, dtype=self.param_dtype,
                               checked=mini.checked, vocab=mini.vocab, probe_tokens=self.options.self_check_max_tokens,
                               miniature=mini.params)
            self._warm.add(strategy)
            self._warm_places.update(zip(replicas, self._placement(strategy)))
            for bucket in (b for b in self.buckets.sizes if b <= max(top)):
                lens = [min(bucket * s.cp, self.cost_model.max_tokens(s)) if bucket <= t else 0
                        for s, t in zip(replicas, top)]
                plan = _dry_plan(strategy, lens, self.cost_model.gpus_per_node)
                self.executor.run_step(plan, [torch.zeros(n, dtype=torch.long) for n in lens if n],
                                       self.program(plan), dry_run=True)

    def _check(self, batch: Sequence[torch.Tensor] | None, call: str = "train_step", failure: str | None = None,
               ended: bool = False) -> tuple[int, ...] | None:
        """The batch's sequence lengths, once every rank agreed it called ``call`` and holds the same batch
        (collective; ``runtime.batch_check``); ``failure``/``ended``: this rank's iterator raised or ended
        instead (None: it ended on every rank)."""
        lens = agree_on_batch(batch, self.vocab_size, call=call, failure=failure, ended=ended)
        return None if lens is None else tuple(lens)

    def _submit(self, seq_lens: Sequence[int], strategy: str | None) -> None:
        self._planner(seq_lens).submit(list(seq_lens), Strategy.parse(strategy) if strategy else None)
        self._submitted = (tuple(seq_lens), strategy)

    def train_step(self, batch: Sequence[torch.Tensor] | Iterator[Sequence[torch.Tensor]],
                   strategy: str | None = None) -> StepStats | None:
        """Train on one global batch (the same list of 1-D token tensors on every rank); ``strategy`` forces one.
        A batch's plan is made when it is called, so nothing hides the planning. Given an iterator of global
        batches instead, it trains on the next one while rank 0 plans the one after, keeping it (checked) for
        the next call with the same iterator; None when the iterator is exhausted. ``fit`` is that loop (what
        it says of an iterator that raises, and of where its position is left, holds here too). A step
        whose loss, gradient norm, master weights or optimiser settings are not finite is a ``NonFiniteError``
        on every rank before the optimiser changes anything (``TrainOptions.non_finite``)."""
        if isinstance(batch, Iterator):
            if strategy is not None:
                raise ValueError("strategy= forces one batch's strategy; pass a batch, not an iterator, with it")
            self.untrained = []
            return self._next_step(batch, look_ahead=True, call="train_step")
        return self._step(batch, self._check(batch), strategy, None)

    def fit(self, batches: Iterable[Sequence[torch.Tensor]], steps: int | None = None,
            on_step: Callable[[int, StepStats], Any] | None = None) -> StepStats | None:
        """Train on ``batches`` (any iterable of global batches, the same on every rank), ``steps`` of them
        (None: until it ends), keeping one batch ahead: each batch is checked once, and its plan is computed
        on rank 0 while the previous step runs (``StepStats.plan_hidden``); no batch past the last step is
        taken from ``batches``. ``on_step(step, stats)`` is called after each step (0-based), on every rank;
        ``data_position(batches)`` there is the position to save. Returns the last step's statistics (None for
        no batch).

        Each batch is taken and agreed on in one collective: an iterator that raises (or ends) on some rank only
        is the same ``DataError`` on every rank, naming the rank and what it raised (chained to that exception on
        that rank). When ``fit`` ends by any exception (the iterator's, a step's, ``on_step``'s), an iterator
        with a position (``state_dict``/``load_state_dict``, as ``TokenBatches``) is put back at the first batch
        no step trained, so its ``state_dict()`` is what to save; the batches taken from any other iterator and
        not trained are in ``trainer.untrained``."""
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
            raise ValueError(f"steps must be a non-negative integer or None, got {steps!r}")
        source, stats, done = iter(batches), None, 0
        self.untrained = []
        try:
            while steps is None or done < steps:
                step = self._next_step(source, look_ahead=steps is None or done + 1 < steps, call="fit")
                if step is None:
                    break
                stats = step
                if on_step is not None:
                    on_step(done, stats)
                done += 1
        except BaseException:
            if self._ahead is not None and self._ahead[0] is source:  # on_step raised with a batch held
                _, held, _, position = self._ahead
                self._ahead = None
                self._put_back(source, position, [held])
            raise
        return stats

    def data_position(self, source: Any) -> Any:
        """``source.state_dict()`` at the first batch no step trained: the position before the batch ``fit`` or
        ``train_step(iterator)`` holds for its next step, when it holds one of ``source`` (a ``TokenBatches``
        is its own iterator), else where ``source`` is. What to save from ``on_step``."""
        if self._ahead is not None and self._ahead[0] is source and self._ahead[3] is not None:
            return copy.deepcopy(self._ahead[3])
        return source.state_dict()

    def _next_step(self, source: Iterator, look_ahead: bool, call: str) -> StepStats | None:
        """The step on ``source``'s next batch (the one held from the last call, or taken and checked now);
        with ``look_ahead`` the batch after it is taken, checked and planned while this step runs. On any
        exception, ``source`` is put back before the first batch no step trained (``_put_back``)."""
        held = self._ahead if self._ahead is not None and self._ahead[0] is source else None
        self._ahead = None
        position = held[3] if held is not None else _position(source)
        untrained = [held[1]] if held is not None else []
        try:
            if held is None:
                taken = self._take(source, call, untrained)
                if taken is None:
                    return None
                current, lens = taken
            else:
                current, lens = held[1], held[2]
            upcoming = upcoming_lens = upcoming_position = None
            if look_ahead:
                upcoming_position = _position(source)
                taken = self._take(source, call, untrained)
                upcoming, upcoming_lens = taken if taken is not None else (None, None)
            elif held is not None:  # nothing agreed in this call yet: every rank must be in the same call
                agree_on_call(call)
            stats = self._step(current, lens, None, upcoming_lens)
        except BaseException:
            self._put_back(source, position, untrained)
            raise
        if upcoming is not None:
            self._ahead = (source, upcoming, upcoming_lens, upcoming_position)
        return stats

    def _take(self, source: Iterator, call: str, untrained: list) -> tuple[Sequence[torch.Tensor],
                                                                         tuple[int, ...]] | None:
        """``source``'s next batch and its checked lengths (None: it ended on every rank), taken and agreed in
        one collective: what the iterator raised on some rank is a ``DataError`` on every rank (chained to the
        exception on that rank). A batch taken is appended to ``untrained``."""
        batch, failure = None, None
        try:
            batch = next(source)
        except StopIteration:
            pass
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it, whatever it is
            failure = exc
        if batch is not None:
            untrained.append(batch)
        try:
            lens = self._check(batch, call=call, failure=None if failure is None else
                               f"{type(failure).__name__}: {failure}", ended=failure is None and batch is None)
        except SourceError as exc:
            raise DataError(str(exc)) from failure
        return None if lens is None else (batch, lens)

    def _put_back(self, source: Iterator, position: Any, untrained: list) -> None:
        """After an exception: ``source`` back at ``position`` (the first batch no step trained) when it has a
        position, else its batches taken and not trained in ``self.untrained``."""
        if position is not None:
            try:
                source.load_state_dict(position)
            except Exception as exc:  # noqa: BLE001 - the exception being raised is the one to see
                log.warning("could not put the batches back at the first untrained one (%s): %s", position, exc)
                self.untrained = list(untrained)
        elif untrained:
            self.untrained = list(untrained)

    def _step(self, batch: Sequence[torch.Tensor], seq_lens: tuple[int, ...], strategy: str | None,
              upcoming: tuple[int, ...] | None) -> StepStats:
        """One step on a checked batch; ``upcoming``: the next batch's lengths, planned while this step runs."""
        if global_pair_count(seq_lens) == 0:
            return self._skip(seq_lens, upcoming)
        if self._submitted != (seq_lens, strategy):
            if self._submitted is not None:
                self._service.take()  # a stale prefetch: drain it so every rank stays in step
            self._submit(seq_lens, strategy)
            self._compute_end = None  # planned now: nothing ran while it was planned
        self._submitted = None
        planned = self._service.take(self._compute_end)
        if upcoming is not None and global_pair_count(upcoming) > 0:
            self._submit(upcoming, None)
        self.last_plan = planned
        if planned.plan.regrouped or planned.plan.policy in CP_POLICIES:  # compiled and checked on first use
            self._warm_for(planned.plan)
        stats = self.executor.run_step(planned.plan, batch, self.program(planned.plan))
        self._compute_end = stats.compute_window[1]
        if self.calibration is not None:  # plans submitted from the next step on use the corrected model
            self.calibration.observe(planned.plan, stats.busy_ms)
            self._service.set_cost_model(self.calibration.model())
        return dataclasses.replace(stats, compilations=self.lowerings.compilations(), plan_ms=planned.plan_ms,
                                   plan_hidden=planned.hidden, plan_window=planned.window,
                                   non_finite_skips=self.executor.non_finite_skips)

    def _skip(self, seq_lens: Sequence[int], upcoming: tuple[int, ...] | None) -> StepStats:
        """A batch without a next-token pair (only 1-token sequences): nothing runs and nothing changes (no
        optimiser step, no weight decay); a plan prefetched for it is drained and the next batch's submitted."""
        if self._submitted is not None:
            self._service.take()
            self._submitted = None
        if upcoming is not None and global_pair_count(upcoming) > 0:
            self._submit(upcoming, None)
            self._compute_end = None
        world = self.ctx.world_size
        return StepStats(loss=0.0, tokens=sum(seq_lens), strategy="", busy_ms=(0.0,) * world, wall_ms=0.0,
                         compilations=self.lowerings.compilations(), traffic=Traffic(),
                         tokens_computed=(0,) * world, skipped=True, non_finite_skips=self.executor.non_finite_skips)

    def save(self, path: str, step: int, data_position: Any, keep: int = DEFAULT_KEEP) -> None:
        """Checkpoint the fixed layout, optimiser state, RNG, step, data position, strategy pool and cost-model
        calibration (collective, atomic: ``runtime.checkpoint``). ``data_position``: anything JSON gives back
        exactly, e.g. ``TokenBatches.state_dict()`` (a tuple, a non-finite float, ... are refused). ``keep``:
        how many of the checkpoint's versions stay (the newest); nothing else in ``path`` is touched. Called on
        some ranks only (``if rank == 0: save``), it is a ``CollectiveCallError`` on every rank, nothing written."""
        agree_on_call("save")
        extra: dict = {}
        if self._service is not None:
            planner = self._service.planner
            extra["pool"] = [s.describe() for s in planner.pool]
            extra["fixed"] = planner.fixed.describe()
        if self.calibration is not None:
            extra["calibration"] = self.calibration.state_dict()
        save_checkpoint(path, self.layout, self.optimizer, step=step, data_position=data_position, extra=extra,
                        keep=keep)

    def load(self, path: str) -> dict:
        """Resume from ``save`` on any number of ranks; returns ``{"step", "data_position", ...}``. Restored:
        the master weights, the optimiser state and param groups, and, with the same number of ranks, the
        strategy pool, the calibration and the RNG, so the steps after a resume are the steps an uninterrupted
        run takes. Explicit arguments win: listed ``strategies`` and the ``optimizer_kwargs`` entries
        replace what the checkpoint held, which one logged line names. Collective (``CollectiveCallError`` on
        every rank when called on some ranks only)."""
        agree_on_call("load")
        explicit = set(self.options.optimizer_kwargs)
        meta = load_checkpoint(path, self.layout, self.optimizer, override=explicit, check_extra=_extra_problem)
        self.executor.steps_run = meta["step"]  # the steps after a resume are numbered on from the saved step
        extra = meta["extra"]
        held = [f"{k}={g[k]!r}" for g in meta["optimizer"]["param_groups"][:1] for k in sorted(explicit)
                if k in g and g[k] != _plain(self.options.optimizer_kwargs[k])]
        if meta["world_size"] == self.ctx.world_size and "pool" in extra and self._service is None:
            pool = [Strategy.parse(s) for s in extra["pool"]]
            if self.options.strategies != "auto":
                listed = [Strategy.parse(s) for s in self.options.strategies]
                held += [f"strategies {[s.describe() for s in pool]}"] if listed != pool else []
                pool = listed
            self._restored_pool = (pool, Strategy.parse(extra["fixed"]))
        if self.calibration is not None and "calibration" in extra:
            self.calibration.load_state_dict(extra["calibration"])
        if held and self.ctx.rank == 0:
            log.warning("resuming from %s: the explicit arguments replace what the checkpoint held (%s)", path,
                         ", ".join(held))
        return meta

    def save_pretrained(self, path: str, *, dtype: torch.dtype | str = torch.float32,
                        max_shard_size: int | str = "5GB") -> list[str] | None:
        """Write the trained parameters as a Hugging Face folder (``hcompile.export``): the model's own names,
        a tied weight once, its persistent buffers, ``dtype`` a floating one (or its name), safetensors shards
        of at most ``max_shard_size``, the model's config; loads with
        ``AutoModelForCausalLM.from_pretrained(path)``. Collective (rank 0 writes; returns its file names): called
        on some ranks only (``if rank == 0``), a ``CollectiveCallError`` on every rank, nothing written."""
        agree_on_call("save_pretrained")
        return save_pretrained(self.compiled.model, self.layout, path, dtype=dtype,
                               max_shard_size=max_shard_size)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The current parameters under the original module's names (collective)."""
        agree_on_call("full_state_dict")
        return self.layout.full_state_dict()


def _extra_problem(extra: dict) -> str | None:
    """What is wrong with what ``Trainer.save`` added to a checkpoint (None: nothing)."""
    try:
        for text in [*extra.get("pool", []), *([extra["fixed"]] if "pool" in extra else [])]:
            Strategy.parse(text)
    except (PlanError, TypeError, AttributeError, KeyError) as exc:
        return f"its strategy pool is not one: {exc}"
    calibration = extra.get("calibration", {})
    return None if isinstance(calibration, dict) else f"'extra.calibration' is {calibration!r}"


def _plain(value: Any) -> Any:
    """``value`` as JSON gives it back (a tuple as a list), to compare with a checkpoint's."""
    return [_plain(v) for v in value] if isinstance(value, (tuple, list)) else value


def _layout(compiled: CompiledModel, dims: Mapping[str, int], ctx: DistContext, *, init: Init | None,
            state_dict: Mapping[str, torch.Tensor] | None) -> FixedLayout:
    """The fixed layout of the model's parameters (tensor parallelism's split ``dims`` stored outermost; none:
    stored whole), filled once from what rank 0 was given (``runtime.fixed_layout.fill_layout``); the parameters
    that do not require a gradient are frozen in it (``FixedLayout.freeze``: training keeps them as they are)."""
    named = dict(compiled.model.named_parameters())
    layout = FixedLayout({n: tuple(p.shape) for n, p in named.items()}, ctx.rank, ctx.world_size, ctx.device, dims)
    fill_layout(layout, init=init, state_dict=state_dict, named=named)
    layout.freeze(n for n, p in named.items() if not p.requires_grad)
    if layout.frozen and ctx.rank == 0:
        log.info("%d parameters do not require a gradient (%s): training keeps them as they are", len(layout.frozen),
                 ", ".join(n for n in named if n in layout.frozen)[:200])
    return layout


def _dry_plan(strategy: Strategy, lens: list[int], gpus_per_node: int) -> StepPlan:
    """A plan giving replica i one sequence of ``lens[i]`` tokens (none when 0), placed as the planner does."""
    seq_lens: list[int] = []
    micro = []
    for n in lens:
        micro.append(((len(seq_lens),),) if n else ())
        seq_lens.extend([n] if n else [])
    replicas = placed_replicas(strategy, gpus_per_node, micro_batches=tuple(micro),
                               max_tokens=tuple(max(n, 1) for n in lens))
    return StepPlan(strategy=strategy, seq_lens=tuple(seq_lens), replicas=replicas, est_step_ms=0.0,
                    lower_bound_ms=0.0, policy="warm-up")


def _position(source: Any) -> Any:
    """``source.state_dict()`` when it can be put back there (``state_dict`` and ``load_state_dict``, as
    ``TokenBatches``), else None."""
    if callable(getattr(source, "state_dict", None)) and callable(getattr(source, "load_state_dict", None)):
        return source.state_dict()
    return None


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _context() -> DistContext:
    """This rank's place: the job's as made (by the user: under NCCL its device is then checked and set,
    ``runtime.distributed.joined_context``), or a new one (``init_distributed``)."""
    if comm.is_initialized():
        return comm.joined_context()
    return init_distributed()
