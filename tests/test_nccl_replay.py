"""The NCCL replay (``passes.plan.nccl_replay``) on hand-worked cases: a 2-rank exchange timed by hand, a fan-out
from one owner serialised on one communicator against a balanced exchange, two communicators issued in opposite
orders (a deadlock on one stream, an order hazard either way), a collective waiting for a late member."""

from __future__ import annotations

import pytest

from passes.plan.links import Links
from passes.plan.nccl_replay import Op, order_hazards, replay

LINKS = Links(gpus_per_node=4, intra_gbps=100.0, inter_gbps=25.0, latency_us=10.0)
GB = 10**9


def p2p(comm="move", sends=(), recvs=(), **kw):
    return Op(kind="p2p", comm=comm, sends=tuple(sends), recvs=tuple(recvs), **kw)


def test_two_rank_exchange_by_hand():
    # rank 0 sends 1 GB to rank 1 and receives 0.5 GB, in one batch; each direction has its own 100 GB/s link.
    ops = [[p2p(sends=[(1, GB)], recvs=[(1, GB // 2)])], [p2p(sends=[(0, GB // 2)], recvs=[(0, GB)])]]
    out = replay(ops, LINKS)
    assert out.deadlock is None
    # both batches complete when the larger message has moved: 10 us start-up + 1 GB / 100 GB/s
    assert out.end[0][0] == pytest.approx(10e-6 + 0.01, rel=1e-9)
    assert out.end[1][0] == pytest.approx(10e-6 + 0.01, rel=1e-9)
    # across nodes (rank 4 of 4-GPU nodes) the same exchange runs at 25 GB/s
    far = [[p2p(sends=[(4, GB)])], [], [], [], [p2p(recvs=[(0, GB)])]]
    assert replay(far, LINKS).step_time() == pytest.approx(10e-6 + 0.04, rel=1e-9)


def test_fan_out_serialised_on_one_communicator_vs_balanced():
    # owner 0 sends 1 GB to each of ranks 1..3, one batch per peer on one communicator: one after another
    serial = [[p2p(sends=[(p, GB)]) for p in (1, 2, 3)]] + [[p2p(recvs=[(0, GB)])] for _ in (1, 2, 3)]
    out = replay(serial, LINKS)
    assert out.end[0] == pytest.approx([10e-6 + 0.01, 2 * (10e-6 + 0.01), 3 * (10e-6 + 0.01)], rel=1e-9)
    # in one batch: the three share rank 0's egress: 3 GB / 100 GB/s
    batch = [[p2p(sends=[(p, GB) for p in (1, 2, 3)])]] + [[p2p(recvs=[(0, GB)])] for _ in (1, 2, 3)]
    assert replay(batch, LINKS).step_time() == pytest.approx(10e-6 + 0.03, rel=1e-9)
    # balanced: the same 3 GB spread so every rank sends 1/3 GB to each other rank: every link busy, 1 GB each
    third = GB // 3
    bal = [[p2p(sends=[(p, third) for p in range(4) if p != r], recvs=[(p, third) for p in range(4) if p != r])]
           for r in range(4)]
    assert replay(bal, LINKS).step_time() == pytest.approx(10e-6 + 3 * third / 100e9, rel=1e-9)


def test_opposite_orders_on_two_communicators_deadlock_on_one_stream():
    ops = [[p2p("a", sends=[(1, 100)]), p2p("b", sends=[(1, 100)])],
           [p2p("b", recvs=[(0, 100)]), p2p("a", recvs=[(0, 100)])]]
    out = replay(ops, LINKS)
    assert out.deadlock is not None
    blocked = {(b.rank, b.op.comm, b.waits_for) for b in out.deadlock.blocked}
    assert blocked == {(0, "a", (1,)), (1, "b", (0,))}
    assert "rank 0 op 0 (p2p on a" in str(out.deadlock)
    assert order_hazards(ops) == [("a", "b", (1,))]
    # on two streams each communicator runs on its own: no deadlock, still an order hazard
    two = [[p2p("a", sends=[(1, 100)], stream="s_a"), p2p("b", sends=[(1, 100)], stream="s_b")],
           [p2p("b", recvs=[(0, 100)], stream="s_b"), p2p("a", recvs=[(0, 100)], stream="s_a")]]
    assert replay(two, LINKS).deadlock is None
    assert order_hazards(two) == [("a", "b", (1,))]
    same = [[p2p("a", sends=[(1, 100)]), p2p("b", sends=[(1, 100)])],
            [p2p("a", recvs=[(0, 100)]), p2p("b", recvs=[(0, 100)])]]
    assert replay(same, LINKS).deadlock is None and order_hazards(same) == []


def test_collective_waits_for_a_late_member():
    ar = Op(kind="all_reduce", comm="tp", members=(0, 1, 2, 3), nbytes=GB)
    ops = [[ar], [ar], [ar], [Op(kind="compute", seconds=1.0), ar]]
    out = replay(ops, LINKS)
    ring = 2 * 3 / 4 * GB / 100e9 + 6 * 10e-6
    assert [out.start[r][0] for r in range(3)] == [1.0] * 3 and out.start[3][1] == 1.0
    assert out.step_time() == pytest.approx(1.0 + ring, rel=1e-9)
    # a member that never issues it: a deadlock naming it
    missing = [[ar], [ar], [ar], []]
    dead = replay(missing, LINKS).deadlock
    assert dead is not None and {b.waits_for for b in dead.blocked} == {(3,)}


def test_a_receive_posted_late_holds_the_send():
    ops = [[p2p(sends=[(1, GB)])], [Op(kind="compute", seconds=0.5), p2p(recvs=[(0, GB)])]]
    out = replay(ops, LINKS)
    assert out.start[0][0] == 0.0 and out.end[0][0] == pytest.approx(0.5 + 10e-6 + 0.01, rel=1e-9)


def test_bad_ops_are_refused():
    with pytest.raises(ValueError, match="op kind"):
        Op(kind="send", comm="x")
    with pytest.raises(ValueError, match="peer 5"):
        replay([[p2p(sends=[(5, 1)])], []], LINKS)
    with pytest.raises(ValueError, match="receives 2"):
        replay([[p2p(sends=[(1, 1)])], [p2p(recvs=[(0, 2)])]], LINKS)


SHAPES = {"p0": (13,), "p1": (4, 5), "p2": (31,), "p3": (7, 3), "p4": (17,)}
SPLIT = {"p1": 1, "p3": 0}


@pytest.mark.parametrize(("inflight", "chunk", "windows", "dims"), [(1 << 28, 5, 3, SPLIT), (40, 3, 4, SPLIT),
                                                                    (1 << 28, 1000, 2, {})])
def test_runtime_trace_equals_the_planner_mirror(inflight, chunk, windows, dims):
    """The ops derived from the runtime's WindowedMovement (runtime.comm_trace) equal, batch by batch, those the
    torch-free mirror derives from the same ranges; and both replay to the same times."""
    from passes.plan.movement import _Prefix, merged
    from passes.plan.nccl_replay import ranks_movement_ops
    from runtime.comm_trace import windowed_ops
    from runtime.fixed_layout import FixedLayout
    from runtime.overlap import WindowedMovement, layout_windows
    from runtime.redistribute import Redistribution

    world = 4
    subsets = [["p0", "p1", "p2"], ["p2", "p3", "p4"], ["p0", "p4"], ["p1", "p3", "p4", "p0"]]
    pushed = [["p0", "p1"], ["p2", "p3", "p4"], ["p4"], ["p1", "p3", "p0"]]
    layouts = [FixedLayout(SHAPES, rank=r, world_size=world, split_dims=dims) for r in range(world)]
    spec = layouts[0].specs

    def ranges(names):
        return list(merged([(spec[n].offset, spec[n].offset + spec[n].numel) for n in names]))

    needs, pushes = [ranges(s) for s in subsets], [ranges(s) for s in pushed]
    cuts = layout_windows(layouts[0], windows)
    plans = [WindowedMovement(Redistribution(layouts[r], needs, chunk, pushes), layouts[r], cuts, chunk)
             for r in range(world)]
    traced = windowed_ops(plans, param_bytes=2, reduce_bytes=4, inflight_bytes=inflight)
    mirror = ranks_movement_ops(layouts[0].regions, [_Prefix.of(n) for n in needs], [_Prefix.of(p) for p in pushes],
                                cuts, param_bytes=2, reduce_bytes=4, inflight_bytes=inflight)
    assert sum(len(o) for o in traced) > world
    for r in range(world):
        assert [(o.tag, o.window, o.sends, o.recvs) for o in traced[r]] == \
               [(o.tag, o.window, o.sends, o.recvs) for o in mirror[r]], r
    links = Links(gpus_per_node=2, intra_gbps=1e-6, inter_gbps=1e-7, latency_us=1.0)
    a, b = replay(traced, links), replay(mirror, links)
    assert a.deadlock is None and a.end == b.end
    assert order_hazards(traced) == []


@pytest.mark.parametrize(("pp", "v"), [(2, 1), (2, 3), (3, 4), (4, 8)])
def test_pipeline_1f1b_replays_without_deadlock_and_the_old_order_deadlocks(pp, v):
    """The pipeline's batches (runtime.pipeline via runtime.comm_trace) complete under the replay's rules, and
    the step takes at least (pp - 1 + v) forward+backward slots; the old order (tests/test_p2p_order.py: each
    message a lone call) deadlocks exactly where tests/p2p_order.py's rule says it does."""
    from p2p_order import p2p_problems
    from test_p2p_order import _old_order

    from runtime.comm_trace import pipeline_ops, recorded_ops

    ops = pipeline_ops(list(range(pp)), v, 1 << 20, forward_s=1e-3, backward_s=2e-3)
    out = replay([ops[r] for r in range(pp)], LINKS)
    assert out.deadlock is None
    assert out.step_time() >= (pp - 1 + v) * 3e-3 - 1e-12
    old = _old_order(pp, v)
    dead = replay(recorded_ops(old), LINKS).deadlock
    assert (dead is not None) == bool(p2p_problems(old)), (dead, p2p_problems(old))


@pytest.mark.parametrize("mix", ["2x(tp1,pp1)+1x(tp2,pp1)", "1x(tp1,pp2)+1x(tp2,pp1)", "2x(tp2,pp1)"])
def test_planner_trace_moves_what_the_planner_counts(mix):
    """Every rank's pull and push bytes in ``movement_ops`` of a LLaMA compute layout equal
    ``passes.plan.movement.movement_bytes``; the replay finishes, never faster than the balanced bound."""
    import dataclasses

    from passes.plan.ir import Strategy
    from passes.plan.movement import llama_compute_layout, movement_bytes
    from passes.plan.nccl_replay import balanced_s, movement_ops

    strategy = Strategy.parse(mix)
    layout = llama_compute_layout(layers=4, hidden=64, ffn_hidden=176, heads=4, kv_heads=2, vocab=100,
                                  schemes=list(strategy.replicas()))
    layout = dataclasses.replace(layout, windows=5)
    ops = movement_ops(layout, strategy, 2, param_bytes=2, reduce_bytes=4, inflight_bytes=2000)
    want = movement_bytes(layout, strategy, 2, param_bytes=2, reduce_bytes=4)
    for r, rank in enumerate(want):
        got = {(tag, way): sum(b for op in ops[r] if op.tag == tag for _, b in getattr(op, way))
               for tag in ("pull", "push") for way in ("sends", "recvs")}
        assert got == {("pull", "recvs"): rank.params_received, ("pull", "sends"): rank.params_sent,
                       ("push", "sends"): rank.grads_sent, ("push", "recvs"): rank.grads_received}, r
    links = Links(gpus_per_node=2, intra_gbps=1.0, inter_gbps=0.25, latency_us=0.0)
    out = replay(ops, links)
    assert out.deadlock is None
    pull = max(out.tag_end(r, "pull") for r in range(len(ops)))
    assert pull >= balanced_s(ops, links, "pull") * (1 - 1e-9) and pull > 0
