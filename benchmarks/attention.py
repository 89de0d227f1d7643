"""Packed (varlen) causal attention benchmark: the generated Triton op against PyTorch's attention paths.

``python -m benchmarks.attention`` (GPU): for four length mixes (short 64-512, uniform 512-8K, a long-tail mix,
one 32K sequence) it times forward and forward+backward of

- ``hydraulis``: ``codegen.packed_attention(..., kernel="triton")`` on the packed batch;
- ``varlen_attn``: ``torch.nn.attention.varlen.varlen_attn`` on the packed batch, where it exists;
- ``flex``: FlexAttention (compiled) on the packed batch with a document-causal block mask;
- ``sdpa_padded``: ``scaled_dot_product_attention(is_causal=True)`` on the batch padded to its longest sequence
  (padded once, outside the timed region),

and reports ms, TFLOPS and the peak memory of forward+backward.  FLOPs count only the useful work of causal
attention, the same for every method (padding and masked blocks are overhead, not work):

    forward FLOPs          = sum_i 4 * s_i^2 * heads_q * head_dim / 2       (QK^T and PV, 2 flops per MAC,
                                                                             half the pairs are causal-visible)
    forward+backward FLOPs = 3.5 * forward FLOPs                            (backward: 5 matmuls to forward's 2)
    TFLOPS                 = FLOPs / (ms * 1e-3) / 1e12

``--window W`` limits every query to the keys i - W .. i (a sliding window, flash-attn's ``window_size=(W, 0)``):
``hydraulis`` passes ``window=W`` (its kernels skip the key blocks outside it), ``varlen_attn`` its own
``window_size``, ``flex`` adds the window to its block mask, ``sdpa_padded`` is not run; FLOPs then count only
the pairs inside the window, so ms falling with W is the kernels skipping work, and TFLOPS stays comparable.

``--smoke`` (CPU or GPU): checks the Triton op against the reference on small ragged batches (under
``TRITON_INTERPRET=1`` on a CPU), forward and backward, and prints that no GPU timing was taken on a CPU.
Every row is also written as a JSON line stamped with commit, device and config (default
``results/attention.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from benchmarks.provenance import commit

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """What one benchmark run measures."""

    heads_q: int = 32
    """Query heads."""
    heads_kv: int = 8
    """Key/value heads (GQA when fewer than heads_q)."""
    head_dim: int = 128
    """Size of each head."""
    dtype: str = "bf16"
    """Element type: fp32, fp16 or bf16."""
    tokens: int = 65536
    """Token budget of the packed batch for the uniform and long-tail mixes."""
    seed: int = 0
    """Seed for lengths and tensors."""
    methods: tuple[str, ...] = ("hydraulis", "varlen_attn", "flex", "sdpa_padded")
    """Methods to run, of those listed in the module docstring."""
    window: int | None = None
    """Left window W (keys i - W .. i visible to query i); None: plain causal."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.heads_q % self.heads_kv:
            raise ValueError(f"heads_q={self.heads_q} is not a multiple of heads_kv={self.heads_kv}")
        if self.window is not None and self.window < 0:
            raise ValueError(f"window={self.window} must be >= 0 (or None)")
        unknown = set(self.methods) - set(METHODS)
        if unknown:
            raise ValueError(f"methods={sorted(unknown)} are not among {sorted(METHODS)}")


@dataclass(slots=True, kw_only=True)
class Row:
    """One measured (mix, method) pair."""

    mix: str
    method: str
    num_seqs: int
    total_tokens: int
    max_seqlen: int
    fwd_ms: float | None = None
    fwd_bwd_ms: float | None = None
    fwd_tflops: float | None = None
    fwd_bwd_tflops: float | None = None
    peak_memory_gib: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def length_mixes(tokens: int, seed: int) -> dict[str, list[int]]:
    """The four length mixes: short (64-512), uniform 512-8K and a long tail up to ``tokens``, and one 32K
    sequence."""
    rng = random.Random(seed)

    def fill(draw: Callable[[], int]) -> list[int]:
        lengths: list[int] = []
        while sum(lengths) < tokens:
            lengths.append(min(draw(), tokens - sum(lengths)))
        return lengths

    def long_tail() -> int:  # mostly short sequences, a few very long ones (log-normal, median ~700)
        return max(16, min(16384, int(rng.lognormvariate(6.5, 1.2))))

    uniform, tail = fill(lambda: rng.randint(512, 8192)), fill(long_tail)
    short = fill(lambda: rng.randint(64, 512))  # drawn last: the other mixes stay as they were
    return {"short-64-512": short, "uniform-512-8k": uniform, "long-tail": tail, "one-32k": [32768]}


