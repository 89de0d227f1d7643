"""``python -m benchmarks.memory``: what the runtime moves and holds per rank per step, against the ideal.

A LLaMA of 52.4M parameters (14 layers, hidden 512, SwiGLU 1536, 8 heads, 4 kv heads, vocab 8192), built on
the meta device and initialised per parameter, trains on 4 local gloo ranks under 4x(tp1), 2x(tp2), 1x(tp4)
and 1x(tp2,pp2) (SGD, fp32, a small batch so that activations stay small). For one measured step of each,
per rank:

- bytes received and sent (the runtime's own counters), against the ideal: the bytes of the slices the rank
  computes with that its own shard does not hold (parameters in, gradients out), plus the parts of its shard
  that the other ranks compute with (parameters out, gradients in);
- the peak of live tensor bytes (every tensor an op allocates during the step, tracked until it is freed,
  plus the rank's fp32 shard), over the whole step and over the parameter-movement phases alone (pull,
  compute start, push: no activations then), against the target 1.5 x ideal + shard, where ideal is the
  rank's parameter and gradient slices and shard its master shard and shard gradient.

"before" is the previous runtime's movement re-enacted on the same layout by the same meters: every rank
all-gathers the whole fp32 vector, copies its slices from it, and all-reduces a full-size gradient buffer.

The runtime measured is the plain one (``TrainOptions(overlap_movement=False)``), whose movement phases can be
timed apart from the compute; what the default overlapped runtime adds to the step, predicted against measured,
is ``benchmarks.overlap``'s.

Time of the movement, predicted against measured, per strategy: once every strategy has compiled, the links
between these ranks are probed (``runtime.link_probe``: the movement's rounds of pairs for a few message sizes, a
latency and a bandwidth fitted; the rates of writing new memory and of adding written memory), the planner
replays the strategy's rounds and its memory work on them (``passes.plan.movement.movement_time``, from the
layout the lowerings give), and three more steps are timed with a barrier before the pull and before the push:
measured pull is from the barrier until the last rank starts computing, measured push from the barrier until
the last rank reaches its optimiser (medians of the three). ``pred_move_ms`` / ``measured_move_ms`` is their
sum; the target is within 25%. The ranks run under :data:`FRESH_ALLOCATOR` (``--default-allocator``: not).
Prints a table; ``--json`` prints one JSON object; every row is appended, stamped, to
``results/memory.jsonl``. ``--smoke``: a tiny model, two strategies (CI).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hcompile.models import LlamaConfig

MODEL = LlamaConfig(vocab=8192, layers=14, hidden=512, ffn_hidden=1536, heads=8, kv_heads=4)
SMOKE_MODEL = LlamaConfig(vocab=256, layers=2, hidden=64, ffn_hidden=128, heads=4, kv_heads=2)
STRATEGIES = ("4x(tp1)", "2x(tp2)", "1x(tp4)", "1x(tp2,pp2)")
SMOKE_STRATEGIES = ("4x(tp1)", "1x(tp2,pp2)")
MOVEMENT_PHASES = ("pull", "push")
"""Phases without activations: the peak over them and the start of the compute phase (the gradient buffer
exists, no forward has run) is the parameter, gradient and buffer peak."""


class LiveBytes(TorchDispatchMode):
    """Live tensor bytes on this rank: every storage an op returns, from its allocation until it is freed,
    plus ``base`` bytes that existed before; the peak per phase. Compiled variants run under it as compiled
    (the compiler's own work is not counted)."""

    def __init__(self, base: int) -> None:
        super().__init__()
        self.current = self.base = base
        self.phase = "start"
        self.peaks: dict[str, int] = {}
        self.at_start: dict[str, int] = {}
        self._live: dict[int, tuple[int, weakref.ref]] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def mark(self, phase: str) -> None:
        """Enter ``phase``; its peak starts at what is live now."""
        self.phase = phase
        self.at_start[phase] = self.current
        self.peaks[phase] = max(self.peaks.get(phase, 0), self.current)

    def movement_peak(self) -> int:
        """The peak over the movement phases and the start of compute."""
        return max([self.peaks.get(p, 0) for p in MOVEMENT_PHASES] + [self.at_start.get("compute", 0)])

    def _free(self, key: int) -> None:
        nbytes, _ = self._live.pop(key)
        self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._live and storage.nbytes():
                    self._live[key] = (storage.nbytes(), weakref.ref(storage, lambda _, k=key: self._free(k)))
                    self.current += storage.nbytes()
                    self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), self.current)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class RankRow:
    """One rank under one strategy."""

    strategy: str
    rank: int
    slice_bytes: int
    """Bytes of the parameter slices the rank computes with (the same again for their gradients)."""
    shard_bytes: int
    """Master shard and its gradient (fp32)."""
    received: int
    sent: int
    ideal_received: int
    """Slices not in the own shard (parameters in) plus other ranks' gradients of the own shard."""
    ideal_sent: int
    """Parts of the own shard other ranks compute with (parameters out) plus the rank's gradient slices
    that other shards own."""
    peak_movement: int
    """Peak live bytes in the parameter-movement phases."""
    peak_step: int
    """Peak live bytes over the whole step (activations included)."""
    before_received: int
    before_sent: int
    before_peak_movement: int
    pred_pull_ms: float = 0.0
    """The planner's pull time of the strategy on the probed links (the same on every rank's row)."""
    pred_push_ms: float = 0.0
    measured_pull_ms: float = 0.0
    """Measured: from a barrier before the pull until the last rank starts computing."""
    measured_push_ms: float = 0.0
    """Measured: from a barrier before the push until the last rank reaches its optimiser."""

    @property
    def pred_move_ms(self) -> float:
        return self.pred_pull_ms + self.pred_push_ms

    @property
    def measured_move_ms(self) -> float:
        return self.measured_pull_ms + self.measured_push_ms

    @property
    def target_bytes(self) -> int:
        """1.5 x (parameter and gradient slices) + shard."""
        return int(1.5 * 2 * self.slice_bytes) + self.shard_bytes


