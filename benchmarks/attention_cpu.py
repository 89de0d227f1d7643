"""CPU packed attention: ``python -m benchmarks.attention_cpu`` times forward+backward of the plain-torch reference
and of the ``cpu-flash`` kernel (PyTorch's fused CPU flash kernel) side by side on one thread, for packed
batches of one sequence and of eight equal sequences at several total lengths (the llama-small attention shape:
4 heads of 32 by default), and prints ms and the speed-up.  Median of ``--repeats`` runs after one warm run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import codegen


def time_ms(lengths: list[int], heads: int, head_dim: int, kernel: str, repeats: int) -> float:
    """Median ms of forward+backward of causal packed attention over sequences of ``lengths``."""
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, head_dim, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    runs = []
    for i in range(repeats + 1):
        started = time.perf_counter()
        codegen.packed_attention(q, k, v, cu, max(lengths), kernel=kernel).sum().backward()
        if i:
            runs.append((time.perf_counter() - started) * 1e3)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention_cpu", description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--totals", default="128,512,1024", help="comma-separated total tokens")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    try:
        totals = [int(t) for t in args.totals.split(",")]
        if min(totals) < 8 or args.heads < 1 or args.head_dim < 1 or args.repeats < 1:
            raise ValueError
    except ValueError:
        print(f"bad sizes: --totals {args.totals!r} (integers >= 8), --heads, --head-dim and --repeats >= 1",
              file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    print(f"{'tokens':>7} {'seqs':>5} {'reference ms':>13} {'cpu-flash ms':>13} {'speed-up':>9}")
    for total in totals:
        for seqs in (1, 8):
            lengths = [total // seqs] * seqs
            ref, flash = (time_ms(lengths, args.heads, args.head_dim, b, args.repeats)
                          for b in ("reference", "cpu-flash"))
            print(f"{total:>7} {seqs:>5} {ref:>13.2f} {flash:>13.2f} {ref / flash:>8.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
