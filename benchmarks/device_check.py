"""One command for a GPU machine: ``python -m benchmarks.device_check`` checks the GPU path of the whole stack.

Parts (``--parts a,b,c,d,e``; ``--quick`` runs fewer sizes):

- (a) packed attention forward and backward in bf16 on the Triton kernel against SDPA run one sequence at a time
  in fp32 (the oracle) on ragged grouped-query and multi-query batches, head dims 64 and 128: the largest error
  of out, dq, dk and dv over the oracle's largest value under 2e-2 (or under twice SDPA's own in bf16, reported
  beside, should that be larger);
- (b) its forward+backward TFLOPS against torch's own varlen attention and FlexAttention with a document mask
  (whichever this torch has) and padded SDPA, on length mixes from short sequences to one of 32K
  (``benchmarks.attention``'s mixes and timing): passes when ours and at least one of torch's varlen paths ran;
- (c) a world-of-one training run of a ~125M LLaMA (``benchmarks.device_train``) in bf16 with packed attention and
  inductor-compiled variants against the same model in fp32 eager: every step's loss within 2e-2, no compilation
  after the first step, tokens/s and MFU (model FLOPs over the bf16 peak of this GPU's preset,
  ``passes.graph.hardware``, which must exist and match the device's memory);
- (d) ``hcompile profile`` run on the GPU (a small model) writes a profile measured there that
  ``hcompile plan --profile`` accepts;
- (e) with two GPUs or more, the runtime on 2 or 4 of them under NCCL (``benchmarks.device_multi``): tp2, a
  two-stage pipeline with several micro-batches, tp2 replicas beside tp1 ones, each equal to single-process
  SGD on the same GPU; plain against overlapped movement; each rank's memory peak against the memory model's
  prediction. With one GPU it says so and passes.

Prints one table (part, check, pass/FAIL, numbers, detail) and one JSON line stamped with the commit, torch and
triton versions and the device, also appended to ``results/device_check.jsonl``; exits 1 when any check failed.
Each part runs in its own ``try``: one that raises is a failed check and the others still run. On a machine
without a CUDA GPU it prints one line saying what it skipped and exits 0, having run and written nothing.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from benchmarks.attention import BenchConfig, Row, length_mixes, measure, packed_inputs
from benchmarks.device_multi import check_multi_gpu
from benchmarks.device_train import TrainRun, TrainSetup, run_training
from benchmarks.provenance import commit
from passes.graph.hardware import hardware_for_device
from passes.plan.cost_model import load_profile_file

__all__ = ["PARTS", "Check", "AttentionCase", "attention_cases", "sdpa_per_sequence", "relative_error",
           "attention_errors", "correctness_check", "speed_check", "training_checks", "preset_check",
           "check_profile", "run_part", "format_table", "summary_record", "exit_code", "skip_line", "main"]

PARTS = {
    "a": "packed attention bf16 forward/backward on Triton against SDPA per sequence",
    "b": "packed attention TFLOPS against torch's varlen attention, FlexAttention and padded SDPA",
    "c": "~125M LLaMA training, bf16, inductor, world of one, against fp32 eager",
    "d": "hcompile profile on the GPU, loaded by the planner",
    "e": "the runtime on every GPU under NCCL (tp2, pp2, movement) against one device",
}
ATTENTION_TOLERANCE = {"bf16": 2e-2, "fp32": 1e-4}
"""Largest error over the oracle's largest value, by dtype."""
LOSS_TOLERANCE = 2e-2
"""Largest relative difference of a bf16 step's loss from the fp32 eager one."""
MEMORY_TOLERANCE = 0.05
"""How far a preset's memory may be from what the device reports (the driver keeps some for itself)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Check:
    """One line of the table."""

    part: str
    """``a`` to ``d``."""
    name: str
    """What was checked."""
    passed: bool
    """Whether it passed."""
    numbers: dict[str, Any] = field(default_factory=dict)
    """What was measured (JSON values)."""
    detail: str = ""
    """Why it failed, or what else to know."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionCase:
    """One packed batch shape of part (a)."""

    name: str
    """Named in the table."""
    lengths: tuple[int, ...]
    """The packed sequences' lengths (0: an empty sequence)."""
    heads_q: int
    """Query heads."""
    heads_kv: int
    """Key/value heads (fewer: grouped-query or multi-query attention)."""
    head_dim: int
    """Width of one head."""


