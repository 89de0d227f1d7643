"""Graph analysis: what each node of a captured forward is, and what the model costs.

Owns the node classification (linear, attention, norm, elementwise, embedding, view, ...), the attention
sites with their head counts, the per-token linear FLOPs, the per-sequence quadratic attention FLOPs and
the parameter bytes of a captured graph (:func:`analyze_graph`), and the analytic
:class:`passes.plan.ir.CostModel` built from them and a :class:`Hardware` description
(:func:`analytic_cost_model`; the GPU presets are in :mod:`passes.graph.hardware`). Works on torch-level
graphs from capture, on fake or meta tensors, so a 70B-shaped model can be analysed without allocating it.
Reads ``meta["val"]`` of nodes for shapes.
"""

from __future__ import annotations

import enum
import math
import operator
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import fx

from codegen.reference import extended_attention
from passes.plan.cost_model import HCOMPILE_RUNTIME, RuntimeMemory, with_recompute_time
from passes.plan.ir import CostModel, ParallelScheme, SchemeCost
from passes.plan.memory import ModelMemory, scheme_cap

__all__ = [
    "OpClass",
    "AttentionSite",
    "GraphAnalysis",
    "Hardware",
    "classify_node",
    "attention_sites",
    "analyze_graph",
    "analytic_cost_model",
    "node_flops",
    "SDPA_TARGETS",
    "token_vocab",
]


class OpClass(enum.Enum):
    """What a node does, for cost and for the rewrites."""

    INPUT = "input"
    PARAM = "param"
    OUTPUT = "output"
    LINEAR = "linear"
    ATTENTION = "attention"
    NORM = "norm"
    EMBEDDING = "embedding"
    ELEMENTWISE = "elementwise"
    VIEW = "view"
    OTHER = "other"


SDPA_TARGETS = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention, extended_attention)
"""Attention calls in SDPA form (q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa): SDPA itself and
the soft-capped attention that ``fold_eager_attention_pass`` makes of an eager one."""
_LINEAR = (F.linear, torch._C._nn.linear, torch.matmul, operator.matmul, torch.mm, torch.bmm, torch.addmm)
_NORM = (F.layer_norm, F.rms_norm, F.group_norm, torch.layer_norm)
_VIEW_METHODS = {"view", "reshape", "transpose", "permute", "contiguous", "unsqueeze", "squeeze", "split",
                 "chunk", "expand", "flatten", "t"}
_VIEW_FUNCTIONS = (torch.reshape, torch.transpose, torch.permute, torch.split, torch.chunk, torch.cat,
                   torch.unsqueeze, torch.squeeze, torch.flatten, operator.getitem)
_ELEMENTWISE_FUNCTIONS = (operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
                          torch.add, torch.mul, torch.rsqrt, torch.sqrt, torch.exp, torch.tanh, torch.sigmoid,
                          F.gelu, F.silu, F.relu, F.dropout, torch.cos, torch.sin, torch.where)
_ELEMENTWISE_METHODS = {"add", "mul", "pow", "float", "to", "type_as", "cos", "sin", "exp", "rsqrt", "sqrt",
                        "neg", "tanh", "sigmoid", "mean", "sum", "half", "bfloat16", "masked_fill"}


_aten = torch.ops.aten
_ATEN_CLASSES = {
    _aten.mm.default: "linear", _aten.addmm.default: "linear", _aten.bmm.default: "linear",
    _aten._scaled_dot_product_flash_attention_for_cpu.default: "attention",
    _aten._scaled_dot_product_efficient_attention.default: "attention",
    _aten._scaled_dot_product_flash_attention.default: "attention",
    _aten.scaled_dot_product_attention.default: "attention",
    _aten.native_layer_norm.default: "norm", _aten.embedding.default: "embedding",
    _aten.view.default: "view", _aten._unsafe_view.default: "view", _aten.t.default: "view",
    _aten.transpose.int: "view", _aten.permute.default: "view", _aten.expand.default: "view",
    _aten.add.Tensor: "elementwise", _aten.mul.Tensor: "elementwise", _aten.gelu.default: "elementwise",
    _aten.silu.default: "elementwise", _aten.rsqrt.default: "elementwise",
}


def _is_packed_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and "packed_attention" in str(getattr(node.target, "__name__", node.target))


def _in_norm_module(node: fx.Node) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return False
    _, mod_type = list(stack.values())[-1]
    return "norm" in getattr(mod_type, "__name__", str(mod_type)).lower()


