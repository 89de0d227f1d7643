"""The typed plan IR: parallel schemes, strategies, the cost model and step plans.

Every type here is a frozen dataclass that validates itself on construction and quotes the bad value in
its error. The planner decides in these types; the runtime and the compiler consume them. Nothing here
imports torch.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

__all__ = [
    "ParallelScheme",
    "Strategy",
    "SchemeCost",
    "CostModel",
    "ReplicaPlan",
    "Place",
    "StepPlan",
    "PlanError",
    "bucket_padding",
]


class PlanError(ValueError):
    """Bad planner input (a length, a scheme, a GPU count): the message names the value and what was expected."""


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True, order=True)
class ParallelScheme:
    """One data-parallel replica's layout: tensor, pipeline and context parallel degrees."""

    tp: int = 1
    """Tensor-parallel degree (GPUs that split every layer)."""
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    cp: int = 1
    """Context-parallel degree (GPUs that split one sequence); 1 unless given."""
    rc: bool = False
    """Activation recomputation: every layer's activations are dropped after its forward and recomputed in its
    backward (a micro-batch keeps each layer's input only); the parameter layout is the same as without."""

    def __post_init__(self) -> None:
        _check_positive_int("tp", self.tp)
        _check_positive_int("pp", self.pp)
        _check_positive_int("cp", self.cp)
        if not isinstance(self.rc, bool):
            raise PlanError(f"rc must be True or False, got {self.rc!r}")

    @property
    def gpus(self) -> int:
        """GPUs one replica of this scheme occupies."""
        return self.tp * self.pp * self.cp

    def describe(self) -> str:
        """Stable text form, e.g. ``(tp4,pp2)``; ``cp`` is printed only when it is not 1, ``rc`` (recomputation)
        only when set: ``(tp8,pp1,cp2,rc)``."""
        cp = f",cp{self.cp}" if self.cp != 1 else ""
        rc = ",rc" if self.rc else ""
        return f"(tp{self.tp},pp{self.pp}{cp}{rc})"

    @classmethod
    def parse(cls, text: str) -> "ParallelScheme":
        """Parse ``tp4``, ``(tp4,pp2)``, ``(cp2,tp4)``, ``tp8,pp3,cp1`` or ``(tp8,rc)``: the degrees in any order,
        each at most once; missing degrees default to 1; ``rc``: activation recomputation."""
        body = text.strip()
        if body.startswith("(") and body.endswith(")"):
            body = body[1:-1]
        degrees: dict[str, int | bool] = {}
        for part in filter(None, (p.strip() for p in body.split(","))):
            m = re.fullmatch(r"(tp|pp|cp)(\d+)|(rc)", part)
            key = "" if m is None else str(m.group(1) or m.group(3))
            if m is None or key in degrees:
                raise PlanError(f"cannot parse scheme {text!r}: expected e.g. '(tp4,pp2)' or '(tp8,cp2,rc)'")
            degrees[key] = True if key == "rc" else int(m.group(2))
        if not set(degrees) - {"rc"}:
            raise PlanError(f"cannot parse scheme {text!r}: expected e.g. '(tp4,pp2)' or '(tp8,cp2,rc)'")
        return cls(**degrees)  # type: ignore[arg-type]


def _scheme_sort_key(scheme: ParallelScheme) -> tuple[int, int, int, int, bool]:
    return (-scheme.gpus, -scheme.tp, -scheme.pp, -scheme.cp, scheme.rc)


