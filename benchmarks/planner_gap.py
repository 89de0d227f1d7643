"""Planner gap benchmark: per step, the hydraulis plan's estimated time over the step's lower bound, with the
per-step strategy refinement (``after``) and without it (``before``: the pool's strategies only, the old
candidate order), on the same batches, side by side.

    python -m benchmarks.planner_gap           # 32B on 64 GPUs (4x(tp16) layout, 200K tokens), 30 steps each
                                               # of commoncrawl, github and python-code; 32B on 1024 GPUs
                                               # (1.6M tokens, 10 steps) for the solve time
    python -m benchmarks.planner_gap --smoke   # one small case (what CI runs)

Each ratio is reported against the tightest bound (``passes.plan.bounds``) and against the area/latency bound
alone (the bound before the pipeline and long-sequence bounds existed), as mean, p50, p90 and max over the
steps; with the steps on which ``after`` is better, equal or worse than ``before``, the solve time, and which
part (strategy, dispatch, packing) costs the most. Step times are cost-model estimates; solve times are
wall clock on this machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.provenance import commit
from hcompile.tools.progress import progress_bar
from hcompile.tools.simulate import PlanJob, prepare
from passes.plan.bounds import bound_terms
from passes.plan.diagnose import diagnose
from passes.plan.policies import Planner

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


def measure(job: PlanJob) -> dict:
    """Plan every step of ``job`` with and without refinement; the record of the comparison."""
    after, dataset, batches = prepare(job)
    before = Planner(after.cost_model, after.gpus, after.pool, after.fixed, refine=False, full_at_least=1)
    runs = {name: _Run([], [], [], [], {"strategy": 0, "dispatch": 0, "packing": 0}) for name in ("before", "after")}
    for step, batch in enumerate(batches):
        bounds = bound_terms(after.cost_model, job.gpus, batch)
        for name, planner in (("before", before), ("after", after)):
            plan = planner.plan(batch)
            d = diagnose(after.cost_model, job.gpus, plan, bounds)
            run = runs[name]
            run.ratios.append(d.vs_bound)
            run.simple_ratios.append(plan.est_step_ms / max(bounds.area, bounds.latency))
            run.est_ms.append(plan.est_step_ms)
            run.solve_ms.append(plan.solve_ms)
            run.costliest[d.costliest] += 1
        progress_bar(f"{_label(job)}", step + 1, len(batches))
    diff = np.asarray(runs["after"].est_ms) / np.asarray(runs["before"].est_ms)
    return {
        "config": _label(job), "steps": len(batches), "pool": [s.describe() for s in after.pool],
        **{name: {"vs_bound": _distribution(r.ratios), "vs_area_latency_bound": _distribution(r.simple_ratios),
                  "est_step_ms_mean": round(float(np.mean(r.est_ms)), 3),
                  "solve_ms_p50": round(float(np.percentile(r.solve_ms, 50)), 3),
                  "solve_ms_p95": round(float(np.percentile(r.solve_ms, 95)), 3), "costliest": r.costliest}
           for name, r in runs.items()},
        "after_vs_before_steps": {"better": int((diff < 1 - 1e-9).sum()), "equal": int((abs(diff - 1) <= 1e-9).sum()),
                                  "worse": int((diff > 1 + 1e-9).sum())},
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
    return "\n".join(lines)


def run(jobs: tuple[PlanJob, ...], out_dir: Path) -> list[dict]:
    """Measure each setting, print its table and append stamped JSON lines to ``out_dir/planner_gap.jsonl``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = {"commit": commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    records = []
    for job in jobs:
        record = {**stamp, **measure(job)}
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
    args = parser.parse_args(argv)
    run(SMOKE if args.smoke else SETTINGS, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
