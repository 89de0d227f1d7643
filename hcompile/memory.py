"""What one rank can hold: the token cap a trainer may use on this machine, checked before anything is captured
at that size.

Owns :func:`model_memory` (the captured model as the one memory model, ``passes.plan.memory``, reads it: its
parameters as tensor parallelism splits them and an upper estimate of a training step's bytes per token, with
every layer recomputed too),
:func:`usable_memory` (what a rank may fill: its GPU's memory, or its share of the host's available memory, the
smallest figure of the job so every rank decides alike) and :func:`bound_caps` (every scheme's cap lowered to
what its own ranks hold, by the same function the analytic cost model uses; an explicit ``tokens_per_rank``
beyond what any scheme's rank holds is refused with one line).
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import fx

from passes.graph.normalize import canonical_graph
from passes.graph.pass_runner import PassError
from passes.graph.tensor_parallel import LinearRole, decide_tensor_parallel
from passes.plan.cost_model import RuntimeMemory, hcompile_runtime
from passes.plan.ir import CostModel
from passes.plan.memory import ModelMemory, scheme_cap
from runtime import distributed as comm
from runtime.overlap import overlap_buffer_bytes

__all__ = ["MemoryCapError", "trainer_runtime", "rank_memory_bytes", "step_bytes_per_token",
           "recompute_bytes_per_token", "model_memory",
           "usable_memory", "bound_caps", "USABLE"]

USABLE = 0.9
"""Fraction of a rank's memory a step may fill (the rest: the framework, fragmentation)."""
LOSS_COPIES = 3
"""fp32 copies of the logits the loss keeps per token (the logits, their log-softmax, its gradient)."""


class MemoryCapError(ValueError):
    """A token cap that this machine cannot hold; the message names the cap and what fits."""


def trainer_runtime(param_dtype: torch.dtype, reduce_dtype: torch.dtype, grad_dtype: torch.dtype,
                    chunk_numel: int, overlap_inflight_bytes: int | None = None,
                    overlap_unit_numel: int = 0) -> RuntimeMemory:
    """What a trainer's rank holds per parameter and in buffers (``passes.plan.cost_model.hcompile_runtime``, Adam)
    with these dtypes: the movement rounds' send and receive chunk, or with overlapped movement
    (``overlap_inflight_bytes`` given) the progress thread's bound on its buffers in flight, or its largest unit
    of ``overlap_unit_numel`` elements when that is more (``runtime.overlap.overlap_buffer_bytes``)."""
    size = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in (param_dtype, reduce_dtype, grad_dtype)}
    runtime = hcompile_runtime(param_bytes=size[param_dtype], reduce_bytes=size[reduce_dtype],
                               chunk_numel=chunk_numel, grad_bytes=size[grad_dtype])
    if overlap_inflight_bytes is None:
        return runtime
    return dataclasses.replace(runtime, buffer_bytes=overlap_buffer_bytes(
        overlap_inflight_bytes, overlap_unit_numel, size[param_dtype], size[reduce_dtype]))


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


_ALIASES = frozenset({"view", "reshape", "transpose", "permute", "expand", "unsqueeze", "squeeze", "getitem",
                      "split", "chunk", "unflatten", "flatten", "t", "contiguous", "detach", "narrow", "select",
                      "view_as", "expand_as"})
"""Ops whose result shares its input's memory (or may: counted once, at the base)."""
_NO_SAVE = frozenset({"add", "sub", "neg", "to", "float", "type_as", "cat", "stack", "iadd", "isub", "clone",
                      "dropout", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "embedding"})
"""Ops whose backward needs none of their floating inputs (sums, casts, concatenation, selection)."""


