"""The K/V exchange of context-parallel attention, unpipelined against pipelined over head groups:
``python -m benchmarks.kv_exchange`` times, on ``--world`` local ranks holding one long sequence split by the CP
layout, the forward+backward of ``cp_attention`` with ``kv_splits`` 1 (one all-gather before the attention), 2
and 4 (``passes.graph.kv_exchange``), beside the attention alone (its K/V gathered beforehand) and the exchange
alone (the same collectives without the attention), and the attention alone run head group by head group
(what splitting the kernel calls costs by itself). Exposed exchange = step - attention alone; the model's
(``passes.plan.context_parallel.cp_cost``) is ``E/n + max(0, E (n-1)/n - A) + s E (n-1)/n`` for n head groups,
exchange E and attention A, shown for a slowdown s of 0 (transfers cost the compute nothing, what a GPU's copy
engines and NCCL's few SMs come close to) and 1 (every transfer millisecond is a compute millisecond lost: ranks
sharing few CPU cores). Each figure is the slowest rank's median of ``--repeats`` timings after one warm run.

On the CPU the ranks run gloo (the gradients' reduce-scatter is an all-reduce there); ``--backend nccl`` puts
rank r on GPU r (at least two GPUs) and times in bf16 with the Triton kernels: what decides the default on GPUs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable

SPLITS = (1, 2, 4)


def _rank(rank: int, world: int, tokens: int, heads: int, kv_heads: int, head_dim: int, splits: tuple[int, ...],
          repeats: int, backend: str) -> dict:
    import torch

    import codegen
    from passes.graph.collectives import CP_ALL_GATHER
    from passes.graph.context_parallel import CpAttentionInputs, cp_attention, cp_layout
    from passes.plan.context_parallel import kv_splits
    from runtime import distributed as comm

    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layout = cp_layout([tokens], world)
    inputs = CpAttentionInputs.build(layout, rank, device=device)
    group = comm.group_name(comm.world_group())
    n = layout.tokens(rank)
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(n, h, head_dim, generator=gen).to(device, dtype) for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(n, heads, head_dim, generator=gen).to(device, dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn: Callable[[], None]) -> float:
        runs = []
        for i in range(repeats + 1):
            comm.barrier()
            sync()
            started = time.perf_counter()
            fn()
            sync()
            if i:
                runs.append((time.perf_counter() - started) * 1e3)
        return statistics.median(runs)

    def leaves(*xs: torch.Tensor) -> list[torch.Tensor]:
        return [x.detach().clone().requires_grad_() for x in xs]

    def step(s: int) -> None:
        lq, lk, lv = leaves(q, k, v)
        cp_attention(lq, lk, lv, inputs, group, kv_splits=s).backward(grad)

    with torch.no_grad():  # the K/V this rank's queries read, gathered once, for the attention alone
        rows = inputs.key_rows
        k_sel = CP_ALL_GATHER(k, group, inputs.width, world, rank).index_select(0, rows)
        v_sel = CP_ALL_GATHER(v, group, inputs.width, world, rank).index_select(0, rows)

    def attention(groups: int = 1) -> None:
        hq, hk = heads // groups, kv_heads // groups
        for g in range(groups):  # head group by head group, as the pipelined exchange runs it
            lq, lk, lv = leaves(q[:, g * hq:(g + 1) * hq], k_sel[:, g * hk:(g + 1) * hk], v_sel[:, g * hk:(g + 1) * hk])
            out = codegen.packed_attention(lq, lk, lv, inputs.cu_seqlens_q, inputs.max_seqlen_q, validate=False,
                                           cu_seqlens_k=inputs.cu_seqlens_k, max_seqlen_k=inputs.max_seqlen_k)
            out.backward(grad[:, g * hq:(g + 1) * hq])

    def exchange() -> None:
        lk, lv = leaves(k, v)
        gathered = [CP_ALL_GATHER(x, group, inputs.width, world, rank) for x in (lk, lv)]
        torch.autograd.backward(gathered, [torch.ones_like(t) for t in gathered])

    out = {"attention_ms": timed(attention), "exchange_ms": timed(exchange), "tokens": n}
    for s in splits:
        out[f"splits{s}_ms"] = timed(lambda s=s: step(s))
        out[f"attention{s}_ms"] = timed(lambda s=s: attention(kv_splits(kv_heads, s)))
    return out


def model_exposed(exchange_ms: float, attention_ms: float, splits: int, slowdown: float) -> float:
    """What ``cp_cost`` charges beyond the attention for ``splits`` head groups (module docstring)."""
    hidden = exchange_ms * (splits - 1) / splits
    return exchange_ms / splits + max(0.0, hidden - attention_ms) + slowdown * hidden


def run(world: int, tokens: int, heads: int, kv_heads: int, head_dim: int, splits: tuple[int, ...], repeats: int,
        backend: str) -> dict:
    """Every figure, the slowest rank's."""
    from hcompile.tools.spawn import run_local_ranks
    from passes.plan.context_parallel import kv_splits

    ranks = run_local_ranks(world, _rank, tokens, heads, kv_heads, head_dim, splits, repeats, backend,
                            timeout_s=1800, dist_backend=backend)
    worst = {key: max(r[key] for r in ranks) for key in ranks[0] if key.endswith("_ms")}
    rows = []
    for s in splits:
        used = kv_splits(kv_heads, s)
        step = worst[f"splits{s}_ms"]
        rows.append({"kv_splits": s, "groups": used, "step_ms": step,
                     "grouped_attention_ms": worst[f"attention{s}_ms"],
                     "exposed_ms": step - worst["attention_ms"],
                     "model_exposed_ms": [model_exposed(worst["exchange_ms"], worst["attention_ms"], used, slow)
                                          for slow in (0.0, 1.0)]})
    return {"world": world, "tokens": tokens, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "backend": backend, "attention_ms": worst["attention_ms"], "exchange_ms": worst["exchange_ms"],
            "rows": rows}


