"""The ``hcompile`` command line. ``hcompile plan`` simulates the planner policies side by side on a
cluster and a length dataset; ``hcompile profile`` fits the cost model on this machine; ``hcompile launch``
starts local ranks. Bad input exits with status 2 and a one-line message."""

from __future__ import annotations

import argparse
import json
import sys

from passes.plan.context_parallel import CP_MODES
from passes.plan.cost_model import MEMORY_MODELS, PRESET_HARDWARE, PRESET_MODELS, RECOMPUTE_MODES
from passes.plan.datasets import PRESET_DATASETS
from passes.plan.ir import PlanError
from passes.plan.policies import CP_POLICIES, POLICIES
from runtime.launch import LaunchError

__all__ = ["main", "build_parser"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="simulate the planner policies side by side on a cluster and dataset",
                       description="Plan global batches of a length dataset with every policy and compare the "
                                   "cost model's estimated step times.")
    p.add_argument("--model", default="llama-32b", help=f"preset model: {', '.join(PRESET_MODELS)}")
    p.add_argument("--hardware", default="a800-80g", help=f"preset hardware: {', '.join(PRESET_HARDWARE)}")
    p.add_argument("--profile", dest="profile_file", help="a profile JSON (from `hcompile profile`) instead")
    p.add_argument("--gpus", type=_positive_int, default=64, help="GPUs in the cluster (default 64)")
    p.add_argument("--dataset", default="commoncrawl", help=f"preset dataset: {', '.join(PRESET_DATASETS)}")
    p.add_argument("--lengths", dest="lengths_file",
                   help="a JSON histogram or a text file of lengths (one per line; with --steps 1: one batch)")
    p.add_argument("--global-tokens", type=_positive_int, default=200_000, help="tokens per global batch")
    p.add_argument("--steps", type=_positive_int, default=30, help="global batches to plan (default 30)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--policy", action="append", dest="policies", metavar="NAME",
                   help=f"a policy to run, repeatable (default: all of {', '.join(POLICIES)}; and "
                        f"{', '.join(CP_POLICIES)} when context parallelism is planned; the strategy pool is built "
                        f"only where hydraulis is planned)")
    p.add_argument("--no-regroup", action="store_true",
                   help="hydraulis plans one strategy per step, no regrouped step (CP groups re-forming per "
                        "sequence inside groups of same-scheme replicas; planned by default where CP is)")
    p.add_argument("--context-parallel", choices=CP_MODES, default="auto",
                   help="context-parallel schemes: auto (default) "
                        "when a sequence is longer than every scheme without CP holds, on, off")
    p.add_argument("--recompute", choices=RECOMPUTE_MODES, default="auto",
                   help="activation recomputation (every layer's forward again in its backward): auto (default) "
                        "when a sequence is longer than every scheme holds without it, on, off")
    p.add_argument("--optimizer-layout", help="the fixed optimiser layout, e.g. '4x(tp16)' (default: the "
                                              "homogeneous strategy sized for the longest sequence)")
    p.add_argument("--memory-model", choices=MEMORY_MODELS, default="hcompile",
                   help="whose memory bounds the micro-batches: hcompile (this runtime: states sharded over all GPUs, "
                        "compute copies, transfer chunks; the optimiser layout only sets the GPU count) or paper "
                        "(the profiled runtime's, sharded by the layout) (default hcompile)")
    p.add_argument("--movement", choices=("charged", "ignored"), default="charged",
                   help="charged: estimates include each strategy's exposed parameter and gradient movement and "
                        "strategies are chosen by it; ignored: compute only, the movement still reported "
                        "(default charged)")
    p.add_argument("--movement-mode", choices=("plain", "overlapped"), default="overlapped",
                   help="the runtime whose movement is charged: overlapped (the default runtime, "
                        "TrainOptions(overlap_movement=True): what the micro-batches do not cover) or plain "
                        "(overlap_movement=False: pull before the compute, push after it) (default overlapped)")
    p.add_argument("--reduce-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the dtype gradients travel to their owners in, TrainOptions(reduce_dtype=) (default fp32)")
    p.add_argument("--plans-out", help="write one JSON line per (step, policy) to this file")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _add_launch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="run a training script on N local ranks (gloo on CPU, NCCL on GPUs)",
                       description="Start N ranks of a script on this machine, as torchrun would.")
    p.add_argument("--nproc", type=_positive_int, required=True, help="ranks to start")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="fit the cost model on this machine by running the compiled variants",
                       description="Time forward+backward of the compiled variants of each scheme on a sweep of "
                                   "packed micro-batches, fit T(s) = a*s^2 + b*s + c, and write a profile JSON.")
    p.add_argument("--model", default="llama-small", help="CPU model preset: llama-small, llama-tiny")
    p.add_argument("--tp", type=_positive_int, action="append", dest="tps", metavar="N",
                   help="a tensor-parallel degree to profile, repeatable (default 1, 2, 4)")
    p.add_argument("--cp", type=_positive_int, action="append", dest="cps", metavar="N",
                   help="a context-parallel degree (>= 2) to profile at the smallest tp, repeatable (default 2 "
                        "where the --gpus and, on CUDA, this machine's GPUs hold it)")
    p.add_argument("--no-cp", action="store_true", help="profile no context-parallel scheme")
    p.add_argument("--tokens-per-rank", type=_positive_int, default=512, help="per-rank memory cap in tokens (512)")
    p.add_argument("--repeats", type=_positive_int, default=5, help="timed runs per micro-batch, median kept (5)")
    p.add_argument("--gpus", type=_positive_int, default=4, help="ranks the memory constants are written for (4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out lengths (0)")
    p.add_argument("--out", default="profile.json", help="where to write the profile JSON (profile.json)")
    p.add_argument("--smoke", action="store_true", help="a seconds-long run: llama-tiny, tp 1 and 2, cap 128")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where to measure: cpu (one core per rank, CPU time) or cuda (rank r on GPU r, bf16, CUDA "
                        "events) (cpu)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hcompile``."""
    parser = argparse.ArgumentParser(prog="hcompile", description="Hydraulis training compiler.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan(sub)
    _add_launch(sub)
    _add_profile(sub)
    return parser


def _run_plan(args: argparse.Namespace) -> int:
    from hcompile.tools.simulate import PlanJob, format_report, run_plan_job, stderr_progress

    job = PlanJob(model=args.model, hardware=args.hardware, gpus=args.gpus, dataset=args.dataset,
                  global_tokens=args.global_tokens, steps=args.steps, seed=args.seed,
                  policies=tuple(args.policies or ()), context_parallel=args.context_parallel,
                  regroup=not args.no_regroup,
                  lengths_file=args.lengths_file,
                  optimizer_layout=args.optimizer_layout, profile_file=args.profile_file,
                  memory_model=args.memory_model, charge_movement=args.movement == "charged",
                  movement_mode=args.movement_mode, reduce_dtype=args.reduce_dtype, recompute=args.recompute)
    report, _ = run_plan_job(job, plans_out=args.plans_out, progress=stderr_progress)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print(format_report(report))
    return 0


def _run_profile(args: argparse.Namespace) -> int:
    from hcompile.tools.files import check_output_path, write_text_atomically
    from hcompile.tools.profile import ProfileJob, default_cps, format_profile, run_profile
    from hcompile.tools.spawn import RankError

    if args.no_cp and args.cps:
        print("hcompile profile: error: --cp and --no-cp contradict each other", file=sys.stderr)
        return 2
    tps = (1, 2) if args.smoke else tuple(args.tps or (1, 2, 4))
    cps = () if args.no_cp else tuple(args.cps) if args.cps else default_cps(tps, args.gpus, args.device)
    if args.smoke:
        job = ProfileJob(model="llama-tiny", tps=tps, cps=cps, tokens_per_rank=128, repeats=2, gpus=args.gpus,
                         seed=args.seed, device=args.device)
    else:
        job = ProfileJob(model=args.model, tps=tps, cps=cps, tokens_per_rank=args.tokens_per_rank,
                         repeats=args.repeats, gpus=args.gpus, seed=args.seed, device=args.device)
    check_output_path(args.out, "--out")  # before minutes of profiling
    try:
        report = run_profile(job)
    except RankError as exc:
        print(f"hcompile profile: error: {exc}", file=sys.stderr)
        return 1
    write_text_atomically(args.out, json.dumps(report.to_json(), indent=1) + "\n")
    print(format_profile(report, args.out))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hcompile`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "plan":
            return _run_plan(args)
        if args.command == "profile":
            return _run_profile(args)
        if args.command == "launch":
            from runtime.launch import launch

            return launch(args.nproc, args.script, args.script_args)
    except (PlanError, LaunchError) as exc:
        print(f"hcompile {args.command}: error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
