"""GPU presets of the analytic cost model, and which preset a CUDA device is.

Owns :data:`GPU_PRESETS` (NVIDIA A100 40 GB and 80 GB, A800 80 GB, H100 80 GB, H200 141 GB, all SXM, as
:class:`passes.graph.analyze.Hardware`), :func:`hardware_preset` (a preset by name) and
:func:`hardware_for_device` (the preset of a ``torch.cuda.get_device_name()`` string). A device without a preset
is a ``ValueError`` that names it and the presets: a GPU is never planned with another device's model (nor the
CPU's) by default. PCIe and NVL boards, the H800 and the GH200 have other bandwidths and are refused.

Per GPU, from NVIDIA's datasheets (dense bf16 Tensor Core peak: the datasheets' bf16 figure is with 2:4
sparsity for Hopper, twice the dense one; NVLink: the datasheets' bidirectional total, ``link_gbps`` is half
of it, one direction):

| preset | bf16 dense TFLOP/s | HBM GB/s | memory | NVLink GB/s | datasheet |
|---|---|---|---|---|---|
| ``a100-40g`` | 312 | 1555 (HBM2) | 40 GB | 600 | NVIDIA A100 Tensor Core GPU datasheet (A100 SXM) |
| ``a100-80g`` | 312 | 2039 (HBM2e) | 80 GB | 600 | same |
| ``a800-80g`` | 312 | 2039 (HBM2e) | 80 GB | 400 | NVIDIA A800 product brief (an A100 80GB SXM, NVLink 400) |
| ``h100-80g`` | 989 (1979 sparse) | 3350 (HBM3) | 80 GB | 900 | NVIDIA H100 Tensor Core GPU datasheet (H100 SXM) |
| ``h200-141g`` | 989 (1979 sparse) | 4800 (HBM3e) | 141 GB | 900 | NVIDIA H200 Tensor Core GPU datasheet (H200 SXM) |

``memory_gib`` is what the driver reports (nvidia-smi: 40960, 81920, 81559 and 143771 MiB), not the marketed GB.

The links (NVLink, network, GPUs per node, latency) are ``passes.plan.links.LINK_PRESETS``, which the planner
reads without torch. Assumed, not datasheet figures: the network is one InfiniBand port per GPU as NVIDIA's DGX
systems have it (DGX A100: eight 200 Gb/s HDR ConnectX-6, so 25 GB/s per GPU one way; DGX H100 and DGX H200:
eight 400 Gb/s NDR ConnectX-7, 50 GB/s); eight GPUs per node (HGX/DGX boards); a collective's start-up latency
of 10 us (the order of a small NCCL all-reduce over NVLink). Efficiencies, activation bytes and the per-layer
fixed cost are the :class:`~passes.graph.analyze.Hardware` defaults, fitted against the measured A800 profiles.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from passes.graph.analyze import Hardware
from passes.plan.links import link_preset

__all__ = ["GPU_PRESETS", "DEVICE_NAMES", "hardware_preset", "hardware_for_device"]


def _gpu(name: str, *, peak_tflops: float, hbm_gbps: float, memory_mib: int) -> Hardware:
    """A preset from datasheet figures (memory in MiB as reported) and the links of ``passes.plan.links``."""
    links = link_preset(name)
    return Hardware(name=name, peak_tflops=peak_tflops, hbm_gbps=hbm_gbps, memory_gib=memory_mib / 1024,
                    link_gbps=links.intra_gbps, network_gbps=links.inter_gbps, latency_us=links.latency_us,
                    gpus_per_node=links.gpus_per_node)


GPU_PRESETS: Mapping[str, Hardware] = MappingProxyType({
    "a100-40g": _gpu("a100-40g", peak_tflops=312.0, hbm_gbps=1555.0, memory_mib=40960),
    "a100-80g": _gpu("a100-80g", peak_tflops=312.0, hbm_gbps=2039.0, memory_mib=81920),
    "a800-80g": _gpu("a800-80g", peak_tflops=312.0, hbm_gbps=2039.0, memory_mib=81920),
    "h100-80g": _gpu("h100-80g", peak_tflops=989.0, hbm_gbps=3350.0, memory_mib=81559),
    "h200-141g": _gpu("h200-141g", peak_tflops=989.0, hbm_gbps=4800.0, memory_mib=143771),
})
"""The GPU presets by name (see the module docstring for the figures and their sources)."""


def _normal(device_name: str) -> str:
    """A device name without case, repeated spaces or the vendor prefix (``NVIDIA A100-SXM4-80GB``:
    ``a100-sxm4-80gb``)."""
    text = " ".join(str(device_name).split()).casefold()
    return text.removeprefix("nvidia ")


DEVICE_NAMES: Mapping[str, str] = MappingProxyType({
    "NVIDIA A100-SXM4-40GB": "a100-40g",
    "NVIDIA A100-SXM4-80GB": "a100-80g",
    "NVIDIA A100-SXM-80GB": "a100-80g",  # HGX A100 boards of some vendors
    "NVIDIA A800-SXM4-80GB": "a800-80g",
    "NVIDIA H100 80GB HBM3": "h100-80g",  # the SXM5 board; the PCIe one is "NVIDIA H100 PCIe"
    "NVIDIA H200": "h200-141g",  # the SXM board; "NVIDIA H200 NVL" is the PCIe one
})
"""``torch.cuda.get_device_name()`` strings -> preset names; matched without case, repeated spaces or the
``NVIDIA`` prefix, and otherwise exactly (an ``H100 PCIe`` must not pass for an SXM H100)."""

_BY_NORMAL_NAME = {_normal(device): preset for device, preset in DEVICE_NAMES.items()}


def hardware_preset(name: str) -> Hardware:
    """The preset called ``name`` (``a100-40g``, ``a100-80g``, ``a800-80g``, ``h100-80g``, ``h200-141g``)."""
    if name not in GPU_PRESETS:
        raise ValueError(f"unknown hardware preset {name!r}; known: {', '.join(GPU_PRESETS)}")
    return GPU_PRESETS[name]


def hardware_for_device(device_name: str) -> Hardware:
    """The preset of a CUDA device, by its ``torch.cuda.get_device_name()``; a device without one is a
    ``ValueError`` naming it, the presets and the device names they cover."""
    preset = _BY_NORMAL_NAME.get(_normal(device_name))
    if preset is None:
        covered = ", ".join(f"{device!r} ({preset})" for device, preset in DEVICE_NAMES.items())
        raise ValueError(f"no hardware preset for the GPU {device_name!r}: the presets {', '.join(GPU_PRESETS)} "
                         f"cover {covered}; pass a cost model measured on this GPU (hcompile profile) or add a "
                         f"preset to passes/graph/hardware.py")
    return GPU_PRESETS[preset]
