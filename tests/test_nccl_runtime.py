"""Runtime lines that matter under NCCL, checked where they can be on the CPU: the movement stream (made once per
executor, high priority, the same object every step; none on the CPU), rank 0's streaming of the fixed layout
(batched point-to-point that pairs up, never a lone send or receive, batches bounded), replicated parameters
pushed once per TP group (every parameter equal to single-process SGD, fewer gradient bytes), and the
communicators ``runtime.distributed`` makes."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_ranks

from runtime.overlap import MOVEMENT_STREAM_PRIORITY, movement_stream

# -- 1. the movement stream -------------------------------------------------------------------------------------


def test_movement_stream_is_none_on_the_cpu_and_high_priority_on_a_gpu():
    made = []

    def factory(device, priority=0):
        made.append((device, priority))
        return ("stream", len(made))

    assert movement_stream("cpu", factory) is None and made == []
    assert movement_stream(torch.device("cuda", 3), factory) == ("stream", 1)
    assert made == [(torch.device("cuda", 3), MOVEMENT_STREAM_PRIORITY)] and MOVEMENT_STREAM_PRIORITY == -1
    with pytest.raises(ValueError, match="CUDA device or the CPU, got meta"):
        movement_stream("meta", factory)


def test_the_executor_hands_every_step_the_one_stream_it_made(monkeypatch):
    """A world of one with overlapped movement: ``movement_stream`` is asked once, at construction, and every
    step's movement (training and dry run) gets the one object it returned."""
    from staged_lm import StagedPrograms, init_params

    from passes.plan.ir import StepPlan, Strategy
    from passes.plan.placement import placed_replicas
    from runtime import executor as executor_module
    from runtime.distributed import DistContext
    from runtime.executor import Executor
    from runtime.fixed_layout import FixedLayout
    from runtime.overlap import WindowedMovement
    from runtime.topology import Cluster

    asked, given = [], []
    real_start = WindowedMovement.start
    kept = object()  # what a GPU's movement_stream would give (on the CPU the movement never uses it)

    def asking(device, factory=None):
        asked.append(torch.device(device))
        assert movement_stream(device, factory) is None  # the CPU has no streams
        return kept

    def start(self, *args, **kwargs):
        given.append(kwargs.get("stream", "missing"))
        return real_start(self, *args, **kwargs)

    monkeypatch.setattr(executor_module, "movement_stream", asking)
    monkeypatch.setattr(WindowedMovement, "start", start)
    ctx = DistContext(rank=0, world_size=1, dist_backend="gloo", device=torch.device("cpu"))
    layout = FixedLayout.from_tensors(init_params(0), 0, 1)
    ex = Executor(ctx, Cluster.local(1), layout, torch.optim.SGD([layout.shard], lr=0.1), overlap=True, windows=3)
    programs, g = StagedPrograms(), torch.Generator().manual_seed(1)
    strategy = Strategy.parse("1x(tp1)")
    for step, lens in enumerate(([9, 13], [5, 11, 7], [6])):
        batch = [torch.randint(0, 61, (n,), generator=g) for n in lens]
        replicas = placed_replicas(strategy, 1, micro_batches=(tuple((i,) for i in range(len(lens))),),
                                   max_tokens=(64,))
        plan = StepPlan(strategy=strategy, seq_lens=tuple(lens), replicas=replicas, est_step_ms=0.0,
                        lower_bound_ms=0.0, policy="test")
        ex.run_step(plan, batch, programs.program(plan, 0), dry_run=step == 2)
    assert asked == [torch.device("cpu")] and ex.movement_stream is kept
    assert len(given) == 3 and all(stream is kept for stream in given), given


# -- 2. rank 0's streaming of the fixed layout ------------------------------------------------------------------

STREAM_SHAPES = {"emb": (6, 4), "row": (4, 6), "bias": (5,), "col": (6, 3), "big": (40,)}
STREAM_DIMS = {"row": 1, "col": 0}


def _stream_values(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in STREAM_SHAPES.items()}


def _streamed(rank, world, chunk):
    """Stream a state dict from rank 0 and gather every parameter back, every point-to-point call recorded and
    the lone ones refused."""
    from p2p_order import P2PRecorder

    from runtime import distributed as comm
    from runtime.fixed_layout import FixedLayout

    def refused(*args, **kwargs):
        raise AssertionError("a lone send or receive: under NCCL a communicator of its own per pair")

    layout = FixedLayout(STREAM_SHAPES, rank, world, split_dims=STREAM_DIMS)
    gathered = {}
    with P2PRecorder() as rec:
        for name in ("send", "recv", "isend", "irecv"):
            setattr(comm, name, refused)  # the recorder puts the real ones back on leaving
        layout.stream_from_rank0(_stream_values(3) if rank == 0 else None, chunk_numel=chunk)
        streamed = len(rec.ops)
        for name in STREAM_SHAPES:
            gathered[name] = layout.gather_to_rank0(name, chunk_numel=chunk)
    return layout.shard.detach().clone(), gathered, rec.ops, streamed


