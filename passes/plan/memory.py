"""The one memory model: what a rank of a scheme holds, and how many tokens of one micro-batch fit beside it.

Owns :class:`ModelMemory` (a model's parameter counts as the layouts split them, and its activation bytes per
token) and :func:`rank_state_bytes` / :func:`scheme_cap`, which the analytic cost model
(``passes.graph.analyze``) and the trainer's bound on its caps (``hcompile.memory``) both call, so the planner and
the trainer never disagree on what fits. A rank of scheme (tp, pp, cp) holds:

- its share of the fixed layout: every parameter's ``runtime.sharded_bytes`` (fp32 master weight, optimiser
  state, shard gradient) over all ranks of the job;
- its compute copy: the parameters of its scheme's heaviest stage, those tensor parallelism splits divided by
  tp, in ``runtime.compute_bytes`` per parameter (the compute-dtype parameter and its gradient-accumulation
  buffer);
- the movement buffers (``runtime.buffer_bytes``: the transfer chunks, and the overlapped runtime's windows);
- the activations of one micro-batch at the token bucket it runs in: ``((bytes_per_token - whole) / tp + whole)
  / cp`` per token, where ``whole_bytes_per_token`` is what every rank of a TP group keeps whole (under sequence
  parallelism the gathered inputs of the column-parallel linears; without it, or with the LM head replicated, more),
  plus the keys and values a context-parallel rank gathers for the backward (``kv_bytes_per_token``, cp - 1 other
  ranks' rows) and one layer's attention-backward working copies (``attention_working_bytes_per_token``); 1F1B keeps
  ``pp`` micro-batches of ``layers / pp`` layers on the first stage: the whole model's worth. Under recomputation
  (``scheme.rc``) ``recompute_bytes_per_token / (tp * cp) + layer_input_bytes / cp``;
- the gradients one compiled piece's backward hands out at once, in the compute dtype, before they are added to
  the accumulation buffer (``runtime.param_bytes`` per parameter of a ``runtime.pieces``-th of the stage).

:class:`RankCharge` is that charge by category at one token count (:func:`rank_charge`), as the rehearsal
(``hcompile.rehearsal``) tracks a rank's peak. What no tracker on fake tensors sees is a reserve apart
(:func:`device_reserve_bytes`): the CUDA context and libraries' workspaces, every NCCL communicator's buffers and
the caching allocator's fragmentation, stated figures that only a GPU confirms.
"""

from __future__ import annotations

from dataclasses import dataclass

from passes.plan.cost_model import TOKEN_ROUNDING, RuntimeMemory
from passes.plan.ir import ParallelScheme, PlanError

__all__ = ["ModelMemory", "RankCharge", "rank_charge", "rank_state_bytes", "scheme_cap", "device_reserve_bytes",
           "CONTEXT_RESERVE_BYTES", "NCCL_COMMUNICATORS", "NCCL_COMMUNICATOR_BYTES", "NCCL_P2P_PEER_BYTES",
           "FRAGMENTATION"]

