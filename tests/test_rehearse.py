"""The rehearsal (``hcompile.rehearsal``, ``python -m benchmarks.rehearse``): a tiny LLaMA's ranks on fake worlds of
4 and 8, every kind of rank of the cost model rehearsed under fake tensors, its tracked bytes checked against
what the runtime's parts must hold, counted independently from the lowering's slices and the layout's shard."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist

from benchmarks import rehearse as cli
from hcompile.rehearsal import CATEGORIES, fake_world, rank_places, rehearse_rank, trainer_parts
from passes.graph.variant import TokenBuckets
from passes.plan.ir import ParallelScheme
from runtime import distributed as comm
from runtime.fixed_layout import FixedLayout

BUCKETS = TokenBuckets(sizes=(64, 128))
MEMORY = 300 * 2**20
"""Each rank's memory: the overlapped runtime's 256 MiB of movement buffers and a few MiB for the tiny model, so
that every scheme's cap reaches the largest bucket."""
FIELDS = ("scheme", "stage", "tp_rank", "cap_tokens", "bucket_tokens", "charged_bytes", "tracked_peak_bytes",
          "reserve_bytes", "wall_s", *(f"tracked_{c}_bytes" for c in CATEGORIES),
          *(f"charged_{c}_bytes" for c in ("parameters", "gradients", "optimizer", "activations", "buffers")))


@pytest.fixture(scope="module")
def parts4():
    return trainer_parts(cli.llama("tiny-llama"), 4, memory_bytes=MEMORY, buckets=BUCKETS)


@pytest.fixture(scope="module")
def parts8():
    return trainer_parts(cli.llama("tiny-llama"), 8, memory_bytes=MEMORY, buckets=BUCKETS)


@pytest.fixture(autouse=True)
def no_group_left():
    if dist.is_initialized():  # the world of one an in-process trainer of an earlier test made and kept
        assert dist.get_world_size() == 1, "a multi-rank process group is initialised in the test process"
        comm.shutdown()
    yield
    if dist.is_initialized():  # a failing test must not leave its fake world to the next one
        dist.destroy_process_group()
        pytest.fail("a process group was left initialised")


def _compute_copy_bytes(parts, scheme: ParallelScheme, stage: int, tp_rank: int) -> int:
    """The compute copy's bytes, from the lowering's slices (what the rank must hold in bf16)."""
    lowering = next(p for key, p in parts.lowerings._programs.items()
                    if key[:3] == (scheme, stage, tp_rank)).lowering
    return sum(math.prod(sl.local_shape) for sl in lowering.params) * 2


def test_every_kind_of_rank_on_a_world_of_4(parts4):
    places = rank_places(parts4)
    kinds = {(s.tp, s.pp) for s, _, _ in places}
    assert kinds == {(1, 1), (1, 2), (2, 1), (2, 2), (4, 1)}, kinds
    shard = FixedLayout(dict(parts4.shapes), 0, 4, "meta", dict(parts4.dims)).shard_numel
    for scheme, stage, tp_rank in places:
        r = rehearse_rank(parts4, scheme, stage, tp_rank)
        row = r.to_json()
        assert set(FIELDS) <= set(row), set(FIELDS) - set(row)
        assert row["bucket_tokens"] == 128 and row["micro_batches"] == scheme.pp - stage
        params = _compute_copy_bytes(parts4, scheme, stage, tp_rank)
        assert r.peak_by_category["parameters"] == params, (scheme, stage, tp_rank)
        # fp32 master + AdamW's two moments + fp32 shard gradient, and AdamW's step counter
        assert r.peak_by_category["optimizer"] == shard * 16 + 4
        assert r.peak_bytes > params + shard * 16
        assert r.peak_by_category["activations"] > 0
        assert 0 < r.held_after_forward_bytes <= r.peak_bytes
        assert sum(r.peak_by_category.values()) == r.peak_bytes
        assert row["charged_bytes"] > 0 and row["reserve_bytes"] > 0
    assert not dist.is_initialized()


def test_the_peak_grows_with_the_bucket(parts4):
    scheme = ParallelScheme(tp=1, pp=1)
    small, large = (rehearse_rank(parts4, scheme, 0, 0, bucket=b) for b in (64, 128))
    assert (small.tokens, large.tokens) == (64, 128)
    assert large.peak_by_category["activations"] > 1.8 * small.peak_by_category["activations"]
    assert large.peak_bytes > small.peak_bytes
    assert large.charge.activations == pytest.approx(2 * small.charge.activations)


def test_a_tp2_rank_holds_about_half_the_parameters_on_a_world_of_8(parts8):
    one = rehearse_rank(parts8, ParallelScheme(tp=1, pp=1), 0, 0)
    assert one.peak_by_category["parameters"] == pytest.approx(one.charge.parameters, rel=0.02)
    two = [rehearse_rank(parts8, ParallelScheme(tp=2, pp=1), 0, t) for t in (0, 1)]
    assert one.world == 8 and {r.rank for r in two} == {0, 1}
    for r in two:
        ratio = r.peak_by_category["parameters"] / one.peak_by_category["parameters"]
        assert 0.45 < ratio < 0.65, ratio  # the embedding and norms stay whole
        assert r.peak_by_category["parameters"] <= r.charge.parameters * 1.02  # the memory model never charges less
        assert r.peak_by_category["optimizer"] == one.peak_by_category["optimizer"]  # the layout's share: 1/world
    stage1 = rehearse_rank(parts8, ParallelScheme(tp=2, pp=2), 1, 1)
    assert stage1.rank == 3 and stage1.micro_batches == 1


def test_the_fake_world_is_the_whole_job_and_is_destroyed():
    with fake_world(5, 8):
        assert dist.get_world_size() == 8 and dist.get_rank() == 5
        with pytest.raises(RuntimeError, match="already initialised"):
            with fake_world(0, 8):
                pass
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"rank must be in \[0, 8\), got 8"):
        with fake_world(8, 8):
            pass
    assert not dist.is_initialized()


def test_bad_places_are_refused(parts4):
    with pytest.raises(ValueError, match=r"\(tp1,pp2\) has stages 0..1"):
        rehearse_rank(parts4, ParallelScheme(tp=1, pp=2), 2, 0)
    with pytest.raises(ValueError, match=r"not a scheme of the cost model"):
        rehearse_rank(parts4, ParallelScheme(tp=8, pp=1), 0, 0)


def test_the_command_line_prints_one_json_object_per_rank(capsys):
    code = cli.main(["--model", "tiny-llama", "--gpus", "4", "--max-bucket", "128", "--memory-gib", str(MEMORY / 2**30),
                     "--scheme", "(tp2,pp2)", "--json"])
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert [(r["scheme"], r["stage"], r["tp_rank"]) for r in rows] == [
        ("(tp2,pp2)", 0, 0), ("(tp2,pp2)", 0, 1), ("(tp2,pp2)", 1, 0), ("(tp2,pp2)", 1, 1)]
    for row in rows:
        assert set(FIELDS) <= set(row)
        assert row["tracked_peak_bytes"] > row["tracked_parameters_bytes"] > 0
    assert not dist.is_initialized()
    assert torch.is_grad_enabled()
