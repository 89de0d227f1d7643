"""Activation recomputation, measured: ``python -m benchmarks.recompute`` times one stage's forward and backward
(a packed micro-batch of ``--tokens`` tokens, a loss on its logits) of a LLaMA built in the repo, lowered plain
and recomputing (``ParallelScheme(rc=True)``: one piece per layer, each under ``torch.utils.checkpoint``), side by
side in one run, and reports the time ratio against the planner's ``RECOMPUTE_TIME`` (4/3) and the step's peak
memory against the memory model's (``ModelMemory.per_token``). Each time is the median of ``--repeats`` runs after
one warm run; the two lowerings alternate, so drift hits both alike.

On the CPU the peak is the live tensor bytes (``benchmarks.memory.LiveBytes``) and the stage runs in fp32; on a GPU
(``--device cuda``) it is ``torch.cuda.max_memory_allocated`` above what the parameters hold, in bf16 with the
Triton attention: what confirms the planner's 4/3 at scale. ``--json`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from hcompile.models import Llama, LlamaConfig, init_weights_


def _measure(model: torch.nn.Module, tokens: int, sequences: int, repeats: int, device: torch.device,
             dtype: torch.dtype) -> dict:
    import hcompile
    from benchmarks.memory import LiveBytes
    from hcompile.memory import model_memory
    from passes.graph.lowering import apply_lowering, decide_lowerings
    from passes.plan.ir import ParallelScheme

    compiled = hcompile.compile(model)
    captured = compiled.captured(tokens, dtype=dtype, device=device).graph_module
    vocab = model.cfg.vocab
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    bounds = torch.linspace(0, tokens, sequences + 1).round().to(torch.int32).to(device)
    params = {n: torch.nn.Parameter(p.detach().to(device=device, dtype=dtype)) for n, p in model.named_parameters()}
    variants = {}
    for rc in (False, True):
        variant = apply_lowering(decide_lowerings(captured, ParallelScheme(rc=rc))[0], captured, tokens)
        variant.bind_({sl.name: params[sl.name] for sl in variant.params})
        variants[rc] = variant

    def step(rc: bool) -> None:
        for p in params.values():
            p.grad = None
        logits = variants[rc](ids, bounds)[0].float().reshape(-1, vocab)
        F.cross_entropy(logits[:-1], ids[1:]).backward()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    peaks = {}
    for rc in (False, True):
        step(rc)  # warm
        sync()
        if device.type == "cuda":
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            step(rc)
            sync()
            peaks[rc] = torch.cuda.max_memory_allocated(device) - base
        else:
            with LiveBytes(0) as meter:
                step(rc)
            peaks[rc] = max(meter.peaks.values())
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for rc in (False, True):
            sync()
            start = time.perf_counter()
            step(rc)
            sync()
            times[rc].append((time.perf_counter() - start) * 1e3)
    memory = model_memory(compiled.captured(tokens).graph_module, tokens)
    plain_ms, rc_ms = statistics.median(times[False]), statistics.median(times[True])
    return {"tokens": tokens, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "plain_ms": round(plain_ms, 2), "recompute_ms": round(rc_ms, 2), "time_ratio": round(rc_ms / plain_ms, 3),
            "plain_peak_mib": round(peaks[False] / 2**20, 1), "recompute_peak_mib": round(peaks[True] / 2**20, 1),
            "peak_ratio": round(peaks[True] / peaks[False], 3),
            "predicted_plain_mib": round(memory.per_token(ParallelScheme()) * tokens / 2**20, 1),
            "predicted_recompute_mib": round(memory.per_token(ParallelScheme(rc=True)) * tokens / 2**20, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.recompute", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the micro-batch (default 2048)")
    parser.add_argument("--sequences", type=int, default=4, help="sequences packed into it (default 4)")
    parser.add_argument("--layers", type=int, default=8, help="layers of the LLaMA (default 8)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default 256; SwiGLU 3x, 8 heads)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each (default 5)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    for name in ("tokens", "sequences", "layers", "hidden", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.sequences > args.tokens:
        parser.error(f"--sequences ({args.sequences}) must be at most --tokens ({args.tokens})")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU, and this machine has none")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = LlamaConfig(vocab=8192, layers=args.layers, hidden=args.hidden, ffn_hidden=3 * args.hidden, heads=8,
                      kv_heads=4)
    row = _measure(init_weights_(Llama(cfg)), args.tokens, args.sequences, args.repeats, device, dtype)
    row.update(layers=args.layers, hidden=args.hidden)
    if args.json:
        print(json.dumps(row))
        return 0
    print(f"one stage of a {args.layers}-layer LLaMA (hidden {args.hidden}), {args.tokens} tokens, {row['dtype']} on "
          f"{row['device']}: median of {args.repeats}")
    print(f"{'':<12}{'step ms':>10}{'peak MiB':>10}{'predicted MiB':>15}")
    print(f"{'plain':<12}{row['plain_ms']:>10.1f}{row['plain_peak_mib']:>10.1f}{row['predicted_plain_mib']:>15.1f}")
    print(f"{'recompute':<12}{row['recompute_ms']:>10.1f}{row['recompute_peak_mib']:>10.1f}"
          f"{row['predicted_recompute_mib']:>15.1f}")
    print(f"time ratio {row['time_ratio']:.3f} (the planner charges 4/3 = 1.333), peak ratio {row['peak_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