def format_table(result: dict) -> str:
    lines = [f"{result['world']} ranks ({result['backend']}), one sequence of {result['tokens']} tokens, "
             f"{result['heads']} heads / {result['kv_heads']} kv heads of {result['head_dim']}: attention alone "
             f"{result['attention_ms']:.1f} ms, exchange alone {result['exchange_ms']:.1f} ms",
             f"{'kv_splits':>9} {'groups':>6} {'step ms':>9} {'grouped attention ms':>21} {'exposed ms':>11} "
             f"{'model s=0':>10} {'model s=1':>10}"]
    for r in result["rows"]:
        low, high = r["model_exposed_ms"]
        lines.append(f"{r['kv_splits']:>9} {r['groups']:>6} {r['step_ms']:>9.1f} {r['grouped_attention_ms']:>21.1f} "
                     f"{r['exposed_ms']:>11.1f} {low:>10.1f} {high:>10.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_exchange", description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="CP ranks (default 2)")
    parser.add_argument("--tokens", type=int, default=4096, help="the sequence's length (default 4096)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8, help="as many as --heads: MHA, the case that pays most")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--splits", default=",".join(map(str, SPLITS)), help="comma-separated kv_splits to time")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    try:
        splits = tuple(int(s) for s in args.splits.split(","))
    except ValueError:
        splits = ()
    if not splits or min(splits) < 1:
        print(f"--splits {args.splits!r}: expected comma-separated integers >= 1", file=sys.stderr)
        return 2
    if min(args.world, args.heads, args.kv_heads, args.head_dim, args.repeats) < 1 or args.world < 2:
        print("--world must be >= 2; --heads, --kv-heads, --head-dim and --repeats >= 1", file=sys.stderr)
        return 2
    if args.heads % args.kv_heads:
        print(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}", file=sys.stderr)
        return 2
    if args.tokens < 2 * args.world:
        print(f"--tokens {args.tokens} must be at least twice --world {args.world}", file=sys.stderr)
        return 2
    result = run(args.world, args.tokens, args.heads, args.kv_heads, args.head_dim, splits, args.repeats,
                 args.backend)
    print(json.dumps(result) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