def _name(node: fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _base(node: fx.Node) -> fx.Node:
    """The node whose memory ``node`` aliases (itself when it owns its memory)."""
    while _name(node) in _ALIASES and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


@dataclasses.dataclass(frozen=True, slots=True)
class _Activations:
    """What a captured forward's activations come to, read once: bytes some backward needs (each base once), bytes
    of every floating intermediate produced, the logits' elements, the attention layers (at least 1)."""

    saved: int
    produced: int
    logits: int
    layers: int


def _activations(graph: fx.GraphModule) -> _Activations:
    saved: dict[fx.Node, int] = {}
    produced, logits = 0, 0
    for node in graph.graph.nodes:
        value = node.meta.get("val")
        if node.op in ("call_function", "call_method") and isinstance(value, torch.Tensor) \
                and value.is_floating_point() and _name(node) not in _ALIASES:
            produced += value.numel() * value.element_size()
        if node.op in ("call_function", "call_method") and _name(node) not in _ALIASES | _NO_SAVE:
            for arg in node.all_input_nodes:
                base = _base(arg)
                val = base.meta.get("val")
                if base.op in ("call_function", "call_method") and isinstance(val, torch.Tensor) \
                        and val.is_floating_point():
                    saved[base] = val.numel() * val.element_size()
        elif node.op == "output":
            out = node.args[0][0] if isinstance(node.args[0], (tuple, list)) else node.args[0]
            logits = out.meta["val"].numel() if isinstance(out, fx.Node) and "val" in out.meta else 0
    layers = max(1, sum(1 for n in graph.graph.nodes if _name(n) in _ATTENTION_NAMES))
    return _Activations(saved=sum(saved.values()), produced=produced, logits=logits, layers=layers)


def step_bytes_per_token(graph: fx.GraphModule, tokens: int, parts: _Activations | None = None) -> float:
    """An upper estimate of a training step's activation bytes per token (``graph`` captured on ``tokens``
    tokens): every floating intermediate some op's backward needs (the inputs of linears, products, norms,
    activations and attention: a view counted once, at the tensor it views), one layer's worth again for the
    backward's own working memory (the largest attention's share of the graph's intermediates), and the loss's
    fp32 copies of the logits. ``parts``: the graph's activations, when already read."""
    a = parts or _activations(graph)
    return (a.saved + a.produced / a.layers + LOSS_COPIES * 4 * a.logits) / tokens


def recompute_bytes_per_token(graph: fx.GraphModule, tokens: int, parts: _Activations | None = None) -> float:
    """Under recomputation, an upper estimate of what one rank without tensor or context parallelism keeps per
    token besides every layer's input (``graph`` captured on ``tokens`` tokens): one layer's share of the saved
    intermediates (``step_bytes_per_token``'s), the backward's working memory (one layer's share of everything
    produced, twice: the recomputed forward's and the backward's own), and the loss's fp32 copies of the
    logits. ``parts``: the graph's activations, when already read."""
    a = parts or _activations(graph)
    loss = LOSS_COPIES * 4 * a.logits / tokens
    return (step_bytes_per_token(graph, tokens, a) - loss) / a.layers + a.produced / a.layers / tokens + loss


_ATTENTION_NAMES = frozenset({"scaled_dot_product_attention", "extended_attention", "packed_attention"})


def model_memory(graph: fx.GraphModule, tokens: int) -> ModelMemory:
    """The memory model's view of a model captured on ``tokens`` tokens (``graph``): its parameters, those tensor
    parallelism splits (none when it has no tensor-parallel form), the token embedding and an untied LM head,
    and :func:`step_bytes_per_token`."""
    canonical = canonical_graph(graph)
    params = {n.target: n for n in canonical.graph.nodes if n.op == "get_attr" and _is_param(canonical, n.target)}
    numel = {name: int(node.meta["val"].numel()) for name, node in params.items()}
    try:
        plan = decide_tensor_parallel(canonical, 1, 0)
        split = {sl.name for sl in plan.params if sl.dim is not None}
        heads = {name for name, role in plan.roles if role is LinearRole.REPLICATED}
    except PassError:  # no tensor-parallel form: every tp > 1 scheme is refused at its lowering anyway
        split, heads = set(), set()
    embed = {n.args[1].target for n in canonical.graph.nodes
             if n.op == "call_function" and n.target is torch.nn.functional.embedding and n.args[0].op == "placeholder"
             and getattr(n.args[1], "target", None) in numel}
    head = {_weight_name(n) for n in canonical.graph.nodes if n.name in heads} - embed - {None}
    layers = sum(1 for n in canonical.graph.nodes if _name(n) in _ATTENTION_NAMES)
    residual = max((n.meta["val"].numel() * n.meta["val"].element_size() / tokens for n in canonical.graph.nodes
                    if n.op == "call_function" and n.target is torch.nn.functional.embedding
                    and isinstance(n.meta.get("val"), torch.Tensor)), default=0.0)
    parts = _activations(graph)
    return ModelMemory(params=sum(numel.values()), split_params=sum(numel[n] for n in split),
                       embed_params=sum(numel[n] for n in embed), head_params=sum(numel[n] for n in head if n in numel),
                       bytes_per_token=step_bytes_per_token(graph, tokens, parts),
                       recompute_bytes_per_token=recompute_bytes_per_token(graph, tokens, parts),
                       layer_input_bytes=layers * residual)


def _is_param(gm: fx.GraphModule, name: str) -> bool:
    try:
        gm.get_parameter(name)
    except AttributeError:
        return False
    return True


def _weight_name(linear: fx.Node) -> str | None:
    weight = linear.args[2] if linear.target is torch.addmm else (linear.args[1] if len(linear.args) > 1 else None)
    return weight.target if isinstance(weight, fx.Node) and weight.op == "get_attr" else None


def usable_memory(device: torch.device, local_ranks: int) -> int:
    """Bytes every rank of the job may fill (``USABLE`` of its memory), the smallest over the ranks
    (collective when there are several)."""
    memory = rank_memory_bytes(device, local_ranks) * USABLE
    least = comm.all_reduce(torch.tensor([memory], dtype=torch.float64, device="cpu"), "min")
    return max(0, int(least.item()))


def bound_caps(model: CostModel, memory: ModelMemory, runtime: RuntimeMemory, usable: float, world: int,
               tokens_per_rank: int | None) -> CostModel:
    """``model`` with each scheme's cap at most what its ranks hold (``passes.plan.memory.scheme_cap``: the states
    of its own slice, its activations); a scheme whose ranks hold no micro-batch keeps a cap of 0 and leaves the
    pool. An explicit ``tokens_per_rank`` above what a rank of every scheme holds is a :class:`MemoryCapError`,
    as is a model no scheme holds."""
    caps = {e.scheme: scheme_cap(memory, e.scheme, world, runtime, usable) for e in model.entries}
    best = max((caps[e.scheme] // (e.scheme.tp * e.scheme.cp) for e in model.entries), default=0)
    what = (f"about {best} tokens fit in a rank's {usable / 2**30:.1f} GiB at {memory.bytes_per_token / 1024:.1f} "
            "KiB per token of this model")
    if tokens_per_rank is not None and tokens_per_rank > best:
        raise MemoryCapError(f"tokens_per_rank={tokens_per_rank} is more than this machine holds: {what}; pass "
                             f"tokens_per_rank <= {best}")
    entries = tuple(dataclasses.replace(e, max_tokens=min(e.max_tokens, caps[e.scheme])) for e in model.entries)
    if max(e.max_tokens for e in entries) < 1:
        raise MemoryCapError(f"this model does not fit: {what}, and no scheme's slice of it leaves room for a "
                             "micro-batch")
    return dataclasses.replace(model, entries=entries)
