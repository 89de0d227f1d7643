"""``python -m benchmarks.overlap``: exposed movement time with the movement in rounds before and after the
compute (the default) against overlapped with it (``TrainOptions(overlap_movement=True)``, ``runtime.overlap``).

The LLaMA of ``benchmarks.memory`` (52.4M parameters) trains on 4 local gloo ranks under each strategy, two
trainers side by side from the same initial weights (one per mode), their steps interleaved on the same
batches, which mode goes first alternating step by step (so both see the same machine load, and a drift over the
run falls on both alike). Per step and rank, the exposed movement is the wall time the
rank spent on movement that no compute covered: the pull phase (in rounds: the whole pull; overlapped: posting
every window and copying its own shard's part), the time the compute waited for windows still travelling
(overlapped only) and the push phase (in rounds: the whole push; overlapped: what is left after the backward,
the receives and the sums). Reported per strategy: medians over the timed steps of the slowest rank's exposed
movement and of the step's wall time, and the losses of both modes (equal: the same training).

On this machine 4 ranks share 2 cores, so the transfers (gloo's threads copying through the loopback) take
cores from the compute they overlap with; on GPUs they run on the copy engines and NICs.

Predicted against measured, per strategy: what the overlapped runtime adds to the step beyond the same step with
its movement free. Measured: the overlapped step's wall time less the rounds' step wall time without its pull and
push, each timed from a barrier (``benchmarks.memory.PhaseClock``: the pull until the last rank computes, the
push until the last rank reaches its optimiser), medians; the ranks run under ``benchmarks.memory``'s
``FRESH_ALLOCATOR``, as the movement model counts their buffers. Predicted: the planner's model of the
overlapped runtime (``MovementCost(mode="overlapped").step_ms`` less the slowest replica's compute) on the links
probed here once every strategy has compiled
(``runtime.link_probe``, its ``overlap_slowdown`` included: the cores the transfers take from the compute; and
its ``compute_slots``: the 4 ranks share 2 cores, so a replica that the movement keeps busy longer slows the
others, ``passes.plan.host_sharing``), each replica's compute as measured in the rounds (its ranks' longest
compute phase), its first and last micro-batch that compute's share by tokens. Target: within 25%
(``pred_over_measured``).
Prints a table; ``--json`` prints one JSON object; rows are appended, stamped, to ``results/overlap.jsonl``.
``--smoke``: a tiny model, one strategy (CI).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path
from unittest import mock

import torch

from benchmarks.memory import (
    FRESH_ALLOCATOR,
    MODEL,
    PROBE_REPEATS,
    SMOKE_MODEL,
    SMOKE_PROBE_REPEATS,
    PhaseClock,
    _batch,
    barrier_phases_ms,
)
from hcompile.models import LlamaConfig

STRATEGIES = ("4x(tp1)", "2x(tp2)", "1x(tp2,pp2)", "1x(tp2)+2x(tp1)")
SMOKE_STRATEGIES = ("1x(tp2)+2x(tp1)",)
TIMED_STEPS = 8
"""Timed steps per strategy and mode (after one warm-up step each): a step's measured added time varies by about
+-150 ms here (the host's load), against 200-900 ms added, so the median takes eight."""
MODES = ("rounds", "overlap")


def _rank(rank: int, world: int, cfg: LlamaConfig, strategies: tuple[str, ...], steps: int,
          probe_repeats: int) -> list[dict]:
    import hcompile
    from hcompile.models import Llama
    from passes.graph.variant import TokenBuckets
    from runtime import distributed as comm
    from runtime.link_probe import probe_links

    trainers = {}
    with hcompile.empty_init():
        model = Llama(cfg)
    compiled = hcompile.compile(model, buckets=TokenBuckets.powers_of_two(32, 256))  # captured once for both
    for mode in MODES:
        trainers[mode] = compiled.trainer(
            loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, strategies=list(strategies),
            tokens_per_rank=64, calibrate=False, init=hcompile.normal_init(0.02),
            overlap_movement=mode == "overlap")
    for i, strategy in enumerate(strategies):  # warm-up: compiles what each strategy needs
        for mode in MODES:
            trainers[mode].train_step(_batch(cfg, 1000 * i), strategy=strategy)
    probe = probe_links(repeats=probe_repeats)
    rows = []
    for i, strategy in enumerate(strategies):
        measured: dict[str, list] = {mode: [] for mode in MODES}
        for k in range(1, steps + 1):
            batch = _batch(cfg, 1000 * i + k)
            for mode in MODES if k % 2 else MODES[::-1]:
                clock = PhaseClock()  # rounds: a barrier before each phase times it apart from the compute
                if mode == "rounds":
                    trainers[mode].executor.hooks.insert(0, clock)
                stats = trainers[mode].train_step(batch, strategy=strategy)
                if mode == "rounds":
                    trainers[mode].executor.hooks.remove(clock)
                every = comm.all_gather_object((clock.at, stats.wall_ms,
                                                stats.compute_window[1] - stats.compute_window[0]))
                walls = [wall for _, wall, _ in every]
                exposed = [p + w + q for p, w, q in zip(stats.pull_ms, stats.pull_wait_ms or [0.0] * world,
                                                        stats.push_ms)]
                measured[mode].append({"loss": stats.loss, "wall_ms": max(walls), "exposed_ms": max(exposed),
                                       "pull_ms": max(stats.pull_ms), "push_ms": max(stats.push_ms),
                                       "wait_ms": max(stats.pull_wait_ms or [0.0]),
                                       "moved_ms": sum(barrier_phases_ms([at for at, _, _ in every]))
                                       if clock.at else 0.0,
                                       "compute_ms": [1e3 * c for _, _, c in every],
                                       "plan": trainers[mode].last_plan.plan})
        predicted = _predicted(trainers["overlap"], strategy, probe.host_links(world), measured["rounds"])
        if rank == 0:
            row = {"strategy": strategy, "steps": steps}
            for mode in MODES:
                for key in ("wall_ms", "exposed_ms", "pull_ms", "push_ms", "wait_ms"):
                    row[f"{mode}_{key}"] = statistics.median(m[key] for m in measured[mode])
                row[f"{mode}_losses"] = [m["loss"] for m in measured[mode]]
            row["exposed_ratio"] = row["overlap_exposed_ms"] / row["rounds_exposed_ms"]
            row["wall_ratio"] = row["overlap_wall_ms"] / row["rounds_wall_ms"]
            row["measured_added_steps_ms"] = [o["wall_ms"] - (r["wall_ms"] - r["moved_ms"])
                                              for o, r in zip(measured["overlap"], measured["rounds"])]
            row["rounds_wall_steps_ms"] = [r["wall_ms"] for r in measured["rounds"]]
            row["overlap_wall_steps_ms"] = [o["wall_ms"] for o in measured["overlap"]]
            row["measured_added_ms"] = statistics.median(row["measured_added_steps_ms"])
            row.update(predicted)
            row["pred_over_measured"] = row["pred_added_ms"] / row["measured_added_ms"]
            row["links"] = probe.to_dict()
            rows.append(row)
    return rows


def _predicted(trainer, strategy: str, links, rounds: list[dict]) -> dict:
    """The planner's overlapped charge of ``strategy`` on ``links``, with each replica's compute as the rounds
    measured it (the median over steps of its ranks' longest compute phase), its first and last micro-batch
    that compute's share by tokens (1F1B: ``sum t_j + (pp - 1) max t_j``); and the same charge with the
    replicas not sharing the host's cores (``pred_added_unshared_ms``: the model before
    ``passes.plan.host_sharing``)."""
    from passes.plan.ir import Strategy

    parsed = Strategy.parse(strategy)
    cost = trainer.movement_cost(parsed.schemes, links)
    unshared = trainer.movement_cost(parsed.schemes, replace(links, compute_slots=None))
    added, alone, computes = [], [], []
    for step in rounds:
        plan = step["plan"]
        replica_ms, edges = [], []
        for replica in plan.replicas:
            ms = max(step["compute_ms"][r] for r in replica.ranks)
            tokens = [sum(plan.seq_lens[i] for i in mb) for mb in replica.micro_batches] or [0]
            unit = ms / max(1, sum(tokens) + (replica.scheme.pp - 1) * max(tokens))
            replica_ms.append(ms)
            edges.append((unit * tokens[0], unit * tokens[-1]))
        added.append(cost.step_ms(plan.strategy, replica_ms, edges) - max(replica_ms))
        alone.append(unshared.step_ms(plan.strategy, replica_ms, edges) - max(replica_ms))
        computes.append(max(replica_ms))
    time = cost.time(parsed)
    return {"pred_added_ms": statistics.median(added), "compute_ms": statistics.median(computes),
            "pred_added_unshared_ms": statistics.median(alone),
            "pred_pull_ms": time.pull_ms, "pred_push_ms": time.push_ms, "slowdown": links.overlap_slowdown,
            "compute_slots": links.compute_slots,
            "windows": cost.windows}


def run(cfg: LlamaConfig, strategies: tuple[str, ...], steps: int = TIMED_STEPS, world: int = 4,
        probe_repeats: int = PROBE_REPEATS) -> list[dict]:
    """One row per strategy, measured on ``world`` local ranks, the links probed with ``probe_repeats`` timings
    per figure."""
    from hcompile.tools.spawn import run_local_ranks

    with mock.patch.dict(os.environ, FRESH_ALLOCATOR):  # as benchmarks.memory: the buffers the model counts
        return run_local_ranks(world, _rank, cfg, strategies, steps, probe_repeats, timeout_s=2400)[0]


def format_table(rows: list[dict]) -> str:
    head = (f"{'strategy':<18} {'exposed ms':>22} {'ratio':>6} {'step wall ms':>22} {'ratio':>6} "
            f"{'overlap: pull/wait/push ms':>28}")
    lines = [head, f"{'':<18} {'rounds -> overlap':>22} {'':>6} {'rounds -> overlap':>22}"]
    for r in rows:
        lines.append(f"{r['strategy']:<18} {r['rounds_exposed_ms']:>10.1f} -> {r['overlap_exposed_ms']:>8.1f} "
                     f"{r['exposed_ratio']:>6.2f} {r['rounds_wall_ms']:>10.1f} -> {r['overlap_wall_ms']:>8.1f} "
                     f"{r['wall_ratio']:>6.2f} {r['overlap_pull_ms']:>10.1f}/{r['overlap_wait_ms']:.1f}/"
                     f"{r['overlap_push_ms']:.1f}")
    lines.append("")
    slots = rows[0].get("compute_slots") if rows else None
    lines.append(f"what the overlapped runtime adds to the step, predicted against measured (slowdown "
                 f"{rows[0]['slowdown']:.2f} probed, {rows[0]['windows']} windows, "
                 f"{'no shared cores' if slots is None else f'{slots:.2f} compute slots'}):" if rows else "")
    lines.append(f"{'strategy':<18} {'compute ms':>10} {'pred ms':>8} {'meas ms':>8} {'pred/meas':>9} "
                 f"{'unshared pred/meas':>18}")
    for r in rows:
        lines.append(f"{r['strategy']:<18} {r['compute_ms']:>10.1f} {r['pred_added_ms']:>8.1f} "
                     f"{r['measured_added_ms']:>8.1f} {r['pred_over_measured']:>9.3f} "
                     f"{r['pred_added_unshared_ms'] / r['measured_added_ms']:>18.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overlap", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model and one strategy (seconds)")
    parser.add_argument("--steps", type=int, default=TIMED_STEPS, help=f"timed steps per mode ({TIMED_STEPS})")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--out", default="results", help="folder of overlap.jsonl (default results)")
    parser.add_argument("--strategy", action="append", default=None,
                        help=f"a strategy of 4 ranks to run (repeatable; default {', '.join(STRATEGIES)})")
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
    if args.strategy:
        from passes.plan.ir import PlanError, Strategy

        for text in args.strategy:
            try:
                gpus = Strategy.parse(text).gpus
            except PlanError as err:
                print(f"--strategy {text!r}: {err}", file=sys.stderr)
                return 2
            if gpus != 4:
                print(f"--strategy {text!r} uses {gpus} ranks, expected 4", file=sys.stderr)
                return 2
        strategies = tuple(args.strategy)
    rows = run(cfg, strategies, args.steps, probe_repeats=SMOKE_PROBE_REPEATS if args.smoke else PROBE_REPEATS)
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
