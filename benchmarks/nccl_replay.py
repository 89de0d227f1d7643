"""The planner's steps with their movement replayed under NCCL's rules (``python -m benchmarks.nccl_replay``).

Plans the steps as ``python -m benchmarks.planner`` does (``hcompile.tools.simulate.prepare``: the hydraulis
policy, movement charged, the overlapped runtime), lays out the compute copies with the planner's
``llama_compute_layout`` (its ``MovementCost.layout``), derives every rank's movement ops as
``runtime.overlap.WindowedMovement`` posts them (``passes.plan.nccl_replay.movement_ops``; windows: the layout's
window count cut evenly, ``even_windows``) and replays them (``passes.plan.nccl_replay.replay``) twice: the
movement alone (pull and push times) and beside the step's compute (each rank its replica's planned time:
exposed movement and step time). Prints a table per step, ``--json`` one object per step, and the communicators
a rank holds (NCCL: default, movement, every TP/CP group of every step's placement; each sub-group also a gloo
mesh, ``cpu:gloo,cuda:nccl``). Not replayed: the pipeline's p2p and the TP/CP collectives of the compute.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from passes.plan.nccl_replay import balanced_s, movement_ops, order_hazards, replay


def _communicators(plans, gpus: int) -> dict:
    """Per rank, the communicators the runtime makes over these steps (``runtime.distributed``)."""
    groups: list[set[tuple[int, ...]]] = [set() for _ in range(gpus)]
    for plan in plans:
        for replica in plan.replicas:
            for g in replica.tp_groups + replica.cp_groups:
                if len(g) > 1:
                    for r in g:
                        groups[r].add(tuple(sorted(g)))
    sub = [len(g) for g in groups]
    return {"nccl_per_rank_max": 2 + max(sub), "nccl_per_rank_min": 2 + min(sub),
            "gloo_meshes_per_rank_max": 1 + max(sub), "distinct_subgroups": len(set().union(*groups))}


def run_step(plan, movement, gpus_per_node: int) -> dict:
    """Replay one planned step's movement, alone and beside its compute."""
    compute = [0.0] * plan.strategy.gpus
    for replica in plan.replicas:
        for r in replica.ranks:
            compute[r] = replica.est_ms / 1e3
    layout, links = movement.layout, movement.links
    alone = movement_ops(layout, plan.strategy, gpus_per_node, param_bytes=movement.param_bytes,
                         reduce_bytes=movement.reduce_bytes)
    moved = replay(alone, links)
    world = len(alone)
    both = movement_ops(layout, plan.strategy, gpus_per_node, param_bytes=movement.param_bytes,
                        reduce_bytes=movement.reduce_bytes, compute_s=compute)
    stepped = replay(both, links)
    t = movement.time(plan.strategy) if hasattr(movement, "time") else None
    return {
        "strategy": plan.strategy.describe(),
        "replay_pull_s": max(moved.tag_end(r, "pull") for r in range(world)),
        "replay_push_s": max(moved.tag_span(r, "push") for r in range(world)),
        "balanced_pull_s": balanced_s(alone, links, "pull"),
        "balanced_push_s": balanced_s(alone, links, "push"),
        "planner_pull_s": None if t is None else t.pull_ms / 1e3,
        "planner_push_s": None if t is None else t.push_ms / 1e3,
        "replay_exposed_s": max(stepped.rank_time(r) - compute[r] for r in range(world)),
        "planner_exposed_s": movement.exposed_ms(plan.strategy) / 1e3,
        "replay_step_s": stepped.step_time(),
        "planner_step_s": plan.est_step_ms / 1e3,
        "order_hazards": [list(h[:2]) + [list(h[2])] for h in order_hazards(both)],
        "deadlock": None if stepped.deadlock is None else str(stepped.deadlock)[:500],
        "ops": sum(len(o) for o in both),
    }


def main(argv: list[str] | None = None) -> int:
    """The CLI (module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.nccl_replay", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-32b")
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--hardware", default="a800-80g")
    parser.add_argument("--dataset", default="commoncrawl")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON object per planned step")
    args = parser.parse_args(argv)
    from hcompile.tools.simulate import PlanJob, prepare

    job = PlanJob(model=args.model, hardware=args.hardware, gpus=args.gpus, dataset=args.dataset,
                  steps=args.steps, seed=args.seed, policies=("hydraulis",), movement_mode="overlapped")
    started = time.perf_counter()
    planner, _, batches = prepare(job)
    movement = planner.movement
    if movement is None:
        print("the planner charges no movement for this model (no heads / FFN width)", file=sys.stderr)
        return 2
    plans = [planner.plan(batch, "hydraulis") for batch in batches]
    plan_s = time.perf_counter() - started
    gpn = planner.cost_model.gpus_per_node
    comms = _communicators(plans, args.gpus)
    links = movement.links
    if not args.json:
        print(f"{args.model} on {args.gpus} x {args.hardware} ({args.dataset}), {len(plans)} steps planned in "
              f"{plan_s:.1f} s; links: {gpn} GPUs/node, NVLink {links.intra_gbps} GB/s, IB {links.inter_gbps} "
              f"GB/s, {links.latency_us} us; layout {movement.layout.numel} elements, {movement.layout.windows} "
              f"windows\ncommunicators per rank: {comms}")
        print(f"{'step':>4} {'strategy':<40} {'pull':>7} {'bal':>7} {'plan':>7} {'push':>7} {'bal':>7} {'plan':>7}"
              f" {'exp':>7} {'plan':>7} {'step':>7} {'plan':>7} {'s':>5}  hazards")
    for step, plan in enumerate(plans):
        t0 = time.perf_counter()
        row = {"step": step, **run_step(plan, movement, gpn), "replay_wall_s": 0.0}
        row["replay_wall_s"] = round(time.perf_counter() - t0, 2)
        row["communicators"] = comms
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            def f(k: str, row: dict = row) -> str:
                return f"{row[k]:7.3f}" if row[k] is not None else "      -"

            print(f"{step:>4} {row['strategy'][:40]:<40} {f('replay_pull_s')} {f('balanced_pull_s')} "
                  f"{f('planner_pull_s')} {f('replay_push_s')} {f('balanced_push_s')} {f('planner_push_s')} "
                  f"{f('replay_exposed_s')} {f('planner_exposed_s')} {f('replay_step_s')} {f('planner_step_s')} "
                  f"{row['replay_wall_s']:5.1f}  {row['order_hazards'] or ''}{' DEADLOCK' if row['deadlock'] else ''}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
