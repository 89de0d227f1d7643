"""One memory model for the planner and the trainer (``passes.plan.memory``): LLaMA 7B, 13B and 32B built on the
meta device, on simulated 80 GB GPUs at 8 and 64 ranks. The caps the trainer derives (its default cost model
bounded by what each scheme's ranks hold) equal the analytic cost model's for every scheme, every rank holds
its own scheme's slice of the compute copy (not the whole model), 32B is accepted, a scheme whose ranks hold no
micro-batch leaves the pool instead of the model being refused, and the figures follow the formula by hand."""

from __future__ import annotations

import functools

import pytest
import torch

from hcompile.capture import capture
from hcompile.cost import ANALYSIS_TOKENS, default_cost_model
from hcompile.memory import MemoryCapError, bound_caps, model_memory
from hcompile.models import Llama, llama_preset
from passes.graph.analyze import analytic_cost_model, analyze_graph
from passes.graph.hardware import hardware_preset
from passes.graph.normalize import canonical_graph
from passes.plan.cost_model import hcompile_runtime
from passes.plan.datasets import LengthDataset
from passes.plan.ir import ParallelScheme
from passes.plan.memory import rank_state_bytes, scheme_cap
from passes.plan.policies import sized_homogeneous
from passes.plan.pool import build_pool

GIB = 2**30
USABLE = 80 * GIB * 0.9  # a simulated 80 GB GPU, as hcompile.memory.usable_memory counts it
RUNTIME = hcompile_runtime()  # bf16 compute copies, fp32 reduction, Adam


@functools.lru_cache(maxsize=None)
def _captured(preset: str):
    with torch.device("meta"):
        model = Llama(llama_preset(preset))
    ids = torch.zeros(1, ANALYSIS_TOKENS, dtype=torch.long, device="meta")
    return capture(model, ids, dtype=torch.bfloat16).graph_module  # as a GPU trainer captures it


def _caps(preset: str, world: int):
    """(the model as the memory model reads it, the trainer's caps or the MemoryCapError it raises, the
    planner's)."""
    graph = _captured(preset)
    held = model_memory(graph, ANALYSIS_TOKENS)
    a800 = hardware_preset("a800-80g")
    derived = default_cost_model(graph, preset, world, None, RUNTIME, memory=held, memory_bytes=USABLE, hardware=a800)
    planner = analytic_cost_model(analyze_graph(canonical_graph(graph)), a800, [e.scheme for e in derived.entries],
                                  world_size=world, runtime=RUNTIME, memory=held, memory_bytes=USABLE)
    try:
        trainer = bound_caps(derived, held, RUNTIME, USABLE, world, None)
    except MemoryCapError as exc:
        return held, exc, planner
    return held, trainer, planner


@pytest.mark.parametrize("preset", ["7b", pytest.param("13b", marks=[pytest.mark.slow]), "32b"])
@pytest.mark.parametrize("world", [8, 64])
def test_the_trainer_and_the_planner_cap_every_scheme_alike(preset, world):
    held, trainer, planner = _caps(preset, world)
    if (preset, world) == ("32b", 8):  # 32B x 16 bytes of master weights and Adam over 8 GPUs: 64 GB each
        assert isinstance(trainer, MemoryCapError) and "this model does not fit" in str(trainer)
        assert all(e.max_tokens == 0 for e in planner.entries)
        return
    assert {e.scheme: e.max_tokens for e in trainer.entries} == {e.scheme: e.max_tokens for e in planner.entries}
    cfg = llama_preset(preset)
    assert held.embed_params == held.head_params == cfg.vocab * cfg.hidden  # untied, replicated under TP
    assert held.split_params == cfg.layers * (4 * cfg.hidden ** 2 + 3 * cfg.hidden * cfg.ffn_hidden)
    assert max(e.max_tokens for e in trainer.entries) > 0  # accepted: some scheme holds a micro-batch