def classify_node(node: fx.Node) -> OpClass:
    """The class of one node of a torch-level graph."""
    if node.op == "placeholder":
        return OpClass.INPUT
    if node.op == "get_attr":
        return OpClass.PARAM
    if node.op == "output":
        return OpClass.OUTPUT
    target = node.target
    if node.op == "call_function" and target in _ATEN_CLASSES:  # aten-level graphs (aot_autograd)
        kind = OpClass(_ATEN_CLASSES[target])
        return OpClass.NORM if kind is OpClass.ELEMENTWISE and _in_norm_module(node) else kind
    if node.op == "call_function":
        if target in SDPA_TARGETS or _is_packed_attention(node):
            return OpClass.ATTENTION
        if target in _LINEAR:
            return OpClass.LINEAR
        if target in _NORM:
            return OpClass.NORM
        if target is F.embedding:
            return OpClass.EMBEDDING
        if target in _VIEW_FUNCTIONS:
            return OpClass.VIEW
        if target in _ELEMENTWISE_FUNCTIONS:
            return OpClass.NORM if _in_norm_module(node) else OpClass.ELEMENTWISE
    if node.op == "call_method":
        if target in _VIEW_METHODS:
            return OpClass.VIEW
        if target in _ELEMENTWISE_METHODS:
            return OpClass.NORM if _in_norm_module(node) else OpClass.ELEMENTWISE
    return OpClass.OTHER


def _val(node: object) -> torch.Tensor | None:
    if isinstance(node, fx.Node):
        val = node.meta.get("val", node.meta.get("example_value"))
        return val if isinstance(val, torch.Tensor) else None
    return None


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return str(path)


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionSite:
    """One attention call of the graph."""

    node: str
    """Name of the attention node."""
    module: str
    """Module path the call was made from ('' when unknown)."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads."""
    head_dim: int
    """Width of one head."""
    causal: bool
    """Whether the call is causal."""


def attention_sites(gm: fx.GraphModule) -> tuple[AttentionSite, ...]:
    """Every attention node with its head counts; q/k/v are (B, H, T, D) for SDPA, (T, H, D) when packed."""
    sites = []
    for node in gm.graph.nodes:
        if classify_node(node) is not OpClass.ATTENTION:
            continue
        q, k = _val(node.args[0]), _val(node.args[1])
        if q is None or k is None:
            raise ValueError(f"attention node {node.name!r} has no shape metadata (run propagate_vals first)")
        head_axis = -3 if q.dim() == 4 else -2  # (B, H, T, D) unpacked, (T, H, D) packed
        causal = bool(node.kwargs.get("is_causal", node.kwargs.get("causal", False)))
        sites.append(AttentionSite(node=node.name, module=_module_path(node), heads=int(q.shape[head_axis]),
                                   kv_heads=int(k.shape[head_axis]), head_dim=int(q.shape[-1]), causal=causal))
    return tuple(sites)


def token_vocab(gm: fx.GraphModule) -> int | None:
    """Rows of the table the graph's first input is looked up in (the token embedding), or None."""
    ids = next((n for n in gm.graph.nodes if n.op == "placeholder"), None)
    frontier = list(ids.users) if ids is not None else []
    while frontier:  # through views of the ids (GPT-2 reshapes them first)
        node = frontier.pop(0)
        if node.op == "call_function" and node.target is F.embedding:
            weight = _val(node.args[1])
            return int(weight.shape[0]) if weight is not None else None
        if classify_node(node) is OpClass.VIEW:
            frontier.extend(node.users)
    return None


