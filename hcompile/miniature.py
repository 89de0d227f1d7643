"""Miniatures: a Hugging Face model rebuilt with tiny widths and the same layer kinds, for the lowering self-check.

The self-check (``hcompile.verify``) runs the whole model twice on every rank, so above
``TrainOptions.self_check_max_params`` it cannot run on the model itself. What it catches, though, is mostly
about the architecture (which ops the lowering rewrites and how: a gradient sum left out under TP, positions
running across packed sequences, a mask lost), and those defects show at any width. Owns :func:`shrink_config`
(a copy of a ``transformers`` config with small widths: every layer, its kind (``layer_types``, sliding windows,
chunks, mixture-of-experts interleaving) and the positions kept; heads shrunk keeping their grouping and their
divisibility by every TP degree the trainer may plan), :func:`build_miniature` (the model's own class on that
config, random float32 values from a fixed seed, the same on every rank), :func:`miniature_check` (it compiled
and lowered as the trainer lowers the model: what the trainer checks) and :class:`NotShrinkable` (why a model
has no miniature: then the check is skipped, as before). Not covered at a small size: what depends on the
widths themselves (the lowering passes decide those from shapes alone). Ops that mix tokens across packed
sequences are refused at every size anyway (``passes.graph.token_mixing``).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
from torch import nn

if TYPE_CHECKING:
    from hcompile.api import CompiledModel
    from passes.graph.lowering import LoweringCache
    from passes.plan.ir import ParallelScheme

__all__ = ["MiniatureCheck", "NotShrinkable", "build_miniature", "miniature_check", "shrink_config", "MINI_HEAD_DIM",
           "MINI_VOCAB"]

MINI_HEAD_DIM = 16
"""A miniature's head dim (at most the model's)."""
MINI_Q_WIDTH = 256
"""A miniature's query heads times head dim, at most (unless it has so many heads that their dim is 4)."""
MINI_VOCAB = 320
"""A miniature's vocabulary (rounded up to a multiple of every TP degree)."""
MINI_EXPERTS = 4
"""A miniature's experts per mixture-of-experts layer, at least (at most the model's; more than its top-k)."""

_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
_EXPERT_WIDTHS = ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size")
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id")


class NotShrinkable(ValueError):
    """The model has no miniature (not a ``transformers`` model, a composite config, or the build failed)."""