def attention_flops(lengths: list[int], heads_q: int, head_dim: int, *, causal: bool = True,
                    window: int | None = None) -> float:
    """Forward FLOPs of packed attention (see the module docstring for the formula); with a ``window`` only the
    pairs inside it count (query i sees min(i, window) + 1 keys)."""
    if window is None:
        pairs = sum(s * s for s in lengths) * (0.5 if causal else 1.0)
    else:
        w = window + 1  # keys a query sees once it is past the window's start
        pairs = sum(s * (s + 1) / 2 if s <= w else w * (w + 1) / 2 + (s - w) * w for s in lengths)
    return 4.0 * pairs * heads_q * head_dim


def packed_inputs(lengths: list[int], config: BenchConfig, device: torch.device) -> tuple:
    """Random q, k, v (requiring grad), cu_seqlens and max_seqlen for a packed batch."""
    generator = torch.Generator(device=device).manual_seed(config.seed)
    total, dtype = sum(lengths), DTYPES[config.dtype]

    def leaf(heads: int) -> torch.Tensor:
        x = torch.randn(total, heads, config.head_dim, generator=generator, device=device, dtype=dtype)
        return x.requires_grad_()

    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    cu_seqlens = torch.tensor(offsets, dtype=torch.int32, device=device)
    return leaf(config.heads_q), leaf(config.heads_kv), leaf(config.heads_kv), cu_seqlens, max(lengths)


def run_hydraulis(q, k, v, cu_seqlens, max_seqlen, window: int | None = None) -> torch.Tensor:
    import codegen

    return codegen.packed_attention(q, k, v, cu_seqlens, max_seqlen, causal=True, kernel="triton", window=window)


def run_varlen_attn(q, k, v, cu_seqlens, max_seqlen, window: int | None = None) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                       window_size=(-1 if window is None else window, 0), enable_gqa=q.shape[1] != k.shape[1])


def flex_runner(cu_seqlens: torch.Tensor, total: int, *, compiled: bool = True,
                window: int | None = None) -> Callable[..., torch.Tensor]:
    """FlexAttention over the packed batch as one sequence, masked to document-causal (within ``window``;
    compiled on a GPU)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    document = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)
    reach = total if window is None else window

    def document_causal(batch, head, query, key):
        return (document[query] == document[key]) & (key <= query) & (query - key <= reach)

    block_mask = create_block_mask(document_causal, None, None, total, total, device=cu_seqlens.device)
    attend = torch.compile(flex_attention) if compiled else flex_attention

    def run(q, k, v, cu, max_seqlen):
        # (T, heads, d) -> (1, heads, T, d)
        out = attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                       block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
        return out[0].transpose(0, 1)

    return run


def pad_packed(x: torch.Tensor, offsets: list[int], max_seqlen: int) -> torch.Tensor:
    """(T, heads, d) packed -> (batch, heads, max_seqlen, d), each sequence right-padded with zeros."""
    padded = x.new_zeros(len(offsets) - 1, max_seqlen, x.shape[1], x.shape[2])
    for index, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        padded[index, : end - start] = x[start:end]
    return padded.transpose(1, 2)


def unpad(out: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """(batch, heads, max_seqlen, d) -> (T, heads, d), dropping the padding rows."""
    rows = out.transpose(1, 2)
    return torch.cat([rows[i, : end - start] for i, (start, end) in enumerate(zip(offsets[:-1], offsets[1:]))])


def sdpa_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA on right-padded (batch, heads, max_seqlen, d) tensors; real rows see only real keys."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=q.shape[1] != k.shape[1])


METHODS: dict[str, str] = {
    "hydraulis": "codegen.packed_attention, Triton kernel",
    "varlen_attn": "torch.nn.attention.varlen.varlen_attn",
    "flex": "flex_attention with a document-causal block mask",
    "sdpa_padded": "scaled_dot_product_attention on the padded batch",
}


def _time_ms(fn: Callable[[], object], repeats: int = 10) -> float:
    """Median wall time of ``fn`` on the GPU in ms, after warm-up (CUDA events)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One method bound to one batch: a forward to time and the leaves its backward differentiates."""

    forward: Callable[[], torch.Tensor]
    """Runs the method's forward once."""
    leaves: tuple[torch.Tensor, ...]
    """q, k, v as that method holds them (packed, or padded for ``sdpa_padded``)."""


