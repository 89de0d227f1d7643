"""What each rank of the compile-and-run harness does: for every policy a ``Trainer`` of the same compiled
model (same initial weights, same batches) with every variant its strategies can use compiled up front; then
the steps, the policies interleaved step by step so that background load hits them alike (warm-up steps
first, not measured). Rank 0 records per step the plan (strategy, per replica its ranks, scheme and
micro-batches), the runtime's ``StepStats`` and the cost-model calibration factors (``runtime.calibration``)
the following plans use."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from passes.graph.variant import TokenBuckets
from passes.plan.datasets import LengthDataset
from passes.plan.ir import CostModel, StepPlan
from passes.plan.links import Links

__all__ = ["RankJob", "rank_main", "predicted_replicas", "predicted_slots", "predicted_move_ms"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankJob:
    """Everything a rank needs (picklable)."""

    model: str
    """CPU model preset."""
    seed: int
    """Weight seed (the same for every policy)."""
    policies: tuple[str, ...]
    """Policies, run one after the other."""
    batches: tuple[tuple[int, ...], ...]
    """Sequence lengths of every step (warm-up steps first)."""
    tokens: tuple[tuple[tuple[int, ...], ...], ...] | None
    """The token ids of every sequence of every step (real text), or None: random tokens of those lengths."""
    warmup: int
    """Leading steps that are not measured."""
    tokens_per_rank: int
    """Per-rank token cap."""
    buckets: tuple[int, ...]
    """Token buckets of micro-batches."""
    cost_model: CostModel
    """The planner's cost model."""
    dataset: LengthDataset
    """The (scaled) length dataset the hydraulis pool is built from."""
    lr: float
    """AdamW learning rate."""
    show_progress: bool
    """Progress bar on rank 0."""
    compile_backend: str = "auto"
    """torch.compile backend of the variants."""
    take_turns: bool = False
    """Replicas compute one after the other within a step (``Executor.take_turns``)."""
    links: Links | None = None
    """The links the profile measured between these ranks, on which the planner's movement time is predicted
    (None: the ranks probe them first, ``runtime.link_probe``)."""
    strategies: tuple[str, ...] | None = None
    """A listed pool (context parallelism is planned only where strategies list it), or None: each trainer
    builds its own."""


def predicted_replicas(cost_model: CostModel, plan: StepPlan,
                       buckets: TokenBuckets) -> list[tuple[float, tuple[float, float]]]:
    """Per replica, the cost model's time of its micro-batches as the runtime executes them (each padded up to its
    token bucket by one extra sequence), and the time of its first and last micro-batch (what the overlapped
    movement's model reads, ``MovementCost.step_ms``)."""
    executed = dataclasses.replace(cost_model, buckets=buckets.sizes)
    out = []
    for r in plan.replicas:
        times = executed.micro_batch_times(r, plan.seq_lens)
        out.append((executed.replica_ms(r.scheme, times), (times[0], times[-1]) if times else (0.0, 0.0)))
    return out


def predicted_slots(plan: StepPlan, groups: list[tuple[float, tuple[float, float]]],
                    gpus_per_node: int) -> list[tuple[float, tuple[float, float]]]:
    """A regrouped plan's groups (``predicted_replicas``) replayed in the plan's order on their ranks, as the
    runtime runs them (a group starts when all of its ranks are free): per slot of its layout
    (``plan.strategy``), when it finishes and the time of its first and last micro-batch."""
    from passes.plan.placement import assign_ranks

    free: dict[int, float] = {}
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for group, (ms, (head, tail)) in zip(plan.replicas, groups):
        start = max(free.get(r, 0.0) for r in group.ranks)
        for r in group.ranks:
            free[r] = start + ms
            if group.micro_batches:
                first.setdefault(r, head)
                last[r] = tail
    return [(max(free.get(r, 0.0) for r in slot), (first.get(slot[0], 0.0), last.get(slot[0], 0.0)))
            for slot in assign_ranks(plan.strategy, gpus_per_node)]