GIB = 2**30
MIB = 2**20
CONTEXT_RESERVE_BYTES = 1.0 * GIB
"""The CUDA context, cuBLAS/cuDNN workspaces and loaded kernel images on one GPU (an assumption: PyTorch's own
figure on an H100 with lazy module loading is 0.5-0.8 GiB; only a GPU confirms it)."""
NCCL_COMMUNICATOR_BYTES = 0.25 * GIB
"""Buffers of one NCCL communicator a rank is a member of, for its collectives (ring/tree channels of the
SIMPLE, LL and LL128 protocols at the default NCCL_BUFFSIZE; NVLS, on by default on HGX H100, costs more: set
NCCL_NVLS_ENABLE=0 or raise this). An assumption that only a GPU confirms."""
NCCL_P2P_PEER_BYTES = 16 * MIB
"""Buffers of one point-to-point connection to one peer (send and receive, the default NCCL_BUFFSIZE over the
channels NCCL opens per peer); the movement communicator opens one to every peer it exchanges with. An
assumption that only a GPU confirms."""
NCCL_COMMUNICATORS = 6
"""NCCL communicators a GPU rank is a member of: the default group, the movement group, and the TP and CP groups
of the schemes it runs (the planner's 64-GPU long-context job: 4 per rank)."""
FRAGMENTATION = 0.05
"""Share of a GPU's memory kept for the caching allocator's fragmentation (the runtime asks for expandable
segments, which keeps it small)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelMemory:
    """A model's parameters as the layouts split them, and what one token of a micro-batch keeps."""

    params: int
    """Every parameter (what the fixed layout shards over all ranks)."""
    split_params: int
    """Parameters of the layers that tensor parallelism splits (each rank of a TP group holds 1/tp)."""
    embed_params: int
    """The token embedding's parameters (held whole by the first stage, replicated over its TP group)."""
    head_params: int
    """The LM head's parameters when not tied to the embedding (held whole by the last stage), else 0."""
    bytes_per_token: float
    """Activation bytes one token of a micro-batch keeps for the backward on one rank without tensor or context
    parallelism (all layers, the loss's copies of the logits included)."""
    recompute_bytes_per_token: float | None = None
    """Under recomputation: the activation bytes per token that tensor parallelism splits, on one rank without
    tensor or context parallelism (one layer's, recomputed in the backward, and the loss's copies of the
    logits); None: not known, a recomputing scheme is charged ``bytes_per_token`` (no saving)."""
    layer_input_bytes: float = 0.0
    """Under recomputation: the bytes per token of every layer's input together (what each layer keeps for its
    recomputation), whole on every rank of a TP group (its tensor parallelism does not split the sequence)."""
    whole_bytes_per_token: float = 0.0
    """Of ``bytes_per_token``, what every rank of a TP group keeps whole rather than a 1/tp share of (under
    sequence parallelism the gathered inputs of the column-parallel linears, which they save for the backward)."""
    kv_bytes_per_token: float = 0.0
    """Every layer's keys and values together per token, as the attention reads them: a context-parallel rank
    gathers the other cp - 1 ranks' rows and keeps them for the backward (split over TP ranks by heads)."""
    edges_split: bool = False
    """The token embedding and the LM head split by vocabulary over a TP group (a vocab-parallel head)."""
    attention_working_bytes_per_token: float = 0.0
    """What one layer's attention backward allocates per token besides its inputs (fp32 copies of the output and
    its gradient), for the layer being differentiated (split over TP ranks by heads)."""

    def __post_init__(self) -> None:
        for name in ("params", "split_params", "embed_params", "head_params"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PlanError(f"{name} must be an integer >= 0, got {value!r}")
        if self.split_params + self.embed_params + self.head_params > self.params:
            raise PlanError(f"split ({self.split_params}), embedding ({self.embed_params}) and head "
                            f"({self.head_params}) parameters are more than all {self.params}")
        if not self.bytes_per_token > 0:
            raise PlanError(f"bytes_per_token must be > 0, got {self.bytes_per_token!r}")
        if self.recompute_bytes_per_token is not None and not self.recompute_bytes_per_token > 0:
            raise PlanError(f"recompute_bytes_per_token must be > 0 or None, got {self.recompute_bytes_per_token!r}")
        for name in ("layer_input_bytes", "whole_bytes_per_token", "kv_bytes_per_token",
                     "attention_working_bytes_per_token"):
            if not getattr(self, name) >= 0:
                raise PlanError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.whole_bytes_per_token > self.bytes_per_token:
            raise PlanError(f"whole_bytes_per_token ({self.whole_bytes_per_token}) is more than bytes_per_token "
                            f"({self.bytes_per_token})")

    def stage_params(self, scheme: ParallelScheme) -> float:
        """Parameters one rank of ``scheme`` computes with: its TP slice of the layers of its heaviest stage (a
        pp-th of them), and the embedding and head on the stages that hold them (a 1/tp share of each when
        ``edges_split``)."""
        layers = self.params - self.embed_params - self.head_params
        sliced = (self.split_params / scheme.tp + (layers - self.split_params)) / scheme.pp
        edges = self.embed_params + self.head_params if scheme.pp == 1 else max(self.embed_params, self.head_params)
        return sliced + (edges / scheme.tp if self.edges_split else edges)

    def per_token(self, scheme: ParallelScheme) -> float:
        """Activation bytes a rank of ``scheme`` keeps per token of one of its micro-batches (module docstring)."""
        tp, cp = scheme.tp, scheme.cp
        gathered = self.kv_bytes_per_token * (cp - 1) / (tp * cp)
        if scheme.rc and self.recompute_bytes_per_token is not None:  # its figure has a layer's working memory
            return self.recompute_bytes_per_token / (tp * cp) + self.layer_input_bytes / cp + gathered
        whole = self.whole_bytes_per_token if tp > 1 else 0.0
        return (((self.bytes_per_token - whole) / tp + whole) / cp + gathered
                + self.attention_working_bytes_per_token / (tp * cp))


@dataclass(frozen=True, slots=True, kw_only=True)
class RankCharge:
    """What the memory model charges one rank of a scheme at one token count, by category (bytes)."""

    parameters: float
    """The compute copy: its scheme's heaviest stage's parameters (TP slices) in the compute dtype."""
    gradients: float
    """The gradient accumulation buffer of the compute copy, and one piece's gradients handed out at once."""
    optimizer: float
    """Its share of the fixed layout: fp32 master weights, optimiser state, the shard's gradient."""
    activations: float
    """One micro-batch's activations at the token count (1F1B's in-flight micro-batches on the first stage)."""
    buffers: float
    """The movement buffers."""
    optimizer_step: float = 0.0
    """The optimiser step's working memory; the step runs after the backward, so it counts against the
    activations, not beside them (the larger of the two is charged)."""
    reserve: float = 0.0
    """What no tracker on fake tensors sees (:func:`device_reserve_bytes`)."""

    @property
    def tracked(self) -> float:
        """Everything but the reserve: what a rehearsal on fake tensors tracks."""
        return (self.parameters + self.gradients + self.optimizer + max(self.activations, self.optimizer_step)
                + self.buffers)

    @property
    def total(self) -> float:
        """Every byte charged."""
        return self.tracked + self.reserve

    def as_dict(self) -> dict[str, float]:
        """Category -> bytes, with ``tracked`` and ``total``."""
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "buffers": self.buffers, "optimizer_step": self.optimizer_step,
                "reserve": self.reserve,
                "tracked": self.tracked, "total": self.total}


