"""A replay of one step's communication under NCCL's rules (pure Python, deterministic, event-driven; no torch).

Owns :class:`Op` (one operation a rank posts: a p2p batch, a collective or a span of compute), :func:`replay`
(run every rank's ops to completion or to a deadlock) and :func:`order_hazards` (pairs of communicators whose
operations ranks issue in different orders). The rules, as NCCL runs them on GPUs and gloo does not:

- each rank runs each of its *streams* as one in-order queue (one CUDA stream; a communicator's operations are on
  the stream they were issued on); an op starts once it heads its stream and the ops named in ``after`` are done;
- a p2p batch (one NCCL group) moves each of its messages once the peer's batch that holds the matching message
  heads the peer's stream (the peer's current operation); the batch completes when all its messages have moved,
  so a send never completes before its receive is posted;
- a collective starts when every member has it at the head of its stream; it then takes the ring time of its
  bytes over the slowest link among its members (``2 (n-1)/n`` of the bytes for an all-reduce, ``(n-1)/n`` for
  an all-gather / reduce-scatter, the bytes for a broadcast);
- messages share bandwidth: each rank has an egress and an ingress of ``intra_gbps`` towards its node (NVLink) and
  of ``inter_gbps`` towards other nodes (its InfiniBand port), split max-min fairly between the messages that run
  at once; each message also pays ``latency_us`` once before its bytes flow;
- when no op can start or progress and some are left, the step is deadlocked: :class:`Deadlock` names every rank's
  blocked op, the communicator it is on and the ranks it waits for.

Collectives do not take bandwidth from concurrent p2p messages (their ring time is charged on its own): a
simplification to keep in mind where collectives and movement run at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from passes.plan.ir import PlanError, Strategy
from passes.plan.links import Links
from passes.plan.movement import ComputeLayout, places, region_shares

__all__ = ["Op", "Blocked", "Deadlock", "Replay", "replay", "order_hazards", "COLLECTIVES", "movement_ops",
           "ranks_movement_ops", "even_windows", "balanced_s", "INFLIGHT_BYTES"]

INFLIGHT_BYTES = 1 << 28
"""``runtime.overlap.DEFAULT_INFLIGHT_BYTES`` (mirrored: that module imports torch): the bytes of buffers the
movement thread keeps in flight, which cuts a window's units into several batches."""

COLLECTIVES = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0 if n > 1 else 0.0,
               "all_to_all": lambda n: (n - 1) / n, "barrier": lambda n: 0.0}
"""Collective kinds and the fraction of their bytes each member sends over its slowest link (ring algorithms)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Op:
    """One operation a rank posts in a step."""

    kind: str
    """``p2p`` (a batch of sends and receives: one NCCL group), ``compute`` or one of :data:`COLLECTIVES`."""
    comm: str = ""
    """The communicator (process group) it runs on; empty for compute."""
    stream: str = "main"
    """The in-order queue it runs in on its rank (a CUDA stream)."""
    thread: str = "main"
    """The host thread that issues it (``main`` or ``movement``): reported, not simulated."""
    sends: tuple[tuple[int, int], ...] = ()
    """p2p: (peer, bytes) of each send."""
    recvs: tuple[tuple[int, int], ...] = ()
    """p2p: (peer, bytes) of each receive."""
    members: tuple[int, ...] = ()
    """Collective: the ranks of its group."""
    nbytes: int = 0
    """Collective: bytes of each member's tensor."""
    seconds: float = 0.0
    """Compute: how long it runs."""
    tag: str = ""
    """What it is part of (``pull``, ``push``, ``pipeline``, ``tp`` ...): times are reported per tag."""
    window: int = -1
    """Movement: the layout window it moves (-1: none)."""
    after: tuple[int, ...] = ()
    """Indices of ops of the same rank that must be complete before it starts (besides its stream's order)."""

    def __post_init__(self) -> None:
        if self.kind != "p2p" and self.kind != "compute" and self.kind not in COLLECTIVES:
            raise ValueError(f"op kind must be p2p, compute or one of {sorted(COLLECTIVES)}, got {self.kind!r}")
        if self.kind != "compute" and not self.comm:
            raise ValueError(f"a {self.kind} op needs a communicator name, got {self.comm!r}")
        if self.kind in COLLECTIVES and not self.members:
            raise ValueError(f"a {self.kind} op needs its group's members")
        if self.seconds < 0 or self.nbytes < 0 or any(b < 0 for _, b in self.sends + self.recvs):
            raise ValueError(f"op sizes and times must be >= 0, got {self}")


