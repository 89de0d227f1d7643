"""Planner simulation: run every planner policy side by side over the same global batches of a length
dataset on a simulated cluster, with the cost model's estimates. Used by ``hcompile plan`` and
``benchmarks.planner``."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from hcompile.tools.files import check_output_path, write_text_atomically
from hcompile.tools.progress import progress_bar
from passes.plan.bounds import Bounds
from passes.plan.context_parallel import CP_MODES, with_context_parallel
from passes.plan.cost_model import (
    HCOMPILE_RUNTIME,
    MEMORY_MODELS,
    RECOMPUTE_MODES,
    Profile,
    build_cost_model,
    default_optimizer_layout,
    load_profile,
    load_profile_file,
)
from passes.plan.datasets import LengthDataset, load_dataset, read_lengths_file, sample_batches
from passes.plan.diagnose import PARTS, StepDiagnosis, diagnose
from passes.plan.ir import CostModel, ParallelScheme, PlanError, StepPlan, Strategy
from passes.plan.links import LINK_PRESETS, link_preset
from passes.plan.movement import MOVEMENT_MODES, MovementCost, full_micro_batch_ms, llama_compute_layout, movement_bytes
from passes.plan.placement import too_long_error, usable_schemes
from passes.plan.policies import ALL_POLICIES, CP_POLICIES, POLICIES, Planner, sized_homogeneous
from passes.plan.pool import build_pool

__all__ = ["PlanJob", "PolicyResult", "PlanReport", "run_plan_job", "format_report"]

BASELINE = "homogeneous-token"

Progress = Callable[[str, int, int], None]
"""``progress(label, done, total)``: how far a phase of a planning job is."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanJob:
    """What to simulate: model, hardware, cluster, data, steps and policies."""

    model: str = "llama-32b"
    """Preset model name (ignored when ``profile_file`` is given)."""
    hardware: str = "a800-80g"
    """Preset hardware name."""
    gpus: int = 64
    """GPUs in the cluster."""
    dataset: str = "commoncrawl"
    """Preset dataset (ignored when ``lengths_file`` is given)."""
    global_tokens: int = 200_000
    """Tokens per global batch."""
    steps: int = 30
    """Global batches to plan."""
    seed: int = 0
    """Seed of batch sampling and of the pool's draws."""
    policies: tuple[str, ...] = ()
    """Policies to run, side by side; empty: every policy of ``POLICIES``, and the ``CP_POLICIES`` too when
    context-parallel schemes are planned."""
    lengths_file: str | None = None
    """A JSON histogram or a text file of lengths; with ``steps == 1`` a text file is planned as one batch."""
    optimizer_layout: str | None = None
    """The fixed optimiser layout; default: the homogeneous strategy sized for the data's longest sequence."""
    profile_file: str | None = None
    """A profile JSON (``hcompile profile`` output) instead of the preset."""
    memory_model: str = "hcompile"
    """Whose memory the schemes' longest micro-batches are computed for: ``hcompile`` (this project's runtime:
    states sharded over all GPUs, compute copies, transfer chunks) or ``paper`` (the profiled runtime)."""
    charge_movement: bool = True
    """Whether estimates include the exposed parameter and gradient movement and strategies are chosen by it
    (counted either way when the profile gives the model's heads and FFN width)."""
    reduce_dtype: str = "fp32"
    """The dtype gradients travel to their owners in (``TrainOptions.reduce_dtype``): ``fp32`` or ``bf16`` (half
    the push's bytes, as Megatron's default)."""
    movement_mode: str = "overlapped"
    """The runtime whose movement is modelled (``passes.plan.movement.MOVEMENT_MODES``): ``plain`` (pull before
    the compute, push after it) or ``overlapped`` (``TrainOptions(overlap_movement=True)``)."""
    regroup: bool = True
    """Whether hydraulis also plans regrouped steps where context-parallel schemes are planned: CP groups
    re-forming sequence by sequence inside groups of same-scheme slots (``passes.plan.regrouped``)."""
    context_parallel: str = "auto"
    """Context-parallel schemes (``passes.plan.context_parallel.CP_MODES``): ``auto`` plans them only when a
    sequence of the data is longer than every scheme without CP holds; ``on``; ``off``."""
    recompute: str = "auto"
    """Activation recomputation (``passes.plan.cost_model.RECOMPUTE_MODES``; ``TrainOptions(recompute=True)``):
    ``auto`` recomputes every layer only when a sequence of the data is longer than every scheme holds without
    it (context parallelism included); ``on``; ``off``."""

    def __post_init__(self) -> None:
        if self.memory_model not in MEMORY_MODELS:
            raise PlanError(f"unknown memory model {self.memory_model!r}; known: {', '.join(MEMORY_MODELS)}")
        for name in ("gpus", "global_tokens", "steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise PlanError(f"seed must be a non-negative integer, got {self.seed!r}")
        for policy in self.policies:
            if policy not in ALL_POLICIES:
                raise PlanError(f"unknown policy {policy!r}; known: {', '.join(ALL_POLICIES)}")
        if self.context_parallel not in CP_MODES:
            raise PlanError(f"unknown context-parallel mode {self.context_parallel!r}; known: {', '.join(CP_MODES)}")
        if self.recompute not in RECOMPUTE_MODES:
            raise PlanError(f"unknown recompute mode {self.recompute!r}; known: {', '.join(RECOMPUTE_MODES)}")
        if self.reduce_dtype not in REDUCE_BYTES:
            raise PlanError(f"unknown reduce dtype {self.reduce_dtype!r}; known: {', '.join(REDUCE_BYTES)}")
        if self.movement_mode not in MOVEMENT_MODES:
            raise PlanError(f"unknown movement mode {self.movement_mode!r}; known: {', '.join(MOVEMENT_MODES)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyResult:
    """One policy's numbers over all steps."""

    est_step_ms: tuple[float, ...]
    """Estimated step time of each step."""
    solve_ms: tuple[float, ...]
    """Planning wall time of each step."""
    tokens: int
    """Tokens planned over all steps."""
    diagnoses: tuple[StepDiagnosis, ...] = ()
    """Each step's plan against its bounds."""
    moved_bytes: tuple[int, ...] = ()
    """Per step, the busiest rank's parameter and gradient bytes (received and sent) under this runtime's fixed
    layout (``passes.plan.movement``); empty when the profile does not give the model's heads and FFN width."""
    median_moved_bytes: tuple[int, ...] = ()
    """Per step, the median rank's bytes as ``moved_bytes`` counts them: far below the busiest where owners of
    replicated parameters are a hot spot."""
    move_ms: tuple[float, ...] = ()
    """Per step, the exposed movement of the step's strategy (in ``est_step_ms`` when the job charges it)."""

    @property
    def est_step_ms_mean(self) -> float:
        return float(np.mean(self.est_step_ms))

    def vs_bound(self) -> dict[str, float]:
        """The distribution of step time over the step's lower bound: mean, p50, p90 and max."""
        ratios = np.array([d.vs_bound for d in self.diagnoses])
        return {"mean": float(ratios.mean()), "p50": float(np.percentile(ratios, 50)),
                "p90": float(np.percentile(ratios, 90)), "max": float(ratios.max())}

    def costliest(self) -> dict[str, int]:
        """Over the steps: how often each of strategy, dispatch, packing and movement cost the most."""
        out = dict.fromkeys(PARTS, 0)
        for d in self.diagnoses:
            out[d.costliest] += 1
        return out

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (sum(self.est_step_ms) / 1e3)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanReport:
    """The outcome of a job."""

    job: PlanJob
    """The job that ran."""
    dataset_name: str
    """Dataset or file name."""
    pool: tuple[Strategy, ...]
    """The hydraulis strategy pool."""
    fixed: Strategy
    """The fixed homogeneous strategy of the baselines."""
    lower_bound_ms: tuple[float, ...]
    """The lower bound of each step (the tightest of ``bounds``)."""
    bounds: tuple[Bounds, ...]
    """Every lower bound of each step."""
    cost_model: CostModel
    """The cost model the estimates come from."""
    results: dict[str, PolicyResult] = field(default_factory=dict)
    """Per policy."""
    movement: MovementCost | None = None
    """The movement count and its links; None when the profile does not give the model's heads and FFN width."""
    movement_floor_ms: float = 0.0
    """Movement no strategy avoids, in every step's bound when the job charges movement."""
    cp_fixed: Strategy | None = None
    """The ``homogeneous-cp`` baseline's strategy (None: CP not planned)."""
    cp_base: ParallelScheme | None = None
    """The ``dynamic-cp`` baseline's TP scheme (None: CP not planned)."""

    @property
    def recompute(self) -> bool:
        """Whether the plans recompute every layer (``PlanJob.recompute``, decided by the data under ``auto``)."""
        return any(e.scheme.rc for e in self.cost_model.entries)

    @property
    def any_schedule_bound_ms(self) -> float:
        """The mean over steps of the bound that also holds for schedules regrouping ranks within a step
        (``Bounds.any_schedule``, plus the movement floor where it is charged): what ``dynamic-cp`` is measured
        against, and how much faster than any baseline any planner could be."""
        return float(np.mean([b.any_schedule for b in self.bounds])) + self.movement_floor_ms

    def to_json(self) -> dict:
        """The ``--json`` object."""
        return {
            "model": self.job.model if self.job.profile_file is None else Path(self.job.profile_file).stem,
            "hardware": self.job.hardware,
            "gpus": self.job.gpus,
            "dataset": self.dataset_name,
            "global_tokens": self.job.global_tokens,
            "steps": len(self.lower_bound_ms),
            "seed": self.job.seed,
            "memory_model": self.job.memory_model,
            "recompute": self.recompute,
            "max_tokens": {e.scheme.describe(): e.max_tokens for e in self.cost_model.entries},
            "pool": [s.describe() for s in self.pool],
            "fixed_strategy": self.fixed.describe(),
            **({"cp_fixed_strategy": self.cp_fixed.describe()} if self.cp_fixed is not None else {}),
            **({"cp_base": self.cp_base.describe()} if self.cp_base is not None else {}),
            "lower_bound_ms_mean": round(float(np.mean(self.lower_bound_ms)), 3),
            "any_schedule_bound_ms_mean": round(self.any_schedule_bound_ms, 3),
            "movement": None if self.movement is None else {
                "charged": self.job.charge_movement, "mode": self.movement.mode,
                **({"windows": self.movement.windows} if self.movement.mode == "overlapped" else {}),
                "links": self.movement.links.to_dict(),
                "param_bytes": self.movement.param_bytes, "reduce_bytes": self.movement.reduce_bytes,
                "floor_ms": round(self.movement_floor_ms, 3)},
            "policies": {
                name: {
                    "est_step_ms_mean": round(r.est_step_ms_mean, 3),
                    **({"est_comm_ms_mean": round(float(np.mean(r.move_ms)), 3)} if r.move_ms else {}),
                    **({"bytes_per_rank_max": int(np.mean(r.moved_bytes)),
                        "bytes_per_rank_median": int(np.mean(r.median_moved_bytes))} if r.moved_bytes else {}),
                    "tokens_per_s": round(r.tokens_per_s, 3),
                    "solve_ms_p50": round(float(np.percentile(r.solve_ms, 50)), 3),
                    "solve_ms_p95": round(float(np.percentile(r.solve_ms, 95)), 3),
                    "vs_bound": {k: round(v, 4) for k, v in r.vs_bound().items()},
                    "costliest": r.costliest(),
                }
                for name, r in self.results.items()
            },
            "per_step": [
                {"step": i, "lower_bound_ms": round(b.best + self.movement_floor_ms, 3),
                 "bounds": {**b.to_dict(), "binding": b.binding}, "movement_floor_ms": round(self.movement_floor_ms, 3),
                 "policies": {name: _without_bounds(r.diagnoses[i].to_dict()) for name, r in self.results.items()}}
                for i, b in enumerate(self.bounds)
            ],
        }


def _without_bounds(diagnosis: dict) -> dict:
    """A step's diagnosis without the bounds, which the step lists once for all policies."""
    return {k: v for k, v in diagnosis.items() if k not in ("bounds", "lower_bound_ms")}


def _load_data(job: PlanJob) -> tuple[LengthDataset, list[list[int]] | None]:
    """The dataset, and the exact batch when a text file of lengths is planned for one step."""
    if job.lengths_file is None:
        return load_dataset(job.dataset), None
    data = read_lengths_file(job.lengths_file)
    if isinstance(data, LengthDataset):
        return data, None
    name = Path(job.lengths_file).stem
    dataset = LengthDataset.from_lengths(name, data, source=f"file {job.lengths_file}")
    return dataset, ([data] if job.steps == 1 else None)


def _profile(job: PlanJob) -> Profile:
    return load_profile_file(job.profile_file) if job.profile_file else load_profile(job.model, job.hardware)


def job_cost_model(job: PlanJob) -> CostModel:
    """The cost model ``job`` plans with: its profile's schemes under the optimiser layout, context-parallel
    schemes and recomputing twins added as the job says (``auto``: only where a sequence of the data is longer
    than every scheme holds without them); a sequence longer than every scheme holds is a PlanError naming it."""
    return _job_model(job, _profile(job), _load_data(job)[0])


def _job_model(job: PlanJob, profile: Profile, dataset: LengthDataset) -> CostModel:
    runtime = HCOMPILE_RUNTIME if job.memory_model == "hcompile" else None
    links = profile.links if profile.links is not None else (
        link_preset(job.hardware) if job.hardware in LINK_PRESETS else None)
    recompute = job.recompute == "on"
    _, cost_model = _layout_and_model(job, profile, dataset, links, runtime, recompute)
    if job.recompute == "auto" and dataset.max_len > _longest_held(cost_model, job.gpus):
        _, cost_model = _layout_and_model(job, profile, dataset, links, runtime, True)
    if dataset.max_len > _longest_held(cost_model, job.gpus):
        raise too_long_error(cost_model, job.gpus, dataset.max_len)
    return cost_model


def prepare(job: PlanJob, progress: Progress | None = None) -> tuple[Planner, LengthDataset, list[list[int]]]:
    """Everything before the steps: cost model under the layout (:func:`job_cost_model`), pool (``progress`` per
    length tier; not built where the job does not plan hydraulis), fixed strategy, movement cost (charged when
    the job says so) and batches."""
    profile = _profile(job)
    dataset, exact = _load_data(job)
    cost_model = _job_model(job, profile, dataset)
    fixed = sized_homogeneous(cost_model, job.gpus, dataset.max_len)
    tiers = None if progress is None else functools.partial(progress, "building the strategy pool")
    movement = _job_movement(job, profile, cost_model)
    charged = movement if job.charge_movement else None
    pool: list[Strategy] = []
    if not job.policies or "hydraulis" in job.policies:  # only hydraulis plans from the pool
        # it scores thousands of mixes (50K at 1024 GPUs): by the exact replay where cheap, else per scheme
        pool = build_pool(cost_model, job.gpus, dataset, job.global_tokens, fixed, seed=job.seed, progress=tiers,
                          extra=charged.pool_ms if charged is not None else None)
    batches = exact if exact is not None else sample_batches(dataset, job.global_tokens, job.steps, job.seed)
    planner = Planner(cost_model, job.gpus, pool, fixed, movement=charged,
                      regroup=job.regroup and any(s.cp > 1 for s in cost_model.schemes))
    if any(s.cp > 1 for s in cost_model.schemes):
        planner.choose_cp_baselines(dataset.max_len, batches[:_CP_TRIAL_BATCHES])
    return planner, dataset, batches


def _layout_and_model(job: PlanJob, profile: Profile, dataset: LengthDataset, links, runtime,
                      recompute: bool) -> tuple[Strategy, CostModel]:
    """The optimiser layout (the job's, else the one sized for the data's longest sequence) and the cost model
    under it, context-parallel schemes added as the job says, every layer recomputed or not."""
    if job.optimizer_layout is not None:
        layout = Strategy.parse(job.optimizer_layout)
        if layout.gpus != job.gpus or not layout.is_homogeneous:
            raise PlanError(f"optimizer layout {layout.describe()} must be homogeneous over {job.gpus} GPUs")
    else:
        layout = default_optimizer_layout(profile, job.gpus, dataset.max_len, runtime,
                                          longest_held=job.context_parallel != "off", recompute=recompute)
    cost_model = with_context_parallel(build_cost_model(profile, layout, runtime, recompute), profile, links,
                                       job.gpus, dataset.max_len, layout, runtime, job.context_parallel)
    return layout, cost_model


def _longest_held(cost_model: CostModel, gpus: int) -> int:
    """The longest sequence a scheme usable on ``gpus`` GPUs holds."""
    return max((cost_model.max_tokens(s) for s in usable_schemes(cost_model, gpus)), default=0)


REDUCE_BYTES = {"fp32": 4, "bf16": 2}
"""Bytes of a gradient on the wire per ``PlanJob.reduce_dtype``."""

_CP_TRIAL_BATCHES = 3
"""Batches the CP baselines' TP is chosen on."""


def movement_cost(profile: Profile, hardware: str, cost_model: CostModel, mode: str = "plain",
                  reduce_bytes: int = 4) -> MovementCost | None:
    """The movement of this runtime on GPUs (bf16 parameters, gradients in ``reduce_bytes``: fp32 by default)
    under the ``mode`` runtime, from the LLaMA layout of the profile's shape, on the profile's measured links or
    else the hardware preset's (``Links.overlap_slowdown``: how much the transfers slow the compute they
    overlap); None when the profile does not give the heads and FFN width."""
    if profile.heads is None or profile.ffn_hidden is None:
        return None
    layout = llama_compute_layout(layers=profile.layers, hidden=profile.hidden, ffn_hidden=profile.ffn_hidden,
                                  heads=profile.heads, kv_heads=profile.kv_heads or profile.heads,
                                  vocab=profile.vocab, schemes=list(cost_model.schemes))
    links = profile.links if profile.links is not None else link_preset(hardware)
    return MovementCost(layout, links, param_bytes=2, reduce_bytes=reduce_bytes, mode=mode,
                        slowdown=links.overlap_slowdown, edge_ms=full_micro_batch_ms(cost_model))


def _job_movement(job: PlanJob, profile: Profile, cost_model: CostModel) -> MovementCost | None:
    """:func:`movement_cost` of ``job``'s hardware, runtime and gradient dtype."""
    return movement_cost(profile, job.hardware, cost_model, job.movement_mode, REDUCE_BYTES[job.reduce_dtype])


def _rank_bytes(movement: MovementCost, gpus_per_node: int) -> Callable[[Strategy], tuple[int, int]]:
    """``moved(strategy)``: the busiest rank's and the median rank's bytes per step (received and sent)."""
    cache: dict[Strategy, tuple[int, int]] = {}

    def moved(strategy: Strategy) -> tuple[int, int]:
        if strategy not in cache:
            ranks = movement_bytes(movement.layout, strategy, gpus_per_node, param_bytes=movement.param_bytes,
                                   reduce_bytes=movement.reduce_bytes)
            totals = [r.total for r in ranks]
            cache[strategy] = (max(totals), int(np.median(totals)))
        return cache[strategy]

    return moved


def run_plan_job(job: PlanJob, plans_out: str | None = None,
                 progress: Progress | None = None) -> tuple[PlanReport, list[StepPlan]]:
    """Plan every step with every policy; write ``plans_out`` (JSON lines, checked first) atomically at the end.
    ``progress(label, done, total)``: the pool's length tiers, then every (step, policy) planned."""
    if plans_out is not None:
        check_output_path(plans_out, "--plans-out")
    planner, dataset, batches = prepare(job, progress)
    policies = job.policies or (POLICIES + (CP_POLICIES if planner.cp_base is not None else ()))
    movement = planner.movement or _job_movement(job, _profile(job), planner.cost_model)
    moved = None if movement is None else _rank_bytes(movement, planner.cost_model.gpus_per_node)
    plans: list[StepPlan] = []
    lines: list[str] = []
    per_policy: dict[str, list[StepPlan]] = {p: [] for p in policies}
    diagnoses: dict[str, list[StepDiagnosis]] = {p: [] for p in policies}
    bounds: list[Bounds] = []
    for step, batch in enumerate(batches):
        bounds.append(planner.bounds(batch))  # computed once, reused by every policy's plan of the batch
        for policy in policies:
            plan = planner.plan(batch, policy)
            diagnosis = diagnose(planner.cost_model, job.gpus, plan, bounds[-1], planner.movement_floor_ms)
            per_policy[policy].append(plan)
            diagnoses[policy].append(diagnosis)
            plans.append(plan)
            lines.append(json.dumps({**plan.to_dict(step=step), "diagnosis": diagnosis.to_dict()},
                                    separators=(",", ":")))
            if progress is not None:
                progress("planning steps x policies", len(plans), len(batches) * len(policies))
    results = {
        name: PolicyResult(est_step_ms=tuple(p.est_step_ms for p in ps), solve_ms=tuple(p.solve_ms for p in ps),
                           tokens=sum(sum(p.seq_lens) for p in ps), diagnoses=tuple(diagnoses[name]),
                           moved_bytes=tuple(moved(p.strategy)[0] for p in ps) if moved is not None else (),
                           median_moved_bytes=tuple(moved(p.strategy)[1] for p in ps) if moved is not None else (),
                           move_ms=(tuple(movement.exposed_ms(p.strategy) for p in ps) if movement is not None
                                    else ()))
        for name, ps in per_policy.items()
    }
    report = PlanReport(job=job, dataset_name=dataset.name, pool=tuple(planner.pool), fixed=planner.fixed,
                        lower_bound_ms=tuple(b.best + planner.movement_floor_ms for b in bounds),
                        bounds=tuple(bounds), cost_model=planner.cost_model, results=results, movement=movement,
                        movement_floor_ms=planner.movement_floor_ms, cp_fixed=planner.cp_fixed,
                        cp_base=planner.cp_base)
    if plans_out is not None:
        write_text_atomically(plans_out, "\n".join(lines) + "\n")
    return report, plans


def format_report(report: PlanReport) -> str:
    """A readable table: policies side by side, then the pool."""
    job = report.job
    bound = float(np.mean(report.lower_bound_ms))
    base = report.results.get(BASELINE)
    lines = [
        f"{job.model if job.profile_file is None else job.profile_file} on {job.gpus} GPUs ({job.hardware}), "
        f"dataset {report.dataset_name}, {job.global_tokens} tokens/step, {len(report.lower_bound_ms)} steps, "
        f"seed {job.seed}",
        f"{'policy':<22}{'step ms':>10}{'move ms':>9}{'tokens/s':>11}{'vs ' + BASELINE:>24}"
        f"{'step / bound: mean':>20}{'p50':>7}{'p90':>7}{'max':>7}{'solve p50':>11}{'p95':>9}",
    ]
    for name, r in report.results.items():
        speedup = f"{base.est_step_ms_mean / r.est_step_ms_mean:.2f}x" if base else "-"
        ratio = r.vs_bound()
        move = f"{np.mean(r.move_ms):.1f}" if r.move_ms else "-"
        lines.append(
            f"{name:<22}{r.est_step_ms_mean:>10.1f}{move:>9}{r.tokens_per_s:>11.0f}{speedup:>24}"
            f"{ratio['mean']:>20.3f}{ratio['p50']:>7.3f}{ratio['p90']:>7.3f}{ratio['max']:>7.3f}"
            f"{np.percentile(r.solve_ms, 50):>9.1f}ms{np.percentile(r.solve_ms, 95):>7.1f}ms"
        )
    lines.append(f"{'lower bound':<22}{bound:>10.1f}   (plans with one strategy per step)")
    if report.recompute:
        lines.append("every layer recomputed in its backward (activation recomputation: the caps of layer inputs, "
                     "the forward charged twice)")
    if report.cp_base is not None:
        lines.append(f"{'bound, any schedule':<22}{report.any_schedule_bound_ms:>10.1f}   (area and latency only: "
                     f"also for ranks regrouping within the step, as dynamic-cp's do)")
    if report.movement is not None:
        links = report.movement.links
        windows = f", {report.movement.windows} windows" if report.movement.mode == "overlapped" else ""
        lines.append(f"movement ({report.movement.mode} runtime{windows}; move ms: the exposed pull and push of the "
                     f"step's plan) "
                     f"{'in' if job.charge_movement else 'NOT in'} the step estimates; links: "
                     f"{links.gpus_per_node} GPUs per node, {links.intra_gbps:g} GB/s inside a node, "
                     f"{links.inter_gbps:g} GB/s between nodes, {links.latency_us:g} us per message")
    else:
        lines.append("movement not counted: the profile does not give the model's heads and FFN width")
    lines.append(f"fixed strategy (baselines): {report.fixed.describe()}")
    if report.cp_fixed is not None and report.cp_base is not None:
        lines.append(f"context-parallel baselines: homogeneous-cp {report.cp_fixed.describe()}, dynamic-cp slots of "
                     f"{report.cp_base.describe()} (its ranks regroup within a step; step / bound of a regrouped "
                     f"plan is over the any-schedule bound)")
    lines.append("hydraulis pool: " + (", ".join(s.describe() for s in report.pool) or "not built (hydraulis not "
                                                                                        "planned)"))
    return "\n".join(lines)


def stderr_progress(label: str, done: int, total: int) -> None:
    """A progress bar per phase on stderr (the pool's tiers, the planned steps)."""
    progress_bar(label, done, total)