def attention_cases(quick: bool) -> list[AttentionCase]:
    """Per head dim (64, 128): a ragged grouped-query batch (an empty sequence, single tokens, a 4097-token one)
    and, unless ``quick``, a multi-query batch led by one 8K sequence."""
    ragged, long = (1, 3, 0, 17, 64, 129, 300, 1000, 2048, 4097), (8192, 100, 31)
    cases = []
    for dim in (64, 128):
        cases.append(AttentionCase(name=f"ragged-gqa-d{dim}", lengths=ragged, heads_q=16, heads_kv=4, head_dim=dim))
        if not quick:
            cases.append(AttentionCase(name=f"long-mqa-d{dim}", lengths=long, heads_q=8, heads_kv=1, head_dim=dim))
    return cases


def sdpa_per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      max_seqlen: int) -> torch.Tensor:
    """The oracle: causal ``scaled_dot_product_attention`` on each sequence alone, (T, heads, d) packed."""
    offsets = cu_seqlens.tolist()
    outs = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        if end > start:
            one = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]  # (1, heads, s, d)
            out = F.scaled_dot_product_attention(*one, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
            outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference over the largest absolute value of ``want``."""
    scale = want.double().abs().max().item() if want.numel() else 0.0
    return (got.double() - want.double()).abs().max().item() / max(scale, 1e-6)


def attention_errors(case: AttentionCase, dtype: str, device: torch.device,
                     attend: Callable[..., torch.Tensor], seed: int = 0) -> dict[str, float]:
    """Errors of ``attend(q, k, v, cu_seqlens, max_seqlen)``'s output and q, k, v gradients, on random inputs in
    ``dtype``, against :func:`sdpa_per_sequence` in fp32 on the same inputs."""
    config = BenchConfig(heads_q=case.heads_q, heads_kv=case.heads_kv, head_dim=case.head_dim, dtype=dtype,
                         seed=seed)
    q, k, v, cu_seqlens, max_seqlen = packed_inputs(list(case.lengths), config, device)
    grad_out = torch.randn(q.shape, generator=torch.Generator(device=device).manual_seed(seed + 1), device=device,
                           dtype=q.dtype)
    out = attend(q, k, v, cu_seqlens, max_seqlen)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad_out))
    leaves = tuple(t.detach().float().requires_grad_() for t in (q, k, v))
    oracle = sdpa_per_sequence(*leaves, cu_seqlens, max_seqlen)
    want = (oracle, *torch.autograd.grad(oracle, leaves, grad_out.float()))
    return {name: relative_error(g, w) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}


def correctness_check(case: AttentionCase, errors: dict[str, float], baseline: dict[str, float] | None,
                      tolerance: float, dtype: str = "bf16") -> Check:
    """Part (a)'s line for one case: passes when every error is under ``tolerance``, or under twice the worst error
    of ``baseline`` (SDPA's own in the same dtype) where that is larger."""
    worst = max(errors.values())
    limit = max(tolerance, 2 * max(baseline.values())) if baseline is not None else tolerance
    numbers: dict[str, Any] = {name: float(f"{value:.3g}") for name, value in errors.items()}
    if baseline is not None:
        numbers[f"sdpa_{dtype}_worst"] = float(f"{max(baseline.values()):.3g}")
    numbers.update(seqs=len(case.lengths), tokens=sum(case.lengths), heads=f"{case.heads_q}/{case.heads_kv}")
    passed = worst < limit
    detail = "" if passed else f"worst error {worst:.3g} >= {limit:.3g}"
    return Check(part="a", name=f"{dtype} {case.name}", passed=passed, numbers=numbers, detail=detail)


def check_attention_correctness(device: torch.device, quick: bool) -> list[Check]:
    """Part (a) on ``device``: the Triton kernel in bf16 against the fp32 oracle (and SDPA's bf16 beside)."""
    import codegen

    triton = functools.partial(codegen.packed_attention, causal=True, kernel="triton")
    tolerance = ATTENTION_TOLERANCE["bf16"]
    return [correctness_check(case, attention_errors(case, "bf16", device, triton),
                              attention_errors(case, "bf16", device, sdpa_per_sequence), tolerance)
            for case in attention_cases(quick)]


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def speed_methods() -> tuple[str, ...]:
    """``benchmarks.attention``'s methods this torch has: ours, varlen_attn and flex where present, padded SDPA."""
    present = {"varlen_attn": _has_module("torch.nn.attention.varlen"),
               "flex": _has_module("torch.nn.attention.flex_attention")}
    return ("hydraulis", *(m for m, ok in present.items() if ok), "sdpa_padded")


def speed_check(mix: str, lengths: Sequence[int], rows: Sequence[Row]) -> Check:
    """Part (b)'s line for one mix: passes when ours was timed and so was one of torch's varlen paths."""
    by_method = {row.method: row for row in rows}
    ours = by_method.get("hydraulis")
    baselines = [r for r in rows if r.method in ("varlen_attn", "flex") and r.fwd_bwd_tflops]
    numbers: dict[str, Any] = {"seqs": len(lengths), "tokens": sum(lengths), "longest": max(lengths)}
    numbers.update({f"{r.method}_tflops": round(r.fwd_bwd_tflops, 1) if r.fwd_bwd_tflops else None for r in rows})
    passed = ours is not None and ours.fwd_bwd_tflops is not None and bool(baselines)
    if passed:
        best = max(baselines, key=lambda r: r.fwd_bwd_tflops or 0.0)
        numbers[f"vs_{best.method}"] = round(ours.fwd_bwd_tflops / best.fwd_bwd_tflops, 3)
    notes = "; ".join(f"{r.method}: {r.note}" for r in rows if r.note)
    if ours is None or ours.fwd_bwd_tflops is None:
        notes = "ours was not timed" + (f"; {notes}" if notes else "")
    elif not baselines:
        notes = "no torch varlen path ran to compare with" + (f"; {notes}" if notes else "")
    return Check(part="b", name=f"fwd+bwd TFLOPS {mix}", passed=passed, numbers=numbers, detail=notes)


def check_attention_speed(quick: bool) -> list[Check]:
    """Part (b): every mix of ``benchmarks.attention.length_mixes`` at 32K tokens (quick: 16K, no uniform mix;
    the one-sequence mix is 32K either way), 32 query and 8 kv heads of 128."""
    config = BenchConfig(heads_q=32, heads_kv=8, head_dim=128, dtype="bf16", tokens=16384 if quick else 32768,
                         methods=speed_methods())
    mixes = length_mixes(config.tokens, config.seed)
    if quick:
        mixes.pop("uniform-512-8k")
    return [speed_check(mix, lengths, [measure(mix, lengths, method, config) for method in config.methods])
            for mix, lengths in mixes.items()]


def preset_check(device_name: str, memory_gib: float) -> tuple[Check, float | None]:
    """Whether this GPU has a hardware preset whose memory is the device's; with the preset's bf16 peak."""
    try:
        hardware = hardware_for_device(device_name)
    except ValueError as error:
        return Check(part="c", name="hardware preset", passed=False, detail=str(error)), None
    off = abs(hardware.memory_gib - memory_gib) / hardware.memory_gib
    numbers = {"preset": hardware.name, "peak_tflops": hardware.peak_tflops,
               "preset_gib": round(hardware.memory_gib, 1), "device_gib": round(memory_gib, 1)}
    passed = off < MEMORY_TOLERANCE
    detail = "" if passed else f"the preset's memory is {100 * off:.1f}% off the device's"
    return Check(part="c", name="hardware preset", passed=passed, numbers=numbers, detail=detail), \
        hardware.peak_tflops


def training_checks(run: TrainRun, peak_tflops: float | None, kernel: str = "triton",
                    tolerance: float = LOSS_TOLERANCE) -> list[Check]:
    """Part (c)'s lines: the losses against fp32 eager, no compilation after warm-up, and the throughput (packed
    attention ran on ``kernel`` alone; the MFU, when a peak is known, above 0 and at most 1)."""
    errors = run.loss_errors()
    worst = max(errors)
    loss = Check(part="c", name="loss against fp32 eager", passed=worst < tolerance,
                 numbers={"steps": len(errors), "first": round(run.losses[0], 4), "last": round(run.losses[-1], 4),
                          "fp32_last": round(run.reference[-1], 4), "worst_rel": float(f"{worst:.3g}")},
                 detail="" if worst < tolerance else f"a loss is {worst:.3g} off fp32 eager (>= {tolerance:g})")
    after = run.compilations_after_warmup()
    compiled = run.compilations[0] >= 1
    recompiles = Check(part="c", name="no recompilation after warm-up", passed=after == 0 and compiled,
                       numbers={"at_warmup": run.compilations[0], "after": after},
                       detail="" if compiled else "nothing was compiled at warm-up")
    ran = run.kernels_run()
    numbers: dict[str, Any] = {"params_m": round(run.params / 1e6, 1), "tokens_per_s": round(run.tokens_per_s()),
                               "model_tflops": round(run.achieved_tflops(), 1), "attention": "+".join(ran) or None}
    mfu_ok = True
    if peak_tflops is not None:
        mfu = run.mfu(peak_tflops)
        numbers["mfu"] = round(mfu, 4)
        mfu_ok = 0 < mfu <= 1
    problems = [f"packed attention ran on {list(ran)}, not only on {kernel!r}"] * (ran != (kernel,)) + \
        ["an MFU outside (0, 1] means a wrong FLOP count or peak"] * (not mfu_ok)
    speed = Check(part="c", name="throughput", passed=not problems, numbers=numbers, detail="; ".join(problems))
    return [loss, recompiles, speed]


def check_training(quick: bool, device_name: str) -> list[Check]:
    """Part (c): the hardware preset, then the ~125M LLaMA in bf16 with inductor against fp32 eager."""
    memory_gib = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
    preset, peak = preset_check(device_name, memory_gib)
    setup = TrainSetup(tokens=4096 if quick else 8192, steps=4 if quick else 6)
    return [preset, *training_checks(run_training(setup), peak)]


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "hcompile.cli", *args]


def _run(command: list[str], timeout_s: float) -> tuple[int, str, str]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    return done.returncode, done.stdout, done.stderr


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def check_profile(workdir: Path, device: str | None, measured_on: str, timeout_s: float = 300.0) -> list[Check]:
    """Part (d): ``hcompile profile`` (``--device device`` when given) of a small model at tp 1 writes a profile
    whose hardware names ``measured_on`` with non-negative coefficients; ``hcompile plan --profile`` plans with
    it."""
    out = workdir / "profile.json"
    args = ["profile", *(["--device", device] if device else []), "--model", "llama-tiny", "--tp", "1",
            "--tokens-per-rank", "512", "--repeats", "3", "--gpus", "1", "--out", str(out)]
    code, _, stderr = _run(_command(*args), timeout_s)
    if code != 0:
        return [Check(part="d", name="profile written", passed=False,
                      detail=f"hcompile {' '.join(args[:3])} ... exited {code}: {_last_line(stderr)}")]
    data = json.loads(out.read_text())
    (_, a, b, c), = load_profile_file(out).coefficients
    where = str(data.get("hardware", {}).get("gpu", ""))
    passed = measured_on in where and min(a, b, c) >= 0 and b > 0
    written = Check(part="d", name="profile written", passed=passed,
                    numbers={"a": float(f"{a:.3g}"), "b": float(f"{b:.3g}"), "c": float(f"{c:.3g}")},
                    detail=f"measured on {where!r}" + ("" if measured_on in where else f", not {measured_on!r}"))
    return [written, plan_check(out, workdir, gpus=1, timeout_s=timeout_s)]


def plan_check(profile: Path, workdir: Path, gpus: int, timeout_s: float = 300.0) -> Check:
    """Whether ``hcompile plan --profile profile`` plans two small batches on ``gpus`` GPUs."""
    lengths = workdir / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in (60, 12, 40, 128, 7, 33)) + "\n")
    args = ["plan", "--profile", str(profile), "--gpus", str(gpus), "--lengths", str(lengths),
            "--global-tokens", "200", "--steps", "2", "--json"]
    code, stdout, stderr = _run(_command(*args), timeout_s)
    policies = sorted(json.loads(stdout).get("policies", {})) if code == 0 else []
    passed = code == 0 and "hydraulis" in policies
    detail = "" if passed else f"hcompile plan --profile exited {code}: {_last_line(stderr)}"
    return Check(part="d", name="planner loads it", passed=passed, numbers={"policies": len(policies)}, detail=detail)