def node_flops(node: fx.Node) -> tuple[float, float]:
    """Forward (linear FLOPs per token, attention FLOPs per token^2 of one sequence) of one node."""
    kind = classify_node(node)
    if kind is OpClass.LINEAR:
        w = _val(node.args[2] if node.target is torch.addmm else node.args[1])  # addmm(bias, x, w)
        if w is None:
            return 0.0, 0.0
        if node.target in (F.linear, torch._C._nn.linear):
            return 2.0 * w.shape[0] * w.shape[1], 0.0
        return 2.0 * w.shape[-2] * w.shape[-1], 0.0
    if kind is OpClass.ATTENTION:
        q = _val(node.args[0])
        if q is None:
            return 0.0, 0.0
        head_axis = -3 if q.dim() == 4 else -2  # (B, H, T, D) unpacked, (T, H, D) packed
        heads, head_dim = q.shape[head_axis], q.shape[-1]
        causal = bool(node.kwargs.get("is_causal", node.kwargs.get("causal", False)))
        # QK^T and PV: 2 matmuls x 2 FLOPs x heads x head_dim per (query, key) pair; causal keeps half.
        return 0.0, 4.0 * heads * head_dim * (0.5 if causal else 1.0)
    return 0.0, 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class GraphAnalysis:
    """What a captured forward holds and costs."""

    op_counts: tuple[tuple[str, int], ...]
    """(op class value, node count), sorted by class."""
    attention: tuple[AttentionSite, ...]
    """Attention sites in graph order."""
    linear_flops_per_token: float
    """Forward FLOPs of all linears (matmuls with a weight) for one token."""
    attention_flops_per_seq_sq: float
    """Forward attention FLOPs of one sequence of length s, divided by s^2."""
    param_bytes: int
    """Bytes of the distinct parameters the graph reads."""
    param_count: int
    """Elements of the distinct parameters the graph reads."""
    hidden: int
    """Model width (query heads x head dim of the first attention site; 0 without attention)."""

    @property
    def layers(self) -> int:
        """Transformer layers, counted as attention sites."""
        return len(self.attention)

    def train_linear_flops_per_token(self) -> float:
        """Forward + backward linear FLOPs per token (backward is twice the forward)."""
        return 3.0 * self.linear_flops_per_token

    def describe(self) -> str:
        """Stable one-line summary."""
        counts = ",".join(f"{k}={v}" for k, v in self.op_counts)
        return (f"layers={self.layers} hidden={self.hidden} params={self.param_count} "
                f"linear_flops/token={self.linear_flops_per_token:.4g} "
                f"attn_flops/seq^2={self.attention_flops_per_seq_sq:.4g} ops[{counts}]")


def _params(gm: fx.GraphModule) -> Iterable[torch.Tensor]:
    seen: set[int] = set()
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            tensor = gm.get_parameter(node.target)
        except AttributeError:
            continue  # a buffer or constant, not a parameter
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield tensor


