"""What each rank posts in a step, derived from the runtime's own movement plan, as ops of the NCCL replay.

Owns :func:`windowed_ops`, :func:`pipeline_ops` (a pipeline replica's 1F1B batches, ``runtime.pipeline.
gap_messages``, with its forward and backward computations between them) and :func:`recorded_ops` (what
``tests/p2p_order.py``'s recorder saw on gloo ranks, as ops to replay). :func:`windowed_ops`: per rank, the p2p
batches ``runtime.overlap.MovementInFlight._progress`` posts for that rank's ``WindowedMovement`` (its units in
their order, a window's units one batch, cut where the buffers in flight would pass the bound), as
``passes.plan.nccl_replay.Op`` on the movement communicator, stream and thread.
The planner's torch-free mirror (``passes.plan.nccl_replay.ranks_movement_ops``) is checked equal to it.
The batch cut mirrors ``_progress`` as if no earlier batch were in flight when a window starts: the runtime's
cut also depends on how far the earlier batches have completed, which a trace cannot know.
"""

from __future__ import annotations

from passes.plan.nccl_replay import Op
from runtime.overlap import DEFAULT_INFLIGHT_BYTES, WindowedMovement
from runtime.pipeline import gap_messages, one_f_one_b

__all__ = ["windowed_ops", "pipeline_ops", "recorded_ops"]


def windowed_ops(plans: list[WindowedMovement], param_bytes: int = 2, reduce_bytes: int = 4,
                 inflight_bytes: int = DEFAULT_INFLIGHT_BYTES) -> list[list[Op]]:
    """Per rank (``plans[r]``: rank r's plan, every rank of the job), its movement batches in posting order:
    each unit one (peer, bytes) send and/or receive, pull in ``param_bytes`` per element, push in
    ``reduce_bytes``; a pull unit weighs its sends against ``inflight_bytes``, a push unit its sends and
    receives (gradients cast to the reduce dtype)."""
    for r, plan in enumerate(plans):
        if plan.rank != r or plan.world_size != len(plans):
            raise ValueError(f"plans[{r}] is rank {plan.rank} of {plan.world_size}; expected rank {r} of "
                             f"{len(plans)}")
    out = []
    for plan in plans:
        ops: list[Op] = []
        batch: list[tuple[int, int, int]] = []
        held, key = 0, ("", -1)
        for unit in plan.units:
            size = param_bytes if unit.phase == "pull" else reduce_bytes
            snd = sum(m.count for m in unit.messages if m.send) * size
            rcv = sum(m.count for m in unit.messages if not m.send) * size
            more = snd if unit.phase == "pull" else snd + rcv
            if batch and ((unit.phase, unit.window) != key or held + more > inflight_bytes):
                ops.append(_batch_op(key, batch))
                batch, held = [], 0
            key = (unit.phase, unit.window)
            batch.append((unit.peer, snd, rcv))
            held += more
        if batch:
            ops.append(_batch_op(key, batch))
        out.append(ops)
    return out


def _batch_op(key: tuple[str, int], batch: list[tuple[int, int, int]]) -> Op:
    phase, g = key
    return Op(kind="p2p", comm="movement", stream="movement", thread="movement", tag=phase, window=g,
              sends=tuple((p, s) for p, s, _ in batch if s), recvs=tuple((p, v) for p, _, v in batch if v))


def pipeline_ops(ranks: list[int], micro_batches: int, message_bytes: int, forward_s: float = 0.0,
                 backward_s: float = 0.0, comm: str = "default") -> dict[int, list[Op]]:
    """Per rank of a pipeline replica (``ranks[s]``: stage s), the 1F1B step ``runtime.pipeline`` runs: the
    batches of each gap (``gap_messages``) on ``comm`` (the pipeline talks on the default group) and, between
    gaps, the forward (``forward_s``) or backward (``backward_s``) of one micro-batch; every message
    ``message_bytes``."""
    pp, out = len(ranks), {}
    for stage, rank in enumerate(ranks):
        ops: list[Op] = []
        order = one_f_one_b(pp, stage, micro_batches)
        for g, gap in enumerate(gap_messages(pp, stage, micro_batches)):
            for sends, recvs in gap:
                if sends or recvs:
                    ops.append(Op(kind="p2p", comm=comm, tag="pipeline",
                                  sends=tuple((ranks[stage + m.peer], message_bytes) for m in sends),
                                  recvs=tuple((ranks[stage + m.peer], message_bytes) for m in recvs)))
            if g < len(order):
                ops.append(Op(kind="compute", tag="forward" if order[g][0] == "F" else "backward",
                              seconds=forward_s if order[g][0] == "F" else backward_s))
        out[rank] = ops
    return out


def recorded_ops(records: list[list], element_bytes: int = 4) -> list[list[Op]]:
    """Per rank, the recorded point-to-point operations (``P2POp``: kind, peer, shape, group, batch) as p2p ops,
    one per recorded batch, on the recorded group's communicator and a stream of that name (the recorder's rule:
    different groups are different communicators and streams)."""
    out = []
    for rops in records:
        batches: dict[tuple[str, int], list] = {}
        for op in rops:
            batches.setdefault((op.group, op.batch), []).append(op)
        ops = []
        for (group, _), members in batches.items():
            nbytes = [(m.peer, element_bytes * _numel(m.shape)) for m in members]
            ops.append(Op(kind="p2p", comm=group, stream=group, tag="recorded",
                          sends=tuple(b for b, m in zip(nbytes, members) if m.kind == "send"),
                          recvs=tuple(b for b, m in zip(nbytes, members) if m.kind == "recv")))
        out.append(ops)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
