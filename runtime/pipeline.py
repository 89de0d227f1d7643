"""The 1F1B pipeline of one replica's stages, with point-to-point messages paired as NCCL needs them.

Owns :func:`one_f_one_b` (the order of a stage's forwards and backwards), :func:`gap_messages` (what a stage sends
and receives in each gap between two of its computations) and :class:`Pipeline` (that schedule run on this rank).

Under NCCL both directions between two ranks share one communicator and one stream: the operations of a pair
run in the order they are issued, and a send completes only once its receive is posted. A stage that sent its
activations with ``isend`` and received gradients with a blocking ``recv`` queued [send a0, send a1, recv g0] on
stage 0 against [recv a0, send g0, recv a1] on stage 1 (pp = 2, two micro-batches): once an activation is larger
than NCCL's buffers, neither side moves. Here each gap's messages (the sends of the computation that just ended,
the receives of the one about to start) are posted as one batch (``runtime.distributed.exchange``, one NCCL group;
two in one case, :func:`gap_messages`) and waited for before the next computation, as Megatron-LM's and
``torch.distributed.pipelining``'s schedules do: between two neighbouring stages the k-th batch of one that holds
messages with the other meets exactly the other's k-th such batch, sends matched with receives of the same shapes
in the same order (``tests/test_p2p_order.py`` checks this for every
pp and micro-batch count, and in recorded runs of every strategy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from passes.plan.ir import Place, ReplicaPlan
from runtime import distributed as comm
from runtime.loss import vocab_shard_of

__all__ = ["Message", "one_f_one_b", "gap_messages", "Pipeline"]


@dataclass(frozen=True, slots=True)
class Message:
    """One boundary crossing of one micro-batch between neighbouring stages."""

    kind: str
    """``activation`` (forward, to the next stage) or ``gradient`` (backward, to the previous stage)."""
    micro: int
    """The micro-batch, 0-based."""
    peer: int
    """The other stage, relative to this one: +1 or -1."""


def one_f_one_b(pp: int, stage: int, micro_batches: int) -> list[tuple[str, int]]:
    """Stage ``stage``'s computations in order, ``("F", i)`` and ``("B", i)``: ``min(pp - stage - 1, v)``
    forwards ahead, then one forward and one backward in turn, then the remaining backwards."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage must be in [0, {pp}), got {stage}")
    v = micro_batches
    warmup = min(pp - stage - 1, v)
    order = [("F", i) for i in range(warmup)]
    for k in range(v - warmup):
        order += [("F", warmup + k), ("B", k)]
    return order + [("B", v - warmup + k) for k in range(warmup)]


def gap_messages(pp: int, stage: int, micro_batches: int) -> list[list[tuple[list[Message], list[Message]]]]:
    """Per gap of stage ``stage``'s 1F1B order (before its first computation, between two, after its last), the
    batches it posts there, in order, each (sends, receives): the output of the computation that ended and the
    input of the one that starts. One batch, except where a forward is followed by a backward outside the
    steady phase (the last micro-batch's forward before the first backward when every forward is a warm-up
    one): its activation goes first, alone, as the next stage receives it before it sends that gradient.
    Megatron-LM's ``send_forward_recv_backward`` and ``send_backward_recv_forward`` are this pairing."""
    order = one_f_one_b(pp, stage, micro_batches)
    steady = micro_batches > min(pp - stage - 1, micro_batches)
    gaps = []
    for g in range(len(order) + 1):
        sends, recvs = [], []
        if g > 0:
            op, i = order[g - 1]
            if op == "F" and stage < pp - 1:
                sends.append(Message("activation", i, +1))
            if op == "B" and stage > 0:
                sends.append(Message("gradient", i, -1))
        if g < len(order):
            op, i = order[g]
            if op == "F" and stage > 0:
                recvs.append(Message("activation", i, -1))
            if op == "B" and stage < pp - 1:
                recvs.append(Message("gradient", i, +1))
        apart = 0 < g < len(order) and order[g - 1][0] == "F" and order[g][0] == "B" and not steady
        gaps.append([(sends, []), ([], recvs)] if apart else [(sends, recvs)])
    return gaps


