"""Planner gap benchmark: per step, the hydraulis plan's estimated time over the step's lower bound, with the
per-step strategy refinement (``after``) and without it (``before``: the pool's strategies only, the old
candidate order), on the same batches, side by side.

    python -m benchmarks.planner_gap           # 32B on 64 GPUs (4x(tp16) layout, 200K tokens), 30 steps each
                                               # of commoncrawl, github and python-code; 32B on 1024 GPUs
                                               # (1.6M tokens, 10 steps) for the solve time
    python -m benchmarks.planner_gap --smoke   # one small case (what CI runs)
    python -m benchmarks.planner_gap --search  # also a strategy search on the 64-GPU settings: every
                                               # strategy of one to three usable schemes, the 40 best by
                                               # the fluid estimate planned in full (minutes)

Each ratio is reported against the tightest bound (``passes.plan.bounds``) and against the area/latency bound
alone (the bound before the pipeline and long-sequence bounds existed), as mean, p50, p90 and max over the
steps; with the steps on which ``after`` is better, equal or worse than ``before``, the solve time, and which
part (strategy, dispatch, packing) costs the most. Step times are cost-model estimates; solve times are
wall clock on this machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from benchmarks.provenance import commit
from hcompile.tools.progress import progress_bar
from hcompile.tools.simulate import PlanJob, prepare
from passes.plan.diagnose import PARTS, diagnose
from passes.plan.ir import CostModel, Strategy
from passes.plan.placement import usable_schemes
from passes.plan.policies import Planner
from passes.plan.pool import fluid_scores, mixes_of

SETTINGS = (
    PlanJob(model="llama-32b", gpus=64, dataset="commoncrawl", global_tokens=200_000, steps=30,
            optimizer_layout="4x(tp16)"),
    PlanJob(model="llama-32b", gpus=64, dataset="github", global_tokens=200_000, steps=30,
            optimizer_layout="4x(tp16)"),
    PlanJob(model="llama-32b", gpus=64, dataset="python-code", global_tokens=200_000, steps=30,
            optimizer_layout="4x(tp16)"),
    PlanJob(model="llama-32b", gpus=1024, dataset="commoncrawl", global_tokens=1_600_000, steps=10),
)
SMOKE = (PlanJob(model="llama-32b", gpus=64, dataset="python-code", global_tokens=200_000, steps=3,
                 optimizer_layout="4x(tp16)"),)


@dataclass
class _Run:
    ratios: list[float]
    simple_ratios: list[float]
    est_ms: list[float]
    solve_ms: list[float]
    costliest: dict[str, int]


def _distribution(values: list[float]) -> dict[str, float]:
    v = np.asarray(values)
    return {"mean": round(float(v.mean()), 4), "p50": round(float(np.percentile(v, 50)), 4),
            "p90": round(float(np.percentile(v, 90)), 4), "max": round(float(v.max()), 4)}


def _label(job: PlanJob) -> str:
    return f"{job.model}/{job.gpus}gpu/{job.dataset}/{job.global_tokens // 1000}K"


_SEARCH_FULL = 40  # strategies the search plans in full per step


def search_space(cost_model: CostModel, gpus: int) -> list[Strategy]:
    """Every placeable strategy of one, two or three usable schemes of distinct caps that fills ``gpus`` (the
    third scheme's replicas bounded by the second's and 8 for the first, as the pool's refinements are)."""
    mt = cost_model.max_tokens
    schemes = sorted(usable_schemes(cost_model, gpus), key=lambda s: (-mt(s), -s.gpus))
    out: dict[Strategy, None] = {}
    for k in (1, 2, 3):
        for types in itertools.combinations(schemes, k):
            if len({mt(t) for t in types}) < k:
                continue
            limits = {1: [], 2: None, 3: [4, 8]}[k]
            out.update(dict.fromkeys(mixes_of(cost_model, gpus, list(types), limits=limits)))
    return list(out)


def searched_ms(planner: Planner, space: list[Strategy], batch: list[int]) -> float:
    """The least estimated step time of the search: the best strategies of ``space`` by the fluid estimate,
    each planned in full with the same dispatch and packing."""
    longest = max(batch)
    holding = [s for s in space if max(planner.cost_model.max_tokens(t) for t in s.schemes) >= longest]
    scores = fluid_scores(planner.cost_model, holding, np.asarray(batch))
    best = sorted(zip(scores, (s.describe() for s in holding), holding))[:_SEARCH_FULL]
    return min(planner.plan(batch, strategy=s).est_step_ms for _, _, s in best)


def measure(job: PlanJob, search: bool = False) -> dict:
    """Plan every step of ``job`` with and without refinement (and, with ``search``, by the strategy search);
    the record of the comparison. Compute only (movement not charged): the gap measured is the planner's
    search against the compute bounds."""
    after, dataset, batches = prepare(replace(job, charge_movement=False))
    before = Planner(after.cost_model, after.gpus, after.pool, after.fixed, refine=False, full_at_least=1)
    space = search_space(after.cost_model, job.gpus) if search else []
    searched: list[float] = []
    tightening: list[float] = []  # the tightest bound over the area/latency bound, per step
    runs = {name: _Run([], [], [], [], dict.fromkeys(PARTS, 0)) for name in ("before", "after")}
    for step, batch in enumerate(batches):
        bounds = after.bounds(batch)
        tightening.append(bounds.best / max(bounds.area, bounds.latency))
        for name, planner in (("before", before), ("after", after)):
            plan = planner.plan(batch)
            d = diagnose(after.cost_model, job.gpus, plan, bounds)
            run = runs[name]
            run.ratios.append(d.vs_bound)
            run.simple_ratios.append(plan.est_step_ms / max(bounds.area, bounds.latency))
            run.est_ms.append(plan.est_step_ms)
            run.solve_ms.append(plan.solve_ms)
            run.costliest[d.costliest] += 1
        if space:
            searched.append(searched_ms(after, space, batch) / bounds.best)
        progress_bar(f"{_label(job)}", step + 1, len(batches))
    diff = np.asarray(runs["after"].est_ms) / np.asarray(runs["before"].est_ms)
    extra = {}
    if searched:
        lead = np.asarray(runs["after"].ratios) / np.asarray(searched)
        extra = {"search": {"strategies": len(space), "vs_bound": _distribution(searched),
                            "after_over_search": _distribution(lead.tolist()),
                            "steps_search_better_by_1pct": int((lead > 1.01).sum())}}
    return {
        "config": _label(job), "steps": len(batches), "pool": [s.describe() for s in after.pool],
        **{name: {"vs_bound": _distribution(r.ratios), "vs_area_latency_bound": _distribution(r.simple_ratios),
                  "est_step_ms_mean": round(float(np.mean(r.est_ms)), 3),
                  "solve_ms_p50": round(float(np.percentile(r.solve_ms, 50)), 3),
                  "solve_ms_p95": round(float(np.percentile(r.solve_ms, 95)), 3), "costliest": r.costliest}
           for name, r in runs.items()},
        "bound_over_area_latency_bound": _distribution(tightening),
        "after_vs_before_steps": {"better": int((diff < 1 - 1e-9).sum()), "equal": int((abs(diff - 1) <= 1e-9).sum()),
                                  "worse": int((diff > 1 + 1e-9).sum())},
        **extra,
    }


def format_record(r: dict) -> str:
    """The comparison as a table."""
    d = lambda x: f"{x['mean']:.3f} {x['p50']:.3f} {x['p90']:.3f} {x['max']:.3f}"  # noqa: E731
    lines = [f"== {r['config']}, {r['steps']} steps",
             f"{'':8}{'step / bound: mean p50 p90 max':>32}{'/ area-latency bound':>30}{'solve p50':>11}{'p95':>9}"
             f"  costliest"]
    for name in ("before", "after"):
        x = r[name]
        lines.append(f"{name:<8}{d(x['vs_bound']):>32}{d(x['vs_area_latency_bound']):>30}"
                     f"{x['solve_ms_p50']:>9.1f}ms{x['solve_ms_p95']:>7.1f}ms  {x['costliest']}")
    s = r["after_vs_before_steps"]
    lines.append(f"after vs before, per step: {s['better']} better, {s['equal']} equal, {s['worse']} worse")
    lines.append(f"the bound over the area/latency bound: {d(r['bound_over_area_latency_bound'])} "
                 "(no plan is closer to the area/latency bound than this)")
    if "search" in r:
        x = r["search"]
        lines.append(f"{'search':<8}{d(x['vs_bound']):>32}   ({x['strategies']} strategies; after / search per step: "
                     f"{d(x['after_over_search'])}; search better by > 1% on {x['steps_search_better_by_1pct']} steps)")
    return "\n".join(lines)


def run(jobs: tuple[PlanJob, ...], out_dir: Path, search: bool = False) -> list[dict]:
    """Measure each setting, print its table and append stamped JSON lines to ``out_dir/planner_gap.jsonl``;
    ``search`` adds the strategy search to the 64-GPU settings."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = {"commit": commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    records = []
    for job in jobs:
        record = {**stamp, **measure(job, search=search and job.gpus <= 64)}
        print(format_record(record), flush=True)
        records.append(record)
    with open(out_dir / "planner_gap.jsonl", "a") as fh:
        for record in records:
            fh.write(json.dumps(record) + "\n")
    print(f"wrote {out_dir / 'planner_gap.jsonl'}")
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner_gap", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one small case, for CI")
    parser.add_argument("--out", default="results", help="folder for planner_gap.jsonl")
    parser.add_argument("--search", action="store_true", help="also the strategy search (64-GPU settings; minutes)")
    args = parser.parse_args(argv)
    run(SMOKE if args.smoke else SETTINGS, Path(args.out), search=args.search)
    return 0


if __name__ == "__main__":
    sys.exit(main())