def test_each_rank_holds_its_own_slice():
    """32B on 64 GPUs: tp1 would hold the whole compute copy (128 GB) and leaves the pool; tp8's ranks hold an
    eighth of the layers, and its cap follows the formula by hand."""
    held, trainer, _ = _caps("32b", 64)
    assert trainer.max_tokens(ParallelScheme(tp=1)) == 0 and ParallelScheme(tp=1) not in trainer.schemes
    tp8 = ParallelScheme(tp=8)
    layers = held.params - held.embed_params - held.head_params
    # the vocab-parallel head and embedding (on by default) are split by vocabulary too
    assert held.edges_split
    stage = held.split_params / 8 + (layers - held.split_params) + (held.embed_params + held.head_params) / 8
    # the compute copy, its fp32 accumulation buffer and the bf16 gradients one of its 4 pieces hands out at once
    states = (held.params * RUNTIME.sharded_bytes / 64 + stage * (RUNTIME.compute_bytes + RUNTIME.param_bytes / 4)
              + RUNTIME.buffer_bytes)
    assert rank_state_bytes(held, tp8, 64, RUNTIME) == pytest.approx(states)
    # without sequence parallelism the values outside the TP regions stay whole on all 8 ranks
    per_token = (held.bytes_per_token - held.whole_bytes_per_token) / 8 + held.whole_bytes_per_token \
        + held.attention_working_bytes_per_token / 8
    assert held.per_token(tp8) == pytest.approx(per_token)
    assert trainer.max_tokens(tp8) == scheme_cap(held, tp8, 64, RUNTIME, USABLE) == \
        int((USABLE - states) // held.per_token(tp8)) // 128 * 128 > 4096


def test_32b_is_accepted_with_the_strategies_the_planner_picks():
    _, trainer, _ = _caps("32b", 64)
    data = LengthDataset.from_lengths("long", [512] * 40 + [4000, 7000])
    fixed = sized_homogeneous(trainer, 64, data.max_len)
    pool = build_pool(trainer, 64, data, sum(data.lengths[:20]), fixed)
    for strategy in [*pool, fixed]:
        assert strategy.gpus == 64 and all(trainer.max_tokens(s) > 0 for s in strategy.schemes), strategy


def test_a_cap_no_scheme_holds_is_refused_with_the_figures():
    held, trainer, _ = _caps("7b", 8)
    best = max(e.max_tokens // e.scheme.tp for e in trainer.entries)
    with pytest.raises(MemoryCapError, match=f"tokens_per_rank={best + 1} is more than this machine holds: about "
                                             f"{best} tokens fit .* pass tokens_per_rank <= {best}"):
        bound_caps(trainer, held, RUNTIME, USABLE, 8, best + 1)
    with pytest.raises(MemoryCapError, match="this model does not fit"):
        bound_caps(trainer, held, RUNTIME, 10 * GIB, 8, None)


def test_overlapped_movement_charges_its_bound_and_7b_still_fits():
    """Overlapped movement's buffers are the progress thread's bound (256 MiB by default) or one unit (a window's
    messages with one peer, each way), not every window at once (the shard served to every replica both ways,
    about 42 GB a rank for 7B on 8 GPUs): 7B on 8 GPUs keeps every scheme, each cap lower by at most the
    buffers' tokens."""
    from hcompile.memory import trainer_runtime
    from runtime.overlap import DEFAULT_INFLIGHT_BYTES
    from runtime.redistribute import DEFAULT_CHUNK_NUMEL

    plain = trainer_runtime(torch.bfloat16, torch.float32, torch.float32, DEFAULT_CHUNK_NUMEL)
    window = 4096 * 32000  # LLaMA 7B's largest window: its embedding, one parameter
    overlapped = trainer_runtime(torch.bfloat16, torch.float32, torch.float32, DEFAULT_CHUNK_NUMEL,
                                 DEFAULT_INFLIGHT_BYTES, window)
    assert plain == RUNTIME and DEFAULT_INFLIGHT_BYTES == 256 * 2**20
    assert overlapped.buffer_bytes == 2 * window * 4  # one unit each way in fp32 (1.05 GB), more than the bound
    assert trainer_runtime(torch.bfloat16, torch.float32, torch.float32, DEFAULT_CHUNK_NUMEL, DEFAULT_INFLIGHT_BYTES,
                           1 << 20).buffer_bytes == DEFAULT_INFLIGHT_BYTES
    graph = _captured("7b")
    held = model_memory(graph, ANALYSIS_TOKENS)
    a800 = hardware_preset("a800-80g")
    caps = {}
    for runtime in (plain, overlapped):
        derived = default_cost_model(graph, "7b", 8, None, runtime, memory=held, memory_bytes=USABLE, hardware=a800)
        caps[runtime] = {e.scheme: e.max_tokens for e in bound_caps(derived, held, runtime, USABLE, 8, None).entries}
    assert caps[plain].keys() == caps[overlapped].keys()
    for scheme, cap in caps[plain].items():
        bound_tokens = (overlapped.buffer_bytes - plain.buffer_bytes) / held.per_token(scheme)
        assert cap - bound_tokens - 128 <= caps[overlapped][scheme] <= cap, scheme


def _small_memory(**extra):
    from passes.plan.memory import ModelMemory
    return ModelMemory(params=1000, split_params=600, embed_params=100, head_params=100, bytes_per_token=64.0,
                       **extra)


def test_the_charge_by_category_follows_the_formula_by_hand():
    """tp2 x pp2 on 8 ranks, a stage cut into 4 pieces, 256 tokens: each category by hand."""
    from passes.plan.memory import rank_charge

    memory = _small_memory(whole_bytes_per_token=16.0, kv_bytes_per_token=8.0, attention_working_bytes_per_token=4.0)
    scheme = ParallelScheme(tp=2, pp=2, cp=2)
    stage = (600 / 2 + 200) / 2 + 100  # a pp-th of the layers (split ones halved), the larger edge
    charge = rank_charge(memory, scheme, 8, RUNTIME, 256, reserve=1e6)  # 4 pieces, as the trainer cuts stages
    assert charge.parameters == stage * 2  # bf16 compute copy
    assert charge.gradients == stage * 4 + stage / 4 * 2  # fp32 accumulation buffer, a piece's bf16 gradients
    assert charge.optimizer == 1000 * RUNTIME.sharded_bytes / 8
    per_token = ((64 - 16) / 2 + 16) / 2 + (8 * (2 - 1) + 4) / (2 * 2)  # SP split, gathered K/V, attention bwd
    assert memory.per_token(scheme) == per_token and charge.activations == 256 * per_token
    assert charge.buffers == RUNTIME.buffer_bytes and charge.reserve == 1e6
    # the optimiser's step runs after the backward: the larger of it and the activations is charged
    assert charge.optimizer_step == 1000 * RUNTIME.step_bytes / 8 < charge.activations
    assert charge.total == charge.tracked + 1e6 == pytest.approx(sum(
        v for k, v in charge.as_dict().items() if k not in ("tracked", "total", "optimizer_step")))
    tiny = rank_charge(memory, scheme, 8, RUNTIME, 1)
    assert tiny.tracked == pytest.approx(tiny.parameters + tiny.gradients + tiny.optimizer + tiny.buffers
                                         + tiny.optimizer_step)
    # without tensor parallelism nothing is "whole" beside a split: the tp1 figure is the model's own
    assert memory.per_token(ParallelScheme()) == 64 + 4


def test_the_device_reserve_and_its_refusals():
    from passes.plan.ir import PlanError
    from passes.plan.memory import (
        CONTEXT_RESERVE_BYTES,
        FRAGMENTATION,
        NCCL_COMMUNICATOR_BYTES,
        NCCL_P2P_PEER_BYTES,
        device_reserve_bytes,
    )

    gpu = 80 * GIB
    assert device_reserve_bytes(gpu, 6, 63) == pytest.approx(
        CONTEXT_RESERVE_BYTES + 6 * NCCL_COMMUNICATOR_BYTES + 63 * NCCL_P2P_PEER_BYTES + FRAGMENTATION * gpu)
    assert device_reserve_bytes(gpu, 6, 1023) - device_reserve_bytes(gpu, 6, 63) == 960 * NCCL_P2P_PEER_BYTES
    for bad in (-1, 1.5, True):
        with pytest.raises(PlanError, match="communicators must be an integer >= 0"):
            device_reserve_bytes(gpu, bad, 0)
    with pytest.raises(PlanError, match="whole_bytes_per_token .* is more than bytes_per_token"):
        _small_memory(whole_bytes_per_token=65.0)


def test_caps_between_buckets_become_buckets():
    """A micro-batch runs, and allocates, at its bucket: a cap of 1100 tokens would run in the 2048 bucket
    (1.86x what was charged). A cap of 1500 becomes a bucket of 1472 (a multiple of the smallest bucket) and the
    cap is lowered to it; a cap on a bucket, or a CP scheme's share on one, is left alone."""
    from hcompile.train import buckets_cut_to_caps
    from passes.graph.variant import TokenBuckets
    from passes.plan.ir import CostModel, SchemeCost

    buckets = TokenBuckets.powers_of_two(64, 4096)
    entries = (SchemeCost(scheme=ParallelScheme(), a=0, b=1, c=0, max_tokens=1500),
               SchemeCost(scheme=ParallelScheme(tp=2), a=0, b=1, c=0, max_tokens=2048),
               SchemeCost(scheme=ParallelScheme(cp=2), a=0, b=1, c=0, max_tokens=2 * 2944))
    model, cut = buckets_cut_to_caps(CostModel(name="m", entries=entries), buckets)
    assert cut.sizes == (64, 128, 256, 512, 1024, 1472, 2048, 2944, 4096)
    assert [e.max_tokens for e in model.entries] == [1472, 2048, 2 * 2944]
    assert all(cut.bucket_for(e.max_tokens // e.scheme.cp) == e.max_tokens // e.scheme.cp for e in model.entries)
    same, kept = buckets_cut_to_caps(CostModel(name="m", entries=entries[1:2]), buckets)
    assert kept is buckets and same.entries == entries[1:2]
    # only the memory model's caps: a cap the user set (the first scheme's) runs in its bucket
    model, cut = buckets_cut_to_caps(CostModel(name="m", entries=entries), buckets, {ParallelScheme(cp=2)})
    assert cut.sizes == (64, 128, 256, 512, 1024, 2048, 2944, 4096)
    assert [e.max_tokens for e in model.entries] == [1500, 2048, 2 * 2944]
    # small buckets: multiples of the smallest one
    small, cut = buckets_cut_to_caps(CostModel(name="m", entries=entries[:1]), TokenBuckets.powers_of_two(16, 4096))
    assert small.entries[0].max_tokens == 1488 and 1488 in cut.sizes


def test_the_step_is_measured_on_fake_tensors_linear_in_the_tokens():
    """The memory model's bytes per token are those of the lowered step run on fake tensors (forward, loss,
    backward): the same slope from captures on 64/128 tokens as the peak's growth from 512 to 1024 tokens, below
    the static upper estimate, and of it, under sequence parallelism, every layer's two gathered inputs (the
    attention's and the MLP's) kept whole."""
    from hcompile.memory import _fake_step_peak, measured_bytes_per_token
    from hcompile.models import LlamaConfig

    cfg = LlamaConfig(vocab=500, layers=2, hidden=128, ffn_hidden=344, heads=4, kv_heads=2)
    with torch.device("meta"):
        model = Llama(cfg)

    def captured(tokens):
        return capture(model, torch.zeros(1, tokens, dtype=torch.long, device="meta"),
                       dtype=torch.bfloat16).graph_module

    slope = measured_bytes_per_token(captured(64), 64, captured(128))
    big = (_fake_step_peak(captured(1024), 1024)[0] - _fake_step_peak(captured(512), 512)[0]) / 512
    assert slope == pytest.approx(big, rel=1e-3)
    held = model_memory(captured(64), 64, measure=True, twice=captured(128), sequence_parallel=True)
    assert held.bytes_per_token == pytest.approx(slope)
    assert held.bytes_per_token < model_memory(captured(64), 64).bytes_per_token  # the static upper estimate
    assert held.whole_bytes_per_token == 2 * 2 * 128 * 2  # layers x (qkv, gate/up inputs) x hidden x bf16
    assert held.kv_bytes_per_token == 2 * 2 * 2 * 32 * 2  # layers x (k, v) x kv heads x head dim x bf16
    replicated = model_memory(captured(64), 64, measure=True, twice=captured(128), vocab_parallel=False,
                              sequence_parallel=True)
    assert replicated.whole_bytes_per_token == held.whole_bytes_per_token + 500 * (3 * 4 + 2)
    # without sequence parallelism (today's lowering) the residual stream, the norms and every projection's input
    # are whole on every TP rank: more than the gathered inputs, less than everything
    plain = model_memory(captured(64), 64, measure=True, twice=captured(128))
    assert held.whole_bytes_per_token < plain.whole_bytes_per_token < plain.bytes_per_token


def test_expandable_segments_are_asked_for_on_gpus_only_where_the_user_set_nothing(monkeypatch):
    from hcompile.memory import ALLOC_CONF, prefer_expandable_segments

    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.delenv(ALLOC_CONF, raising=False)
    assert not prefer_expandable_segments(torch.device("cpu")) and calls == []
    assert prefer_expandable_segments(torch.device("cuda", 0)) and calls == ["expandable_segments:True"]
    monkeypatch.setenv(ALLOC_CONF, "max_split_size_mb:128")
    assert not prefer_expandable_segments(torch.device("cuda", 0)) and len(calls) == 1
