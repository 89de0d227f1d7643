"""``hcompile profile``: fit the cost model on the machine it runs on.

Owns the profiling job: for each scheme (tp in ``tps``, pp = 1, and each context-parallel degree of ``cps`` at the
smallest of those tps) it runs the real compiled variants (the tensor-parallel, packed-attention and
context-parallel rewrites of the captured model, on ``tp * cp`` local ranks; under CP each rank computes its
share of the pack's sequences, ``runtime.micro_batch.context_parallel``, and attends over the K/V all-gathered
from its CP group) forward and backward on a sweep of packed micro-batches, each made of one or several
sequences of different lengths at
a token bucket's size (so no padding) so that ``a`` (sum s^2), ``b`` (sum s) and ``c`` separate. It times
the busiest rank's CPU time with its communication threads (``runtime.cpu_clock``, one core per rank), the
median of repeats taken round-robin over the sweep, fits ``T = a*sum s^2 + b*sum s + c`` by least
squares on relative error with non-negative coefficients, reports R^2 on the fitted packs and the mean
absolute percentage error on held-out packs of other lengths, measures the activation bytes each token keeps
for backward, and writes a profile JSON in the presets' format (``passes.plan.cost_model.Profile.from_dict``)
whose memory constants make the longest micro-batch of tp = 1 equal the per-rank token cap. A CP scheme's fit
is written as its own scheme entry (``"cp": 2``), which the planner then uses instead of deriving the CP cost
from the scheme without CP (``passes.plan.context_parallel.cp_cost``); the report also gives that derivation's
error on the measured CP packs (``derived_mape``), which checks the planner's CP model. It also probes
the links between local ranks (``runtime.link_probe``: gloo between processes on the CPU, NCCL between the
node's GPUs on CUDA) into the profile's ``hardware`` entry (``intra_gbps``, ``inter_gbps``, ``latency_us``),
which ``hcompile plan --profile`` charges parameter and gradient movement with; between nodes it writes the
GPU preset's network on CUDA and, on one CPU machine, the probed figure.
"""

from __future__ import annotations

import itertools
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from hcompile.models import Llama, LlamaConfig, init_weights_
from hcompile.tools.progress import progress_bar
from passes.graph.variant import TokenBuckets
from passes.plan.cost_model import HCOMPILE_RUNTIME, MIB, Profile, max_tokens_for, state_bytes
from passes.plan.ir import CostModel, ParallelScheme, PlanError, SchemeCost, Strategy
from runtime.link_probe import LinkProbe

__all__ = ["CPU_MODELS", "default_cps", "ProfileJob", "SchemeFit", "ProfileReport", "build_model", "token_buckets",
           "sweep_packs", "fit_nonnegative", "run_profile", "format_profile", "cost_model_from_profile"]

CPU_MODELS: dict[str, LlamaConfig] = {
    "llama-tiny": LlamaConfig(layers=2, hidden=32, ffn_hidden=64, heads=4, kv_heads=4, vocab=256),
    "llama-small": LlamaConfig(layers=4, hidden=128, ffn_hidden=256, heads=4, kv_heads=4, vocab=512),
}
"""LLaMA-style models sized for CPU runs: ``llama-small`` runs a step in about a second per core."""

STATE_BYTES_PER_PARAM = 16.0  # fp32 parameter + gradient + two AdamW moments
SHARDABLE_FRACTION = 0.75


def build_model(name: str, seed: int = 0) -> Llama:
    """A deterministic instance of a CPU model preset."""
    if name not in CPU_MODELS:
        raise PlanError(f"unknown model {name!r}; known: {', '.join(CPU_MODELS)}")
    return init_weights_(Llama(CPU_MODELS[name]), seed=seed)