def predicted_move_ms(movement, plan: StepPlan, replicas: list[tuple[float, tuple[float, float]]]) -> float:
    """What the movement adds to the predicted step (``MovementCost.step_ms`` less the slowest replica's
    compute): plain, the pull and the push; overlapped, the slowdown of the compute beside its transfers plus
    the stall of the first forward and the push's tail after the last backward."""
    compute = [ms for ms, _ in replicas]
    return movement.step_ms(plan.strategy, compute, [e for _, e in replicas]) - max(compute, default=0.0)


def _token_batches(job: RankJob) -> list[list[torch.Tensor]]:
    if job.tokens is not None:
        return [[torch.tensor(seq, dtype=torch.long) for seq in batch] for batch in job.tokens]
    vocab = __import__("hcompile.tools.profile", fromlist=["CPU_MODELS"]).CPU_MODELS[job.model].vocab
    gen = torch.Generator().manual_seed(job.seed + 7)
    return [[torch.randint(0, vocab, (n,), generator=gen) for n in lens] for lens in job.batches]


def _step_record(step: int, stats, plan: StepPlan, wall_ms: float,
                 replicas: list[tuple[float, tuple[float, float]]], movement,
                 groups: list[tuple[float, tuple[float, float]]]) -> dict:
    """One measured step; ``replicas``: per replica of ``plan.strategy`` its predicted time and edges (a
    regrouped plan's slots), ``groups``: per entry of ``plan.replicas``."""
    moved = None if movement is None else movement.time(plan.strategy)
    pred = [ms for ms, _ in replicas]
    return {
        "pull_ms": list(stats.pull_ms), "push_ms": list(stats.push_ms),
        "wait_ms": list(stats.pull_wait_ms) or [0.0] * len(stats.pull_ms),
        "movement_mode": None if movement is None else movement.mode,
        "pred_pull_ms": None if moved is None else moved.pull_ms,
        "pred_push_ms": None if moved is None else moved.push_ms,
        "pred_move_ms": None if movement is None else predicted_move_ms(movement, plan, replicas),
        "step": step, "loss": stats.loss, "tokens": stats.tokens, "strategy": stats.strategy,
        "busy_ms": list(stats.busy_ms), "compute_thread_ms": list(stats.compute_thread_ms), "wall_ms": wall_ms,
        "compilations": stats.compilations,
        "param_bytes_received": stats.traffic.params_received, "grad_bytes_sent": stats.traffic.grads_sent,
        "tokens_computed": list(stats.tokens_computed), "plan_ms": stats.plan_ms, "plan_hidden": stats.plan_hidden,
        "est_ms": plan.est_step_ms, "pred_ms": max(pred), "lower_bound_ms": plan.lower_bound_ms,
        "regrouped": plan.regrouped,
        "replicas": [{"scheme": r.scheme.describe(), "ranks": list(r.ranks), "est_ms": r.est_ms, "pred_ms": p,
                      "micro_batch_tokens": [sum(plan.seq_lens[i] for i in mb) for mb in r.micro_batches]}
                     for r, (p, _) in zip(plan.replicas, groups)],
    }


def _setup_policy(job: RankJob, compiled, policy: str) -> dict:
    """A Trainer for ``policy`` from the initial weights, with every variant it can use compiled."""
    from hcompile.models import init_weights_
    from hcompile.train import Trainer, TrainOptions

    init_weights_(compiled.model, seed=job.seed)
    buckets = TokenBuckets(sizes=job.buckets)
    options = TrainOptions(optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": job.lr},
                           tokens_per_rank=job.tokens_per_rank, strategies=job.strategies or "auto",
                           policy=policy, buckets=buckets, replicas_take_turns=job.take_turns)
    trainer = Trainer(compiled, options, cost_model=job.cost_model, dataset=job.dataset)
    started = time.perf_counter()
    planner = trainer._planner(list(job.batches[0])).planner  # builds the planner and warms its pool up
    strategies = _warmed(trainer, planner, policy)
    trainer.warm_up(strategies)  # every variant these strategies can ask of this rank
    builds = trainer.lowerings.compilations()
    movement = None
    if job.links is not None:  # the planner's replay of this runtime's movement, on the profiled links
        movement = trainer.movement_cost({s for strategy in strategies for s in strategy.schemes}, job.links)
    return {"trainer": trainer, "buckets": buckets, "pool": [s.describe() for s in planner.pool], "movement": movement,
            "fixed": planner.fixed.describe(), "compile_s": time.perf_counter() - started,
            "builds_before_steps": builds, "warm_compilations": builds, "steps": [],
            "batches": iter(_token_batches(job))}


