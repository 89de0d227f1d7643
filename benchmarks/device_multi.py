"""Part (e) of ``python -m benchmarks.device_check``: the runtime on every GPU of one machine, under NCCL.

On ``world`` local ranks (rank r on GPU r; ``hcompile.tools.spawn.run_local_ranks`` with ``dist_backend="nccl"``,
which is what torchrun gives a job) a small LLaMA trains two SGD steps under each of

- a two-way tensor-parallel replica beside tp1 ones (``1x(tp2)+...``), its gradients moved to their owners;
- a two-stage pipeline running several micro-batches (``1x(pp2)+...``): the 1F1B point-to-point order NCCL must
  not deadlock on;
- every rank in tp2 replicas (``{world/2}x(tp2)``) when there are four GPUs or more;

each in fp32 against single-process SGD on the same GPU (the loss and every parameter, relative 1e-4: NCCL sums in
another order). Then the first strategy trains a few steps with plain and with overlapped movement, and the part
reports both step times, how long the forward waited for its parameters, and each rank's memory peak against
the memory model's prediction (``passes.plan.memory``: the states of the rank's scheme and its micro-batch's
activations), which must not be exceeded; and the compute's slowdown beside transfers, probed
(``runtime.link_probe``), against what the GPU presets assume (``passes.plan.links.OVERLAP_SLOWDOWN``). The
job runs on gloo CPU ranks too (the tests do), without the memory line.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from passes.plan.links import OVERLAP_SLOWDOWN

__all__ = ["multi_strategies", "multi_gpu_job", "multi_gpu_checks", "TOLERANCE"]

TOLERANCE = 1e-4
"""Largest relative difference of a loss or a parameter from single-process SGD."""
LR = 0.1


def multi_strategies(world: int) -> list[str]:
    """The strategies part (e) trains on ``world`` ranks."""
    rest = f"+{world - 2}x(tp1)" if world > 2 else ""
    out = [f"1x(tp2){rest}", f"1x(pp2){rest}"]
    if world >= 4:
        out.append(f"{world // 2}x(tp2)")
    return out


def _setup(device: torch.device) -> tuple[Any, list[list[torch.Tensor]], int]:
    """(model config, the global batches, tokens per rank): small on a CPU, larger on a GPU."""
    from hcompile.models import LlamaConfig

    gpu = device.type == "cuda"
    cfg = LlamaConfig(layers=4, hidden=256 if gpu else 64, ffn_hidden=512 if gpu else 128, heads=8 if gpu else 4,
                      kv_heads=4 if gpu else 2, vocab=1024 if gpu else 128)
    lens = [[300, 120, 64, 250, 90, 33, 200, 150], [180, 260, 40, 99, 310, 75, 128, 60]] if gpu else \
        [[40, 12, 30, 9, 25, 17], [22, 35, 8, 28, 14, 31]]
    g = torch.Generator().manual_seed(7)
    batches = [[torch.randint(0, cfg.vocab, (n,), generator=g) for n in b] for b in lens]
    return cfg, batches, 256 if gpu else 40


def _model(cfg: Any, device: torch.device) -> torch.nn.Module:
    from hcompile.models import Llama, init_weights_

    return init_weights_(Llama(cfg), seed=11).to(device)


def _reference(cfg: Any, batches: Sequence[Sequence[torch.Tensor]], device: torch.device) -> tuple[list, dict]:
    """Single-process SGD on this rank's device: the losses and the final parameters."""
    model = _model(cfg, device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in batches:
        pairs = sum(len(s) - 1 for s in batch)
        loss = sum(F.cross_entropy(model(s[None].to(device))[0, :-1], s[1:].to(device), reduction="sum")
                   for s in batch) / pairs
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, {n: p.detach().cpu() for n, p in model.named_parameters()}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1e-12))