def _has(config: Any, name: str) -> bool:
    """Whether ``config`` carries ``name`` as an int (directly or through its ``attribute_map``)."""
    value = getattr(config, name, None)
    return isinstance(value, int) and not isinstance(value, bool)


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def shrink_config(config: Any, tp_degrees: Iterable[int] = (1,)) -> Any:
    """A copy of ``config`` (a ``transformers`` ``PretrainedConfig`` of a decoder) with tiny widths: the same
    number of layers and every per-layer pattern (``layer_types``, windows, chunks, which layers are mixtures of
    experts), the same positions and scalar options; ``num_key_value_heads`` the greatest common divisor of the
    model's and lcm(2, every degree in ``tp_degrees``) (so a degree divides the miniature's kv heads exactly when
    it divides the model's), the query heads in the model's ratio to them, a head dim of at most
    :data:`MINI_HEAD_DIM` (less where the heads' width would pass :data:`MINI_Q_WIDTH`, 4 at least), the hidden
    size their product (or in the model's proportion to it, where the config names its head dim apart), the MLP
    twice that, experts' MLPs 1.5 times it, :data:`MINI_VOCAB` tokens and at most max(:data:`MINI_EXPERTS`,
    top-k + 1) experts; widths that TP splits are multiples of every degree.
    Raises :class:`NotShrinkable` when the config is not one of a decoder this knows how to shrink."""
    if getattr(config, "sub_configs", None):
        raise NotShrinkable(f"{type(config).__name__} is a composite config ({', '.join(config.sub_configs)}); "
                            "only a decoder's own config is shrunk")
    for name in ("hidden_size", "num_attention_heads", "num_hidden_layers"):
        if not _has(config, name):
            raise NotShrinkable(f"{type(config).__name__} has no integer {name}")
    unit = math.lcm(2, *(int(t) for t in tp_degrees))
    heads = config.num_attention_heads
    kv = config.num_key_value_heads if _has(config, "num_key_value_heads") else heads
    if kv < 1 or heads % kv:
        raise NotShrinkable(f"{type(config).__name__}: {heads} attention heads are not a multiple of {kv} kv heads")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    mini_kv = math.gcd(kv, unit)
    mini_heads = mini_kv * (heads // kv)
    mini_head_dim = max(4, min(MINI_HEAD_DIM, MINI_Q_WIDTH // mini_heads, head_dim) // 2 * 2)
    q_width = mini_heads * mini_head_dim
    hidden = q_width  # unless the model's hidden size is not its heads' width: then in the model's proportion
    if _has(config, "head_dim") and config.hidden_size != heads * head_dim:
        hidden = max(unit, _round_up(q_width * config.hidden_size // (heads * head_dim), unit))
    mlp = _round_up(2 * hidden, unit)  # widths kept apart, so that no two dims of a weight coincide by chance
    mini = copy.deepcopy(config)
    mini.hidden_size = hidden
    mini.num_attention_heads = mini_heads
    if _has(config, "num_key_value_heads"):
        mini.num_key_value_heads = mini_kv
    if _has(config, "head_dim"):
        mini.head_dim = mini_head_dim
    if _has(config, "intermediate_size"):
        mini.intermediate_size = mlp
    for name in _EXPERT_WIDTHS:
        if _has(config, name) and getattr(config, name) > 0:
            setattr(mini, name, _round_up(hidden + hidden // 2, unit))
    top_k = getattr(config, "num_experts_per_tok", None)
    top_k = top_k if isinstance(top_k, int) else 1
    for name in _EXPERT_COUNTS:
        if _has(config, name) and getattr(config, name) > 0:
            setattr(mini, name, min(getattr(config, name), max(MINI_EXPERTS, top_k + 1)))
    if _has(config, "vocab_size"):
        vocab = _round_up(MINI_VOCAB, unit)
        mini.vocab_size = vocab
        for name in _TOKEN_IDS:  # kept below the vocabulary (a pad id is an embedding's padding row)
            value = getattr(mini, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value >= vocab:
                setattr(mini, name, vocab - 1)
            elif isinstance(value, list):
                setattr(mini, name, [min(v, vocab - 1) if isinstance(v, int) else v for v in value])
    return mini


def build_miniature(model: nn.Module, tp_degrees: Iterable[int] = (1,), seed: int = 0) -> nn.Module:
    """``model``'s class built on :func:`shrink_config` of its config, on the CPU in float32 with random values
    drawn from ``seed`` (the same on every rank; the global random state is left as it was), in ``model``'s
    train or eval mode. Raises :class:`NotShrinkable` when ``model`` is not a ``transformers``
    ``PreTrainedModel``, its config cannot be shrunk, the build fails or the miniature is not smaller."""
    try:
        from transformers import PreTrainedModel
    except ImportError as e:  # pragma: no cover - transformers is a test dependency
        raise NotShrinkable(f"transformers is not importable ({e})") from e
    if not isinstance(model, PreTrainedModel):
        raise NotShrinkable(f"{type(model).__name__} is not a transformers PreTrainedModel, whose config could "
                            "rebuild it smaller")
    try:
        mini_config = shrink_config(model.config, tp_degrees)
    except NotShrinkable:
        raise
    except Exception as e:  # noqa: BLE001 - a config this cannot copy or read: no miniature
        raise NotShrinkable(f"shrinking {type(model.config).__name__} failed: {type(e).__name__}: {e}") from e
    try:
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(seed)
            mini = type(model)(mini_config).float()
    except Exception as e:  # noqa: BLE001 - any failure means no miniature, reported in the skip warning
        raise NotShrinkable(f"building {type(model).__name__} on the shrunk config failed: "
                            f"{type(e).__name__}: {e}") from e
    mini.train(model.training)
    size = sum(p.numel() for p in mini.parameters())
    if size >= sum(p.numel() for p in model.parameters()):
        raise NotShrinkable(f"the miniature of {type(model).__name__} ({size} parameters) is not smaller")
    return mini


@dataclass(kw_only=True)
class MiniatureCheck:
    """What the trainer's self-check runs on in place of a model too large for it: the miniature compiled with
    the model's options, its lowerings over the trainer's buckets, and the (scheme, TP rank, CP rank) checked."""

    compiled: "CompiledModel"
    lowerings: "LoweringCache"
    params: int
    """The miniature's parameters (what a refusal names)."""
    vocab: int | None
    """Token ids of the probe are below it (None: the graph's token table was not found)."""
    checked: set = field(default_factory=set)
    """(scheme, TP rank, CP rank) whose lowering of the miniature this rank has checked."""


def miniature_check(compiled: "CompiledModel", tp_degrees: Iterable[int], like: "LoweringCache",
                    dtype: torch.dtype | None, device: torch.device | None,
                    cost_tokens: Callable[["ParallelScheme"], int]) -> MiniatureCheck:
    """The miniature of ``compiled.model`` (:func:`build_miniature`), compiled with the same buckets, backend and
    kernel, its lowerings made as ``like`` (the trainer's: buckets, pieces, kv splits, vocabulary and sequence
    parallelism) for compute copies in ``dtype`` on ``device``, each scheme's longest micro-batch
    ``cost_tokens(scheme)``. Its smallest bucket is captured here, so that a miniature the capture refuses is
    :class:`NotShrinkable` (the check is then skipped) rather than a refusal of the model."""
    from hcompile.api import CompiledModel
    from passes.graph.analyze import token_vocab

    mini = build_miniature(compiled.model, tp_degrees)
    mini_compiled = CompiledModel(mini, buckets=compiled.buckets, compile_backend=compiled.compile_backend,
                                  kernel=compiled.kernel)
    lowerings = mini_compiled.lowerings(dtype, device, buckets=like.buckets, cost_tokens=cost_tokens,
                                        pieces=like.pieces, kv_splits=like.kv_splits,
                                        vocab_parallel=like.vocab_parallel)
    try:
        analysed = lowerings.capture(like.buckets.sizes[0])
    except Exception as e:  # noqa: BLE001 - any failure means no miniature, reported in the skip warning
        raise NotShrinkable(f"capturing the miniature of {type(compiled.model).__name__} failed: "
                            f"{type(e).__name__}: {e}") from e
    return MiniatureCheck(compiled=mini_compiled, lowerings=lowerings, params=sum(p.numel() for p in mini.parameters()),
                          vocab=token_vocab(analysed))
