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
    stage = held.split_params / 8 + (layers - held.split_params) + held.embed_params + held.head_params
    states = held.params * RUNTIME.sharded_bytes / 64 + stage * RUNTIME.compute_bytes + RUNTIME.buffer_bytes
    assert rank_state_bytes(held, tp8, 64, RUNTIME) == pytest.approx(states)
    assert trainer.max_tokens(tp8) == scheme_cap(held, tp8, 64, RUNTIME, USABLE) == \
        int((USABLE - states) // (held.bytes_per_token / 8)) // 128 * 128 > 12288


def test_32b_is_accepted_with_the_strategies_the_planner_picks():
    _, trainer, _ = _caps("32b", 64)
    data = LengthDataset.from_lengths("long", [512] * 40 + [8000, 16000])
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
