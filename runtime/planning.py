"""Planning off the critical path: rank 0 plans step i+1 in a background thread while step i runs, then
broadcasts the plan so that every rank runs the same one."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from passes.plan.ir import CostModel, PlanError, StepPlan, Strategy
from passes.plan.policies import Planner
from runtime import distributed as comm
from runtime.cpu_clock import RankCpuClock

__all__ = ["PlanService", "PlannedStep", "PlanTimeout", "DEFAULT_PLAN_TIMEOUT_S"]

DEFAULT_PLAN_TIMEOUT_S = float(os.environ.get("HCOMPILE_PLAN_TIMEOUT_S", 120.0))
"""How long a step waits for its plan (env ``HCOMPILE_PLAN_TIMEOUT_S``)."""


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
    """Whether planning had finished before the plan was needed (hidden behind the previous step)."""


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

        def work() -> None:
            started = time.perf_counter()
            try:
                plan = self.planner.plan(seq_lens, self.policy, strategy=strategy)
                self._result = (plan, (time.perf_counter() - started) * 1e3, None)
            except BaseException as exc:  # re-raised on the calling thread in take()
                self._result = (None, 0.0, exc)

        target = work if self.cpu_clock is None else self.cpu_clock.background(work)
        self._thread = threading.Thread(target=target, name="hcompile-planner", daemon=True)
        self._thread.start()

    def take(self) -> PlannedStep:
        """The submitted plan, broadcast from rank 0 (collective: every rank calls it)."""
        payload: list = [None]
        if self.rank == 0:
            if self._thread is None:
                raise RuntimeError("take() without submit()")
            hidden = not self._thread.is_alive()
            self._thread.join(timeout=self.timeout_s)
            if self._thread.is_alive():  # left behind (a daemon thread); this job cannot go on
                plan, plan_ms, error = None, 0.0, PlanTimeout(
                    f"planning a step took more than {self.timeout_s:g} s (a hung planner?); every rank stops")
            else:
                plan, plan_ms, error = self._result
            self._thread = None
            payload = [(plan, plan_ms, hidden, error)]
        plan, plan_ms, hidden, error = comm.broadcast_object(payload[0])
        if error is not None:  # the same exception on every rank, so that every rank stops or goes on alike
            raise error
        return PlannedStep(plan=plan, plan_ms=plan_ms, hidden=hidden)
