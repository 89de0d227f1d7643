"""What one rank can hold: the token cap a trainer may use on this machine, checked before anything is captured
at that size.

Owns :func:`model_memory` (the captured model as the one memory model, ``passes.plan.memory``, reads it: its
parameters as tensor parallelism splits them; a training step's bytes per token measured by
:func:`measured_bytes_per_token` (the tp1 lowering's forward, loss and backward run on fake tensors, its peak
tracked by PyTorch's ``MemTracker``), of them what every rank of a TP group keeps whole under sequence parallelism
(the gathered inputs of the column-parallel linears; the logits and the loss's copies too when the LM head is
replicated), the keys and values a context-parallel rank gathers, the attention backward's working copies, and
an upper estimate with every layer recomputed),
:func:`usable_memory` (what a rank may fill: its GPU's memory less the reserve ``passes.plan.memory`` states for
the CUDA context, NCCL and fragmentation, or its share of the host's available memory, the smallest figure of the
job so every rank decides alike) and :func:`bound_caps` (every scheme's cap lowered to
what its own ranks hold, by the same function the analytic cost model uses; an explicit ``tokens_per_rank``
beyond what any scheme's rank holds is refused with one line).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings

import torch
from torch import fx, nn

from passes.graph.analyze import attention_sites
from passes.graph.normalize import canonical_graph
from passes.graph.pass_runner import PassError
from passes.graph.tensor_parallel import LinearRole, decide_tensor_parallel
from passes.plan.cost_model import TRAINER_PIECES, RuntimeMemory, hcompile_runtime
from passes.plan.ir import CostModel
from passes.plan.memory import NCCL_COMMUNICATORS, ModelMemory, device_reserve_bytes, scheme_cap
from runtime import distributed as comm
from runtime.overlap import overlap_buffer_bytes

__all__ = ["MemoryCapError", "trainer_runtime", "rank_memory_bytes", "step_bytes_per_token",
           "recompute_bytes_per_token", "measured_bytes_per_token", "model_memory",
           "usable_memory", "bound_caps", "USABLE", "prefer_expandable_segments"]

log = logging.getLogger(__name__)

USABLE = 0.9
"""Fraction of a host's memory share a CPU rank's step may fill (the rest: the framework, fragmentation)."""
LOSS_COPIES = 3
"""fp32 copies of the logits the loss keeps per token (the logits, their log-softmax, its gradient)."""


class MemoryCapError(ValueError):
    """A token cap that this machine cannot hold; the message names the cap and what fits."""


def trainer_runtime(param_dtype: torch.dtype, reduce_dtype: torch.dtype, grad_dtype: torch.dtype,
                    chunk_numel: int, overlap_inflight_bytes: int | None = None,
                    overlap_unit_numel: int = 0, pieces: int = TRAINER_PIECES) -> RuntimeMemory:
    """What a trainer's rank holds per parameter and in buffers (``passes.plan.cost_model.hcompile_runtime``, Adam)
    with these dtypes: the movement rounds' send and receive chunk, or with overlapped movement
    (``overlap_inflight_bytes`` given) the progress thread's bound on its buffers in flight, or its largest unit
    of ``overlap_unit_numel`` elements when that is more (``runtime.overlap.overlap_buffer_bytes``); each stage
    cut into ``pieces`` compiled pieces (1 without overlapped movement)."""
    size = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in (param_dtype, reduce_dtype, grad_dtype)}
    runtime = hcompile_runtime(param_bytes=size[param_dtype], reduce_bytes=size[reduce_dtype],
                               chunk_numel=chunk_numel, grad_bytes=size[grad_dtype], pieces=pieces)
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


def _saved_bases(graph: fx.GraphModule) -> dict[fx.Node, int]:
    """Per floating intermediate some op's backward needs (a view counted at the tensor it views): its bytes."""
    saved: dict[fx.Node, int] = {}
    for node in graph.graph.nodes:
        if node.op in ("call_function", "call_method") and _name(node) not in _ALIASES | _NO_SAVE:
            for arg in node.all_input_nodes:
                base = _base(arg)
                val = base.meta.get("val")
                if base.op in ("call_function", "call_method") and isinstance(val, torch.Tensor) \
                        and val.is_floating_point():
                    saved[base] = val.numel() * val.element_size()
    return saved