def _batch(cfg: LlamaConfig, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randint(0, cfg.vocab, (n,), generator=g) for n in (24, 9, 31, 16, 12, 28, 5, 19)]


TIMED_STEPS = 3
"""Steps per strategy timed for the movement (their medians)."""
PROBE_REPEATS = 15
"""Timings per figure of the link probe, after every strategy has compiled (with the probe's default 5, its
every-rank bandwidth and new-memory rate varied by up to 30% from run to run on 4 ranks sharing 2 cores; with
15, by under 10%)."""
SMOKE_PROBE_REPEATS = 3
"""Timings per figure of the probe in ``--smoke`` (CI checks the figures are there, not their precision)."""


class PhaseClock:
    """A phase hook: a barrier before the pull and before the push, and this rank's clock as it enters the pull,
    the compute, the push and the optimiser (``time.perf_counter``: one clock for every process here)."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}

    def __call__(self, phase: str, step) -> None:
        from runtime import distributed as comm

        if phase in ("pull", "push"):
            comm.barrier()
        if phase in ("pull", "compute", "push", "optimizer"):
            self.at[phase] = time.perf_counter()


def _timed_movement(trainer, cfg: LlamaConfig, strategy: str, first_batch: int) -> tuple[float, float]:
    """Median over ``TIMED_STEPS`` steps of the measured pull and push (ms), every rank's clocks gathered."""
    from runtime import distributed as comm

    pulls, pushes = [], []
    for k in range(TIMED_STEPS):
        clock = PhaseClock()
        trainer.executor.hooks.insert(0, clock)
        trainer.train_step(_batch(cfg, first_batch + k), strategy=strategy)
        trainer.executor.hooks.remove(clock)
        pull, push = barrier_phases_ms(comm.all_gather_object(clock.at))
        pulls.append(pull)
        pushes.append(push)
    return statistics.median(pulls), statistics.median(pushes)


