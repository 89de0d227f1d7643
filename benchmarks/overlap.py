"""``python -m benchmarks.overlap``: exposed movement time with the movement in rounds before and after the
compute (the default) against overlapped with it (``TrainOptions(overlap_movement=True)``, ``runtime.overlap``).

The LLaMA of ``benchmarks.memory`` (52.4M parameters) trains on 4 local gloo ranks under each strategy, two
trainers side by side from the same initial weights (one per mode), their steps interleaved on the same
batches (so both see the same machine load). Per step and rank, the exposed movement is the wall time the
rank spent on movement that no compute covered: the pull phase (in rounds: the whole pull; overlapped: posting
every window and copying its own shard's part), the time the compute waited for windows still travelling
(overlapped only) and the push phase (in rounds: the whole push; overlapped: what is left after the backward,
the receives and the sums). Reported per strategy: medians over the timed steps of the slowest rank's exposed
movement and of the step's wall time, and the losses of both modes (equal: the same training).

On this machine 4 ranks share 2 cores, so the transfers (gloo's threads copying through the loopback) take
cores from the compute they overlap with; on GPUs they run on the copy engines and NICs.
Prints a table; ``--json`` prints one JSON object; rows are appended, stamped, to ``results/overlap.jsonl``.
``--smoke``: a tiny model, one strategy (CI).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.memory import MODEL, SMOKE_MODEL, _batch
from hcompile.models import LlamaConfig

STRATEGIES = ("4x(tp1)", "2x(tp2)", "1x(tp2,pp2)", "1x(tp2)+2x(tp1)")
SMOKE_STRATEGIES = ("1x(tp2)+2x(tp1)",)
TIMED_STEPS = 4
"""Timed steps per strategy and mode (after one warm-up step each)."""
MODES = ("rounds", "overlap")


def _rank(rank: int, world: int, cfg: LlamaConfig, strategies: tuple[str, ...], steps: int) -> list[dict]:
    import hcompile
    from hcompile.models import Llama
    from passes.graph.variant import TokenBuckets
    from runtime import distributed as comm

    trainers = {}
    with hcompile.empty_init():
        model = Llama(cfg)
    compiled = hcompile.compile(model, buckets=TokenBuckets.powers_of_two(32, 256))  # captured once for both
    for mode in MODES:
        trainers[mode] = compiled.trainer(
            loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, strategies=list(strategies),
            tokens_per_rank=64, calibrate=False, init=hcompile.normal_init(0.02),
            overlap_movement=mode == "overlap")
    rows = []
    for i, strategy in enumerate(strategies):
        measured: dict[str, list] = {mode: [] for mode in MODES}
        for k in range(steps + 1):
            batch = _batch(cfg, 1000 * i + k)
            for mode in MODES:
                stats = trainers[mode].train_step(batch, strategy=strategy)
                if k == 0:
                    continue  # warm-up: compiles what the strategy needs
                walls = comm.all_gather_object(stats.wall_ms)
                exposed = [p + w + q for p, w, q in zip(stats.pull_ms, stats.pull_wait_ms or [0.0] * world,
                                                        stats.push_ms)]
                measured[mode].append({"loss": stats.loss, "wall_ms": max(walls), "exposed_ms": max(exposed),
                                       "pull_ms": max(stats.pull_ms), "push_ms": max(stats.push_ms),
                                       "wait_ms": max(stats.pull_wait_ms or [0.0])})
        if rank == 0:
            row = {"strategy": strategy, "steps": steps}
            for mode in MODES:
                for key in ("wall_ms", "exposed_ms", "pull_ms", "push_ms", "wait_ms"):
                    row[f"{mode}_{key}"] = statistics.median(m[key] for m in measured[mode])
                row[f"{mode}_losses"] = [m["loss"] for m in measured[mode]]
            row["exposed_ratio"] = row["overlap_exposed_ms"] / row["rounds_exposed_ms"]
            row["wall_ratio"] = row["overlap_wall_ms"] / row["rounds_wall_ms"]
            rows.append(row)
    return rows


def run(cfg: LlamaConfig, strategies: tuple[str, ...], steps: int = TIMED_STEPS, world: int = 4) -> list[dict]:
    """One row per strategy, measured on ``world`` local ranks."""
    from hcompile.tools.spawn import run_local_ranks

    return run_local_ranks(world, _rank, cfg, strategies, steps, timeout_s=2400)[0]


def format_table(rows: list[dict]) -> str:
    head = (f"{'strategy':<18} {'exposed ms':>22} {'ratio':>6} {'step wall ms':>22} {'ratio':>6} "
            f"{'overlap: pull/wait/push ms':>28}")
    lines = [head, f"{'':<18} {'rounds -> overlap':>22} {'':>6} {'rounds -> overlap':>22}"]
    for r in rows:
        lines.append(f"{r['strategy']:<18} {r['rounds_exposed_ms']:>10.1f} -> {r['overlap_exposed_ms']:>8.1f} "
                     f"{r['exposed_ratio']:>6.2f} {r['rounds_wall_ms']:>10.1f} -> {r['overlap_wall_ms']:>8.1f} "
                     f"{r['wall_ratio']:>6.2f} {r['overlap_pull_ms']:>10.1f}/{r['overlap_wait_ms']:.1f}/"
                     f"{r['overlap_push_ms']:.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overlap", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model and one strategy (seconds)")
    parser.add_argument("--steps", type=int, default=TIMED_STEPS, help=f"timed steps per mode ({TIMED_STEPS})")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--out", default="results", help="folder of overlap.jsonl (default results)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"--out {args.out!r} is a file, expected a folder", file=sys.stderr)
        return 2
    if args.steps < 1:
        print(f"--steps must be at least 1, got {args.steps}", file=sys.stderr)
        return 2
    from benchmarks.e2e import device_name
    from benchmarks.provenance import commit

    cfg, strategies = (SMOKE_MODEL, SMOKE_STRATEGIES) if args.smoke else (MODEL, STRATEGIES)
    rows = run(cfg, strategies, args.steps)
    summary = {"benchmark": "overlap", "commit": commit(), "device": device_name(), "smoke": args.smoke,
               "model": asdict(cfg), "ranks": 4, "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "overlap.jsonl", "a") as f:
        stamp = {k: summary[k] for k in ("benchmark", "commit", "device", "smoke", "model")}
        for row in rows:
            f.write(json.dumps({**stamp, **row}) + "\n")
    if args.json:
        print(json.dumps(summary))
    else:
        print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