def make_case(method: str, q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, window: int | None = None) -> Case:
    """Bind a method to a packed batch; padding for ``sdpa_padded`` happens here, outside the timed region."""
    if method == "sdpa_padded":
        if window is not None:
            raise RuntimeError("sdpa_padded is not run with a window (it would need a dense padded mask)")
        offsets = cu_seqlens.tolist()
        padded = tuple(pad_packed(x.detach(), offsets, max_seqlen).requires_grad_() for x in (q, k, v))
        return Case(forward=lambda: sdpa_padded(*padded), leaves=padded)
    if method == "hydraulis":
        run = run_hydraulis
    elif method == "varlen_attn":
        run = run_varlen_attn
    else:
        run = flex_runner(cu_seqlens, q.shape[0], window=window)
        return Case(forward=lambda: run(q, k, v, cu_seqlens, max_seqlen), leaves=(q, k, v))
    return Case(forward=lambda: run(q, k, v, cu_seqlens, max_seqlen, window), leaves=(q, k, v))


def measure(mix: str, lengths: list[int], method: str, config: BenchConfig) -> Row:
    """Time forward and forward+backward of one method on one mix; memory peak of forward+backward."""
    q, k, v, cu_seqlens, max_seqlen = packed_inputs(lengths, config, torch.device("cuda"))
    row = Row(mix=mix, method=method, num_seqs=len(lengths), total_tokens=sum(lengths), max_seqlen=max_seqlen)
    try:
        case = make_case(method, q, k, v, cu_seqlens, max_seqlen, config.window)
        grad_out = torch.randn_like(case.forward())

        def forward_backward() -> None:
            torch.autograd.grad(case.forward(), case.leaves, grad_out)

        with torch.no_grad():
            row.fwd_ms = _time_ms(case.forward)
        row.fwd_bwd_ms = _time_ms(forward_backward)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        forward_backward()
        torch.cuda.synchronize()
        row.peak_memory_gib = (torch.cuda.max_memory_allocated() - baseline) / 2**30
    except (ImportError, RuntimeError, torch.OutOfMemoryError) as error:  # a method that cannot run is reported
        row.note = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
        torch.cuda.empty_cache()
        return row
    flops = attention_flops(lengths, config.heads_q, config.head_dim, window=config.window)
    row.fwd_tflops = flops / (row.fwd_ms * 1e-3) / 1e12
    row.fwd_bwd_tflops = 3.5 * flops / (row.fwd_bwd_ms * 1e-3) / 1e12
    return row


def smoke(config: BenchConfig) -> list[Row]:
    """Triton op vs reference, forward and backward, on small ragged batches (interpreter on a CPU)."""
    import codegen

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for mix, lengths in {"ragged": [1, 19, 0, 33, 5], "one": [40], "tiny": [1, 2, 3, 1]}.items():
        q, k, v, cu_seqlens, max_seqlen = packed_inputs(lengths, config, device)
        grad_out = torch.randn_like(q)
        started = time.perf_counter()
        errors = {}
        results = {}
        for kernel in ("triton", "reference"):
            out = codegen.packed_attention(q, k, v, cu_seqlens, max_seqlen, kernel=kernel, window=config.window)
            results[kernel] = (out, *torch.autograd.grad(out, (q, k, v), grad_out))
        for name, got, want in zip(("out", "dq", "dk", "dv"), results["triton"], results["reference"]):
            scale = max(want.double().abs().max().item(), 1e-2)
            errors[name] = (got.double() - want.double()).abs().max().item() / scale
        rows.append(Row(mix=mix, method="hydraulis-vs-reference", num_seqs=len(lengths),
                        total_tokens=sum(lengths), max_seqlen=max_seqlen,
                        note="correctness only; no GPU timing was taken" if device.type == "cpu" else "correctness",
                        extra={"max_relative_error": errors, "check_s": round(time.perf_counter() - started, 3)}))
    return rows