def _param_bytes(runtime: RuntimeMemory) -> float:
    """Bytes of a compute-copy parameter itself (all of ``compute_bytes`` when the runtime does not say)."""
    return runtime.param_bytes or runtime.compute_bytes


def rank_charge(model: ModelMemory, scheme: ParallelScheme, world: int, runtime: RuntimeMemory, tokens: float, *,
                reserve: float = 0.0) -> RankCharge:
    """The charge of one rank of ``scheme`` on a job of ``world`` ranks running a micro-batch of ``tokens`` tokens
    (its token bucket), its stage cut into ``runtime.pieces`` compiled pieces (module docstring)."""
    pieces = runtime.pieces
    stage = model.stage_params(scheme)
    param = _param_bytes(runtime)
    gradients = stage * (runtime.compute_bytes - param) + stage / pieces * param
    return RankCharge(parameters=stage * param, gradients=gradients,
                      optimizer=model.params * runtime.sharded_bytes / world,
                      optimizer_step=model.params * runtime.step_bytes / world,
                      activations=tokens * model.per_token(scheme), buffers=runtime.buffer_bytes, reserve=reserve)


def rank_state_bytes(model: ModelMemory, scheme: ParallelScheme, world: int, runtime: RuntimeMemory) -> float:
    """Bytes a rank of ``scheme`` holds besides activations on a job of ``world`` ranks (module docstring)."""
    charge = rank_charge(model, scheme, world, runtime, 0)
    return charge.tracked - charge.optimizer_step


def scheme_cap(model: ModelMemory, scheme: ParallelScheme, world: int, runtime: RuntimeMemory,
               memory_bytes: float) -> int:
    """Most tokens of one micro-batch of ``scheme`` (a multiple of 128; 0: not even that fits) when each of its
    ranks may use ``memory_bytes``."""
    free = memory_bytes - rank_state_bytes(model, scheme, world, runtime)
    if free <= 0:
        return 0
    return int(free // model.per_token(scheme)) // TOKEN_ROUNDING * TOKEN_ROUNDING


def device_reserve_bytes(memory_bytes: float, communicators: int, p2p_peers: int) -> float:
    """What a GPU of ``memory_bytes`` keeps beside what a rank's tensors take: the CUDA context
    (:data:`CONTEXT_RESERVE_BYTES`), ``communicators`` NCCL communicators (:data:`NCCL_COMMUNICATOR_BYTES` each),
    point-to-point connections to ``p2p_peers`` peers (:data:`NCCL_P2P_PEER_BYTES` each) and the allocator's
    fragmentation (:data:`FRAGMENTATION` of the memory). Assumptions stated per constant; a GPU confirms them."""
    for name, value in (("communicators", communicators), ("p2p_peers", p2p_peers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PlanError(f"{name} must be an integer >= 0, got {value!r}")
    return (CONTEXT_RESERVE_BYTES + communicators * NCCL_COMMUNICATOR_BYTES + p2p_peers * NCCL_P2P_PEER_BYTES
            + FRAGMENTATION * memory_bytes)