@pytest.mark.parametrize("chunk", [4, 1 << 20])
def test_streaming_from_and_to_rank0_is_batched_paired_and_bounded(tmp_path, chunk):
    from p2p_order import p2p_problems

    from runtime.fixed_layout import FixedLayout

    world = 4
    results = run_ranks(world, tmp_path, _streamed, chunk)
    full = _stream_values(3)
    for rank, (shard, gathered, ops, _) in enumerate(results):
        want = FixedLayout.from_tensors(full, rank, world, split_dims=STREAM_DIMS).shard.detach()
        assert torch.equal(shard, want)
        if rank == 0:
            assert all(torch.equal(gathered[n], t) and gathered[n].is_contiguous() for n, t in full.items())
        else:
            assert all(v is None for v in gathered.values())
        assert all(op.group == "default" for op in ops)
        assert all((op.peer == 0) != (rank == 0) for op in ops)  # only rank 0 and the owners talk
        per_batch: dict[int, int] = {}
        for op in ops:
            per_batch[op.batch] = per_batch.get(op.batch, 0) + torch.Size(op.shape).numel()
        assert max(per_batch.values()) <= chunk
    assert p2p_problems([ops for _, _, ops, _ in results]) == []
    rank0_ops, streamed = results[0][2], results[0][3]
    sends = [op for op in rank0_ops[:streamed]]
    assert all(op.kind == "send" for op in sends) and all(op.kind == "recv" for op in rank0_ops[streamed:])
    batches = {op.batch for op in sends}
    if chunk > 100:  # one batch per parameter with parts on other owners, several owners in one batch
        assert len(batches) == len(STREAM_SHAPES)
        assert max(len({op.peer for op in sends if op.batch == b}) for b in batches) > 1
    else:
        assert len(batches) > len(STREAM_SHAPES)


def test_rank0_batches_cover_every_other_owner_once():
    from runtime.fixed_layout import FixedLayout

    for world in (1, 2, 3, 5):
        layout = FixedLayout(STREAM_SHAPES, 0, world, split_dims=STREAM_DIMS)
        for spec in layout.specs.values():
            for chunk in (1, 3, 7, 1000):
                batches = layout.rank0_batches(spec, chunk)
                assert all(sum(n for _, _, n, _ in b) <= chunk for b in batches)
                covered = sorted((at, n) for b in batches for _, at, n, _ in b)
                own = layout._own_part(spec)
                if own is not None:
                    covered = sorted(covered + [(own[0], own[1])])
                at = 0
                for a, n in covered:
                    assert a == at
                    at += n
                assert at == spec.numel
    with pytest.raises(ValueError, match="chunk_numel must be a positive integer, got 0"):
        FixedLayout(STREAM_SHAPES, 0, 2).rank0_batches(next(iter(FixedLayout(STREAM_SHAPES, 0, 2).specs.values())), 0)


# -- 3. replicated parameters pushed once per TP group ----------------------------------------------------------

ONCE_STEPS = [("2x(tp2)", [14, 22, 15, 23, 13, 20, 16, 24, 40, 30, 45]),
              ("1x(tp2,pp2)", [23, 14, 41, 15, 18, 13, 24, 35, 16, 21, 5]),
              ("regroup:2x(tp2)", [70, 40, 30, 14, 9, 22, 5, 16, 3, 11]),
              ("1x(tp4)", [60, 33, 12, 80, 9])]


def _push_bytes(move, rank: int, pushes: bool) -> int:
    """Bytes of fp32 gradients ``move`` sends to other owners: along its push ranges, or (``pushes`` False) along
    every range it computes with, as every TP rank pushed before."""
    from runtime.redistribute import total

    if pushes:
        return 4 * sum(total(part) for k, parts in enumerate(move.push_segments) if k != rank for part in parts)
    return 4 * sum(b - a for k, spans in enumerate(move.segments) if k != rank for a, b in spans)