def stamp(config: BenchConfig, smoke_mode: bool) -> dict:
    """Commit, device and config stamped on every JSON line."""
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = f"cpu ({platform.processor() or platform.machine()}, TRITON_INTERPRET=1)"
    return {"benchmark": "attention", "commit": commit(), "device": device, "smoke": smoke_mode,
            "torch": torch.__version__, "config": asdict(config)}


def print_table(rows: list[Row]) -> None:
    header = f"{'mix':<16}{'method':<24}{'seqs':>5}{'tokens':>8}{'fwd ms':>9}{'f+b ms':>9}" \
             f"{'fwd TF':>8}{'f+b TF':>8}{'peak GiB':>9}  note"
    print(header)
    print("-" * len(header))

    def fmt(value: float | None, width: int, digits: int) -> str:
        return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"

    for row in rows:
        print(f"{row.mix:<16}{row.method:<24}{row.num_seqs:>5}{row.total_tokens:>8}{fmt(row.fwd_ms, 9, 3)}"
              f"{fmt(row.fwd_bwd_ms, 9, 3)}{fmt(row.fwd_tflops, 8, 1)}{fmt(row.fwd_bwd_tflops, 8, 1)}"
              f"{fmt(row.peak_memory_gib, 9, 2)}  {row.note} {json.dumps(row.extra) if row.extra else ''}")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, BenchConfig]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="correctness check only, small, CPU-friendly")
    parser.add_argument("--out", type=Path, default=Path("results/attention.jsonl"), help="JSON lines file")
    parser.add_argument("--heads-q", type=int, default=None)
    parser.add_argument("--heads-kv", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {list(METHODS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=None, help="left window W: keys i - W .. i (default: causal)")
    args = parser.parse_args(argv)
    smoke_defaults = {"heads_q": 4, "heads_kv": 2, "head_dim": 16, "dtype": "fp32"}
    gpu_defaults = {"heads_q": 32, "heads_kv": 8, "head_dim": 128, "dtype": "bf16"}
    defaults = smoke_defaults if args.smoke else gpu_defaults
    chosen = {name: getattr(args, name) if getattr(args, name) is not None else value
              for name, value in defaults.items()}
    config = BenchConfig(**chosen, tokens=args.tokens, seed=args.seed, methods=tuple(args.methods.split(",")),
                         window=args.window)
    return args, config


def main(argv: list[str] | None = None) -> int:
    args, config = parse_args(argv)
    if not torch.cuda.is_available():
        if not args.smoke:
            print("no GPU: nothing to time; run with --smoke for the CPU correctness check", file=sys.stderr)
            return 2
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.smoke:
        rows = smoke(config)
        if not torch.cuda.is_available():
            print("no GPU timing was taken: smoke mode checked correctness under TRITON_INTERPRET=1 on a CPU")
    else:
        rows = [measure(mix, lengths, method, config)
                for mix, lengths in length_mixes(config.tokens, config.seed).items() for method in config.methods]
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    header = stamp(config, args.smoke)
    with args.out.open("a") as sink:
        for row in rows:
            sink.write(json.dumps({**header, **asdict(row)}) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")
    worst = max((max(row.extra["max_relative_error"].values()) for row in rows if row.extra), default=0.0)
    tolerance = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 3e-2}[config.dtype]
    if args.smoke and not worst < tolerance:
        print(f"FAILED: worst relative error {worst:.2e} >= {tolerance:.0e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