@dataclass(frozen=True, slots=True)
class Blocked:
    """One rank's op that could not start or finish at a deadlock."""

    rank: int
    index: int
    op: Op
    waits_for: tuple[int, ...]
    """The ranks whose current op on this communicator is not the matching one (or who have not reached it)."""


class Deadlock(RuntimeError):
    """The replay stopped with ops left and none able to run: ``blocked`` lists them."""

    def __init__(self, at: float, blocked: list[Blocked]):
        self.at, self.blocked = at, blocked
        lines = [f"rank {b.rank} op {b.index} ({b.op.kind} on {b.op.comm or b.op.stream}, stream {b.op.stream}) "
                 f"waits for ranks {list(b.waits_for)}" for b in blocked]
        super().__init__(f"deadlock at {at:.6g}s: " + "; ".join(lines))


@dataclass(slots=True)
class Replay:
    """What a replay found: per rank and op, start and end (seconds from the step's start)."""

    start: list[list[float]]
    end: list[list[float]]
    ops: list[list[Op]]
    deadlock: Deadlock | None = None

    def rank_time(self, rank: int) -> float:
        """When ``rank``'s last op ended."""
        return max(self.end[rank], default=0.0)

    def step_time(self) -> float:
        """When the last op of any rank ended."""
        return max((self.rank_time(r) for r in range(len(self.ops))), default=0.0)

    def tag_span(self, rank: int, tag: str) -> float:
        """From the first start to the last end of ``rank``'s ops tagged ``tag`` (0 when none)."""
        spans = [(s, e) for s, e, op in zip(self.start[rank], self.end[rank], self.ops[rank]) if op.tag == tag]
        return max(e for _, e in spans) - min(s for s, _ in spans) if spans else 0.0

    def tag_end(self, rank: int, tag: str) -> float:
        """When ``rank``'s last op tagged ``tag`` ended (0 when none)."""
        return max((e for e, op in zip(self.end[rank], self.ops[rank]) if op.tag == tag), default=0.0)


@dataclass(slots=True)
class _Msg:
    src: int
    dst: int
    remaining: float
    ready_at: float
    inter: bool
    ops: tuple[tuple[int, int], ...]  # (rank, index) of the two batches
    rate: float = 0.0


@dataclass(slots=True)
class _State:
    ops: list[list[Op]]
    links: Links
    pos: list[dict[str, int]] = field(default_factory=list)  # per rank: stream -> index into its queue
    queues: list[dict[str, list[int]]] = field(default_factory=list)


def _fair_rates(msgs: list[_Msg], links: Links) -> None:
    """Max-min fair rates (bytes/s) of the flowing messages over per-rank egress and ingress per link kind."""
    index: dict[tuple, int] = {}
    caps: list[float] = []
    ends = []
    for m in msgs:
        bw = (links.inter_gbps if m.inter else links.intra_gbps) * 1e9
        pair = []
        for res in ((m.src, m.inter, 0), (m.dst, m.inter, 1)):
            if res not in index:
                index[res] = len(caps)
                caps.append(bw)
            pair.append(index[res])
        ends.append(pair)
    if not msgs:
        return
    cap = np.array(caps)
    count = np.zeros(len(caps))
    users: list[list[int]] = [[] for _ in caps]
    for i, (x, y) in enumerate(ends):
        count[x] += 1
        count[y] += 1
        users[x].append(i)
        users[y].append(i)
    fixed = [False] * len(msgs)
    left = len(msgs)
    while left:
        share = np.where(count > 0, cap / np.maximum(count, 1), np.inf)
        busiest = int(np.argmin(share))
        rate = float(share[busiest])
        for i in users[busiest]:
            if not fixed[i]:
                fixed[i] = True
                left -= 1
                msgs[i].rate = rate
                for other in ends[i]:
                    cap[other] -= rate
                    count[other] -= 1