@dataclass(frozen=True, slots=True, kw_only=True)
class Strategy:
    """A multiset of replica schemes whose GPUs add up to the cluster, e.g. ``1x(tp16,pp1)+12x(tp4,pp1)``."""

    parts: tuple[tuple[ParallelScheme, int], ...]
    """(scheme, replica count) pairs, canonical order: larger replicas first; each scheme at most once."""

    def __post_init__(self) -> None:
        if not self.parts:
            raise PlanError("a strategy needs at least one replica, got none")
        merged: dict[ParallelScheme, int] = {}
        for scheme, count in self.parts:
            if not isinstance(scheme, ParallelScheme):
                raise PlanError(f"strategy part {scheme!r} is not a ParallelScheme")
            _check_positive_int(f"replica count of {scheme.describe()}", count)
            merged[scheme] = merged.get(scheme, 0) + count
        canonical = tuple(sorted(merged.items(), key=lambda kv: _scheme_sort_key(kv[0])))
        object.__setattr__(self, "parts", canonical)

    @classmethod
    def of(cls, counts: Mapping[ParallelScheme, int] | Iterable[tuple[ParallelScheme, int]]) -> "Strategy":
        """Build from a mapping or pairs of (scheme, count)."""
        items = counts.items() if isinstance(counts, Mapping) else counts
        return cls(parts=tuple((s, int(n)) for s, n in items if n))

    @classmethod
    def homogeneous(cls, scheme: ParallelScheme, gpus: int) -> "Strategy":
        """``gpus // scheme.gpus`` replicas of one scheme; the GPU count must divide exactly."""
        if gpus % scheme.gpus:
            raise PlanError(f"{gpus} GPUs cannot be filled by replicas of {scheme.describe()} "
                            f"({scheme.gpus} GPUs each)")
        return cls(parts=((scheme, gpus // scheme.gpus),))

    @classmethod
    def parse(cls, text: str) -> "Strategy":
        """Parse ``1x(tp16,pp1)+12x(tp4)``; a part without ``Nx`` counts once."""
        parts = []
        for chunk in text.replace(" ", "").split("+"):
            m = re.fullmatch(r"(?:(\d+)x)?(\(.*\)|(?:tp|pp|cp)\d+.*)", chunk)
            if m is None:
                raise PlanError(f"cannot parse strategy {text!r}: expected e.g. '1x(tp16)+12x(tp4)'")
            try:
                parts.append((ParallelScheme.parse(m.group(2)), int(m.group(1) or 1)))
            except PlanError as exc:
                raise PlanError(f"cannot parse strategy {text!r}: {exc}") from None
        try:
            return cls(parts=tuple(parts))
        except PlanError as exc:
            raise PlanError(f"bad strategy {text!r}: {exc}") from None

    @property
    def gpus(self) -> int:
        """GPUs of all replicas together."""
        return sum(s.gpus * n for s, n in self.parts)

    @property
    def schemes(self) -> tuple[ParallelScheme, ...]:
        """The distinct schemes, canonical order."""
        return tuple(s for s, _ in self.parts)

    @property
    def is_homogeneous(self) -> bool:
        """True when every replica has the same scheme."""
        return len(self.parts) == 1

    def replicas(self) -> tuple[ParallelScheme, ...]:
        """One scheme per replica, canonical order (the order ranks are handed out in)."""
        return tuple(s for s, n in self.parts for _ in range(n))

    def describe(self) -> str:
        """Stable text form: ``1x(tp16,pp1)+12x(tp4,pp1)``."""
        return "+".join(f"{n}x{s.describe()}" for s, n in self.parts)

    def __str__(self) -> str:
        return self.describe()


def bucket_padding(buckets: Sequence[int], tokens: int) -> int:
    """Tokens the runtime adds to a micro-batch of ``tokens`` to reach its bucket (the smallest of the ascending
    ``buckets`` that holds it): 0 without buckets, for an empty micro-batch, or beyond the largest bucket."""
    if not buckets or tokens <= 0:
        return 0
    i = bisect.bisect_left(buckets, tokens)
    return buckets[i] - tokens if i < len(buckets) else 0


def _relu(x: Any) -> Any:
    """max(x, 0) for a number or a numpy array alike."""
    return (x + abs(x)) / 2


def _least(x: Any, y: Any) -> Any:
    """min(x, y) for numbers or numpy arrays alike."""
    return (x + y - abs(x - y)) / 2


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionShape:
    """How a sequence's attention work grows with its length s: ``s^2`` for causal attention, less for the share
    of it whose keys a window or chunks limit (the kernels skip the key blocks outside them)."""

    limited: tuple[tuple[float, int | None, int | None], ...] = ()
    """(share of the attention work, window, chunk) for each kind of limited attention layer; the shares add
    up to at most 1 and the rest of the work is plain causal."""

    def __post_init__(self) -> None:
        for share, window, chunk in self.limited:
            if not (isinstance(share, (int, float)) and 0 < share <= 1):
                raise PlanError(f"an attention share must be in (0, 1], got {share!r}")
            if (window is None and chunk is None) or (window is not None and window < 0) or \
                    (chunk is not None and chunk < 1):
                raise PlanError(f"a limited share needs a window >= 0 or a chunk >= 1, got {window!r}, {chunk!r}")
        if sum(share for share, _, _ in self.limited) > 1 + 1e-9:
            raise PlanError(f"attention shares add up to more than 1: {self.limited!r}")

    def quadratic(self, s: Any) -> Any:
        """The attention work of a sequence of length ``s`` (a number or a numpy array) in units of ``s^2`` for
        causal attention (its s(s + 1) / 2 pairs): ``2 pairs - s`` of the pairs a limit keeps, so a window W
        keeps ``s^2 - max(s - W - 1, 0) max(s - W, 0)``, chunks of C keep ``n C^2 + (s - n C)^2`` with
        ``n = s // C`` (both: the smaller)."""
        square = s * s
        total = square
        for share, window, chunk in self.limited:
            kept = square
            if window is not None:
                kept = square - _relu(s - (window + 1)) * _relu(s - window)
            if chunk is not None:
                n = s // chunk
                kept = _least(kept, n * chunk * chunk + (s - n * chunk) ** 2)
            total = total - share * (square - kept)
        return total

    def describe(self) -> str:
        """``causal`` or e.g. ``causal; 0.5 window 4095``."""
        parts = [f"{share:.3g} {'window ' + str(w) if w is not None else ''}{' ' if w is not None and c else ''}"
                 f"{'chunks of ' + str(c) if c is not None else ''}" for share, w, c in self.limited]
        return "; ".join(["causal", *parts])


@dataclass(frozen=True, slots=True, kw_only=True)
class SchemeCost:
    """Cost coefficients of one scheme: ``T(s) = a*s^2 + b*s + c`` ms per micro-batch per pipeline stage."""

    scheme: ParallelScheme
    """The scheme these numbers are for."""
    a: float
    """Quadratic (attention) coefficient, ms per token^2, per sequence."""
    b: float
    """Linear coefficient, ms per token."""
    c: float
    """Fixed cost of one micro-batch on one stage, ms."""
    max_tokens: int
    """Most tokens one micro-batch may hold under the memory model (0: the scheme does not fit at all)."""
    exchange: float = 0.0
    """Context parallelism's K/V exchange, ms per token of a sequence per stage: it runs beside the sequence's
    attention (``a s^2``), so a sequence costs ``b s + max(a s^2, exchange s)``; 0 without CP."""
    shape: AttentionShape = field(default_factory=AttentionShape)
    """How the attention term grows with a sequence's length (``s^2`` unless windows or chunks limit it)."""

    def __post_init__(self) -> None:
        for name in ("a", "b", "c", "exchange"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value) or value < 0:
                raise PlanError(
                    f"cost coefficient {name} of {self.scheme.describe()} must be a finite number >= 0, got {value!r}"
                )
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise PlanError(f"max_tokens of {self.scheme.describe()} must be an integer >= 0, got {self.max_tokens!r}")

    def seq_ms(self, seq_len: int | float) -> float:
        """Time one sequence adds to a micro-batch on one stage (without the fixed ``c``): ``a s^2 + b s`` (``s^2``
        as :attr:`shape` counts it), the attention term replaced by the CP exchange where that is longer."""
        return self.b * seq_len + max(self.a * self.shape.quadratic(seq_len), self.exchange * seq_len)


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """Time and memory of every scheme the planner may use, for one model on one kind of hardware."""

    name: str
    """What the numbers describe, e.g. ``llama-32b@a800-80g``."""
    entries: tuple[SchemeCost, ...]
    """One entry per known scheme."""
    gpus_per_node: int = 8
    """GPUs in one node; a TP group of at most this size never crosses a node."""
    buckets: tuple[int, ...] = ()
    """Token counts the runtime pads each micro-batch up to (its compiled graphs' static sizes), ascending; the
    padding runs as one more sequence and is charged as one. Empty: micro-batches run at their own size."""
    _index: dict = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        _check_positive_int("gpus_per_node", self.gpus_per_node)
        if (not isinstance(self.buckets, tuple) or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                                                       for b in self.buckets)
                or list(self.buckets) != sorted(set(self.buckets))):
            raise PlanError(f"buckets of cost model {self.name!r} must be a tuple of strictly ascending positive "
                            f"integers, got {self.buckets!r}")
        index: dict[ParallelScheme, SchemeCost] = {}
        for entry in self.entries:
            if entry.scheme in index:
                raise PlanError(f"cost model {self.name!r} lists scheme {entry.scheme.describe()} twice")
            index[entry.scheme] = entry
        if not index:
            raise PlanError(f"cost model {self.name!r} knows no scheme")
        object.__setattr__(self, "_index", index)

    @property
    def schemes(self) -> tuple[ParallelScheme, ...]:
        """Known schemes that can hold at least one token, canonical order."""
        return tuple(sorted((s for s, e in self._index.items() if e.max_tokens > 0), key=_scheme_sort_key))

    def cost(self, scheme: ParallelScheme) -> SchemeCost:
        """The coefficients of ``scheme``; an unknown scheme is an error that lists the known ones."""
        try:
            return self._index[scheme]
        except KeyError:
            known = ", ".join(s.describe() for s in self.schemes)
            raise PlanError(f"unknown scheme {scheme.describe()} for cost model {self.name!r}; "
                            f"known: {known}") from None

    def max_tokens(self, scheme: ParallelScheme) -> int:
        """Most tokens one micro-batch of ``scheme`` may hold (also its longest sequence)."""
        return self.cost(scheme).max_tokens

    def limited(self, shape: AttentionShape) -> "CostModel":
        """This model with every scheme's attention term shaped by ``shape`` (windows, chunks)."""
        from dataclasses import replace

        return replace(self, entries=tuple(replace(e, shape=shape) for e in self.entries))

    def longest_supported(self) -> int:
        """The longest sequence any known scheme can hold."""
        return max(e.max_tokens for e in self.entries)

    def micro_batch_ms(self, scheme: ParallelScheme, seq_lens: Sequence[int]) -> float:
        """Time of one packed micro-batch on one stage: ``sum_i (a s_i^2 + b s_i) + c``, the padding up to its
        bucket (``buckets``) counted as one more sequence."""
        e = self.cost(scheme)
        return sum(e.seq_ms(s) for s in seq_lens) + e.seq_ms(bucket_padding(self.buckets, sum(seq_lens))) + e.c

    def micro_batch_times(self, replica: ReplicaPlan, seq_lens: Sequence[int]) -> list[float]:
        """``micro_batch_ms`` of each of ``replica``'s micro-batches (indices into ``seq_lens``)."""
        return [self.micro_batch_ms(replica.scheme, [seq_lens[i] for i in mb]) for mb in replica.micro_batches]

    @staticmethod
    def replica_ms(scheme: ParallelScheme, micro_batch_ms: Sequence[float]) -> float:
        """1F1B time of a replica: ``sum_j t_j + (pp - 1) * max_j t_j`` (0 for no micro-batch)."""
        if not micro_batch_ms:
            return 0.0
        return float(sum(micro_batch_ms) + (scheme.pp - 1) * max(micro_batch_ms))

    def fits(self, strategy: Strategy) -> list[ParallelScheme]:
        """The schemes of ``strategy`` this model cannot run (unknown, or no memory left for a token)."""
        return [s for s in strategy.schemes if s not in self._index or self._index[s].max_tokens <= 0]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaPlan:
    """One replica of a step: its scheme, ranks, micro-batches and estimated time."""

    scheme: ParallelScheme
    """The replica's layout."""
    ranks: tuple[int, ...]
    """Global ranks, a grid (stage, CP rank, TP rank) in that order: the rank at (s, c, t) is
    ``ranks[(s * cp + c) * tp + t]``, so a TP group is contiguous (inside a node) and stage s holds
    ``ranks[s*tp*cp:(s+1)*tp*cp]``."""
    micro_batches: tuple[tuple[int, ...], ...]
    """Each micro-batch as indices into the step's ``seq_lens``."""
    max_tokens: int
    """Token cap of one micro-batch of this scheme."""
    est_ms: float
    """Cost-model estimate of this replica's 1F1B time."""

    def __post_init__(self) -> None:
        if len(self.ranks) != self.scheme.gpus:
            raise PlanError(f"replica {self.scheme.describe()} needs {self.scheme.gpus} ranks, got {len(self.ranks)}")

    def rank_at(self, stage: int, cp_rank: int, tp_rank: int) -> int:
        """The global rank at (pipeline stage, CP rank, TP rank) of this replica's grid."""
        return self.ranks[(stage * self.scheme.cp + cp_rank) * self.scheme.tp + tp_rank]

    def tp_group(self, stage: int, cp_rank: int = 0) -> tuple[int, ...]:
        """The tensor-parallel group (global ranks) of ``stage`` at ``cp_rank``."""
        return tuple(self.rank_at(stage, cp_rank, t) for t in range(self.scheme.tp))

    def cp_group(self, stage: int, tp_rank: int = 0) -> tuple[int, ...]:
        """The context-parallel group (global ranks) of ``stage`` at ``tp_rank``: the ranks that share sequences."""
        return tuple(self.rank_at(stage, c, tp_rank) for c in range(self.scheme.cp))

    @property
    def tp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every tensor-parallel group, stage by stage (then CP rank by CP rank): with cp = 1, one per stage,
        ``tp_groups[stage]``."""
        return tuple(self.tp_group(s, c) for s in range(self.scheme.pp) for c in range(self.scheme.cp))

    @property
    def cp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every context-parallel group, stage by stage (then TP rank by TP rank); none when cp = 1."""
        if self.scheme.cp == 1:
            return ()
        return tuple(self.cp_group(s, t) for s in range(self.scheme.pp) for t in range(self.scheme.tp))

    def to_dict(self) -> dict:
        """The JSON form used by ``--plans-out``."""
        return {
            "tp": self.scheme.tp,
            "pp": self.scheme.pp,
            "cp": self.scheme.cp,
            "ranks": list(self.ranks),
            "max_tokens": self.max_tokens,
            "micro_batches": [list(mb) for mb in self.micro_batches],
            "est_ms": round(self.est_ms, 3),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Place:
    """One rank's place in a step plan."""

    replica: int
    """Index into ``StepPlan.replicas``."""
    stage: int
    """Pipeline stage."""
    cp_rank: int
    """Index in its context-parallel group (0 when cp = 1)."""
    tp_rank: int
    """Index in its tensor-parallel group."""


def _place(index: int, replica: ReplicaPlan, at: int) -> Place:
    """The place of ``replica.ranks[at]`` (``replica`` being ``StepPlan.replicas[index]``): its (stage, CP rank,
    TP rank) in the replica's grid."""
    tp, cp = replica.scheme.tp, replica.scheme.cp
    return Place(replica=index, stage=at // (tp * cp), cp_rank=at // tp % cp, tp_rank=at % tp)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepPlan:
    """The whole plan of one training step: strategy, replicas with their data, estimates."""

    strategy: Strategy
    """The step's strategy."""
    seq_lens: tuple[int, ...]
    """Lengths of the global batch's sequences; micro-batches index into this."""
    replicas: tuple[ReplicaPlan, ...]
    """One entry per replica, in the strategy's canonical order."""
    est_step_ms: float
    """Estimated step time: the slowest replica, plus ``est_move_ms``."""
    lower_bound_ms: float
    """A bound no plan of this batch on this cluster can beat (docs/design.md, section 6.2), with the
    movement floor when movement is charged."""
    policy: str = "hydraulis"
    """The planner policy that made the plan."""
    solve_ms: float = 0.0
    """Wall-clock time the planner needed for this step."""
    est_move_ms: float = 0.0
    """The exposed parameter and gradient movement included in ``est_step_ms`` (0 when not charged)."""
    regrouped: bool = False
    """True when ranks regroup during the step (the ``dynamic-cp`` baseline: a CP group per sequence, groups
    one after another on shared ranks). ``strategy`` is then the layout of the slots: every rank computes with
    its slot's parameter slice in every group it joins (:meth:`slot_problem`), and runs its groups in the
    order of ``replicas`` (:meth:`places_of`)."""

    @property
    def num_gpus(self) -> int:
        """GPUs the plan uses."""
        return self.strategy.gpus

    def position_of(self, rank: int) -> tuple[int, int, int]:
        """(replica index, pipeline stage, rank within its TP group) of global ``rank``: the placement the
        planner made (``ReplicaPlan.ranks``), which every layer reads. :meth:`place_of` adds the CP rank."""
        place = self.place_of(rank)
        return place.replica, place.stage, place.tp_rank

    def place_of(self, rank: int) -> "Place":
        """Where global ``rank`` is in the plan: replica, pipeline stage, CP rank, TP rank (a regrouped plan has
        several: :meth:`places_of`)."""
        if self.regrouped:
            raise PlanError(f"a {self.policy} plan regroups its ranks during the step; no rank has one place")
        places = self.places_of(rank)
        if not places:
            raise PlanError(f"rank {rank} is in no replica of {self.strategy.describe()}")
        return places[0]

    def places_of(self, rank: int) -> tuple["Place", ...]:
        """Every place of global ``rank`` in the plan, in the order of ``replicas`` (the order a rank of a
        regrouped plan runs its groups in; one place otherwise)."""
        return tuple(_place(index, replica, replica.ranks.index(rank))
                     for index, replica in enumerate(self.replicas) if rank in replica.ranks)

    def slot_problem(self) -> str | None:
        """What stops a rank from computing with one parameter slice in every group it joins (None: nothing): in
        a regrouped plan each of a rank's groups must give it the same pipeline stage of the same (tp, pp) and
        the same TP group, so that nothing moves between its groups. One pass over the plan."""
        seen: dict[int, tuple[tuple, int]] = {}
        for index, replica in enumerate(self.replicas):
            tp, pp = replica.scheme.tp, replica.scheme.pp
            for at, rank in enumerate(replica.ranks):
                place = _place(index, replica, at)
                key = (tp, pp, place.stage, replica.tp_group(place.stage, place.cp_rank))
                first, i = seen.setdefault(rank, (key, index))
                if first != key:
                    return (f"rank {rank} computes stage {first[2]} of (tp={first[0]}, pp={first[1]}) with TP group "
                            f"{list(first[3])} in group {i} and stage {place.stage} of (tp={tp}, pp={pp}) with TP "
                            f"group {list(key[3])} in group {index}: a rank's groups must share one parameter slice")
        return None

    def to_dict(self, step: int | None = None) -> dict:
        """The JSON form of one ``--plans-out`` line."""
        out: dict = {} if step is None else {"step": step}
        out.update(
            policy=self.policy,
            strategy=self.strategy.describe(),
            num_gpus=self.num_gpus,
            seq_lens=list(self.seq_lens),
            replicas=[r.to_dict() for r in self.replicas],
            est_step_ms=round(self.est_step_ms, 3),
            est_move_ms=round(self.est_move_ms, 3),
            lower_bound_ms=round(self.lower_bound_ms, 3),
            solve_ms=round(self.solve_ms, 3),
        )
        if self.regrouped:
            out["regrouped"] = True
        return out

    def to_json(self, step: int | None = None) -> str:
        """One JSON line."""
        return json.dumps(self.to_dict(step), separators=(",", ":"))