def barrier_phases_ms(every: list[dict]) -> tuple[float, float]:
    """The pull and the push (ms) as every rank's :class:`PhaseClock` timed them: from the barrier until the last
    rank computes, and until the last rank reaches its optimiser."""
    pull = max(a["compute"] for a in every) - min(a["pull"] for a in every)
    push = max(a["optimizer"] for a in every) - min(a["push"] for a in every)
    return 1e3 * pull, 1e3 * push


def _rank(rank: int, world: int, cfg: LlamaConfig, strategies: tuple[str, ...],
          probe_repeats: int = PROBE_REPEATS) -> list[dict]:
    import hcompile
    from hcompile.cost import compute_layout
    from hcompile.models import Llama
    from passes.graph.variant import TokenBuckets
    from passes.plan.ir import Strategy
    from passes.plan.movement import movement_time
    from runtime.link_probe import probe_links
    from runtime.redistribute import total

    with hcompile.empty_init():
        model = Llama(cfg)
    trainer = hcompile.compile(model, buckets=TokenBuckets.powers_of_two(32, 256)).trainer(
        loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, strategies=list(strategies),
        tokens_per_rank=64, calibrate=False, init=hcompile.normal_init(0.02),
        overlap_movement=False)  # the phases timed apart: the plain runtime (overlapped: benchmarks.overlap)
    layout, executor = trainer.layout, trainer.executor
    for i, strategy in enumerate(strategies):
        trainer.train_step(_batch(cfg, 2 * i), strategy=strategy)  # compiles what the strategy needs
    probe = probe_links(repeats=probe_repeats)
    links = probe.host_links(world)
    parsed = [Strategy.parse(s) for s in strategies]
    compute = compute_layout(trainer.lowerings, layout, sorted({s for p in parsed for s in p.schemes}))
    rows = []
    for i, strategy in enumerate(strategies):
        meter = LiveBytes(base=layout.shard_numel * 4)
        hook = lambda phase, step, meter=meter: meter.mark(phase)  # noqa: E731
        executor.hooks.insert(0, hook)
        with meter:
            stats = trainer.train_step(_batch(cfg, 2 * i + 1), strategy=strategy)
        executor.hooks.remove(hook)
        move = executor.redistribution_of(Strategy.parse(strategy))
        size = layout.shard.element_size()
        owned = move.numel - move.local_numel
        # a TP rank above 0 pushes no replicated parameter (runtime.stage_params.StageParams.push_ranges)
        push_sent = sum(total(r) for k, parts in enumerate(move.push_segments) if k != rank for r in parts)
        push_received = sum(total(r) for j, r in enumerate(move.push_serves) if j != rank)
        before = _full_vector_movement(layout, move)
        predicted = movement_time(compute, Strategy.parse(strategy), links, param_bytes=size, reduce_bytes=4,
                                  chunk_numel=executor.chunk_numel)
        measured_pull, measured_push = _timed_movement(trainer, cfg, strategy, first_batch=100 + 10 * i)
        row = RankRow(
            strategy=strategy, rank=rank, slice_bytes=move.numel * size, shard_bytes=2 * layout.shard_numel * 4,
            received=stats.traffic.params_received + stats.traffic.grads_received,
            sent=stats.traffic.params_sent + stats.traffic.grads_sent,
            ideal_received=(owned + push_received) * size, ideal_sent=(move.served_numel() + push_sent) * size,
            peak_movement=meter.movement_peak(), peak_step=max(meter.peaks.values()),
            pred_pull_ms=predicted.pull_ms, pred_push_ms=predicted.push_ms, measured_pull_ms=measured_pull,
            measured_push_ms=measured_push, **before)
        rows.append({**asdict(row), "pred_move_ms": row.pred_move_ms, "measured_move_ms": row.measured_move_ms,
                     "links": probe.to_dict()})
    return rows