def token_buckets(largest: int) -> TokenBuckets:
    """Buckets 64 * (1, 2, 3, 4, 6, 8, 12, ...) up to the first >= ``largest``: padding is under a third of a
    micro-batch while few graphs are captured."""
    sizes, k = [], 0
    while not sizes or sizes[-1] < largest:
        sizes.append(64 * (1 << (k // 2)) * (1 if k % 2 == 0 else 3) // (1 if k % 2 == 0 else 2))
        k += 1
    return TokenBuckets(sizes=tuple(sorted(set(sizes))))


def default_cps(tps: tuple[int, ...], gpus: int, device: str = "cpu") -> tuple[int, ...]:
    """The context-parallel degrees ``hcompile profile`` measures unless told: 2 at the smallest tp, where a
    cluster of ``gpus`` holds that replica and (on CUDA) this machine has its GPUs; else none."""
    ranks = 2 * min(tps or (1,))
    if gpus % ranks or (device == "cuda" and torch.cuda.device_count() < ranks):
        return ()
    return (2,)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileJob:
    """What to profile."""

    model: str = "llama-small"
    """A CPU model preset (``CPU_MODELS``)."""
    tps: tuple[int, ...] = (1, 2, 4)
    """Tensor-parallel degrees to profile (pp = 1)."""
    cps: tuple[int, ...] = (2,)
    """Context-parallel degrees to profile, each at the smallest of ``tps`` (on ``min(tps) * cp`` ranks, packs
    of up to ``cp`` times that scheme's cap); empty: none."""
    tokens_per_rank: int = 512
    """Per-rank memory cap in tokens: tp = k runs micro-batches up to k times this."""
    repeats: int = 5
    """Timed runs per micro-batch (the median counts), after one untimed run; the sweep is timed this many
    times over, round-robin."""
    gpus: int = 4
    """Cluster size the profile's memory constants are written for (``hcompile plan --gpus``)."""
    seed: int = 0
    """Seed of the held-out lengths and the token ids."""
    timeout_s: float = 900.0
    """Hard limit per scheme."""
    device: str = "cpu"
    """``cpu``: ranks on CPU cores, fp32, busy CPU time; ``cuda``: rank r on GPU r (NCCL), bf16 compute copies,
    CUDA events around each micro-batch (the kernels' time)."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise PlanError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and torch.cuda.device_count() < max(self.tps or (1,)):
            raise PlanError(f"--device cuda needs {max(self.tps or (1,))} GPUs for tp {max(self.tps or (1,))}, this "
                            f"machine has {torch.cuda.device_count()}")
        if self.model not in CPU_MODELS:
            raise PlanError(f"unknown model {self.model!r}; known: {', '.join(CPU_MODELS)}")
        cfg = CPU_MODELS[self.model]
        if not self.tps:
            raise PlanError("at least one tensor-parallel degree is needed")
        for tp in self.tps:
            if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or cfg.kv_heads % tp:
                raise PlanError(f"tp {tp!r} must be a positive divisor of the model's {cfg.kv_heads} kv heads")
        for name in ("tokens_per_rank", "repeats", "gpus"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name} must be a positive integer, got {value!r}")
        if self.tokens_per_rank < 128:
            raise PlanError(f"tokens_per_rank must be at least 128 (the memory model counts in 128-token steps), "
                            f"got {self.tokens_per_rank!r}")
        if self.gpus % max(self.tps):
            raise PlanError(f"gpus {self.gpus!r} is not a multiple of the largest tp {max(self.tps)}")
        for cp in self.cps:
            if isinstance(cp, bool) or not isinstance(cp, int) or cp < 2:
                raise PlanError(f"a context-parallel degree to profile must be an integer >= 2, got {cp!r}")
            if self.gpus % (min(self.tps) * cp):
                raise PlanError(f"gpus {self.gpus!r} is not a multiple of the {min(self.tps) * cp} ranks of "
                                f"(tp{min(self.tps)},cp{cp})")
            if self.device == "cuda" and torch.cuda.device_count() < min(self.tps) * cp:
                raise PlanError(f"--device cuda needs {min(self.tps) * cp} GPUs for (tp{min(self.tps)},cp{cp}), this "
                                f"machine has {torch.cuda.device_count()}")
        if len(set(self.cps)) != len(self.cps):
            raise PlanError(f"context-parallel degrees to profile are listed twice: {self.cps!r}")

    @property
    def schemes(self) -> tuple[ParallelScheme, ...]:
        """The schemes profiled, in order: every tp without CP, then each CP degree at the smallest tp."""
        return (*(ParallelScheme(tp=tp) for tp in self.tps),
                *(ParallelScheme(tp=min(self.tps), cp=cp) for cp in self.cps))


@dataclass(frozen=True, slots=True, kw_only=True)
class SchemeFit:
    """One scheme's fitted cost and how well it fits."""

    scheme: ParallelScheme
    """The scheme (pp = 1)."""
    a: float
    """ms per squared token of each sequence."""
    b: float
    """ms per token."""
    c: float
    """ms per micro-batch."""
    r2: float
    """R^2 on the fitted packs."""
    mape: float
    """Mean absolute percentage error (0.1 = 10%) on the held-out packs."""
    act_bytes_per_token: float
    """Bytes of activations kept for backward per token on one rank."""
    points: tuple[tuple[tuple[int, ...], float, bool], ...]
    """(sequence lengths, measured ms, held out) per micro-batch; under CP the whole sequences' lengths."""
    derived_mape: float | None = None
    """CP schemes: the mean absolute percentage error, on every measured pack, of the cost the planner derives
    for this scheme from the profiled scheme without CP and the probed links (``context_parallel.cp_cost``);
    None without CP or without the links."""

    def predict(self, seq_lens: tuple[int, ...]) -> float:
        return self.a * sum(s * s for s in seq_lens) + self.b * sum(seq_lens) + self.c


def sweep_packs(cap: int, buckets: TokenBuckets, seed: int) -> list[tuple[tuple[int, ...], bool]]:
    """Micro-batches at every bucket up to ``cap``: even splits into 1, 2, 4, 8 sequences (fitted) and two
    uneven random splits (held out); (lengths, held_out) each."""
    rng = np.random.default_rng(seed)
    packs: list[tuple[tuple[int, ...], bool]] = []
    for total in (b for b in buckets.sizes if b <= cap):
        for parts in (1, 2, 4, 8):
            if total // parts >= 16:
                packs.append((tuple([total // parts] * parts), False))
        for _ in range(2):
            k = int(rng.integers(2, 6))
            cuts = np.sort(rng.choice(np.arange(8, total - 7), size=k - 1, replace=False))
            lens = np.diff(np.concatenate([[0], cuts, [total]]))
            if lens.min() >= 1:
                packs.append((tuple(int(x) for x in lens), True))
    return packs


def _time_packs(rank: int, world: int, model: str, seed: int, packs: list, repeats: int,
                bucket_sizes: tuple[int, ...], show: bool, device_type: str = "cpu", cp: int = 1) -> dict:
    """In each of ``world`` ranks, a replica ``(tp, cp)`` with ``tp = world // cp``: ms of forward+backward of
    every pack on this rank's TP slice and CP share (on the CPU the computing and communication threads' CPU time,
    as the executor's busy time; on a GPU CUDA events), and the bytes saved for backward at two sizes."""
    from hcompile.api import CompiledModel
    from passes.plan.ir import ReplicaPlan
    from runtime import distributed as comm
    from runtime import micro_batch
    from runtime.fixed_layout import FixedLayout
    from runtime.stage_params import StageParams

    device = comm.group_device() if device_type == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    net = build_model(model, seed)
    buckets = TokenBuckets(sizes=bucket_sizes)
    compiled = CompiledModel(net, buckets=buckets)
    lowerings = compiled.lowerings(dtype if device.type == "cuda" else None, device if device.type == "cuda" else None)
    scheme = ParallelScheme(tp=world // cp, cp=cp)
    replica = ReplicaPlan(scheme=scheme, ranks=tuple(range(world)), micro_batches=(), max_tokens=0, est_ms=0.0)
    groups = comm.GroupCache()
    groups.prepare([replica])
    cp_rank, tp_rank = divmod(rank, scheme.tp)
    tp_group = comm.group_name(groups.get(replica.tp_group(0, cp_rank)))
    cp_group = comm.group_name(groups.get(replica.cp_group(0, tp_rank))) if cp > 1 else None
    program = lowerings.program(scheme, 0, tp_rank, tp_group, cp_rank, cp_group)
    full = dict(net.named_parameters())
    params = StageParams(FixedLayout({n: tuple(p.shape) for n, p in full.items()}, 0, 1), program.param_slices,
                         scheme.tp, dtype, device)
    program.bind(params.params)
    params.materialize()
    params.fill_from(full)
    gen = torch.Generator().manual_seed(seed + 1)
    vocab = CPU_MODELS[model].vocab
    clock = _Clock(device)

    def share(batch: list[torch.Tensor]) -> micro_batch.MicroBatch:
        if cp == 1:
            return micro_batch.packed(batch, range(len(batch)), device)
        return micro_batch.context_parallel(batch, range(len(batch)), cp, cp_rank, program.bucket, device)

    def run(lens: tuple[int, ...], hooks: dict | None = None) -> float:
        batch = [torch.randint(0, vocab, (n,), generator=gen) for n in lens]
        params.zero_grads()
        clock.start()
        mb = share(batch)
        if hooks is None:
            loss = mb.loss_sum(mb.run(program, ())[0])
        else:
            def keep(t: torch.Tensor) -> torch.Tensor:
                hooks[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                loss = mb.loss_sum(mb.run(program, ())[0])
        loss.backward()
        return clock.stop()

    def tick(done: int) -> None:
        if show and rank == 0 and done % len(packs) in (0, len(packs) // 2):
            progress_bar(f"profile {scheme.describe()}", done, (repeats + 1) * len(packs))

    for i, (lens, _) in enumerate(packs):
        run(lens)  # untimed: builds the bucket's graph, warms the allocator
        tick(i + 1)
    # Round-robin repeats: a burst of background load on a shared machine lands on one repeat of several packs
    # (which the median drops), not on every repeat of one pack.
    times: list[list[float]] = [[] for _ in packs]
    for rep in range(repeats):
        for i, (lens, _) in enumerate(packs):
            times[i].append(run(lens))
            tick((rep + 1) * len(packs) + i + 1)
    saved = []
    for total in (bucket_sizes[0], max(sum(lens) for lens, _ in packs)):
        hooks: dict = {}
        run((total,), hooks)
        saved.append((total, sum(hooks.values())))
    return {"times": times, "saved": saved}


class _Clock:
    """ms of one measured run: the rank's CPU time on the CPU, CUDA events on a GPU (waited for: a profiler may
    synchronise)."""

    def __init__(self, device: torch.device):
        from runtime.cpu_clock import RankCpuClock

        self.cuda = device.type == "cuda"
        self.cpu = RankCpuClock()
        self.begin = 0.0

    def start(self) -> None:
        if self.cuda:
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        else:
            self.begin = self.cpu.seconds()

    def stop(self) -> float:
        if self.cuda:
            self.events[1].record()
            self.events[1].synchronize()
            return self.events[0].elapsed_time(self.events[1])
        return (self.cpu.seconds() - self.begin) * 1e3


def fit_nonnegative(features: np.ndarray, y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted least squares with every coefficient >= 0: the best of the unconstrained fits on every
    subset of the columns whose coefficients are all non-negative (exact for a few columns)."""
    n = features.shape[1]
    best, best_err = np.zeros(n), float(np.sum((weights * y) ** 2))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = features[:, cols] * weights[:, None]
            coef, *_ = np.linalg.lstsq(sub, weights * y, rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(n)
            full[list(cols)] = coef
            err = float(np.sum((weights * (features @ full - y)) ** 2))
            if err < best_err - 1e-15:
                best, best_err = full, err
    return best


def _fit_scheme(scheme: ParallelScheme, packs: list, ms: list[float], act_bytes: float) -> SchemeFit:
    feats = np.array([[sum(s * s for s in lens), sum(lens), 1.0] for lens, _ in packs], dtype=np.float64)
    y = np.asarray(ms, dtype=np.float64)
    held = np.array([h for _, h in packs], dtype=bool)
    a, b, c = fit_nonnegative(feats[~held], y[~held], 1.0 / y[~held])
    pred = feats @ np.array([a, b, c])
    fitted = y[~held]
    ss_tot = float(np.sum((fitted - fitted.mean()) ** 2))
    r2 = 1.0 - float(np.sum((pred[~held] - fitted) ** 2)) / ss_tot if ss_tot > 0 else 1.0
    mape = float(np.mean(np.abs(pred[held] - y[held]) / y[held])) if held.any() else float("nan")
    points = tuple((tuple(lens), float(t), bool(h)) for (lens, h), t in zip(packs, ms))
    return SchemeFit(scheme=scheme, a=float(a), b=float(b), c=float(c), r2=r2, mape=mape,
                     act_bytes_per_token=act_bytes, points=points)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileReport:
    """The outcome of a profiling job."""

    job: ProfileJob
    """The job that ran."""
    fits: tuple[SchemeFit, ...]
    """Per scheme."""
    params_per_layer: int
    """Parameters of one transformer block."""
    wall_s: float
    """Wall time of the whole sweep."""
    device: str = field(default_factory=lambda: f"cpu ({platform.processor() or platform.machine()}), "
                                                f"torch {torch.__version__}, 1 thread per rank")
    """What was measured."""
    links: LinkProbe | None = None
    """The links between the profiling ranks (``runtime.link_probe``); None when fewer than two could run."""
    network_gbps: float | None = None
    """GB/s between nodes, which one machine cannot measure: the GPU preset's on CUDA, else the probed links'."""

    def profile(self) -> Profile:
        """The preset-format profile this report writes (``to_json``), parsed back."""
        return Profile.from_dict(self.to_json(), name=f"{self.job.model}@{self.job.device}")

    def _memory(self) -> tuple[dict, float]:
        cfg = CPU_MODELS[self.job.model]
        plain = [f for f in self.fits if f.scheme.cp == 1]
        act = {str(f.scheme.tp): f.act_bytes_per_token / (cfg.layers * cfg.hidden / f.scheme.tp) for f in plain}
        memory = {"safety_margin_gib": 0.0, "activation_bytes_per_token_hidden_layer": act,
                  "state_bytes_per_hidden2_layer": STATE_BYTES_PER_PARAM * self.params_per_layer / cfg.hidden ** 2}
        smallest = min(plain, key=lambda f: f.scheme.tp)
        draft = self._dict(memory, bound_mib=0.0)
        probe = Profile.from_dict(draft)
        layout = Strategy.homogeneous(smallest.scheme, self.job.gpus)
        tokens = self.job.tokens_per_rank * smallest.scheme.tp + 0.5
        bound = state_bytes(probe, smallest.scheme, layout, HCOMPILE_RUNTIME) + tokens * smallest.act_bytes_per_token
        return memory, bound / MIB

    def _dict(self, memory: dict, bound_mib: float) -> dict:
        cfg = CPU_MODELS[self.job.model]
        if self.links is None:
            links = {}
        elif self.job.device == "cuda":
            links = {"intra_gbps": round(self.links.gbps, 4), "latency_us": round(self.links.latency_us, 2),
                     "inter_gbps": round(self.network_gbps or self.links.gbps, 4),
                     "overlap_slowdown": round(self.links.overlap_slowdown, 4)}
        else:  # the probe's ranks share this host (``LinkProbe.host_links``)
            host = self.links.host_links(max(2, *self.job.tps))
            links = {"intra_gbps": round(host.intra_gbps, 4), "latency_us": round(host.latency_us, 2),
                     "inter_gbps": round(host.inter_gbps, 4), "fresh_gbps": round(self.links.fresh_gbps, 4),
                     "freed_gbps": round(self.links.freed_gbps, 4), "warm_gbps": round(self.links.warm_gbps, 4),
                     "host_gbps": round(host.host_gbps or 0.0, 4),
                     "overlap_slowdown": round(self.links.overlap_slowdown, 4)}
        return {
            "hardware": {"name": self.job.device, "gpu": self.device, "gpus_per_node": self.job.gpus,
                         "memory_bound_mib": bound_mib, "reserved_mib_per_gpu": 0.0, **links},
            "optimizer_shardable_fraction": SHARDABLE_FRACTION,
            "source": f"hcompile profile on this machine: "
                      f"{'CUDA-event' if self.job.device == 'cuda' else 'thread CPU'} time of forward+backward of "
                      f"packed micro-batches, busiest of tp ranks, median of {self.job.repeats}; memory bound set "
                      f"so that tp=1 holds {self.job.tokens_per_rank} tokens per rank",
            "model": {"name": self.job.model, "layers": cfg.layers, "hidden": cfg.hidden,
                      "ffn_hidden": cfg.ffn_hidden, "heads": cfg.heads, "kv_heads": cfg.kv_heads, "vocab": cfg.vocab},
            "memory": memory,
            "schemes": [{"tp": f.scheme.tp, "pp": 1, **({"cp": f.scheme.cp} if f.scheme.cp > 1 else {}),
                         "a": f.a, "b": f.b, "c": f.c, "r2": round(f.r2, 5), "mape_held_out": round(f.mape, 5),
                         **({} if f.derived_mape is None else {"derived_mape": round(f.derived_mape, 5)})}
                        for f in self.fits],
        }

    def draft_json(self) -> dict:
        """The profile JSON without the per-scheme token caps and the measurements (what parses as a profile)."""
        memory, bound = self._memory()
        return self._dict(memory, bound_mib=bound)

    def to_json(self) -> dict:
        """The profile JSON (the presets' format plus fit quality and the measurements)."""
        data = self.draft_json()
        layout = self.layout()
        probe = Profile.from_dict(data)
        for entry, f in zip(data["schemes"], self.fits):
            entry["max_tokens"] = max_tokens_for(probe, f.scheme, layout, HCOMPILE_RUNTIME)
        data["max_tokens_per_rank"] = self.job.tokens_per_rank
        data["measurements"] = [{"tp": f.scheme.tp, "cp": f.scheme.cp, "seq_lens": list(lens), "ms": round(ms, 3),
                                 "held_out": h} for f in self.fits for lens, ms, h in f.points]
        data["wall_s"] = round(self.wall_s, 1)
        if self.links is not None:
            data["link_probe"] = self.links.to_dict()
        return data

    def layout(self) -> Strategy:
        """The optimiser layout the reported longest micro-batches assume: all ranks at the smallest tp."""
        return Strategy.homogeneous(ParallelScheme(tp=min(self.job.tps)), self.job.gpus)


def _params_per_layer(model: str) -> int:
    net = build_model(model)
    return sum(p.numel() for n, p in net.named_parameters() if n.startswith("layers.0."))


def run_profile(job: ProfileJob, show_progress: bool = True) -> ProfileReport:
    """Profile every scheme of ``job`` on local ranks and fit its cost."""
    from hcompile.tools.spawn import run_local_ranks

    started = time.perf_counter()
    fits = []
    for scheme in job.schemes:
        cap = job.tokens_per_rank * scheme.tp
        buckets = token_buckets(cap)
        # Under CP, packs of cp times the bucket sizes: each rank's share is about one bucket.
        totals = TokenBuckets(sizes=tuple(scheme.cp * b for b in buckets.sizes))
        packs = sweep_packs(cap * scheme.cp, totals, job.seed + scheme.tp + 100 * (scheme.cp - 1))
        results = run_local_ranks(scheme.gpus, _time_packs, job.model, job.seed, packs, job.repeats, buckets.sizes,
                                  show_progress, job.device, scheme.cp, timeout_s=job.timeout_s,
                                  dist_backend="nccl" if job.device == "cuda" else "gloo")
        ms = [statistics.median(max(r["times"][i][k] for r in results) for k in range(job.repeats))
              for i in range(len(packs))]
        (t0, b0), (t1, b1) = results[0]["saved"]
        act = (b1 - b0) / (t1 - t0) if t1 > t0 else b1 / t1
        fits.append(_fit_scheme(scheme, packs, ms, act))
    device = (f"cuda ({torch.cuda.get_device_name(0)}), torch {torch.__version__}, bf16" if job.device == "cuda"
              else ProfileReport.__dataclass_fields__["device"].default_factory())
    links, network = _probe(job, show_progress)
    report = ProfileReport(job=job, fits=tuple(fits), params_per_layer=_params_per_layer(job.model),
                           wall_s=time.perf_counter() - started, device=device, links=links, network_gbps=network)
    return replace(report, fits=tuple(_with_derived_error(report, f) for f in report.fits))


def _with_derived_error(report: "ProfileReport", fit: SchemeFit) -> SchemeFit:
    """``fit`` with ``derived_mape`` set where it is a CP scheme whose base (same tp, no CP) was profiled and the
    links were probed: the planner's derived CP cost against what was measured."""
    from passes.plan.context_parallel import cp_cost

    base = next((f for f in report.fits if f.scheme == ParallelScheme(tp=fit.scheme.tp)), None)
    if fit.scheme.cp == 1 or base is None or report.links is None:
        return fit
    profile = Profile.from_dict(report.draft_json())
    assert profile.links is not None  # the probe's links are in the draft
    base_cost = SchemeCost(scheme=base.scheme, a=base.a, b=base.b, c=base.c, max_tokens=1)
    derived = cp_cost(profile, base_cost, fit.scheme.cp, profile.links, report.layout())
    errors = [abs(derived.c + sum(derived.seq_ms(s) for s in lens) - ms) / ms for lens, ms, _ in fit.points]
    return replace(fit, derived_mape=float(np.mean(errors)))


def _probe_rank(rank: int, world: int, device_type: str) -> LinkProbe:
    from runtime import distributed as comm
    from runtime.link_probe import probe_links

    return probe_links(device=comm.group_device() if device_type == "cuda" else "cpu")


def _probe(job: ProfileJob, show_progress: bool) -> tuple[LinkProbe | None, float | None]:
    """The links between ``max(2, largest tp)`` local ranks (the GPUs of this node on CUDA), and the network's
    GB/s: the GPU preset's on CUDA (one node cannot measure it), the probed links' on the CPU (one machine)."""
    from hcompile.tools.spawn import run_local_ranks

    world = max(2, *job.tps)
    if job.device == "cuda" and torch.cuda.device_count() < world:
        return None, None
    if show_progress:
        print(f"probing the links between {world} local ranks", file=sys.stderr)
    probe = run_local_ranks(world, _probe_rank, job.device, timeout_s=job.timeout_s,
                            dist_backend="nccl" if job.device == "cuda" else "gloo")[0]
    if job.device != "cuda":
        return probe, None
    from passes.graph.hardware import hardware_for_device

    try:
        return probe, hardware_for_device(torch.cuda.get_device_name(0)).network_gbps
    except ValueError:
        return probe, None


def cost_model_from_profile(profile: Profile, tokens_per_rank: int, schemes: list[ParallelScheme] | None = None,
                            gpus_per_node: int | None = None) -> CostModel:
    """The profiled coefficients with a per-rank token cap: scheme (tp, cp) holds ``tokens_per_rank * tp * cp``
    tokens."""
    entries = tuple(SchemeCost(scheme=s, a=a, b=b, c=c, max_tokens=tokens_per_rank * s.tp * s.cp)
                    for s, a, b, c in profile.coefficients if schemes is None or s in schemes)
    if not entries:
        raise PlanError(f"profile {profile.name!r} has none of the schemes {schemes}")
    return CostModel(name=f"{profile.name} cap {tokens_per_rank}/rank", entries=entries,
                     gpus_per_node=gpus_per_node or profile.gpus_per_node)


def format_profile(report: ProfileReport, out: str | None = None) -> str:
    """The table ``hcompile profile`` prints."""
    data = report.to_json()
    lines = [f"profile of {report.job.model} on {report.device} ({report.wall_s:.0f} s)",
             f"{'scheme':<15} {'a (ms/tok^2)':>13} {'b (ms/tok)':>11} {'c (ms)':>8} {'R^2':>7} "
             f"{'MAPE held-out':>13} {'act B/token':>11} {'max tokens':>10} {'derived CP error':>16}"]
    for f, entry in zip(report.fits, data["schemes"]):
        derived = "" if f.derived_mape is None else f"{100 * f.derived_mape:.1f}%"
        lines.append(f"{f.scheme.describe():<15} {f.a:>13.3e} {f.b:>11.4f} {f.c:>8.2f} {f.r2:>7.4f} "
                     f"{100 * f.mape:>12.1f}% {f.act_bytes_per_token:>11.0f} {entry['max_tokens']:>10} {derived:>16}")
    if any(f.derived_mape is not None for f in report.fits):
        lines.append("derived CP error: mean error, on the CP scheme's measured packs, of the cost the planner derives "
                     "for it from the scheme without CP and the links (used when a profile has no CP entry)")
    lines.append(f"memory budget {data['hardware']['memory_bound_mib']:.1f} MiB per rank "
                 f"(tp=1 holds {report.job.tokens_per_rank} tokens; longest micro-batches under the optimiser layout "
                 f"{report.layout().describe()})")
    if report.links is not None:
        hw = data["hardware"]
        lines.append(f"links: {hw['intra_gbps']:g} GB/s one way between local ranks, {hw['latency_us']:.0f} us per "
                     f"message; {hw['inter_gbps']:g} GB/s between nodes")
    if out:
        lines.append(f"wrote {out}")
    return "\n".join(lines)