def _activations(graph: fx.GraphModule) -> _Activations:
    saved = _saved_bases(graph)
    produced, logits = 0, 0
    for node in graph.graph.nodes:
        value = node.meta.get("val")
        if node.op in ("call_function", "call_method") and isinstance(value, torch.Tensor) \
                and value.is_floating_point() and _name(node) not in _ALIASES:
            produced += value.numel() * value.element_size()
        if node.op == "output":
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


_TOTAL = "Total"
"""MemTracker's key for a device's total among its per-category figures."""

_ATTENTION_NAMES = frozenset({"scaled_dot_product_attention", "extended_attention", "packed_attention"})


def measured_bytes_per_token(graph: fx.GraphModule, tokens: int, twice: fx.GraphModule | None = None) -> float | None:
    """Bytes per token a training step of the model captured on ``tokens`` tokens (``graph``) holds at its peak
    besides its parameters and their gradients, on one rank without tensor, context or pipeline parallelism: its
    tp1 lowering (packed attention) run forward, through the runtime's loss and backward on fake tensors (nothing
    is computed or allocated), each parameter's gradient handed on as the runtime's accumulation hook does, the
    peak tracked by ``torch.distributed._tools.mem_tracker.MemTracker``. Activations are linear in the tokens
    (every one has a token dim) and the rest is not, so two captures measure any bucket: ``twice``, the model
    captured on ``2 * tokens`` tokens, gives the slope; without it, the largest parameter's gradient (the peak's
    one token-free part besides the parameters) is taken off one peak. None when the graph cannot run on fake
    tensors."""
    first = _fake_step_peak(graph, tokens)
    if first is None:
        return None
    if twice is not None:
        second = _fake_step_peak(twice, 2 * tokens)
        if second is not None:
            return max(second[0] - first[0], 0) / tokens
    peak, largest = first
    return max(peak - largest, 0) / tokens