def check_profile_on_gpu(device_name: str) -> list[Check]:
    """Part (d) on this GPU, in a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="device-check-") as workdir:
        return check_profile(Path(workdir), "cuda", device_name)


def run_part(part: str, run: Callable[[], Iterable[Check]]) -> tuple[list[Check], float]:
    """A part's checks and its seconds; a part that raises (or returns nothing) is one failed check naming the
    error, and its traceback goes to stderr."""
    started = time.perf_counter()
    try:
        checks = list(run())
        if not checks:
            raise RuntimeError("the part returned no checks")
    except Exception as error:  # one part's failure is reported; the others still run
        traceback.print_exc(file=sys.stderr)
        first = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        checks = [Check(part=part, name=PARTS[part], passed=False, detail=f"{type(error).__name__}: {first}")]
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return checks, time.perf_counter() - started


def _format_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_table(checks: Sequence[Check]) -> str:
    """The table: part, check, result, numbers (``name=value``), detail."""
    rows = [(c.part, c.name, "pass" if c.passed else "FAIL",
             " ".join(f"{k}={_format_value(v)}" for k, v in c.numbers.items()), c.detail) for c in checks]
    header = ("part", "check", "result", "numbers", "detail")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths)) + "  " + row[4]
             for row in [header, *rows]]
    lines.insert(1, "-" * (sum(widths) + 8 + len(header[4])))
    return "\n".join(line.rstrip() for line in lines)


def stamp(device_name: str, parts: str, quick: bool, part_s: dict[str, float]) -> dict[str, Any]:
    """What the JSON line is stamped with: commit, versions, device, options, seconds per part."""
    try:
        from importlib.metadata import version

        triton = version("triton")
    except Exception:  # triton absent or unreadable: stamped as unknown
        triton = None
    return {"benchmark": "device_check", "commit": commit(), "torch": torch.__version__, "triton": triton,
            "cuda": torch.version.cuda, "device": device_name, "parts": parts, "quick": quick,
            "part_s": {k: round(v, 1) for k, v in part_s.items()}}


def summary_record(checks: Sequence[Check], header: dict[str, Any]) -> dict[str, Any]:
    """The JSON line: the stamp, whether everything passed, every check."""
    return {**header, "passed": exit_code(checks) == 0, "checks": [asdict(c) for c in checks]}


def exit_code(checks: Sequence[Check]) -> int:
    """0 when there were checks and every one passed, else 1."""
    return 0 if checks and all(c.passed for c in checks) else 1


def skip_line(parts: str) -> str:
    """The one line printed on a machine without a CUDA GPU."""
    skipped = "; ".join(f"({p}) {PARTS[p]}" for p in parts)
    return f"device_check: no CUDA GPU on this machine, nothing run or written; skipped {skipped}"


def _parts(text: str) -> str:
    parts = "".join(p.strip() for p in text.split(",") if p.strip())
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts or len(set(parts)) != len(parts):
        raise argparse.ArgumentTypeError(f"--parts takes distinct letters of {','.join(PARTS)}, got {text!r}")
    return parts


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.device_check", description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=_parts, default="abcde", help="which parts, e.g. 'a,c' (default all)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes: a minute or two less")
    parser.add_argument("--out", type=Path, default=Path("results/device_check.jsonl"),
                        help="JSON lines file the record is appended to (default results/device_check.jsonl)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(skip_line(args.parts))
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    runners: dict[str, Callable[[], Iterable[Check]]] = {
        "a": lambda: check_attention_correctness(device, args.quick),
        "b": lambda: check_attention_speed(args.quick),
        "c": lambda: check_training(args.quick, name),
        "d": lambda: check_profile_on_gpu(name),
        "e": lambda: check_multi_gpu(args.quick),
    }
    checks: list[Check] = []
    part_s: dict[str, float] = {}
    for part in args.parts:
        done, part_s[part] = run_part(part, runners[part])
        checks.extend(done)
    record = summary_record(checks, stamp(name, ",".join(args.parts), args.quick, part_s))
    print(format_table(checks))
    line = json.dumps(record)
    print(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as sink:
        sink.write(line + "\n")
    return exit_code(checks)


if __name__ == "__main__":
    sys.exit(main())
