"""The links parameters and gradients cross, as the planner sees them (without torch).

Owns :class:`Links` (GPUs per node, one GPU's bandwidth to a GPU of its node and to one of another node, one
message's start-up latency) and :data:`LINK_PRESETS`, the links of the GPU presets of
``passes.graph.hardware`` (the same figures; a test keeps the two equal): NVLink one direction per GPU inside
a node, one InfiniBand port per GPU between nodes. A profile measured by ``hcompile profile`` carries the
links it measured (gloo between local processes on a CPU machine: one node, the same bandwidth both ways).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from passes.plan.ir import PlanError

__all__ = ["Links", "LINK_PRESETS", "OVERLAP_SLOWDOWN", "link_preset"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Links:
    """One GPU's links: what a message between two ranks costs."""

    gpus_per_node: int
    """GPUs per node: ranks ``n * gpus_per_node ..`` share node n."""
    intra_gbps: float
    """GB/s one direction from a GPU to another of its node (NVLink)."""
    inter_gbps: float
    """GB/s one direction from a GPU to one of another node (its network port)."""
    latency_us: float
    """Start-up of one message, microseconds."""
    fresh_gbps: float | None = None
    """GB/s at which a rank writes newly allocated memory (the movement phases' buffers are new each step);
    None: not counted (on GPUs the caching allocator reuses them and HBM writes them in microseconds)."""
    freed_gbps: float | None = None
    """GB/s at which a rank frees such buffers (a CPU gives their pages back; None: not counted)."""
    warm_gbps: float | None = None
    """GB/s at which a rank adds a buffer it has written before into another, every rank at once (the
    movement's copies and sums: gathering a message, adding received gradients into the shard's); None: not
    counted (HBM does them in microseconds)."""
    host_gbps: float | None = None
    """GB/s that all the transfers running at once share, where the ranks share one host's cores (local CPU
    ranks: a transfer is a copy by the ranks' own threads), each transfer still at most its link's speed;
    None: every link carries its own (GPUs, whose copy engines and ports do not share)."""
    overlap_slowdown: float = 0.0
    """How much slower compute runs while transfers run beside it (0.05: 5%), what the overlapped runtime's
    model stretches a replica's compute by (``passes.plan.movement.MovementCost``)."""
    compute_slots: float | None = None
    """How many ranks of a node compute at full speed at once, where the node's ranks share a host's cores
    (local CPU ranks; measured by ``runtime.link_probe``); while more of them compute, each runs at this over
    their number of its speed, and replicas of one step slow each other (``passes.plan.host_sharing``). None:
    every rank computes on a device of its own (GPUs)."""

    def __post_init__(self) -> None:
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise PlanError(f"gpus_per_node must be a positive integer, got {self.gpus_per_node!r}")
        for name in ("intra_gbps", "inter_gbps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise PlanError(f"{name} must be a finite number > 0 (GB/s), got {value!r}")
        value = self.latency_us
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise PlanError(f"latency_us must be a finite number >= 0, got {value!r}")
        for name in ("fresh_gbps", "freed_gbps", "warm_gbps", "host_gbps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise PlanError(f"{name} must be None or a finite number > 0 (GB/s), got {value!r}")
        value = self.overlap_slowdown
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise PlanError(f"overlap_slowdown must be a finite number >= 0, got {value!r}")
        value = self.compute_slots
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise PlanError(f"compute_slots must be None or a finite number > 0, got {value!r}")

    def fresh_ms(self, nbytes: float) -> float:
        """Milliseconds to write ``nbytes`` of newly allocated memory (0 when not counted)."""
        return 0.0 if self.fresh_gbps is None else nbytes / (self.fresh_gbps * 1e6)

    def freed_ms(self, nbytes: float) -> float:
        """Milliseconds to free ``nbytes`` of buffers (0 when not counted)."""
        return 0.0 if self.freed_gbps is None else nbytes / (self.freed_gbps * 1e6)

    def warm_ms(self, nbytes: float) -> float:
        """Milliseconds to copy or add ``nbytes`` between buffers written before (0 when not counted)."""
        return 0.0 if self.warm_gbps is None else nbytes / (self.warm_gbps * 1e6)

    def message_ms(self, nbytes: float, same_node: bool, messages: int = 1) -> float:
        """Milliseconds to send ``nbytes`` in ``messages`` messages over the link between two ranks."""
        gbps = self.intra_gbps if same_node else self.inter_gbps
        return messages * self.latency_us * 1e-3 + nbytes / (gbps * 1e6)

    def to_dict(self) -> dict:
        """The JSON form (a profile's ``hardware`` entries)."""
        out = {"gpus_per_node": self.gpus_per_node, "intra_gbps": self.intra_gbps, "inter_gbps": self.inter_gbps,
               "latency_us": self.latency_us}
        for name in ("fresh_gbps", "freed_gbps", "warm_gbps", "host_gbps"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.overlap_slowdown:
            out["overlap_slowdown"] = self.overlap_slowdown
        return out


_HDR_GBPS = 200 / 8
"""One 200 Gb/s InfiniBand HDR port per GPU (DGX A100), GB/s one direction."""
_NDR_GBPS = 400 / 8
"""One 400 Gb/s InfiniBand NDR port per GPU (DGX H100/H200), GB/s one direction."""
_LATENCY_US = 10.0
"""A message's start-up (assumed: the order of a small NCCL transfer)."""
OVERLAP_SLOWDOWN = 0.05
"""Compute beside transfers (assumed, unmeasured: NCCL's point-to-point kernels hold a few of the GPU's SMs and a
share of its memory bandwidth while they run; ``python -m benchmarks.device_check`` part (e) times the
overlapped step on GPUs and probes the slowdown there, ``runtime.link_probe.overlap_slowdown``)."""

LINK_PRESETS: Mapping[str, Links] = MappingProxyType({
    "a100-40g": Links(gpus_per_node=8, intra_gbps=300.0, inter_gbps=_HDR_GBPS, latency_us=_LATENCY_US,
                      overlap_slowdown=OVERLAP_SLOWDOWN),
    "a100-80g": Links(gpus_per_node=8, intra_gbps=300.0, inter_gbps=_HDR_GBPS, latency_us=_LATENCY_US,
                      overlap_slowdown=OVERLAP_SLOWDOWN),
    "a800-80g": Links(gpus_per_node=8, intra_gbps=200.0, inter_gbps=_HDR_GBPS, latency_us=_LATENCY_US,
                      overlap_slowdown=OVERLAP_SLOWDOWN),
    "h100-80g": Links(gpus_per_node=8, intra_gbps=450.0, inter_gbps=_NDR_GBPS, latency_us=_LATENCY_US,
                      overlap_slowdown=OVERLAP_SLOWDOWN),
    "h200-141g": Links(gpus_per_node=8, intra_gbps=450.0, inter_gbps=_NDR_GBPS, latency_us=_LATENCY_US,
                      overlap_slowdown=OVERLAP_SLOWDOWN),
})
"""Per GPU preset: NVLink one direction (half the datasheets' bidirectional figure) inside a node of eight,
one InfiniBand port per GPU between nodes, compute 5% slower beside transfers (assumed)."""


def link_preset(name: str) -> Links:
    """The links of the GPU preset ``name``; an unknown name is a PlanError naming the presets."""
    if name not in LINK_PRESETS:
        raise PlanError(f"no link preset for hardware {name!r}; known: {', '.join(LINK_PRESETS)}")
    return LINK_PRESETS[name]
