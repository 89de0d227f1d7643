"""Planner benchmark: the paper's settings, every policy side by side on the same batches.

    python -m benchmarks.planner            # 32B/64 GPUs on commoncrawl and github, 13B/32 GPUs on github,
                                            # 32B/1024 GPUs; table, JSON lines and PNG plots under results/
    python -m benchmarks.planner --smoke    # one small case (what CI runs)
    python -m benchmarks.planner --movement charged   # only with movement charged (default: both, side by side)
    python -m benchmarks.planner --movement charged --movement-mode both   # charged as the overlapped runtime
                                            # (the default) and the plain one run it, side by side
    python -m benchmarks.planner --long-context --movement charged   # 32B on 64, 128 and 1024 GPUs, long-context
                                            # data, 1M tokens per step: hydraulis with CP (and regrouped steps)
                                            # against dynamic-cp and homogeneous-cp (context parallelism is
                                            # planned only); --no-regroup: hydraulis one strategy per step

Step times are the cost model's estimates (measured A800 profiles), not wall clock; solve times are the
planner's own wall-clock time on this machine. Each setting runs twice: movement ``ignored`` (compute only,
as the planner was before it counted movement; the movement of the chosen strategies still reported) and
``charged`` (every policy's estimate is compute plus the exposed parameter and gradient movement of its
plan on the A800 preset's links, and strategies are chosen by that sum), its movement modelled as the default
(overlapped) runtime runs it (``--movement-mode overlapped``), as the plain one does (``plain``), or both.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.provenance import commit
from hcompile.tools.simulate import BASELINE, PlanJob, PlanReport, format_report, run_plan_job
from passes.plan.cost_model import RECOMPUTE_MODES
from passes.plan.ir import CostModel, PlanError, StepPlan

PAPER_POOL_32B_64 = ("4x(tp16)", "1x(tp16)+2x(tp8,pp3)", "1x(tp16)+6x(tp8)", "1x(tp16)+12x(tp4)",
                     "1x(tp8,pp3)+10x(tp4)", "1x(tp8)+14x(tp4)", "8x(tp4,pp2)")
SETTINGS = (
    PlanJob(model="llama-32b", gpus=64, dataset="commoncrawl", global_tokens=200_000, steps=30),
    PlanJob(model="llama-32b", gpus=64, dataset="github", global_tokens=200_000, steps=30),
    PlanJob(model="llama-13b", gpus=32, dataset="github", global_tokens=100_000, steps=30),
    PlanJob(model="llama-32b", gpus=1024, dataset="commoncrawl", global_tokens=1_600_000, steps=10),
)
LONG_CONTEXT = (
    PlanJob(model="llama-32b", gpus=64, dataset="long-context", global_tokens=1_000_000, steps=30),
    PlanJob(model="llama-32b", gpus=128, dataset="long-context", global_tokens=1_000_000, steps=20),
    PlanJob(model="llama-32b", gpus=1024, dataset="long-context", global_tokens=1_000_000, steps=10),
)
"""Sequences beyond every scheme without CP: ``auto`` plans CP schemes and the CP baselines run beside."""
SMOKE = (PlanJob(model="llama-32b", gpus=64, dataset="commoncrawl", global_tokens=40_000, steps=2),)


def _device() -> str:
    return f"{platform.processor() or platform.machine()} x{os.cpu_count()} (planner runs on CPU)"


def _label(job: PlanJob) -> str:
    mode = "" if job.movement_mode == "plain" else f" ({job.movement_mode})"
    mode += "" if job.reduce_dtype == "fp32" else f" ({job.reduce_dtype} gradients)"
    return (f"{job.model}/{job.gpus}gpu/{job.dataset}/{job.global_tokens // 1000}K/"
            f"movement {'charged' if job.charge_movement else 'ignored'}{mode}")


def _plot(reports: list[tuple[PlanReport, list[StepPlan]]], path: Path) -> None:
    """Speed-up per policy and setting, and the per-replica timeline of the first setting's first step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5), gridspec_kw={"width_ratios": [1.3, 1, 1]})
    policies = list(reports[0][0].results)
    width = 0.8 / len(policies)
    for p, name in enumerate(policies):
        ratios = [r.results[BASELINE].est_step_ms_mean / r.results[name].est_step_ms_mean for r, _ in reports]
        axes[0].bar([i + p * width for i in range(len(reports))], ratios, width, label=name)
    axes[0].set_xticks([i + 0.4 - width / 2 for i in range(len(reports))])
    axes[0].set_xticklabels([_label(r.job).replace("/", "\n", 1) for r, _ in reports], fontsize=7)
    axes[0].set_ylabel(f"speed-up over {BASELINE} (estimated step time)")
    axes[0].axhline(1.0, color="grey", lw=0.5)
    axes[0].legend(fontsize=7)
    report, plans = reports[0]
    for ax, policy in zip(axes[1:], ("hydraulis", BASELINE)):
        plan = next((p for p in plans if p.policy == policy), None)
        if plan is not None:
            _timeline(ax, plan, report.cost_model)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _timeline(ax, plan: StepPlan, cost_model: CostModel) -> None:
    """One row per replica: its micro-batches one after another, then the 1F1B warm-up/drain (hatched)."""
    for row, replica in enumerate(plan.replicas):
        times = cost_model.micro_batch_times(replica, plan.seq_lens)
        x = 0.0
        for j, t in enumerate(times):
            ax.barh(row, t, left=x, height=0.8, color=("tab:blue", "tab:cyan")[j % 2], edgecolor="black",
                    linewidth=0.3)
            x += t
        if times and replica.scheme.pp > 1:
            bubble = (replica.scheme.pp - 1) * max(times)
            ax.barh(row, bubble, left=x, height=0.8, color="white", edgecolor="grey", hatch="//", linewidth=0.3)
    ax.axvline(plan.est_step_ms, color="red", lw=0.8, label="step")
    ax.axvline(plan.lower_bound_ms, color="green", lw=0.8, ls="--", label="lower bound")
    ax.set_yticks(range(len(plan.replicas)))
    ax.set_yticklabels([r.scheme.describe() for r in plan.replicas], fontsize=6)
    ax.set_xlabel("estimated ms (each box a micro-batch)")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"{plan.policy}: {plan.strategy.describe()}\nstep {plan.est_step_ms:.0f} ms, "
                 f"bound {plan.lower_bound_ms:.0f} ms", fontsize=8)