def _collective_seconds(op: Op, links: Links) -> float:
    n = len(op.members)
    nodes = {r // links.gpus_per_node for r in op.members}
    bw = (links.inter_gbps if len(nodes) > 1 else links.intra_gbps) * 1e9
    steps = (n - 1) * (2 if op.kind == "all_reduce" else 1) if n > 1 else 0
    return COLLECTIVES[op.kind](n) * op.nbytes / bw + steps * links.latency_us * 1e-6


def replay(ops: list[list[Op]], links: Links) -> Replay:
    """Run every rank's ops (``ops[r]``: rank r's ops in the order it issues them) under the module's rules.

    Returns the start and end of every op; where the ranks deadlock, ``deadlock`` holds a :class:`Deadlock`
    and the ops that never ran have start and end ``inf``."""
    world = len(ops)
    inf = float("inf")
    start = [[inf] * len(rops) for rops in ops]
    end = [[inf] * len(rops) for rops in ops]
    queues: list[dict[str, list[int]]] = []
    i: int | None  # an op's index; None where a stream has no op ready
    for r, rops in enumerate(ops):
        q: dict[str, list[int]] = {}
        for i, op in enumerate(rops):
            if any(not 0 <= a < i for a in op.after):
                raise ValueError(f"rank {r} op {i}: after={op.after} must name earlier ops of the rank")
            for peer, _ in op.sends + op.recvs:
                if not 0 <= peer < world or peer == r:
                    raise ValueError(f"rank {r} op {i}: peer {peer} must be another rank of 0..{world - 1}")
            q.setdefault(op.stream, []).append(i)
        queues.append(q)
    head = [{s: 0 for s in q} for q in queues]
    done = [[False] * len(rops) for rops in ops]
    running: dict[tuple[int, int], float] = {}  # compute/collective (rank, index) -> end time
    msgs: list[_Msg] = []
    pending: dict[tuple[int, int], int] = {}  # p2p batch -> messages not yet moved
    matched: set[tuple[int, int, int, int]] = set()  # (rank, index, kind 0 send 1 recv, slot) already matched
    now = 0.0

    def current(r: int, stream: str) -> int | None:
        q, h = queues[r].get(stream, []), head[r].get(stream, 0)
        if h >= len(q):
            return None
        i = q[h]
        return i if all(done[r][a] for a in ops[r][i].after) else None

    def heads_on(r: int, comm: str) -> list[int]:
        return [i for s in queues[r] for i in [current(r, s)] if i is not None and ops[r][i].comm == comm]

    dirty = set(range(world))

    def peers(op: Op) -> set[int]:
        return {p for p, _ in op.sends + op.recvs} | set(op.members)

    def finish(r: int, i: int, t: float) -> None:
        done[r][i], end[r][i] = True, t
        head[r][ops[r][i].stream] += 1
        dirty.add(r)
        dirty.update(peers(ops[r][i]))

    while True:
        while dirty:
            r = min(dirty)
            dirty.discard(r)
            for s in list(queues[r]):
                i = current(r, s)
                if i is None:
                    continue
                op = ops[r][i]
                if start[r][i] != inf and op.kind != "p2p":
                    continue
                if op.kind == "compute":
                    start[r][i] = now
                    running[(r, i)] = now + op.seconds
                elif op.kind in COLLECTIVES:
                    found: dict[int, int] = {}
                    for member in op.members:
                        got = [j for j in heads_on(member, op.comm) if ops[member][j].kind == op.kind]
                        if not got or start[member][got[0]] != inf:
                            break
                        found[member] = got[0]
                    else:
                        t_end = now + _collective_seconds(op, links)
                        for member, j in found.items():
                            start[member][j] = now
                            running[(member, j)] = t_end
                else:  # p2p: match each not yet matched send with the peer's current batch on this comm
                    if start[r][i] == inf:
                        start[r][i] = now
                        pending[(r, i)] = len(op.sends) + len(op.recvs)
                        dirty.update(peers(op))
                    for slot, (peer, nbytes) in enumerate(op.sends):
                        if (r, i, 0, slot) in matched:
                            continue
                        for j in heads_on(peer, op.comm):
                            pj = ops[peer][j]
                            if pj.kind != "p2p":
                                continue
                            rslot = next((k for k, (p, b) in enumerate(pj.recvs)
                                          if p == r and (peer, j, 1, k) not in matched), None)
                            if rslot is None:
                                continue
                            if pj.recvs[rslot][1] != nbytes:
                                raise ValueError(f"rank {r} op {i} sends {nbytes} bytes to rank {peer}, whose "
                                                 f"op {j} receives {pj.recvs[rslot][1]}")
                            if start[peer][j] == inf:
                                start[peer][j] = now
                                pending[(peer, j)] = len(pj.sends) + len(pj.recvs)
                                dirty.update(peers(pj))
                            matched.update({(r, i, 0, slot), (peer, j, 1, rslot)})
                            inter = r // links.gpus_per_node != peer // links.gpus_per_node
                            msgs.append(_Msg(r, peer, float(nbytes), now + links.latency_us * 1e-6, inter,
                                             ((r, i), (peer, j))))
                            break
                    if pending.get((r, i)) == 0 and not done[r][i]:
                        del pending[(r, i)]
                        finish(r, i, now)
        # moved messages (and zero-byte ones) complete their batches
        moved = [m for m in msgs if m.remaining <= 0 and m.ready_at <= now]
        if moved:
            msgs = [m for m in msgs if not (m.remaining <= 0 and m.ready_at <= now)]
        for m in moved:
            for key in m.ops:
                pending[key] -= 1
                if pending[key] == 0:
                    del pending[key]
                    finish(*key, now)
        if moved:
            continue
        flowing = [m for m in msgs if m.ready_at <= now]
        _fair_rates(flowing, links)
        times = [t for t in running.values()] + [m.ready_at for m in msgs if m.ready_at > now]
        times += [now + m.remaining / m.rate for m in flowing if m.rate > 0]
        if not times:
            break
        t = min(times)
        for m in flowing:
            m.remaining -= m.rate * (t - now)
            if m.remaining <= 1e-9 * m.rate or m.remaining < 1e-3:
                m.remaining = 0.0
        now = t
        for key in [k for k, te in running.items() if te <= now]:
            del running[key]
            finish(*key, now)
    unfinished = [(r, i) for r in range(world) for i in range(len(ops[r])) if not done[r][i]]
    if not unfinished:
        return Replay(start, end, ops)
    blocked = []
    for r in range(world):
        for s in queues[r]:
            i = current(r, s)
            if i is None:
                continue
            op = ops[r][i]
            if op.kind == "p2p":
                waits = sorted({p for slot, (p, _) in enumerate(op.sends) if (r, i, 0, slot) not in matched}
                               | {p for slot, (p, _) in enumerate(op.recvs) if (r, i, 1, slot) not in matched})
            else:
                waits = sorted(m for m in op.members
                               if not any(ops[m][j].kind == op.kind for j in heads_on(m, op.comm)))
            blocked.append(Blocked(r, i, op, tuple(waits)))
    return Replay(start, end, ops, Deadlock(now, blocked))


def order_hazards(ops: list[list[Op]]) -> list[tuple[str, str, tuple[int, ...]]]:
    """Every pair of communicators (a, b) that two ranks holding both issue in different relative orders, with
    the ranks that disagree with the lowest such rank: NCCL needs them issued in one order on every rank unless
    they cannot block each other (here: reported whatever the streams)."""
    seqs = []
    for rops in ops:
        seq: list[str] = []
        for op in rops:
            if op.comm and (not seq or seq[-1] != op.comm):
                seq.append(op.comm)
        seqs.append(seq)
    comms = sorted({c for seq in seqs for c in seq})
    out = []
    for x, a in enumerate(comms):
        for b in comms[x + 1:]:
            pattern: dict[int, tuple[str, ...]] = {}
            for r, seq in enumerate(seqs):
                if a in seq and b in seq:
                    proj: list[str] = []
                    for c in seq:
                        if c in (a, b) and (not proj or proj[-1] != c):
                            proj.append(c)
                    pattern[r] = tuple(proj)
            if len(set(pattern.values())) > 1:
                first = min(pattern)
                out.append((a, b, tuple(r for r in sorted(pattern) if pattern[r] != pattern[first])))
    return out


def even_windows(layout: ComputeLayout) -> list[tuple[int, int]]:
    """``layout.windows`` windows of about equal size, cut at every region start. A mirror of
    ``passes.plan.movement.window_cuts`` that has no parameter extents to cut at (the compute layout keeps only
    the window count): the cuts are at element boundaries, not parameter starts."""
    count, out = layout.windows, []
    target = -(-layout.numel // count)
    for lo, hi in layout.regions:
        n = max(1, round((hi - lo) / target))
        cuts = [lo + (hi - lo) * i // n for i in range(n + 1)]
        out += [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
    return out


def _window_traffic(regions, needs: list, pushes: list, windows: list[tuple[int, int]]
                    ) -> list[list[tuple[int, int, int, int]]]:
    """Per window: (owner, rank, elements rank pulls from owner, elements rank pushes to owner), owner != rank.
    ``needs[r]`` / ``pushes[r]``: rank r's ranges as ``_Prefix`` (ranks of one place may share one object)."""
    world = len(needs)
    shares = region_shares(regions, world)
    out = []
    for lo, hi in windows:
        rows = []
        for (rlo, rhi), share in zip(regions, shares):
            a0, b0 = max(lo, rlo), min(hi, rhi)
            if b0 <= a0:
                continue
            for k in range((a0 - rlo) // share, min(world - 1, (b0 - 1 - rlo) // share) + 1):
                a, b = max(a0, rlo + k * share), min(b0, rlo + (k + 1) * share)
                if b <= a:
                    continue
                counts: dict[tuple[int, int], tuple[int, int]] = {}
                for r in range(world):
                    key = (id(needs[r]), id(pushes[r]))
                    if key not in counts:
                        counts[key] = (needs[r].inside(a, b), pushes[r].inside(a, b))
                    pull, push = counts[key]
                    if r != k and (pull or push):
                        rows.append((k, r, pull, push))
        out.append(rows)
    return out


def movement_ops(layout: ComputeLayout, strategy: Strategy, gpus_per_node: int, *, param_bytes: int = 2,
                 reduce_bytes: int = 4, inflight_bytes: int = INFLIGHT_BYTES,
                 windows: list[tuple[int, int]] | None = None,
                 compute_s: Sequence[float] | None = None) -> list[list[Op]]:
    """Per rank of ``strategy`` (placed as the planner places it), :func:`ranks_movement_ops` of its ranges in
    ``layout`` (``windows``: default :func:`even_windows`)."""
    where = places(strategy, gpus_per_node)
    return ranks_movement_ops(layout.regions, [layout.needs(p) for p in where], [layout.pushed(p) for p in where],
                              even_windows(layout) if windows is None else windows, param_bytes=param_bytes,
                              reduce_bytes=reduce_bytes, inflight_bytes=inflight_bytes, compute_s=compute_s)


def ranks_movement_ops(regions, needs: list, pushes: list, windows: list[tuple[int, int]], *,
                       param_bytes: int = 2, reduce_bytes: int = 4, inflight_bytes: int = INFLIGHT_BYTES,
                       compute_s: Sequence[float] | None = None) -> list[list[Op]]:
    """Per rank, the ops of one overlapped step as ``runtime.overlap.WindowedMovement`` posts them on its one
    movement communicator (``movement``, stream ``movement``, thread ``movement``), the layout's ``regions`` owned
    as ``runtime.fixed_layout`` owns them, rank r computing with ``needs[r]`` and pushing ``pushes[r]`` (both
    ``passes.plan.movement._Prefix``): a unit per (window, peer), the pull's windows ascending then the push's
    descending, peers ascending in a window; a window's units one batch, cut where the buffers in flight would pass
    ``inflight_bytes`` (the runtime's ``_progress``; mirrored: a pull unit weighs its sends, a push unit its sends
    and receives, as where gradients are cast to the reduce dtype). With ``compute_s`` (per rank, seconds of its
    step's compute), the compute runs on stream ``main``: forward per window after its pull, one third of the
    compute split by the rank's elements per window, then the backward (two thirds) windows descending, each
    window's push after its backward."""
    world = len(needs)
    if compute_s is not None and len(compute_s) != world:
        raise PlanError(f"compute_s must give one time per rank ({world}), got {len(compute_s)}")
    traffic = _window_traffic(regions, needs, pushes, windows)
    out: list[list[Op]] = [[] for _ in range(world)]
    pull_idx: list[list[list[int]]] = [[[] for _ in windows] for _ in range(world)]
    for phase in ("pull", "push"):
        order = range(len(windows)) if phase == "pull" else reversed(range(len(windows)))
        for g in order:
            units: list[dict[int, list]] = [{} for _ in range(world)]  # rank -> peer -> [sends, recvs]
            for k, r, pull, push in traffic[g]:
                if phase == "pull" and pull:
                    units[k].setdefault(r, [0, 0])[0] += pull * param_bytes
                    units[r].setdefault(k, [0, 0])[1] += pull * param_bytes
                elif phase == "push" and push:
                    units[r].setdefault(k, [0, 0])[0] += push * reduce_bytes
                    units[k].setdefault(r, [0, 0])[1] += push * reduce_bytes
            for r in range(world):
                batch: list[tuple[int, int, int]] = []
                held = 0
                for peer in sorted(units[r]):
                    snd, rcv = units[r][peer]
                    more = snd if phase == "pull" else snd + rcv
                    if batch and held + more > inflight_bytes:
                        _emit(out, pull_idx, r, g, phase, batch)
                        batch, held = [], 0
                    batch.append((peer, snd, rcv))
                    held += more
                if batch:
                    _emit(out, pull_idx, r, g, phase, batch)
    if compute_s is None:
        return out
    final: list[list[Op]] = []
    for r in range(world):
        mine = [needs[r].inside(lo, hi) for lo, hi in windows]
        pulls = [op for op in out[r] if op.tag == "pull"]
        pushes_of = [(op.window, op) for op in out[r] if op.tag == "push"]
        ops, total = list(pulls), sum(mine) or 1
        for g in range(len(windows)):
            ops.append(Op(kind="compute", seconds=compute_s[r] / 3 * mine[g] / total, tag="forward",
                          after=tuple(pull_idx[r][g])))
        bwd_at = {}
        for g in reversed(range(len(windows))):
            ops.append(Op(kind="compute", seconds=compute_s[r] * 2 / 3 * mine[g] / total, tag="backward"))
            bwd_at[g] = len(ops) - 1
        for g, op in pushes_of:
            ops.append(Op(kind="p2p", comm=op.comm, stream=op.stream, thread=op.thread, sends=op.sends,
                          recvs=op.recvs, tag="push", window=g, after=(bwd_at[g],)))
        final.append(ops)
    return final


def _emit(out: list[list[Op]], pull_idx: list[list[list[int]]], r: int, g: int, phase: str,
          batch: list[tuple[int, int, int]]) -> None:
    out[r].append(Op(kind="p2p", comm="movement", stream="movement", thread="movement", tag=phase,
                     sends=tuple((p, s) for p, s, _ in batch if s), recvs=tuple((p, v) for p, _, v in batch if v),
                     window=g))
    if phase == "pull":
        pull_idx[r][g].append(len(out[r]) - 1)


def balanced_s(ops: list[list[Op]], links: Links, tag: str) -> float:
    """The busiest rank's time for the ``tag`` messages of ``ops`` were they all moved at once, every link busy:
    per rank the most of its egress and ingress bytes within its node over ``intra_gbps`` and across nodes over
    ``inter_gbps``."""
    worst = 0.0
    for r, rops in enumerate(ops):
        load: dict[tuple[str, bool], float] = {}
        for op in rops:
            if op.tag != tag:
                continue
            for way, pairs in (("out", op.sends), ("in", op.recvs)):
                for p, b in pairs:
                    inter = p // links.gpus_per_node != r // links.gpus_per_node
                    load[(way, inter)] = load.get((way, inter), 0) + b
        for (_, inter), total in load.items():
            worst = max(worst, total / ((links.inter_gbps if inter else links.intra_gbps) * 1e9))
    return worst
