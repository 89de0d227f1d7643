"""Point-to-point order as NCCL needs it (``tests/p2p_order.py``): the matching rule against hand-made orders,
the 1F1B pipeline's batches (``runtime.pipeline``) for every pp and micro-batch count, the old pipeline order
deadlocking and the new one completing on gloo ranks whose sends wait for their receives, and (``make
test-full``) recorded runs of every strategy the equivalence tests draw, with and without overlapped movement.
The default tier checks recorded runs inside the equivalence, CP-equivalence and executor tests' own jobs."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_ranks
from p2p_order import P2POp, p2p_problems

from runtime.pipeline import gap_messages, one_f_one_b


def _op(kind, peer, batch, shape=(4, 8), group="default"):
    return P2POp(kind, peer, tuple(shape), "torch.float32", group, batch)


def _old_order(pp: int, v: int) -> list[list[P2POp]]:
    """The pipeline before: each activation sent with ``isend`` after its forward, each gradient received with a
    blocking ``recv`` before its backward (and sent back with ``isend``), every call a batch of its own."""
    ranks = []
    for stage in range(pp):
        ops: list[P2POp] = []
        for op, i in one_f_one_b(pp, stage, v):
            shape = (i + 1, 8)
            if op == "F":
                if stage > 0:
                    ops.append(_op("recv", stage - 1, len(ops), shape))
                if stage < pp - 1:
                    ops.append(_op("send", stage + 1, len(ops), shape))
            else:
                if stage < pp - 1:
                    ops.append(_op("recv", stage + 1, len(ops), shape))
                if stage > 0:
                    ops.append(_op("send", stage - 1, len(ops), shape))
        ranks.append(ops)
    return ranks


def _batched_order(pp: int, v: int) -> list[list[P2POp]]:
    """The pipeline now (``runtime.pipeline.gap_messages``), stage s on rank s, micro-batch i's activations
    (i + 1, 8) so that a message paired with another micro-batch's shows."""
    ranks = []
    for stage in range(pp):
        ops: list[P2POp] = []
        batch = 0
        for gap in gap_messages(pp, stage, v):
            for sends, recvs in gap:
                for kind, messages in (("send", sends), ("recv", recvs)):
                    ops += [_op(kind, stage + m.peer, batch, (m.micro + 1, 8)) for m in messages]
                batch += bool(sends or recvs)
        ranks.append(ops)
    return ranks


def test_the_rule_finds_the_old_pipeline_deadlock_and_passes_paired_batches():
    problems = p2p_problems(_old_order(2, 2))
    assert len(problems) == 1 and "wait for each other forever" in problems[0], problems
    assert "rank 0 waits in its batch 1 (send->1 [2, 8] float32)" in problems[0]
    assert p2p_problems(_old_order(2, 1)) == []  # one micro-batch: nothing to cross
    assert p2p_problems(_batched_order(2, 2)) == []
    # two ranks that each send first and receive second in one batch do not wait; as lone calls they would
    together = [[_op("send", 1, 0), _op("recv", 1, 0)], [_op("send", 0, 0), _op("recv", 0, 0)]]
    assert p2p_problems(together) == []
    apart = [[_op("send", 1, 0), _op("recv", 1, 1)], [_op("send", 0, 0), _op("recv", 0, 1)]]
    assert "forever" in p2p_problems(apart)[0]
    # different groups are different communicators: the same order on two groups does not wait
    groups = [[_op("send", 1, 0, group="a"), _op("recv", 1, 1, group="b")],
              [_op("send", 0, 0, group="b"), _op("recv", 0, 1, group="a")]]
    assert p2p_problems(groups) == []