def _once(rank, world, name, overlap, steps):
    """Train ``steps`` of model ``name`` on a trainer of its own; per step the loss, the gathered parameters and
    the gradient bytes this rank sent (measured, and from the movement plan with and without the rule)."""
    from p2p_order import P2PRecorder
    from test_equivalence import BUCKETS, CAP, _batch, _layout, _make, _regrouped_plan

    import hcompile
    from passes.plan.ir import Strategy

    out = []
    with P2PRecorder() as rec:
        trainer = hcompile.compile(_make(name, 11), buckets=BUCKETS).trainer(
            loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.3},
            strategies=sorted({_layout(s) for s, _ in steps}), tokens_per_rank=CAP, calibrate=False,
            overlap_movement=overlap)
        for strategy, lens in steps:
            batch = _batch(name, 11, lens)
            if strategy.startswith("regroup:"):
                stats = trainer.train_plan(_regrouped_plan(trainer, strategy, lens), batch)
            else:
                stats = trainer.train_step(batch, strategy=strategy)
            move = trainer.executor.redistribution_of(Strategy.parse(_layout(strategy)))
            out.append((stats.loss, trainer.full_state_dict(), stats.traffic.grads_sent,
                        _push_bytes(move, rank, True), _push_bytes(move, rank, False)))
    return out, rec.ops


@pytest.mark.parametrize("overlap", [False, True])
def test_replicated_parameters_pushed_once_per_tp_group_match_single_process_sgd(tmp_path, overlap):
    """GPT (its embedding tied to the head: partial gradients on the first and last pipeline stage) under
    2x(tp2), 1x(tp2,pp2), a regrouped 2x(tp2) and 1x(tp4): loss and every parameter as plain SGD after each
    step, the runtime's gradient bytes those of the plan, fewer than every TP rank pushing, and no more on TP
    rank 0 than before."""
    from p2p_order import p2p_problems
    from test_equivalence import _batch, _make, reference_sgd

    results = run_ranks(4, tmp_path, _once, "gpt", overlap, ONCE_STEPS, timeout_s=600)
    assert p2p_problems([ops for _, ops in results]) == []
    losses, states = reference_sgd(_make("gpt", 11), [_batch("gpt", 11, lens) for _, lens in ONCE_STEPS], 0.3)
    for step, (strategy, _) in enumerate(ONCE_STEPS):
        for rank, (out, _) in enumerate(results):
            loss, state, sent, planned, before = out[step]
            assert loss == pytest.approx(losses[step], rel=1e-5), (strategy, rank)
            for n, p in states[step].items():
                torch.testing.assert_close(state[n], p, rtol=1e-5, atol=1e-6, msg=f"{strategy} rank {rank} {n}")
            assert sent == planned <= before, (strategy, rank, sent, planned, before)
        assert sum(out[step][3] for out, _ in results) < sum(out[step][4] for out, _ in results), strategy


# -- 4. communicators -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("default", "sub"), [("cpu:gloo,cuda:nccl", "nccl"), ("cuda:nccl,cpu:gloo", "nccl"),
                                              ("nccl", None), ("gloo", None), ("cpu:gloo", None)])
def test_subgroups_on_gpus_are_nccl_alone_and_gloo_jobs_unchanged(default, sub):
    from runtime.distributed import subgroup_backend

    assert subgroup_backend(default) == sub


def test_the_default_group_is_bound_to_the_device_under_nccl_only():
    from runtime.distributed import init_options

    assert init_options("nccl", torch.device("cuda", 5)) == {"device_id": torch.device("cuda", 5)}
    assert init_options("gloo", torch.device("cpu")) == {}
    with pytest.raises(ValueError, match="CUDA device with an index, got cuda"):
        init_options("nccl", torch.device("cuda"))


def _groups(rank, world):
    import torch.distributed as dist

    from passes.plan.ir import Strategy
    from passes.plan.placement import placed_replicas
    from runtime import distributed as comm
    from runtime.distributed import GroupCache

    cache = GroupCache()
    replicas = placed_replicas(Strategy.parse("1x(tp2)+2x(tp1)"), world)
    cache.prepare(replicas)
    group = cache.get((0, 1))
    backends = dist.get_backend(group) if rank in (0, 1) else None
    total = comm.all_reduce(torch.ones(1), group=group) if rank in (0, 1) else None
    return str(dist.get_backend()), backends, None if total is None else float(total)


def test_subgroups_of_a_gloo_job_stay_gloo(tmp_path):
    results = run_ranks(4, tmp_path, _groups)
    assert [r[0] for r in results] == ["gloo"] * 4
    assert [r[1:] for r in results] == [("gloo", 2.0), ("gloo", 2.0), (None, None), (None, None)]