def run(jobs: tuple[PlanJob, ...], out_dir: Path, plot: bool = True) -> list[dict]:
    """Run each setting, print its table, append JSON lines, draw the plot; returns the JSON records. A setting
    the planner refuses (a sequence longer than any scheme holds) is a record with its ``refused`` reason."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = {"commit": commit(), "device": _device(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    reports, records = [], []
    for job in jobs:
        print(f"== {_label(job)}: planning {job.steps} steps x {len(job.policies) or 'every'} policies ...",
              flush=True)
        started = time.perf_counter()
        try:
            report, plans = run_plan_job(job)
        except PlanError as exc:  # a setting this memory model cannot plan: said, recorded, the others go on
            print(f"refused: {exc}\n", flush=True)
            records.append({**stamp, "config": _label(job), "refused": str(exc)})
            continue
        wall_s = time.perf_counter() - started
        reports.append((report, plans))
        print(format_report(report))
        if job.model == "llama-32b" and job.gpus == 64:
            print("paper case-study pool (32B/64 GPUs): " + ", ".join(PAPER_POOL_32B_64))
        print(flush=True)
        summary = {k: v for k, v in report.to_json().items() if k != "per_step"}  # per step: hcompile plan --json
        print(f"wall time (pool, baselines' TP choice, every step and policy): {wall_s:.1f} s", flush=True)
        records.append({**stamp, "config": _label(job), "wall_s": round(wall_s, 1), **summary})
    with open(out_dir / "planner.jsonl", "a") as fh:
        for record in records:
            fh.write(json.dumps(record) + "\n")
    if plot and reports:
        _plot(reports, out_dir / "planner.png")
        print(f"wrote {out_dir / 'planner.jsonl'} and {out_dir / 'planner.png'}")
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one small case, for CI")
    parser.add_argument("--out", default="results", help="folder for planner.jsonl and planner.png")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--long-context", action="store_true",
                        help="only the long-context settings (32B on 64, 128 and 1024 GPUs, context parallelism "
                             "planned)")
    parser.add_argument("--no-regroup", action="store_true",
                        help="hydraulis plans no regrouped step (one strategy per step, as before regrouping)")
    parser.add_argument("--movement", choices=("both", "charged", "ignored"), default="both",
                        help="run each setting with movement ignored, charged, or both (default)")
    parser.add_argument("--movement-mode", choices=("plain", "overlapped", "both"), default="overlapped",
                        help="the runtime whose movement is charged: overlapped (default), plain, or both")
    parser.add_argument("--reduce-dtype", choices=("fp32", "bf16"), default="fp32",
                        help="the dtype gradients travel in (default fp32)")
    parser.add_argument("--recompute", choices=RECOMPUTE_MODES, default="auto",
                        help="activation recomputation: auto (default: only where a sequence is longer than every "
                             "scheme holds without it), on, off")
    args = parser.parse_args(argv)
    modes = {"both": (False, True), "charged": (True,), "ignored": (False,)}[args.movement]
    runtimes = ("plain", "overlapped") if args.movement_mode == "both" else (args.movement_mode,)
    settings = SMOKE if args.smoke else LONG_CONTEXT if args.long_context else SETTINGS + LONG_CONTEXT
    jobs = [replace(job, charge_movement=charged, movement_mode=runtime, reduce_dtype=args.reduce_dtype,
                    regroup=not args.no_regroup, recompute=args.recompute)
            for job in settings for charged in modes for runtime in (runtimes if charged else ("plain",))]
    run(jobs, Path(args.out), plot=not args.no_plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
