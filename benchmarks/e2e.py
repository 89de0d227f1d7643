"""Compile-and-run harness: ``python -m benchmarks.e2e`` trains a compiled model on local ranks with each
planner policy side by side (the same initial weights, the same batches) and measures the real runtime.

Owns the harness configuration, the cost model it plans with (profiled on this machine by default, or a
profile file, or the analytic CPU model), the length dataset scaled to the model's context, the launch of the
ranks (spawned, file:// store, hard timeout), the per-policy metrics, the table, ``--json``, the JSON lines
stamped with commit, device and config, and the plots (``benchmarks/e2e_plots.py``).

Per policy: tokens per second (wall clock); the step time with one core per rank (the largest per-rank busy
time: the CPU time of the rank's computing thread and of its communication threads over the forward and
backward, ``runtime.cpu_clock``; the computing thread alone is reported beside it); balance (largest over
mean per-rank busy time); the prediction of the step over the measured one (``pred_over_measured``): the cost
model's compute as executed (micro-batches padded to their bucket) plus the planner's replay of the
parameter and gradient movement on the profiled links, over the one-core compute plus the measured movement
(the slowest rank's pull and the push of the rank that reached it last). With the default overlapped runtime
the predicted movement is what ``MovementCost.step_ms`` adds to the slowest replica (the compute's slowdown
beside its transfers, at the profile's probed ``overlap_slowdown``, plus the first forward's stall and the
push's tail) and the measured movement is the slowest rank's pull (posting) and wait for windows, plus the
push of the rank that reached it last (its tail); the slowdown the transfers cause shows in the one-core
compute, which counts the movement thread's CPU time on this machine. The compute part alone is
``pred_over_measured_compute`` (what ``pred/meas`` was before commit 82055f5), the movement part alone
``movement_pred_over_measured``; compilations after warm-up; parameter and gradient bytes moved per step;
planning time and whether it was hidden behind the previous step. Bad input exits with status 2 and a
one-line message.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from benchmarks.provenance import commit
from hcompile.cost import ANALYSIS_TOKENS, default_cost_model
from hcompile.data import ByteTokenizer, Corpus, DataError, TokenBatches, python_stdlib
from hcompile.tools.profile import CPU_MODELS, ProfileJob, cost_model_from_profile, run_profile, token_buckets
from hcompile.tools.spawn import RankError, max_local_ranks, run_local_ranks
from passes.plan.cost_model import load_profile_file
from passes.plan.datasets import PRESET_DATASETS, LengthDataset, load_dataset, sample_batches
from passes.plan.ir import CostModel, ParallelScheme, PlanError, Strategy
from passes.plan.links import Links
from passes.plan.policies import ALL_POLICIES

__all__ = ["E2EConfig", "scale_dataset", "run_e2e", "summarize", "format_table", "format_cost_model", "main"]

DEFAULT_POLICIES = ("hydraulis", "homogeneous-token", "fixed-packing")
TEXT_DATASET = "stdlib"
DATASETS = (TEXT_DATASET, *PRESET_DATASETS)
FIELDS = ("tokens_per_s", "step_ms_one_core_per_rank", "balance", "pred_over_measured", "compilations_after_warmup",
          "param_bytes_received", "grad_bytes_sent", "plan_ms", "plan_hidden")


@dataclass(frozen=True, slots=True, kw_only=True)
class E2EConfig:
    """One harness run."""

    model: str = "llama-small"
    """CPU model preset (``hcompile.tools.profile.CPU_MODELS``)."""
    dataset: str = "stdlib"
    """``stdlib``: real text, the running interpreter's standard library sources, one document per function or
    class, byte tokens, documents longer than ``context`` cut into pieces of ``context``; or a length dataset
    preset (``python-code``, ``commoncrawl``, ``github``: lengths scaled to ``context``, random tokens, as the
    harness ran before it had real text)."""
    context: int = 1024
    """The longest sequence, in tokens."""
    long_documents: str = "drop"
    """With ``stdlib``: a document longer than ``context`` is left out (``drop``: 8% of the documents; the
    lengths keep their long tail) or cut into pieces of ``context`` (``split``: 13% of the sequences are then
    exactly ``context`` tokens long)."""
    ranks: int = 4
    """Local ranks (gloo on CPU)."""
    tokens_per_rank: int = 768
    """Per-rank memory cap in tokens: a tp = k replica holds micro-batches of up to k times this. The default
    is three quarters of the context: the long tail (with the default data, 3.3% of the sequences holding 23%
    of the tokens) needs tp2, as on GPUs the longest sequences need a larger TP degree."""
    global_tokens: int = 4096
    """Tokens per global batch."""
    steps: int = 16
    """Measured steps per policy."""
    warmup: int = 1
    """Steps per policy before measuring (variants are compiled before these)."""
    max_tp: int = 2
    """Largest tensor-parallel degree profiled and planned with (the default data needs tp2: longest 1024
    tokens, 768 per rank; tp4 would only lengthen the profile)."""
    max_cp: int = 1
    """Largest context-parallel degree (a power of two; 1: none). With cp > 1 the trainers plan from a listed
    pool, every strategy of this job's schemes: tp in ``tps``, and (tp, cp) for cp = 2, 4, .. up to it, so
    that sequences longer than ``tokens_per_rank * max_tp`` train on CP replicas (``--dataset long-context``)."""
    policies: tuple[str, ...] = DEFAULT_POLICIES
    """Policies, side by side."""
    cost: str = "profile"
    """``profile`` (fit on this machine first), ``analytic``, or a profile JSON file."""
    seed: int = 0
    """Seed of the batches and the weights."""
    lr: float = 1e-3
    """AdamW learning rate."""
    timeout_s: float = 1500.0
    """Hard limit of the training job."""
    take_turns: str = "auto"
    """Replicas compute one after the other within a step (``Executor.take_turns``) so that every rank's busy
    time is measured with the cores to itself: ``on``, ``off``, or ``auto`` (on when the ranks outnumber the
    cores this process may use)."""
    compile_backend: str = "auto"
    """torch.compile backend of the variants (``auto``: eager on the CPU, which compiles nothing; ``inductor``,
    ``aot_eager``)."""

    def __post_init__(self) -> None:
        if self.model not in CPU_MODELS:
            raise PlanError(f"unknown model {self.model!r}; known: {', '.join(CPU_MODELS)}")
        if self.dataset not in DATASETS:
            raise PlanError(f"unknown dataset {self.dataset!r}; known: {', '.join(DATASETS)}")
        if self.dataset == TEXT_DATASET and CPU_MODELS[self.model].vocab < ByteTokenizer().vocab_size:
            raise PlanError(f"model {self.model!r} has {CPU_MODELS[self.model].vocab} tokens, byte-level text "
                            f"needs {ByteTokenizer().vocab_size}")
        for name in ("context", "ranks", "tokens_per_rank", "global_tokens", "steps", "max_tp", "max_cp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise PlanError(f"warmup must be a non-negative integer, got {self.warmup!r}")
        if self.ranks > max_local_ranks():
            raise PlanError(f"{self.ranks} ranks are more than this machine can start (at most {max_local_ranks()})")
        if not self.policies or any(p not in ALL_POLICIES for p in self.policies):
            raise PlanError(f"unknown policy in {list(self.policies)!r}; known: {', '.join(ALL_POLICIES)}")
        if self.long_documents not in ("drop", "split"):
            raise PlanError(f"long_documents must be 'drop' or 'split', got {self.long_documents!r}")
        if self.take_turns not in ("auto", "on", "off"):
            raise PlanError(f"take_turns must be 'auto', 'on' or 'off', got {self.take_turns!r}")
        if self.max_cp & (self.max_cp - 1) or self.max_cp > self.ranks:
            raise PlanError(f"max_cp must be a power of two up to the {self.ranks} ranks, got {self.max_cp}")
        if self.cost not in ("profile", "analytic") and not Path(self.cost).is_file():
            raise PlanError(f"cost {self.cost!r} is neither 'profile', 'analytic' nor a profile file")

    @property
    def replicas_take_turns(self) -> bool:
        """``take_turns`` resolved on this machine."""
        if self.take_turns == "auto":
            return self.ranks > len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else False
        return self.take_turns == "on"

    @property
    def tps(self) -> tuple[int, ...]:
        """Tensor-parallel degrees planned with: divisors of the rank count up to ``max_tp`` that divide the
        kv heads."""
        kv = CPU_MODELS[self.model].kv_heads
        top = min(self.ranks, self.max_tp)
        return tuple(tp for tp in range(1, top + 1) if self.ranks % tp == 0 and kv % tp == 0)

    @property
    def schemes(self) -> tuple[ParallelScheme, ...]:
        """Every scheme planned with: (tp) for tp in ``tps`` and, up to ``max_cp``, (tp, cp) within the ranks."""
        cps = [1 << i for i in range(self.max_cp.bit_length()) if 1 << i <= self.max_cp]
        return tuple(ParallelScheme(tp=tp, cp=cp) for cp in cps for tp in self.tps
                     if tp * cp <= self.ranks and self.ranks % (tp * cp) == 0)

    @property
    def strategies(self) -> tuple[str, ...] | None:
        """The listed pool when context parallelism is on (None: the trainers build their own pool)."""
        if self.max_cp == 1:
            return None
        return tuple(s.describe() for s in _strategies(sorted(self.schemes, key=lambda s: -s.gpus), self.ranks))

    @property
    def longest_supported(self) -> int:
        """The longest sequence a replica of these schemes holds."""
        return self.tokens_per_rank * max(s.tp * s.cp for s in self.schemes)


def _strategies(schemes: list[ParallelScheme], gpus: int) -> list[Strategy]:
    """Every multiset of ``schemes`` (widest first) whose GPUs add up to ``gpus``."""
    out: list[Strategy] = []

    def extend(start: int, left: int, chosen: list[ParallelScheme]) -> None:
        if left == 0:
            out.append(Strategy.of(Counter(chosen)))
            return
        for i in range(start, len(schemes)):
            if schemes[i].gpus <= left:
                extend(i, left - schemes[i].gpus, [*chosen, schemes[i]])

    extend(0, gpus, [])
    return out


def scale_dataset(dataset: LengthDataset, context: int) -> LengthDataset:
    """Every length times ``context / longest``, rounded, at least 1 (a histogram of the scaled lengths)."""
    factor = context / dataset.max_len
    scaled: dict[int, int] = {}
    for length, count in zip(dataset.lengths, dataset.counts):
        key = max(1, int(round(length * factor)))
        scaled[key] = scaled.get(key, 0) + count
    keys = sorted(scaled)
    return LengthDataset(name=f"{dataset.name}@{context}", lengths=tuple(keys), counts=tuple(scaled[k] for k in keys),
                         source=f"{dataset.name} scaled by {factor:.5f}")


def _check_fits(cfg: E2EConfig, data: LengthDataset) -> None:
    shortest, longest = min(data.lengths), data.max_len
    if cfg.tokens_per_rank < shortest:
        raise PlanError(f"the per-rank cap of {cfg.tokens_per_rank} tokens is smaller than the shortest sequence "
                        f"({shortest} tokens)")
    if longest > cfg.longest_supported:
        top = max(cfg.schemes, key=lambda s: s.tp * s.cp)
        raise PlanError(f"the longest sequence ({longest} tokens) needs more than {top.describe()} x "
                        f"{cfg.tokens_per_rank} tokens per rank; raise --tokens-per-rank or --max-cp, or lower "
                        "--context")


def build_cost_model(cfg: E2EConfig, show_progress: bool, out: Path) -> tuple[CostModel, dict, Links | None]:
    """The planner's cost model, where it came from (a fresh profile is written under ``out``), and the links
    the profile measured (None for the analytic model or a profile without them)."""
    schemes = [ParallelScheme(tp=tp) for tp in cfg.tps]
    if cfg.cost == "analytic":
        from hcompile.api import CompiledModel
        from hcompile.tools.profile import build_model

        captured = CompiledModel(build_model(cfg.model)).captured(ANALYSIS_TOKENS).graph_module
        return default_cost_model(captured, cfg.model, cfg.ranks, cfg.tokens_per_rank), {"cost": "analytic"}, None
    if cfg.cost == "profile":
        job = ProfileJob(model=cfg.model, tps=cfg.tps, tokens_per_rank=cfg.tokens_per_rank, gpus=cfg.ranks,
                         seed=cfg.seed)
        report = run_profile(job, show_progress=show_progress)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"profile-{cfg.model}.json"
        path.write_text(json.dumps(report.to_json(), indent=1) + "\n")
        profile, info = report.profile(), {"cost": "profile", "profile_file": str(path)}
        info["fit"] = {f.scheme.describe(): {"r2": round(f.r2, 4), "mape_held_out": round(f.mape, 4)}
                       for f in report.fits}
    else:
        profile, info = load_profile_file(cfg.cost), {"cost": "file", "profile_file": cfg.cost}
    links = None if profile.links is None else replace(profile.links, gpus_per_node=cfg.ranks)
    return cost_model_from_profile(profile, cfg.tokens_per_rank, schemes, gpus_per_node=cfg.ranks), info, links


def text_batches(cfg: E2EConfig) -> tuple[LengthDataset, list[list[list[int]]]]:
    """The standard library as byte tokens: the lengths of all its sequences (what the pool is built from)
    and the first ``warmup + steps`` global batches of ``global_tokens``."""
    corpus = Corpus.from_paths(python_stdlib(), split_python=True)
    data = TokenBatches(corpus, ByteTokenizer(), tokens_per_batch=cfg.global_tokens, max_len=cfg.context,
                        seed=cfg.seed, long_documents=cfg.long_documents)
    lengths = [len(s) for doc in corpus.documents for s in data.sequences(doc)]
    batches = [[s.tolist() for s in data.next_batch()] for _ in range(cfg.warmup + cfg.steps)]
    return LengthDataset.from_lengths(f"{TEXT_DATASET}@{cfg.context}", lengths), batches


def run_e2e(cfg: E2EConfig, show_progress: bool = True, out: Path = Path("results")) -> dict:
    """Profile (unless given a cost model), then train every policy on the same batches; the raw records."""
    from benchmarks.e2e_rank import RankJob, rank_main

    if cfg.dataset == TEXT_DATASET:
        data, tokens = text_batches(cfg)
        batches = [[len(s) for s in batch] for batch in tokens]
    else:
        data, tokens = scale_dataset(load_dataset(cfg.dataset), cfg.context), None
        batches = sample_batches(data, cfg.global_tokens, cfg.warmup + cfg.steps, cfg.seed)
    _check_fits(cfg, data)
    cost_model, cost_info, links = build_cost_model(cfg, show_progress, out)
    buckets = token_buckets(cfg.tokens_per_rank * max(cfg.tps))  # a CP rank's share is at most a TP replica's
    job = RankJob(model=cfg.model, seed=cfg.seed, policies=cfg.policies, batches=tuple(map(tuple, batches)),
                  tokens=None if tokens is None else tuple(tuple(map(tuple, b)) for b in tokens),
                  warmup=cfg.warmup, tokens_per_rank=cfg.tokens_per_rank, buckets=buckets.sizes, cost_model=cost_model,
                  dataset=data, lr=cfg.lr, show_progress=show_progress, take_turns=cfg.replicas_take_turns,
                  compile_backend=cfg.compile_backend, links=links, strategies=cfg.strategies)
    started = time.perf_counter()
    records = run_local_ranks(cfg.ranks, rank_main, job, timeout_s=cfg.timeout_s)[0]
    return {"config": {**asdict(cfg), "policies": list(cfg.policies), "tps": list(cfg.tps),
                       "strategies": None if cfg.strategies is None else list(cfg.strategies),
                       "replicas_take_turns": cfg.replicas_take_turns,
                       "buckets": list(buckets.sizes), "dataset_scaled": data.source, "cost_model": cost_model.name,
                       **cost_info},
            "records": records, "train_wall_s": time.perf_counter() - started,
            "coefficients": {e.scheme.describe(): [e.a, e.b, e.c, e.max_tokens] for e in cost_model.entries}}


def _policy_summary(rec: dict) -> dict:
    steps = rec["steps"]
    busy = [np.asarray(s["busy_ms"]) for s in steps]
    one_core = [float(b.max()) for b in busy]
    # movement: the slowest pull, and the push of the rank that reached it last (the others' include their wait)
    measured_move = [max(p + w for p, w in zip(s["pull_ms"], s["wait_ms"])) + min(s["push_ms"]) for s in steps]
    moved = all(s.get("pred_move_ms") is not None for s in steps)
    pred_move = [s["pred_move_ms"] if moved else 0.0 for s in steps]
    step_ratios = [(s["pred_ms"] + p) / (m + (q if moved else 0.0))
                   for s, m, p, q in zip(steps, one_core, pred_move, measured_move)]
    tokens = sum(s["tokens"] for s in steps)
    strategies: dict[str, int] = {}
    for s in steps:
        strategies[s["strategy"]] = strategies.get(s["strategy"], 0) + 1
    return {
        "tokens_per_s": tokens / (sum(s["wall_ms"] for s in steps) / 1e3),
        "step_ms_one_core_per_rank": float(np.mean(one_core)),
        "step_ms_compute_thread": float(np.mean([max(s["compute_thread_ms"]) for s in steps])),
        "balance": float(np.mean([b.max() / b.mean() for b in busy])),
        "pred_over_measured": float(np.mean(step_ratios)),
        "pred_over_measured_per_step": [round(r, 4) for r in step_ratios],
        "pred_over_measured_compute": float(np.mean([s["pred_ms"] / m for s, m in zip(steps, one_core)])),
        "movement_ms": float(np.mean(measured_move)),
        "movement_pred_over_measured": (float(np.mean([p / m for p, m in zip(pred_move, measured_move)]))
                                        if moved else None),
        "plan_est_over_measured": float(np.mean([s["est_ms"] / m for s, m in zip(steps, one_core)])),
        "compilations_after_warmup": int(rec["compilations_after_warmup"]),
        "param_bytes_received": int(np.mean([s["param_bytes_received"] for s in steps])),
        "grad_bytes_sent": int(np.mean([s["grad_bytes_sent"] for s in steps])),
        "plan_ms": float(np.mean([s["plan_ms"] for s in steps])),
        "plan_hidden": float(np.mean([bool(s["plan_hidden"]) for s in steps])),
        "tokens_per_s_one_core_per_rank": tokens / (sum(one_core) / 1e3),
        "step_wall_ms": float(np.mean([s["wall_ms"] for s in steps])),
        "final_loss": steps[-1]["loss"],
        "losses": [s["loss"] for s in steps],
        "strategies": strategies,
        "pool": rec["pool"],
        "fixed_strategy": rec["fixed"],
        "compile_s": round(rec["compile_s"], 2),
    }


def summarize(result: dict) -> dict:
    """The ``--json`` object: the config and, per policy, every metric (means over measured steps; bytes are
    rank 0's per step; ``plan_hidden`` is the share of steps whose plan was computed while the previous step ran)."""
    config = {**result["config"], "device": device_name(), "commit": commit(),
              "coefficients": result["coefficients"], "train_wall_s": round(result["train_wall_s"], 1)}
    policies = {name: _policy_summary(rec) for name, rec in result["records"].items()}
    curves = np.array([p["losses"] for p in policies.values()])  # (policies, steps)
    spread = float(((curves.max(0) - curves.min(0)) / curves.mean(0)).max()) if len(curves) else 0.0
    return {"config": config, "policies": policies, "loss_spread": spread,
            "loss_drop": float(curves[:, 0].mean() - curves[:, -1].mean()) if len(curves) else 0.0}


def device_name() -> str:
    """What the ranks ran on."""
    return f"cpu {platform.machine()} ({platform.processor() or 'unknown'}), 1 thread per rank"


def format_table(summary: dict, baseline: str = "homogeneous-token") -> str:
    """The table printed at the end of a run."""
    pols = summary["policies"]
    base = pols.get(baseline, {}).get("step_ms_one_core_per_rank")
    lines = [f"{'policy':<18} {'tok/s wall':>10} {'step ms 1core/rank':>18} {'vs ' + baseline[:11]:>14} "
             f"{'thread-only ms':>14} "
             f"{'balance':>8} {'pred/meas':>9} {'comp+':>6} {'param MB':>8} {'grad MB':>8} {'plan ms':>8} "
             f"{'hidden':>6}  strategies"]
    for name, p in pols.items():
        speed = f"{base / p['step_ms_one_core_per_rank']:.2f}x" if base else "-"
        strategies = ", ".join(f"{k} x{v}" for k, v in sorted(p["strategies"].items(), key=lambda kv: -kv[1]))
        lines.append(f"{name:<18} {p['tokens_per_s']:>10.0f} {p['step_ms_one_core_per_rank']:>18.1f} {speed:>14} "
                     f"{p['step_ms_compute_thread']:>14.1f} "
                     f"{p['balance']:>8.3f} {p['pred_over_measured']:>9.3f} {p['compilations_after_warmup']:>6} "
                     f"{p['param_bytes_received'] / 2**20:>8.2f} {p['grad_bytes_sent'] / 2**20:>8.2f} "
                     f"{p['plan_ms']:>8.1f} {100 * p['plan_hidden']:>5.0f}%  {strategies}")
    return "\n".join(lines)


def format_cost_model(summary: dict) -> str:
    """One line on what the planner planned with: the profile's fit quality per scheme (R^2 and the mean
    absolute percentage error on held-out micro-batches), or the analytic model's name."""
    config = summary["config"]
    if "fit" not in config:
        where = f" ({config['profile_file']})" if "profile_file" in config else ""
        return f"cost model: {config['cost_model']}{where}"
    fits = ", ".join(f"{scheme} R^2 {fit['r2']:.3f}, held-out MAPE {100 * fit['mape_held_out']:.1f}%"
                     for scheme, fit in config["fit"].items())
    return f"cost model: profiled here ({config['profile_file']}): {fits}"


def write_json_lines(result: dict, summary: dict, path: Path) -> None:
    """Append one line per measured step and one summary line per policy, each stamped with the commit,
    device and config."""
    stamp = {"commit": summary["config"]["commit"], "device": summary["config"]["device"],
             "config": {k: v for k, v in summary["config"].items() if k not in ("commit", "device")}}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for name, rec in result["records"].items():
            for step in rec["steps"]:
                f.write(json.dumps({**stamp, "kind": "step", "policy": name, **step}) + "\n")
            f.write(json.dumps({**stamp, "kind": "summary", "policy": name, **summary["policies"][name]}) + "\n")


def build_parser() -> argparse.ArgumentParser:
    """Command-line options (defaults: the ``make run`` showcase)."""
    d = E2EConfig()
    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=d.model, help=f"CPU model: {', '.join(CPU_MODELS)} ({d.model})")
    p.add_argument("--dataset", default=d.dataset,
                   help=f"stdlib (real text: this Python's standard library, byte tokens) or a length dataset with "
                        f"random tokens: {', '.join(PRESET_DATASETS)} ({d.dataset})")
    p.add_argument("--context", type=int, default=d.context, help=f"longest sequence in tokens ({d.context})")
    p.add_argument("--long-documents", choices=("drop", "split"), default=d.long_documents,
                   help=f"stdlib documents longer than the context: left out or cut into pieces ({d.long_documents})")
    p.add_argument("--ranks", type=int, default=d.ranks, help=f"local ranks ({d.ranks})")
    p.add_argument("--tokens-per-rank", type=int, default=d.tokens_per_rank,
                   help=f"per-rank token cap ({d.tokens_per_rank})")
    p.add_argument("--global-tokens", type=int, default=d.global_tokens, help=f"tokens per step ({d.global_tokens})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"measured steps per policy ({d.steps})")
    p.add_argument("--warmup", type=int, default=d.warmup, help=f"unmeasured steps per policy ({d.warmup})")
    p.add_argument("--max-tp", type=int, default=d.max_tp, help=f"largest tensor-parallel degree ({d.max_tp})")
    p.add_argument("--max-cp", type=int, default=d.max_cp,
                   help=f"largest context-parallel degree, a power of two ({d.max_cp}: none); above 1 the pool is "
                        "every strategy of the tp and (tp, cp) schemes")
    p.add_argument("--policy", action="append", dest="policies", metavar="NAME",
                   help=f"a policy, repeatable (default: {', '.join(DEFAULT_POLICIES)})")
    p.add_argument("--cost", default=d.cost, help="profile (fit here first), analytic, or a profile JSON file")
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed ({d.seed})")
    p.add_argument("--compile-backend", default=d.compile_backend,
                   help=f"torch.compile backend of the variants: auto, eager, aot_eager, inductor "
                        f"({d.compile_backend})")
    p.add_argument("--take-turns", choices=("auto", "on", "off"), default=d.take_turns,
                   help="replicas compute one after the other, so that each rank's busy time is measured with the "
                        "cores to itself (auto: when the ranks outnumber the cores)")
    p.add_argument("--out", default="results", help="folder of the JSON lines and plots (results)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of the table")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--smoke", action="store_true", help="CI mode: llama-tiny, 2 steps, analytic cost model")
    return p


def config_from_args(args: argparse.Namespace) -> E2EConfig:
    """The run's config; ``--smoke`` replaces the sizes with a seconds-long run."""
    policies = tuple(args.policies or DEFAULT_POLICIES)
    if args.smoke:
        return E2EConfig(model="llama-tiny", dataset=args.dataset, context=128, long_documents=args.long_documents,
                         ranks=args.ranks, tokens_per_rank=64 if args.max_cp == 1 else 32,  # CP: the tail needs it
                         global_tokens=256, steps=2, warmup=1, max_tp=2, max_cp=args.max_cp, policies=policies,
                         cost="analytic", seed=args.seed, take_turns=args.take_turns,
                         compile_backend=args.compile_backend)
    return E2EConfig(model=args.model, dataset=args.dataset, context=args.context, long_documents=args.long_documents,
                     ranks=args.ranks,
                     tokens_per_rank=args.tokens_per_rank, global_tokens=args.global_tokens, steps=args.steps,
                     warmup=args.warmup, max_tp=args.max_tp, max_cp=args.max_cp, policies=policies, cost=args.cost,
                     seed=args.seed, take_turns=args.take_turns, compile_backend=args.compile_backend)


def main(argv: list[str] | None = None) -> int:
    """Run the harness; 0 on success, 2 on bad input, 1 when a rank fails."""
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        result = run_e2e(cfg, show_progress=True, out=Path(args.out))
    except (PlanError, DataError) as exc:
        print(f"benchmarks.e2e: error: {exc}", file=sys.stderr)
        return 2
    except RankError as exc:
        print(f"benchmarks.e2e: a rank failed: {exc}", file=sys.stderr)
        return 1
    summary = summarize(result)
    out = Path(args.out)
    write_json_lines(result, summary, out / "e2e.jsonl")
    plots = [] if args.no_plots else _plots(result, summary, out)
    if args.json:
        print(json.dumps(summary))
    else:
        print(format_table(summary))
        print(format_cost_model(summary))
        print(f"loss: falls by {summary['loss_drop']:.3f} from the first to the last measured step; the policies' "
              f"curves differ by at most {summary['loss_spread']:.1e} of the loss (the same batches, exact gradients)")
        print(f"JSON lines: {out / 'e2e.jsonl'}")
        for path in plots:
            print(f"plot: {path}")
    return 0


def _plots(result: dict, summary: dict, out: Path) -> list[Path]:
    try:
        from benchmarks.e2e_plots import plot_all
    except ImportError as exc:  # matplotlib is an optional dependency
        print(f"benchmarks.e2e: no plots ({exc})", file=sys.stderr)
        return []
    return plot_all(result, summary, out)


if __name__ == "__main__":
    sys.exit(main())