def test_the_rule_names_messages_that_do_not_pair():
    shapes = [[_op("send", 1, 0, (4, 8))], [_op("recv", 0, 0, (8, 4))]]
    assert p2p_problems(shapes) == ["group default: message 0 from rank 0 to rank 1: rank 0 sends send->1 [4, 8] "
                                    "float32 (its batch 0), rank 1 receives recv<-0 [8, 4] float32 (its batch 0)"]
    counts = [[_op("send", 1, 0), _op("send", 1, 1)], [_op("recv", 0, 0)]]
    assert p2p_problems(counts) == ["group default: rank 0 sends 2 messages to rank 1, which receives 1 from it"]
    one_sided = [[], [_op("recv", 0, 0)]]
    assert p2p_problems(one_sided) == ["group default: rank 0 sends 0 messages to rank 1, which receives 1 from it"]
    split = [[_op("send", 1, 0), _op("send", 1, 0)], [_op("recv", 0, 0), _op("recv", 0, 1)]]
    assert p2p_problems(split) == ["group default: rank 0's batch 0 exchanges messages with batches [0, 1] of rank "
                                   "1: batches must pair up one to one"]


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_every_1f1b_schedule_pairs_its_batches(pp):
    for v in range(1, 10):
        assert p2p_problems(_batched_order(pp, v)) == [], (pp, v)
        if v >= 2:  # the old order deadlocks as soon as two micro-batches cross
            assert p2p_problems(_old_order(pp, v)), (pp, v)
        for stage in range(pp):
            order = one_f_one_b(pp, stage, v)
            assert sorted(order) == sorted([("F", i) for i in range(v)] + [("B", i) for i in range(v)])
            assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(v))


def _emulated(rank, world, store):
    """On two ranks whose sends wait for their receives (``BlockingSends``): the old pipeline order (isend the
    activations, receive the first gradient) times out; the executor's 1x(tp1,pp2) with two and three
    micro-batches completes with the single-process loss, its operations recorded."""
    from p2p_order import BlockingSends, P2PRecorder
    from staged_lm import StagedPrograms, init_params, reference_loss

    from passes.plan.ir import StepPlan, Strategy
    from passes.plan.placement import placed_replicas
    from runtime import distributed as comm
    from runtime.distributed import DistContext
    from runtime.executor import Executor
    from runtime.fixed_layout import FixedLayout
    from runtime.topology import Cluster

    old, held, peer = [], [], 1 - rank
    a0, a1, g0 = (torch.full((4,), float(i)) for i in range(3))
    with BlockingSends(store + ".old", rank, world, timeout_s=2.0) as emulated:
        try:
            if rank == 0:
                held.append(comm.isend(a0, 1))
                held.append(comm.isend(a1, 1))  # waits for stage 1's receive, posted after its send of g0
                comm.recv(g0, 1)
            else:
                comm.recv(a0, 0)
                held.append(comm.isend(g0, 0))  # waits for stage 0's receive, posted after its send of a1
                comm.recv(a1, 0)
        except TimeoutError as exc:
            old.append(str(exc))
    comm.recv(torch.empty(4), peer)  # drain the other rank's send that nobody received
    emulated.finish()  # and this rank's, which that receive completes
    ctx = DistContext(rank=rank, world_size=world, dist_backend="gloo", device=torch.device("cpu"))
    layout = FixedLayout.from_tensors(init_params(0), rank, world)
    ex = Executor(ctx, Cluster.local(world), layout, torch.optim.SGD([layout.shard], lr=0.0))
    programs, g = StagedPrograms(), torch.Generator().manual_seed(2)
    losses = []
    with BlockingSends(store + ".pipeline", rank, world, timeout_s=20.0), P2PRecorder() as rec:
        for lens in ([9, 13], [5, 11, 7]):
            batch = [torch.randint(0, 61, (n,), generator=g) for n in lens]
            replicas = placed_replicas(Strategy.parse("1x(tp1,pp2)"), world,
                                       micro_batches=(tuple((i,) for i in range(len(lens))),), max_tokens=(64,))
            plan = StepPlan(strategy=Strategy.parse("1x(tp1,pp2)"), seq_lens=tuple(lens), replicas=replicas,
                            est_step_ms=0.0, lower_bound_ms=0.0, policy="test")
            losses.append((ex.run_step(plan, batch, programs.program(plan, rank)).loss,
                           float(reference_loss(init_params(0), batch))))
    return old, losses, rec.ops


def test_pipeline_completes_where_sends_wait_for_their_receives(tmp_path):
    results = run_ranks(2, tmp_path, _emulated, str(tmp_path / "store"), timeout_s=120)
    assert any("under NCCL both would wait forever" in msg for old, _, _ in results for msg in old), results
    for _, losses, _ in results:
        for got, want in losses:
            assert got == pytest.approx(want, rel=1e-5)
    ops = [r[2] for r in results]
    assert p2p_problems(ops) == []
    activations = [op.shape for op in ops[0] if op.kind == "send" and op.shape[1:] == (32,)]
    assert activations == [(9, 32), (13, 32), (5, 32), (11, 32), (7, 32)]  # 2 + 3 micro-batches, from stage 0