def analyze_graph(gm: fx.GraphModule) -> GraphAnalysis:
    """Classify every node and total the FLOPs and parameter bytes of ``gm``."""
    counts: dict[str, int] = {}
    linear = attn = 0.0
    for node in gm.graph.nodes:
        kind = classify_node(node)
        counts[kind.value] = counts.get(kind.value, 0) + 1
        lf, af = node_flops(node)
        linear += lf
        attn += af
    params = list(_params(gm))
    sites = attention_sites(gm)
    return GraphAnalysis(
        op_counts=tuple(sorted(counts.items())),
        attention=sites,
        linear_flops_per_token=linear,
        attention_flops_per_seq_sq=attn,
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        param_count=sum(p.numel() for p in params),
        hidden=sites[0].heads * sites[0].head_dim if sites else 0,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Hardware:
    """One accelerator kind, as the analytic cost model needs it. GPU presets from vendor datasheets, and the
    mapping from a CUDA device name to one, are in :mod:`passes.graph.hardware`."""

    name: str
    """E.g. ``a800-80g``."""
    peak_tflops: float
    """Dense matmul peak of one device, TFLOP/s, in the training dtype."""
    linear_efficiency: float = 0.75
    """Fraction of peak the linears reach."""
    attention_efficiency: float = 0.4
    """Fraction of peak varlen attention reaches."""
    memory_gib: float = 80.0
    """Device memory."""
    reserved_gib: float = 15.0
    """Memory not available to the model (framework, fragmentation, safety)."""
    link_gbps: float = 200.0
    """Intra-node bandwidth of one device in one direction, GB/s (NVLink: the datasheet's bidirectional
    figure over two): what a ring all-reduce inside a node moves data at."""
    network_gbps: float = 25.0
    """Inter-node bandwidth of one device in one direction, GB/s (25: one 200 Gb/s InfiniBand HDR port per
    GPU): what a ring all-reduce over a tensor-parallel group wider than a node moves data at."""
    hbm_gbps: float | None = None
    """Device memory bandwidth, GB/s; None: not modelled. When given, every micro-batch is also charged the
    activations it keeps written in the forward and read back in the backward at this bandwidth (a lower
    bound on the norms' and elementwise ops' memory-bound time)."""
    latency_us: float = 0.0
    """Start-up time of one collective or point-to-point message, microseconds, charged per tensor-parallel
    all-reduce and per pipeline boundary message of a micro-batch."""
    activation_bytes: float = 36.0
    """Activation bytes kept per (token x hidden x layer) per TP rank."""
    dtype_bytes: int = 2
    """Bytes of one activation element on the wire."""
    fixed_ms_per_layer: float = 1.5
    """Per-layer overhead of one micro-batch (launches, synchronisation)."""
    gpus_per_node: int = 8
    """Devices in one node."""

    def __post_init__(self) -> None:
        for name in ("peak_tflops", "linear_efficiency", "attention_efficiency", "memory_gib", "link_gbps",
                     "network_gbps", "activation_bytes") + (("hbm_gbps",) if self.hbm_gbps is not None else ()):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
                raise ValueError(f"hardware {name} must be a finite number > 0, got {value!r}")
        if not isinstance(self.latency_us, (int, float)) or not 0 <= self.latency_us < math.inf:
            raise ValueError(f"hardware latency_us must be a finite number >= 0, got {self.latency_us!r}")
        if self.linear_efficiency > 1 or self.attention_efficiency > 1:
            raise ValueError(f"efficiencies must be <= 1, got {self.linear_efficiency!r}, "
                             f"{self.attention_efficiency!r}")

    @classmethod
    def a800(cls) -> "Hardware":
        """NVIDIA A800-SXM4-80GB: the ``a800-80g`` preset of :mod:`passes.graph.hardware` (bf16 312 TFLOP/s
        dense, NVLink 400 GB/s bidirectional)."""
        from passes.graph.hardware import hardware_preset

        return hardware_preset("a800-80g")


def _scheme_cost(an: GraphAnalysis, hw: Hardware, scheme: ParallelScheme, world_size: int,
                 runtime: RuntimeMemory, memory: ModelMemory, memory_bytes: float) -> SchemeCost:
    gpus = scheme.tp * scheme.pp
    flops_ms = hw.peak_tflops * 1e12 / 1e3  # FLOPs per ms
    layers, hidden = max(an.layers, 1), max(an.hidden, 1)
    b = 3.0 * an.linear_flops_per_token / gpus / (flops_ms * hw.linear_efficiency)
    # Megatron TP: 2 all-reduces per layer forward and 2 backward, ring cost 2(tp-1)/tp of the message, over the
    # network when the group is wider than a node (bytes per ms = GB/s * 1e6).
    ring = 2.0 * (scheme.tp - 1) / scheme.tp
    link = hw.link_gbps if scheme.tp <= hw.gpus_per_node else hw.network_gbps
    b += 4.0 * layers / scheme.pp * ring * hidden * hw.dtype_bytes / (link * 1e6)
    # Activations kept per token over all layers (1F1B: the first stage holds pp micro-batches of layers/pp).
    per_token = layers * hidden / scheme.tp * hw.activation_bytes
    if hw.hbm_gbps is not None:  # written in the forward, read back in the backward
        b += 2.0 * per_token / scheme.pp / (hw.hbm_gbps * 1e6)
    a = 3.0 * an.attention_flops_per_seq_sq / gpus / (flops_ms * hw.attention_efficiency)
    messages = (4.0 * layers / scheme.pp if scheme.tp > 1 else 0.0) + (2.0 if scheme.pp > 1 else 0.0)
    c = hw.fixed_ms_per_layer * layers / scheme.pp + messages * hw.latency_us / 1e3
    max_tokens = scheme_cap(memory, scheme, world_size, runtime, memory_bytes)
    entry = SchemeCost(scheme=scheme, a=a, b=b, c=c, max_tokens=max_tokens)
    return with_recompute_time(entry) if scheme.rc else entry


def analytic_cost_model(
    analysis: GraphAnalysis, hardware: Hardware, schemes: Sequence[ParallelScheme], *, name: str | None = None,
    world_size: int | None = None, runtime: RuntimeMemory = HCOMPILE_RUNTIME, memory: ModelMemory | None = None,
    memory_bytes: float | None = None,
) -> CostModel:
    """A :class:`CostModel` from FLOP counts and hardware peaks: ``T(s) = a s^2 + b s + c`` per stage; each
    scheme's ``max_tokens`` from the one memory model (``passes.plan.memory.scheme_cap``): ``memory`` (the
    model's parameters as the layouts split them and its activation bytes per token; default: every parameter
    split, ``hardware.activation_bytes`` per token, hidden unit and layer) beside ``runtime``'s states on a job of
    ``world_size`` GPUs (default: the largest scheme's), in ``memory_bytes`` per rank (default: the hardware's
    memory less its reserve)."""
    if not schemes:
        raise ValueError("analytic_cost_model needs at least one scheme, got none")
    world = world_size or max(s.gpus for s in schemes)
    if memory is None:
        per_token = max(analysis.layers, 1) * max(analysis.hidden, 1) * hardware.activation_bytes
        memory = ModelMemory(params=analysis.param_count, split_params=analysis.param_count, embed_params=0,
                             head_params=0, bytes_per_token=per_token)
    usable = (hardware.memory_gib - hardware.reserved_gib) * 2**30 if memory_bytes is None else memory_bytes
    return CostModel(
        name=name or f"analytic@{hardware.name}",
        entries=tuple(_scheme_cost(analysis, hardware, s, world, runtime, memory, usable) for s in schemes),
        gpus_per_node=hardware.gpus_per_node,
    )
