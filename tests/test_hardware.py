"""GPU hardware presets: every preset is a valid Hardware with its datasheet figures, CUDA device names map to
their preset (and nothing else does), and the analytic cost model ranks the GPUs as their figures say."""

import dataclasses
import functools
import math

import pytest
import torch

from hcompile.capture import capture
from hcompile.models import Llama, LlamaConfig
from passes.graph.analyze import Hardware, analytic_cost_model, analyze_graph
from passes.graph.hardware import DEVICE_NAMES, GPU_PRESETS, hardware_for_device, hardware_preset
from passes.plan.ir import ParallelScheme

SCHEMES = [ParallelScheme(tp=1), ParallelScheme(tp=2), ParallelScheme(tp=4), ParallelScheme(tp=2, pp=2)]


@pytest.mark.parametrize("name", list(GPU_PRESETS))
def test_every_preset_validates_and_carries_its_figures(name):
    hw = hardware_preset(name)
    assert hw.name == name and dataclasses.replace(hw) == hw  # replace runs the validation again
    for field in ("peak_tflops", "memory_gib", "link_gbps", "network_gbps", "hbm_gbps", "latency_us"):
        value = getattr(hw, field)
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, field)
    marketed = float(name.split("-")[-1].rstrip("g"))  # a100-40g: 40, h200-141g: 141
    assert abs(hw.memory_gib / marketed - 1) < 0.01
    assert hw.network_gbps < hw.link_gbps < hw.hbm_gbps and hw.gpus_per_node == 8


def test_preset_figures_are_the_datasheets():
    figures = {name: (hw.peak_tflops, hw.hbm_gbps, 2 * hw.link_gbps) for name, hw in GPU_PRESETS.items()}
    assert figures == {"a100-40g": (312.0, 1555.0, 600.0), "a100-80g": (312.0, 2039.0, 600.0),
                       "a800-80g": (312.0, 2039.0, 400.0), "h100-80g": (989.0, 3350.0, 900.0),
                       "h200-141g": (989.0, 4800.0, 900.0)}


def test_a800_classmethod_is_the_preset_with_its_earlier_figures():
    hw = Hardware.a800()
    assert hw == hardware_preset("a800-80g")
    assert (hw.name, hw.peak_tflops, hw.memory_gib, hw.link_gbps) == ("a800-80g", 312.0, 80.0, 200.0)


@pytest.mark.parametrize("device, preset", [
    ("NVIDIA A100-SXM4-40GB", "a100-40g"),
    ("NVIDIA A100-SXM4-80GB", "a100-80g"),
    ("NVIDIA A100-SXM-80GB", "a100-80g"),
    ("NVIDIA A800-SXM4-80GB", "a800-80g"),
    ("NVIDIA H100 80GB HBM3", "h100-80g"),
    ("NVIDIA H200", "h200-141g"),
    ("nvidia  h100 80gb hbm3 ", "h100-80g"),  # case and spaces do not matter
    ("A100-SXM4-80GB", "a100-80g"),  # nor the vendor prefix
])
def test_device_names_map_to_their_preset(device, preset):
    assert hardware_for_device(device) is GPU_PRESETS[preset]


def test_every_listed_device_name_maps():
    assert {hardware_for_device(device).name for device in DEVICE_NAMES} == set(GPU_PRESETS)


@pytest.mark.parametrize("device", [
    "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe", "NVIDIA H200 NVL",
    "NVIDIA H800", "NVIDIA GH200 480GB", "NVIDIA A800 80GB PCIe", "NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-32GB",
    "cpu", "",
])
def test_a_device_without_a_preset_is_refused_by_name(device):
    with pytest.raises(ValueError) as info:
        hardware_for_device(device)
    message = str(info.value)
    assert repr(device) in message and all(name in message for name in GPU_PRESETS)


def test_an_unknown_preset_name_is_refused():
    with pytest.raises(ValueError, match="unknown hardware preset 'h100'; known: a100-40g"):
        hardware_preset("h100")


@pytest.mark.parametrize("field, value", [("hbm_gbps", 0.0), ("network_gbps", -1.0), ("latency_us", -1.0),
                                          ("latency_us", math.inf)])
def test_new_fields_are_validated(field, value):
    with pytest.raises(ValueError, match=field):
        Hardware(name="x", peak_tflops=100.0, **{field: value})


@functools.lru_cache(maxsize=None)
def _analysis():
    with torch.device("meta"):
        model = Llama(LlamaConfig(layers=2, hidden=256, ffn_hidden=512, heads=8, kv_heads=4, vocab=1024))
    return analyze_graph(capture(model, torch.zeros(1, 8, dtype=torch.long, device="meta")).graph_module)


def _times(hw: Hardware, seq_lens=(2048, 512, 64)) -> dict[ParallelScheme, float]:
    model = analytic_cost_model(_analysis(), hw, SCHEMES)
    return {s: model.micro_batch_ms(s, list(seq_lens)) for s in SCHEMES}


def test_h100_plans_faster_than_a100_and_h200_at_least_as_fast():
    a100, h100, h200 = (_times(hardware_preset(n)) for n in ("a100-80g", "h100-80g", "h200-141g"))
    for scheme in SCHEMES:
        assert h100[scheme] < a100[scheme], scheme
        assert h200[scheme] < h100[scheme], scheme  # the same peak, faster memory


def test_a800_costs_what_an_a100_does_until_tensor_parallelism_talks():
    a100, a800 = _times(hardware_preset("a100-80g")), _times(hardware_preset("a800-80g"))
    assert a800[ParallelScheme(tp=1)] == pytest.approx(a100[ParallelScheme(tp=1)], rel=1e-12)
    for scheme in SCHEMES[1:]:
        assert a800[scheme] > a100[scheme], scheme  # NVLink 400 GB/s against 600


def test_tensor_parallelism_wider_than_a_node_uses_the_network():
    inside = hardware_preset("h100-80g")
    across = dataclasses.replace(inside, gpus_per_node=2)
    tp4, tp2 = ParallelScheme(tp=4), ParallelScheme(tp=2)
    model_in, model_across = (analytic_cost_model(_analysis(), hw, SCHEMES) for hw in (inside, across))
    assert model_across.cost(tp4).b > model_in.cost(tp4).b
    assert model_across.cost(tp2).b == model_in.cost(tp2).b


def test_memory_bandwidth_and_latency_are_charged_only_when_given():
    base = Hardware(name="x", peak_tflops=312.0)
    with_hbm = dataclasses.replace(base, hbm_gbps=1000.0)
    with_latency = dataclasses.replace(base, latency_us=10.0)
    costs = {hw: analytic_cost_model(_analysis(), hw, SCHEMES) for hw in (base, with_hbm, with_latency)}
    for scheme in SCHEMES:
        assert costs[with_hbm].cost(scheme).b > costs[base].cost(scheme).b
        latency_ms = costs[with_latency].cost(scheme).c - costs[base].cost(scheme).c
        messages = (4 * 2 / scheme.pp if scheme.tp > 1 else 0) + (2 if scheme.pp > 1 else 0)  # 2 layers
        assert latency_ms == pytest.approx(messages * 10.0 / 1e3)