def _full_vector_movement(layout, move) -> dict:
    """The previous runtime's movement for this rank's slices, measured: all-gather of the whole fp32 vector,
    the slices copied out of it, a zeroed full-size gradient buffer with the slices' gradients added in,
    all-reduced (gloo has no reduce-scatter)."""
    from runtime import distributed as comm

    meter = LiveBytes(base=layout.shard_numel * 4)
    world, shard = layout.world_size, layout.shard_numel
    with meter:
        meter.mark("pull")
        flat = torch.empty(shard * world)
        comm.all_gather_into(flat, layout.shard.detach())
        slices = torch.cat([flat[a:b] for a, b in move.ranges])
        del flat
        meter.mark("push")
        grads = torch.ones_like(slices)
        full = torch.zeros(shard * world)
        pos = 0
        for a, b in move.ranges:
            full[a:b] += grads[pos:pos + b - a]
            pos += b - a
        full = comm.all_reduce(full)
        shard_grad = full[layout.rank * shard:(layout.rank + 1) * shard].clone()  # its size is what counts
        del full, grads, slices, shard_grad
    return {"before_received": (world - 1) * shard * 4 + (world - 1) * shard * 4,
            "before_sent": (world - 1) * shard * 4 + (world - 1) * shard * 4,
            "before_peak_movement": meter.movement_peak()}


FRESH_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 20)}
"""glibc's settings for the ranks (read when a process starts): every block of 1 MiB or more is mapped anew and
given back when freed, so each step's movement buffers are new memory, as the movement model counts them. Under
glibc's default (a threshold that rises as blocks are freed, up to 32 MiB, and freed memory kept in the heap) a
buffer of 30-100 MB is sometimes served from memory the step freed before it, already written, and sometimes
mapped anew; which, depends on the order of everything the step allocated, and no model of the movement can know
it (on 4 ranks the movement of 1x(tp2,pp2) took 134 ms under the default and 283 ms under these settings)."""


def run(cfg: LlamaConfig, strategies: tuple[str, ...], world: int = 4, allocator: bool = True,
        probe_repeats: int = PROBE_REPEATS) -> list[dict]:
    """Every (strategy, rank) row, measured on ``world`` local ranks (under :data:`FRESH_ALLOCATOR` unless
    ``allocator`` is False), the links probed with ``probe_repeats`` timings per figure."""
    from hcompile.tools.spawn import run_local_ranks

    with mock.patch.dict(os.environ, FRESH_ALLOCATOR if allocator else {}):  # the spawned ranks inherit it
        per_rank = run_local_ranks(world, _rank, cfg, strategies, probe_repeats, timeout_s=1200)
    return [row for rows in zip(*per_rank) for row in rows]


def format_table(rows: list[dict]) -> str:
    mb = 2**20
    lines = [f"{'strategy':<13}{'rank':>4} {'slices MB':>9} {'recv MB':>8} {'/ideal':>6} {'sent MB':>8} {'/ideal':>6} "
             f"{'peak move MB':>12} {'target MB':>9} {'peak step MB':>12} | {'before recv':>11} {'sent':>7} "
             f"{'peak move':>9}"]
    for r in rows:
        ratio_in = r["received"] / r["ideal_received"] if r["ideal_received"] else 1.0
        ratio_out = r["sent"] / r["ideal_sent"] if r["ideal_sent"] else 1.0
        target = int(1.5 * 2 * r["slice_bytes"]) + r["shard_bytes"]
        lines.append(f"{r['strategy']:<13}{r['rank']:>4} {r['slice_bytes'] / mb:>9.1f} {r['received'] / mb:>8.1f} "
                     f"{ratio_in:>6.2f} {r['sent'] / mb:>8.1f} {ratio_out:>6.2f} {r['peak_movement'] / mb:>12.1f} "
                     f"{target / mb:>9.1f} {r['peak_step'] / mb:>12.1f} | {r['before_received'] / mb:>11.1f} "
                     f"{r['before_sent'] / mb:>7.1f} {r['before_peak_movement'] / mb:>9.1f}")
    return "\n".join(lines)