def _fake_step_peak(graph: fx.GraphModule, tokens: int) -> tuple[float, float] | None:
    """(the tracked peak of one tp1 training step of ``graph`` less its parameters, its largest parameter's
    bytes) on fake tensors; None when it cannot run on them."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from passes.graph.lowering import apply_lowering, decide_lowerings
    from passes.plan.ir import ParallelScheme
    from runtime.loss import packed_causal_lm_loss_sum

    try:
        lowering = decide_lowerings(graph, ParallelScheme())[0]
        variant = apply_lowering(lowering, graph, tokens)
        fake = FakeTensorMode()
        with fake:
            params = {sl.name: nn.Parameter(torch.empty(sl.local_shape, dtype=_dtype(graph, sl.name)))
                      for sl in variant.params}
            ids = torch.zeros(tokens, dtype=torch.long)
            cu = torch.zeros(2, dtype=torch.int32)

        def buffer(name: str, value: torch.Tensor) -> torch.Tensor:
            with fake:
                return torch.zeros(value.shape, dtype=value.dtype)

        variant.bind_(params, buffer)
        for p in params.values():
            p.register_post_accumulate_grad_hook(_drop_grad)
        tracker = MemTracker()
        with fake, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # MemTracker on the None gradients the hook leaves
            tracker.track_external(*params.values())
            with tracker:
                logits = variant.logits(variant(ids, cu), tokens)
                packed_causal_lm_loss_sum(logits, ids, cu).backward()
        peak = sum(kinds[_TOTAL] for kinds in tracker.get_tracker_snapshot("peak").values())
    except Exception as exc:  # an op without a fake kernel: the static estimate stands
        log.debug("the step's memory is estimated, not measured on fake tensors: %r", exc)
        return None
    sizes = [p.numel() * p.element_size() for p in params.values()]
    return max(peak - sum(sizes), 0), max(sizes, default=0)


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


def _dtype(graph: fx.GraphModule, name: str) -> torch.dtype:
    try:
        return graph.get_parameter(name).dtype
    except AttributeError:
        return torch.float32


def _whole_bytes_per_token(canonical: fx.GraphModule, roles: dict[str, LinearRole], tokens: int,
                           logits: int, sequence_parallel: bool, vocab_parallel: bool, total: float) -> float:
    """Of a step's bytes per token (``total``), what every rank of a TP group keeps whole. Under sequence
    parallelism each column-parallel (or vocab-parallel) linear's gathered input, once per distinct input.
    Without it, the share of ``total`` that the values outside the tensor-parallel regions (what no
    column-parallel linear's output reaches before a row-parallel one; the residual stream, the norms, the
    projections' inputs, the row-parallel outputs) have of the graph's saved activations. With a replicated LM
    head also the logits and the loss's fp32 copies of them."""
    if not roles:
        return total
    if sequence_parallel:
        inputs: dict[fx.Node, float] = {}
        for node in canonical.graph.nodes:
            if roles.get(node.name) in (LinearRole.COLUMN, LinearRole.VOCAB):
                base = _base(node.args[1] if node.target is torch.addmm else node.args[0])
                val = base.meta.get("val")
                if isinstance(val, torch.Tensor):
                    inputs[base] = val.numel() * val.element_size() / tokens
        whole = sum(inputs.values())
    else:
        split: dict[fx.Node, bool] = {}
        for node in canonical.graph.nodes:
            role = roles.get(node.name)
            split[node] = role is LinearRole.COLUMN or (role is None and any(
                split.get(a, False) for a in node.all_input_nodes))
        saved = _saved_bases(canonical)
        whole_saved = sum(b for n, b in saved.items() if not split.get(n, False))
        whole = total * whole_saved / max(sum(saved.values()), 1)
    if not vocab_parallel:
        whole += logits / tokens * (LOSS_COPIES * 4 + 2)
    return min(whole, total)


def model_memory(graph: fx.GraphModule, tokens: int, *, sequence_parallel: bool = False,
                 vocab_parallel: bool = True, measure: bool = False, twice: fx.GraphModule | None = None
                 ) -> ModelMemory:
    """The memory model's view of a model captured on ``tokens`` tokens (``graph``): its parameters, those tensor
    parallelism splits (none when it has no tensor-parallel form), the token embedding and an untied LM head,
    the step's bytes per token (with ``measure``, as a GPU trainer and the rehearsal ask:
    :func:`measured_bytes_per_token`, ``twice`` the model captured on twice the tokens; else, or where it cannot
    run, the upper estimate :func:`step_bytes_per_token`, which costs nothing at start-up), what of them
    a TP group keeps whole (``sequence_parallel`` and ``vocab_parallel`` as the lowering runs them), the keys and
    values and the attention backward's working copies per token."""
    canonical = canonical_graph(graph)
    params = {n.target: n for n in canonical.graph.nodes if n.op == "get_attr" and _is_param(canonical, n.target)}
    numel = {name: int(node.meta["val"].numel()) for name, node in params.items()}
    try:
        plan = decide_tensor_parallel(canonical, 1, 0)
        split = {sl.name for sl in plan.params if sl.dim is not None}
        heads = {name for name, role in plan.roles if role is LinearRole.REPLICATED}
        roles = dict(plan.roles)
    except PassError:  # no tensor-parallel form: every tp > 1 scheme is refused at its lowering anyway
        split, heads, roles = set(), set(), {}
    embed = {n.args[1].target for n in canonical.graph.nodes
             if n.op == "call_function" and n.target is torch.nn.functional.embedding and n.args[0].op == "placeholder"
             and getattr(n.args[1], "target", None) in numel}
    head = {_weight_name(n) for n in canonical.graph.nodes if n.name in heads} - embed - {None}
    layers = sum(1 for n in canonical.graph.nodes if _name(n) in _ATTENTION_NAMES)
    residual = max((n.meta["val"].numel() * n.meta["val"].element_size() / tokens for n in canonical.graph.nodes
                    if n.op == "call_function" and n.target is torch.nn.functional.embedding
                    and isinstance(n.meta.get("val"), torch.Tensor)), default=0.0)
    parts = _activations(graph)
    vocab_parallel = vocab_parallel and _splits_vocabulary(canonical)
    measured = measured_bytes_per_token(graph, tokens, twice) if measure else None
    total = measured if measured is not None else step_bytes_per_token(graph, tokens, parts)
    kv, working = 0.0, 0.0
    for site in attention_sites(canonical):
        size = _element_size(canonical)
        kv += 2 * site.kv_heads * site.head_dim * size
        working = max(working, 2 * site.heads * site.head_dim * 4)
    return ModelMemory(params=sum(numel.values()), split_params=sum(numel[n] for n in split),
                       embed_params=sum(numel[n] for n in embed), head_params=sum(numel[n] for n in head if n in numel),
                       bytes_per_token=total,
                       recompute_bytes_per_token=recompute_bytes_per_token(graph, tokens, parts),
                       layer_input_bytes=layers * residual,
                       whole_bytes_per_token=_whole_bytes_per_token(canonical, roles, tokens, parts.logits,
                                                                    sequence_parallel, vocab_parallel, total),
                       kv_bytes_per_token=kv, attention_working_bytes_per_token=working,
                       edges_split=vocab_parallel)


def _splits_vocabulary(canonical: fx.GraphModule) -> bool:
    """Whether a vocab-parallel lowering of the model splits its head and embedding (tried at tp 2; a model the
    split does not fit keeps them replicated, ``passes.graph.tensor_parallel``)."""
    try:
        return decide_tensor_parallel(canonical, 2, 0, vocab_parallel=True, split_logits=True).vocab_range is not None
    except PassError:
        return False


def _element_size(gm: fx.GraphModule) -> int:
    """Bytes of one element of the graph's floating activations (its first floating parameter's dtype)."""
    return next((p.element_size() for p in gm.parameters() if p.is_floating_point()), 4)


def _is_param(gm: fx.GraphModule, name: str) -> bool:
    try:
        gm.get_parameter(name)
    except AttributeError:
        return False
    return True


def _weight_name(linear: fx.Node) -> str | None:
    weight = linear.args[2] if linear.target is torch.addmm else (linear.args[1] if len(linear.args) > 1 else None)
    return weight.target if isinstance(weight, fx.Node) and weight.op == "get_attr" else None


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
"""The environment variable in which a user sets the CUDA caching allocator's options (left alone when set)."""


def prefer_expandable_segments(device: torch.device) -> bool:
    """On a GPU whose user has not set :data:`ALLOC_CONF`: the caching allocator grows expandable segments from
    now on, so the per-step buffers of per-strategy sizes (the compute copy, its gradient buffer, the movement's)
    do not fragment its memory (what :data:`passes.plan.memory.FRAGMENTATION` reserves assumes it). Returns
    whether it was set."""
    if device.type != "cuda" or os.environ.get(ALLOC_CONF):
        return False
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        return False
    setter("expandable_segments:True")
    return True


def usable_memory(device: torch.device, local_ranks: int, world: int = 1) -> int:
    """Bytes every rank of the job may fill, the smallest over the ranks (collective when there are several): a
    GPU's memory less ``passes.plan.memory.device_reserve_bytes`` (the CUDA context, :data:`NCCL_COMMUNICATORS`
    communicators, point-to-point buffers to the ``world - 1`` peers the movement exchanges with, fragmentation);
    ``USABLE`` of a CPU rank's share of the host's memory."""
    memory = rank_memory_bytes(device, local_ranks)
    if device.type == "cuda":
        memory -= device_reserve_bytes(memory, NCCL_COMMUNICATORS, max(world - 1, 0))
    else:
        memory *= USABLE
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