def multi_gpu_job(rank: int, world: int, steps: int = 4) -> dict[str, Any]:
    """One rank of part (e): per strategy, the worst relative difference from single-process SGD; then plain
    against overlapped movement (step times, parameter waits) and the memory peak against the prediction."""
    import hcompile
    from hcompile.memory import model_memory
    from passes.plan.cost_model import hcompile_runtime
    from passes.plan.memory import rank_state_bytes

    device = torch.device("cuda", rank) if torch.cuda.is_available() and torch.cuda.device_count() > rank \
        else torch.device("cpu")
    cfg, batches, per_rank = _setup(device)
    ref_losses, ref_state = _reference(cfg, batches, device)
    out: dict[str, Any] = {"strategies": {}, "movement": {}}
    for strategy in multi_strategies(world):
        trainer = hcompile.compile(_model(cfg, device)).trainer(
            loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": LR}, strategies=[strategy],
            tokens_per_rank=per_rank, param_dtype=torch.float32, calibrate=False)
        losses, micro = [], 0
        for batch in batches:
            losses.append(trainer.train_step(batch, strategy=strategy).loss)
            micro = max(micro, *(len(r.micro_batches) for r in trainer.last_plan.plan.replicas))
        state = trainer.full_state_dict()
        worst = max([abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)] +
                    [_relative(state[n], p) for n, p in ref_state.items()])
        out["strategies"][strategy] = {"worst": worst, "micro_batches": micro}
    strategy = multi_strategies(world)[0]
    for overlap in (False, True):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        trainer = hcompile.compile(_model(cfg, device)).trainer(
            loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": LR}, strategies=[strategy],
            tokens_per_rank=per_rank, calibrate=False, overlap_movement=overlap)
        walls, waits = [], []
        for i in range(steps):
            stats = trainer.train_step(batches[i % len(batches)], strategy=strategy)
            walls.append(stats.wall_ms)
            waits.append(max(stats.pull_wait_ms, default=0.0))
        record: dict[str, Any] = {"step_ms": statistics.median(walls[1:]), "pull_wait_ms": statistics.median(waits[1:])}
        if device.type == "cuda":
            place = trainer.last_plan.plan.place_of(rank)
            scheme = trainer.last_plan.plan.replicas[place.replica].scheme
            held = model_memory(trainer._captured(64), 64)
            runtime = hcompile_runtime(param_bytes=trainer.param_dtype.itemsize)
            bucket = trainer.lowerings.top_bucket(scheme)
            predicted = rank_state_bytes(held, scheme, world, runtime) + bucket * scheme.tp * held.per_token(scheme)
            record.update(peak_gib=torch.cuda.max_memory_allocated(device) / 2**30, predicted_gib=predicted / 2**30)
        out["movement"]["overlapped" if overlap else "plain"] = record
    from runtime.link_probe import probe_links  # the GPU presets assume it; here it is measured

    out["overlap_slowdown"] = probe_links(repeats=3, device=device).overlap_slowdown
    return out


def multi_gpu_checks(results: Sequence[dict[str, Any]], world: int) -> list:
    """Part (e)'s lines from every rank's :func:`multi_gpu_job` result."""
    from benchmarks.device_check import Check

    checks = []
    for strategy in multi_strategies(world):
        worst = max(r["strategies"][strategy]["worst"] for r in results)
        micro = max(r["strategies"][strategy]["micro_batches"] for r in results)
        problems = [f"a value is {worst:.2g} off single-process SGD"] * (worst > TOLERANCE) + \
            ["the pipeline ran one micro-batch"] * ("pp2" in strategy and micro < 2)
        checks.append(Check(part="e", name=f"{strategy} equals one device", passed=not problems,
                            numbers={"worst_rel": float(f"{worst:.3g}"), "micro_batches": micro},
                            detail="; ".join(problems)))
    plain = [r["movement"]["plain"] for r in results]
    overlapped = [r["movement"]["overlapped"] for r in results]
    numbers = {"plain_ms": round(max(m["step_ms"] for m in plain), 1),
               "overlapped_ms": round(max(m["step_ms"] for m in overlapped), 1),
               "waited_ms": round(max(m["pull_wait_ms"] for m in overlapped), 1),
               "slowdown": round(results[0]["overlap_slowdown"], 3), "slowdown_assumed": OVERLAP_SLOWDOWN}
    checks.append(Check(part="e", name="movement overlapped with compute", passed=True, numbers=numbers,
                        detail="step times of the slowest rank; waited: the forward waiting for its parameters; "
                               "slowdown: extra compute ms per ms of transfers beside it (runtime.link_probe), "
                               "against what the GPU presets assume"))
    peaks = [m for m in plain + overlapped if "peak_gib" in m]
    if peaks:
        over = [m for m in peaks if m["peak_gib"] > m["predicted_gib"]]
        worst = max(peaks, key=lambda m: m["peak_gib"] / m["predicted_gib"])
        checks.append(Check(part="e", name="memory peak within the model's prediction", passed=not over,
                            numbers={"peak_gib": round(worst["peak_gib"], 3),
                                     "predicted_gib": round(worst["predicted_gib"], 3)},
                            detail="" if not over else "a rank used more than the memory model predicts"))
    return checks


def check_multi_gpu(quick: bool) -> list:
    """Part (e) on every visible GPU (two or more); one passing line saying it was skipped on one GPU."""
    from benchmarks.device_check import Check
    from hcompile.tools.spawn import run_local_ranks

    world = torch.cuda.device_count()
    if world < 2:
        return [Check(part="e", name="multi-GPU runtime", passed=True, detail=f"skipped: {world} GPU visible")]
    world = 4 if world >= 4 else 2  # the strategies above are for 2 or 4 ranks
    results = run_local_ranks(world, multi_gpu_job, 3 if quick else 5, timeout_s=900, dist_backend="nccl")
    return multi_gpu_checks(results, world)
