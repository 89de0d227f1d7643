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
- the activations of one micro-batch: ``bytes_per_token / (tp * cp)`` per token (1F1B keeps ``pp`` micro-batches
  of ``layers / pp`` layers on the first stage: the whole model's worth); under recomputation (``scheme.rc``)
  ``recompute_bytes_per_token / (tp * cp) + layer_input_bytes / cp``: every layer's input, whole on every rank
  of a TP group, and what the one layer being recomputed and the loss keep.
"""

from __future__ import annotations

from dataclasses import dataclass

from passes.plan.cost_model import TOKEN_ROUNDING, RuntimeMemory
from passes.plan.ir import ParallelScheme, PlanError

__all__ = ["ModelMemory", "rank_state_bytes", "scheme_cap"]


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
        if not self.layer_input_bytes >= 0:
            raise PlanError(f"layer_input_bytes must be >= 0, got {self.layer_input_bytes!r}")

    def stage_params(self, scheme: ParallelScheme) -> float:
        """Parameters one rank of ``scheme`` computes with: its TP slice of the layers of its heaviest stage (a
        pp-th of them), and the embedding and head whole on the stages that hold them."""
        layers = self.params - self.embed_params - self.head_params
        sliced = (self.split_params / scheme.tp + (layers - self.split_params)) / scheme.pp
        edges = self.embed_params + self.head_params if scheme.pp == 1 else max(self.embed_params, self.head_params)
        return sliced + edges

    def per_token(self, scheme: ParallelScheme) -> float:
        """Activation bytes a rank of ``scheme`` keeps per token of one of its micro-batches (module docstring)."""
        if scheme.rc and self.recompute_bytes_per_token is not None:
            return self.recompute_bytes_per_token / (scheme.tp * scheme.cp) + self.layer_input_bytes / scheme.cp
        return self.bytes_per_token / (scheme.tp * scheme.cp)


def rank_state_bytes(model: ModelMemory, scheme: ParallelScheme, world: int, runtime: RuntimeMemory) -> float:
    """Bytes a rank of ``scheme`` holds besides activations on a job of ``world`` ranks (module docstring)."""
    return (model.params * runtime.sharded_bytes / world + model.stage_params(scheme) * runtime.compute_bytes
            + runtime.buffer_bytes)


def scheme_cap(model: ModelMemory, scheme: ParallelScheme, world: int, runtime: RuntimeMemory,
               memory_bytes: float) -> int:
    """Most tokens of one micro-batch of ``scheme`` (a multiple of 128; 0: not even that fits) when each of its
    ranks may use ``memory_bytes``."""
    free = memory_bytes - rank_state_bytes(model, scheme, world, runtime)
    if free <= 0:
        return 0
    return int(free // model.per_token(scheme)) // TOKEN_ROUNDING * TOKEN_ROUNDING
