"""Planning off the critical path: rank 0 plans step i+1 in a background thread while step i runs, then
broadcasts the plan so that every rank runs the same one, with when it was planned (hidden or not)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from passes.plan.ir import CostModel, PlanError, StepPlan, Strategy
from passes.plan.policies import Planner
from runtime import distributed as comm
from runtime.cpu_clock import RankCpuClock

__all__ = ["PlanService", "PlannedStep", "PlanTimeout", "DEFAULT_PLAN_TIMEOUT_S", "plan_timeout_s"]

DEFAULT_PLAN_TIMEOUT_S = 120.0
"""How long a step waits for its plan unless ``HCOMPILE_PLAN_TIMEOUT_S`` or the trainer says otherwise."""


def plan_timeout_s() -> float:
    """The planning timeout of a trainer built now: env ``HCOMPILE_PLAN_TIMEOUT_S``, else the default; a value
    that is not a positive number is a ValueError naming it."""
    return comm.env_seconds("HCOMPILE_PLAN_TIMEOUT_S", DEFAULT_PLAN_TIMEOUT_S)


class PlanTimeout(RuntimeError):
    """Planning did not finish in time; raised on every rank."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedStep:
    """A broadcast plan and how its planning went."""

    plan: StepPlan
    """The plan every rank runs."""
    plan_ms: float
    """Planning wall time on rank 0."""
    hidden: bool
    """Whether the plan was computed while the previous step ran: planning started before that step's compute
    phase ended (``previous_compute_end`` of ``take``) and finished before ``take`` was called (rank 0's
    clock). A plan submitted and taken with no step between is never hidden, however quick."""
    window: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """(planning started, planning finished, plan needed) on rank 0's ``time.perf_counter``."""


class PlanService:
    """``submit`` the next batch's lengths as soon as they are known; ``take`` the plan when it is needed."""

    def __init__(self, planner: Planner, rank: int, policy: str = "hydraulis", cpu_clock: RankCpuClock | None = None,
                 timeout_s: float = DEFAULT_PLAN_TIMEOUT_S):
        if not timeout_s > 0:
            raise ValueError(f"the planning timeout must be positive, got {timeout_s!r}")
        self.planner, self.rank, self.policy = planner, rank, policy
        self.timeout_s = timeout_s
        """How long ``take`` waits for a plan before every rank raises a :class:`PlanTimeout`."""
        self.cpu_clock = cpu_clock
        """Where the planning thread registers as background work (the executor's clock), if given."""
        self._thread: threading.Thread | None = None
        self._result: tuple[StepPlan | None, float, BaseException | None] = (None, 0.0, None)
        self._window = (0.0, 0.0)
        """(started, finished) of the last planning, ``time.perf_counter`` seconds on rank 0."""
        self._next_cost_model: CostModel | None = None

    def set_cost_model(self, cost_model: CostModel) -> None:
        """Plan with ``cost_model`` from the next ``submit`` on (a plan in flight keeps the model it started
        with); it must know the same schemes with the same caps."""
        current = self.planner.cost_model

        def caps(model: CostModel) -> list:
            return [(e.scheme, e.max_tokens) for e in model.entries]

        if caps(cost_model) != caps(current):
            raise PlanError(f"cost model {cost_model.name!r} does not have the schemes and caps of {current.name!r}")
        self._next_cost_model = cost_model

    def submit(self, seq_lens: list[int], strategy: Strategy | None = None) -> None:
        """Start planning (on rank 0; other ranks do nothing)."""
        if self.rank != 0:
            return
        if self._thread is not None:
            raise RuntimeError("a plan was submitted and not taken yet")
        if self._next_cost_model is not None:  # no planning thread is running now
            self.planner.cost_model, self._next_cost_model = self._next_cost_model, None

        started = time.perf_counter()
        self._window = (started, float("inf"))

        def work() -> None:
            try:
                plan = self.planner.plan(seq_lens, self.policy, strategy=strategy)
                self._result = (plan, (time.perf_counter() - started) * 1e3, None)
            except BaseException as exc:  # re-raised on the calling thread in take()
                self._result = (None, 0.0, exc)
            self._window = (started, time.perf_counter())

        target = work if self.cpu_clock is None else self.cpu_clock.background(work)
        self._thread = threading.Thread(target=target, name="hcompile-planner", daemon=True)
        self._thread.start()

    def take(self, previous_compute_end: float | None = None) -> PlannedStep:
        """The submitted plan, broadcast from rank 0 (collective: every rank calls it). ``previous_compute_end``:
        when the previous step's compute phase ended on rank 0 (``time.perf_counter``; None: no step ran
        since the plan was submitted), which says whether the planning was hidden behind it."""
        payload: list = [None]
        if self.rank == 0:
            if self._thread is None:
                raise RuntimeError("take() without submit()")
            needed = time.perf_counter()
            self._thread.join(timeout=self.timeout_s)
            started, finished = self._window
            hidden = previous_compute_end is not None and started < previous_compute_end and finished <= needed
            if self._thread.is_alive():  # left behind (a daemon thread); this job cannot go on
                plan, plan_ms, error = None, 0.0, PlanTimeout(
                    f"planning a step took more than {self.timeout_s:g} s (a hung planner?); every rank stops")
            else:
                plan, plan_ms, error = self._result
            self._thread = None
            payload = [(plan, plan_ms, hidden, error, (started, finished, needed))]
        plan, plan_ms, hidden, error, window = comm.broadcast_object(payload[0])
        if error is not None:  # the same exception on every rank, so that every rank stops or goes on alike
            raise error
        return PlannedStep(plan=plan, plan_ms=plan_ms, hidden=hidden, window=window)