def _emulated_overlap(rank, world, store):
    """On four ranks whose sends wait for their receives: pipelines of 2 and 4 stages and a heterogeneous step with
    the movement overlapped, one message in flight at a time (``inflight_bytes=0``), the parameters of a
    single-process SGD step after each."""
    from p2p_order import BlockingSends, P2PRecorder
    from staged_lm import StagedPrograms, init_params
    from test_runtime_executor import CPU_MODEL, batches

    from passes.plan.ir import Strategy
    from passes.plan.policies import Planner
    from runtime.distributed import DistContext
    from runtime.executor import Executor
    from runtime.fixed_layout import FixedLayout
    from runtime.topology import Cluster

    ctx = DistContext(rank=rank, world_size=world, dist_backend="gloo", device=torch.device("cpu"))
    layout = FixedLayout.from_tensors(init_params(0), rank, world)
    ex = Executor(ctx, Cluster.local(world), layout, torch.optim.SGD([layout.shard], lr=0.5), overlap=True,
                  windows=3, inflight_bytes=0)
    programs = StagedPrograms()
    planner = Planner(CPU_MODEL, world, [Strategy.parse("4x(tp1)")], fixed=Strategy.parse("4x(tp1)"))
    out = []
    with BlockingSends(store, rank, world, timeout_s=60.0), P2PRecorder() as rec:
        for strategy, batch in zip(["1x(tp1,pp4)", "2x(tp1,pp2)", "1x(tp1,pp2)+2x(tp1)"], batches()):
            plan = planner.plan([len(s) for s in batch], strategy=Strategy.parse(strategy))
            ex.run_step(plan, batch, programs.program(plan, rank))
            out.append(layout.full_state_dict())
    return out, rec.ops


def test_overlapped_movement_completes_where_sends_wait_for_their_receives(tmp_path):
    from staged_lm import init_params, reference_loss
    from test_runtime_executor import batches

    results = run_ranks(4, tmp_path, _emulated_overlap, str(tmp_path / "store"), timeout_s=300)
    assert p2p_problems([ops for _, ops in results]) == []
    assert any(op.group != "default" for _, ops in results for op in ops)  # the movement group was recorded
    params = {k: v.clone().requires_grad_(True) for k, v in init_params(0).items()}
    for step, batch in enumerate(batches()):
        reference_loss(params, batch).backward()
        with torch.no_grad():
            for p in params.values():
                p -= 0.5 * p.grad
                p.grad = None
        for states, _ in results:
            for name, p in params.items():
                torch.testing.assert_close(states[step][name], p.detach(), rtol=1e-5, atol=1e-6)


def _every_strategy(rank, world, overlap):
    """Each strategy of the equivalence tests on a trainer of its own, one step, every p2p operation recorded
    (construction, warm-up, the step)."""
    from p2p_order import P2PRecorder
    from test_equivalence import BUCKETS, CAP, STRATEGIES, _batch, _cap, _make

    import hcompile

    runs = []
    with P2PRecorder() as rec:
        compiled = hcompile.compile(_make("llama", 3), buckets=BUCKETS)
        for strategy in STRATEGIES:
            trainer = compiled.trainer(loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
                                       strategies=[strategy], tokens_per_rank=CAP, calibrate=False,
                                       overlap_movement=overlap)
            lens = [_cap(strategy), 5, 17, 9, 12, 3, 20, 8]
            stats = trainer.train_step(_batch("llama", 3, lens), strategy=strategy)
            runs.append((strategy, max(len(r.micro_batches) for r in trainer.last_plan.plan.replicas), stats.loss))
    return runs, rec.ops


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_recorded_order_of_every_strategy_pairs_up(tmp_path, overlap):
    results = run_ranks(4, tmp_path, _every_strategy, overlap, timeout_s=900)
    assert p2p_problems([ops for _, ops in results]) == []
    runs = results[0][0]
    assert all(micro >= 2 for _, micro, _ in runs), runs