class Pipeline:
    """1F1B over the replica's stages on this rank: activations go to the same TP (and CP) rank of the next
    stage, gradients come back the same way; no header travels: the receiver knows every shape and dtype from
    its program (``StageProgram.boundary_in`` for the micro-batch's tokens; its own outputs for their
    gradients), and the loss stays on the device."""

    def __init__(self, device: torch.device, replica: ReplicaPlan, place: Place):
        stage, cp_rank, tp_rank = place.stage, place.cp_rank, place.tp_rank
        self.pp, self.stage = replica.scheme.pp, stage
        self.prev = replica.rank_at(stage - 1, cp_rank, tp_rank) if stage > 0 else None
        self.next = replica.rank_at(stage + 1, cp_rank, tp_rank) if stage + 1 < self.pp else None
        self.device = device

    def run(self, program: Any, micro: list, pairs: int, flow: Any) -> torch.Tensor:
        """Forward and backward of every micro-batch in 1F1B order; the loss sum (on the device, zero on every
        stage but the last). ``flow``: the executor's hooks for overlapped movement."""
        v = len(micro)
        order = one_f_one_b(self.pp, self.stage, v)
        outs: dict[int, tuple[torch.Tensor, ...]] = {}
        inputs: dict[int, list] = {}
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        forwards = backwards = 0
        for g, batches in enumerate(gap_messages(self.pp, self.stage, v)):
            received: list = []
            for sends, recvs in batches:
                outgoing = [(t, self._peer(m)) for m in sends for t in self._outgoing(m, outs, inputs)]
                boxes = [self._buffers(m, program, micro, outs) for m in recvs]
                comm.exchange(outgoing, [(t, self._peer(m)) for m, (_, leaves) in zip(recvs, boxes) for t in leaves])
                received = boxes[0][0] if boxes else received
            if g == len(order):
                break
            op, i = order[g]
            if op == "F":
                with flow.forward(first=forwards == 0):
                    outs[i], inputs[i], loss = self._forward(program, micro[i], pairs, received)
                total += loss
                forwards += 1
            else:
                backwards += 1
                flow.backward(last=backwards == v)
                self._backward(outs.pop(i), inputs[i], received)
                if self.prev is None:
                    inputs.pop(i)
        return total

    def _peer(self, message: Message) -> int:
        peer = self.next if message.peer > 0 else self.prev
        if peer is None:
            raise RuntimeError(f"stage {self.stage} of {self.pp} has no stage {self.stage + message.peer}")
        return peer

    def _outgoing(self, message: Message, outs: dict, inputs: dict) -> list[torch.Tensor]:
        """The tensors of a message this stage sends, in order."""
        if message.kind == "activation":
            return [t.detach() for t in _leaves(outs[message.micro])]
        held = inputs.pop(message.micro)
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in _leaves(held) if t.is_floating_point()]

    def _buffers(self, message: Message, program: Any, micro: list, outs: dict) -> tuple[list, list[torch.Tensor]]:
        """(items as the stage takes them, their tensors in order) to receive a message into."""
        if message.kind == "gradient":
            leaves = [torch.empty(o.shape, dtype=o.dtype, device=self.device)
                      for o in _leaves(outs[message.micro]) if o.is_floating_point()]
            return leaves, leaves
        items, flat = [], []
        for spec in program.boundary_in(int(micro[message.micro].ids.shape[0])):
            group = spec if isinstance(spec, list) else [spec]
            leaves = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in group]
            flat += leaves
            items.append(tuple(leaves) if isinstance(spec, list) else leaves[0])
        return items, flat

    def _forward(self, program: Any, mb: Any, pairs: int, received: list):
        for t in _leaves(received):
            if t.is_floating_point():
                t.requires_grad_(True)
        outs = mb.run(program, tuple(received))
        if self.next is not None:
            return outs, received, torch.zeros((), dtype=torch.float64, device=self.device)
        loss = mb.loss_sum(outs[0], vocab_shard_of(program))
        return (loss / pairs,), received, loss.detach()

    def _backward(self, outs: tuple[torch.Tensor, ...], inputs: list, grads: list[torch.Tensor]) -> None:
        if self.next is None:
            outs[0].backward()
            return
        floating = [o for o in _leaves(outs) if o.is_floating_point()]
        pairs = [(o, g) for o, g in zip(floating, grads) if o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _leaves(items: Sequence) -> list[torch.Tensor]:
    """The tensors of boundary items (tensors, or tuples of tensors), in order."""
    leaves: list[torch.Tensor] = []
    for item in items:
        if isinstance(item, torch.Tensor):
            leaves.append(item)
        elif isinstance(item, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in item):
            leaves.extend(item)
        else:
            raise TypeError(f"a pipeline boundary carries tensors or tuples of tensors, got {type(item).__name__}")
    return leaves