def _warmed(trainer, planner, policy: str) -> list:
    """The strategies whose variants ``policy``'s plans can ask for: the fixed strategy (the baselines), the CP
    baselines' own, or the pool; where plans regroup (dynamic-cp, hydraulis with CP schemes), the homogeneous
    strategy of every CP scheme of their slots' TP, recomputing or not, whose aligned groups theirs are."""
    from passes.plan.ir import Strategy

    world = planner.gpus
    if policy in ("padding", "fixed-packing", "homogeneous-token"):
        return [planner.fixed]
    if policy == "homogeneous-cp":
        return [planner.cp_fixed]
    slots = ({planner.cp_base} if policy == "dynamic-cp"
             else {s for layout in planner.layouts for s in layout.schemes})
    tps = {s.tp for s in slots}  # a slot's groups recompute or not, group by group, on its slice
    regrouping = [Strategy.homogeneous(s, world) for s in trainer.cost_model.schemes
                  if s.pp == 1 and s.tp in tps and world % s.gpus == 0]
    return regrouping if policy == "dynamic-cp" else [*planner.pool, planner.fixed, *regrouping]


def _step(job: RankJob, state: dict, data: list, i: int) -> None:
    trainer = state["trainer"]
    t0 = time.perf_counter()
    stats = trainer.train_step(state["batches"])  # the next batch is planned while this one trains
    wall = (time.perf_counter() - t0) * 1e3
    plan = trainer.last_plan.plan
    if i == job.warmup - 1:
        state["warm_compilations"] = stats.compilations
    if i >= job.warmup:
        groups = predicted_replicas(trainer.cost_model, plan, state["buckets"])
        slots = predicted_slots(plan, groups, trainer.cost_model.gpus_per_node) if plan.regrouped else groups
        record = _step_record(i, stats, plan, wall, slots, state["movement"], groups)
        if trainer.calibration is not None:  # rank 0: the factors the next plans use
            record["calibration"] = {s.describe(): round(f, 4) for s, f in trainer.calibration.factors.items()}
        state["steps"].append(record)


def rank_main(rank: int, world: int, job: RankJob) -> dict | None:
    """Run every policy on this rank; rank 0 returns the records (the others None)."""
    from hcompile.api import CompiledModel
    from hcompile.tools.profile import build_model
    from hcompile.tools.progress import progress_bar

    compiled = CompiledModel(build_model(job.model, job.seed), buckets=TokenBuckets(sizes=job.buckets),
                             compile_backend=job.compile_backend)
    data = _token_batches(job)

    def progress(label: str, done: int, total: int) -> None:
        if rank == 0 and job.show_progress:
            progress_bar(f"e2e {label} x policies", done, total)

    if job.links is None:  # the cost model came without links: probe them here, as hcompile profile does
        from runtime.link_probe import probe_links

        probe = probe_links()
        job = dataclasses.replace(job, links=probe.host_links(world))
    states = {policy: _setup_policy(job, compiled, policy) for policy in job.policies}
    for i in range(len(data)):  # policies interleaved step by step, so that background load hits them alike
        for k, state in enumerate(states.values()):
            _step(job, state, data, i)
            progress("steps", i * len(states) + k + 1, len(data) * len(states))
    if rank != 0:
        return None
    return {policy: {"pool": st["pool"], "fixed": st["fixed"], "compile_s": st["compile_s"],
                     "builds_before_steps": st["builds_before_steps"],
                     "compilations_after_warmup": st["steps"][-1]["compilations"] - st["warm_compilations"],
                     "steps": st["steps"]} for policy, st in states.items()}