def movement_times(rows: list[dict]) -> list[dict]:
    """Per strategy: the predicted and measured movement (ms) and their ratio."""
    out = []
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        r = next(x for x in rows if x["strategy"] == strategy)
        out.append({"strategy": strategy, **{k: round(r[k], 2) for k in (
            "pred_pull_ms", "measured_pull_ms", "pred_push_ms", "measured_push_ms", "pred_move_ms",
            "measured_move_ms")}, "pred_over_measured": round(r["pred_move_ms"] / r["measured_move_ms"], 3)})
    return out


def format_movement(summary: dict) -> str:
    """The time table: per strategy, predicted against measured."""
    links = summary["links"]
    lines = [f"links probed: {links['gbps']:.3f} GB/s one way every rank at once ({links['pair_gbps']:.3f} one pair "
             f"alone), {links['latency_us']:.0f} us per message, new memory written at {links['fresh_gbps']:.3f} GB/s "
             f"and freed at {links['freed_gbps']:.3f}, "
             f"written memory added at {links['warm_gbps']:.3f} GB/s (allocator: {summary['allocator']})",
             f"{'strategy':<13}{'pull pred':>10}{'meas':>8}{'push pred':>10}{'meas':>8}{'move pred':>10}"
             f"{'meas':>8}{'pred/meas':>10}"]
    for m in summary["movement_time"]:
        lines.append(f"{m['strategy']:<13}{m['pred_pull_ms']:>10.1f}{m['measured_pull_ms']:>8.1f}"
                     f"{m['pred_push_ms']:>10.1f}{m['measured_push_ms']:>8.1f}{m['pred_move_ms']:>10.1f}"
                     f"{m['measured_move_ms']:>8.1f}{m['pred_over_measured']:>10.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model and two strategies (seconds)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--default-allocator", action="store_true",
                        help="leave glibc's allocator at its defaults (the movement's buffers then sometimes reuse "
                             "freed memory, which the movement model does not know)")
    parser.add_argument("--out", default="results", help="folder of memory.jsonl (default results)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"--out {args.out!r} is a file, expected a folder", file=sys.stderr)
        return 2
    from benchmarks.e2e import device_name
    from benchmarks.provenance import commit

    cfg, strategies = (SMOKE_MODEL, SMOKE_STRATEGIES) if args.smoke else (MODEL, STRATEGIES)
    rows = run(cfg, strategies, allocator=not args.default_allocator,
               probe_repeats=SMOKE_PROBE_REPEATS if args.smoke else PROBE_REPEATS)
    params = sum(r["slice_bytes"] for r in rows if r["strategy"] == "4x(tp1)" and r["rank"] == 0) // 4
    summary = {"benchmark": "memory", "commit": commit(), "device": device_name(), "smoke": args.smoke,
               "allocator": "default" if args.default_allocator else "fresh",
               "model": asdict(cfg), "parameters": params, "ranks": 4, "rows": rows,
               "max_moved_over_ideal": max(max(r["received"] / max(1, r["ideal_received"]),
                                               r["sent"] / max(1, r["ideal_sent"])) for r in rows),
               "max_peak_over_target": max(r["peak_movement"] / (int(3 * r["slice_bytes"]) + r["shard_bytes"])
                                           for r in rows),
               "links": rows[0]["links"], "movement_time": movement_times(rows)}
    summary["max_move_error"] = max(abs(m["pred_over_measured"] - 1) for m in summary["movement_time"])
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "memory.jsonl", "a") as f:
        stamp = {k: summary[k] for k in ("benchmark", "commit", "device", "smoke", "allocator", "model")}
        for row in rows:
            f.write(json.dumps({**stamp, **{k: v for k, v in row.items() if k != "links"}}) + "\n")
    if args.json:
        print(json.dumps(summary))
    else:
        print(format_table(rows))
        print(f"{params / 1e6:.1f}M parameters; moved/ideal at most {summary['max_moved_over_ideal']:.3f} "
              f"(target 1.1); peak of the movement phases over 1.5 x slices + shard at most "
              f"{summary['max_peak_over_target']:.3f} (target 1.0)")
        print(format_movement(summary))
        print(f"movement time, predicted over measured: at most {summary['max_move_error']:.1%} off (target 25%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
