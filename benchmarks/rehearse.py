"""``python -m benchmarks.rehearse``: every kind of rank of a large job rehearsed on this CPU under fake tensors.

Builds a LLaMA (Hugging Face ``LlamaForCausalLM``) on the meta device with the shapes of the planner's profile
(``--model llama-7b`` / ``llama-32b``: layers, hidden, ffn_hidden, heads and vocabulary from
``passes/plan/data/profiles/a800-<model>.json``; ``tiny-llama``: 2 layers, hidden 128, vocabulary 500, for CI),
builds what a trainer of ``--gpus`` ranks on ``--hardware`` builds (``hcompile.rehearsal.trainer_parts``), and
rehearses the dry step of every (scheme, stage, TP rank) kind of the cost model's schemes with a cap above 0 at its
largest bucket (``hcompile.rehearsal.rehearse_rank``): TP rank 0 and the last (all with ``--all-tp-ranks``). With
``--dataset`` (``commoncrawl``, ...) it also says which schemes the planner's pool for that data uses
(``passes.plan.pool.build_pool`` at ``--global-tokens``). Prints a table (charged: what the memory model charges
the rank at its bucket, the reserve apart; tracked: MemTracker's peak, by category: parameters, gradients,
optimizer, activations, temporaries); ``--json``: one JSON object per rank per line. Progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import resources

import torch

from hcompile.rehearsal import TrainerParts, rank_places, rehearse_rank, trainer_parts
from passes.graph.hardware import GPU_PRESETS
from passes.graph.variant import TokenBuckets
from passes.plan.ir import ParallelScheme

__all__ = ["MODELS", "llama", "main"]

MODELS = ("tiny-llama", "llama-7b", "llama-32b")
"""The models ``--model`` names."""

GIB = 2**30


def _profile(name: str) -> dict:
    text = resources.files("passes.plan").joinpath("data", "profiles", f"a800-{name}.json").read_text()
    return json.loads(text)["model"]


def llama(name: str) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` of the model ``name`` (one of :data:`MODELS`) on the meta device, its rotary
    embedding's buffer real (a buffer the lowered graph reads, not a parameter)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    if name == "tiny-llama":
        shape = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=344, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=500)
    else:
        p = _profile(name)
        shape = dict(num_hidden_layers=p["layers"], hidden_size=p["hidden"], intermediate_size=p["ffn_hidden"],
                     num_attention_heads=p["heads"], num_key_value_heads=p.get("kv_heads", p["heads"]),
                     vocab_size=p["vocab"])
    config = LlamaConfig(**shape, max_position_embeddings=1 << 20)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.model.rotary_emb = LlamaRotaryEmbedding(config)  # its inv_freq computed on the host, as on a GPU
    return model


def _pool_schemes(parts: TrainerParts, dataset: str, global_tokens: int) -> set[ParallelScheme]:
    """The schemes of the planner's pool for ``dataset`` (``build_pool``, as ``Trainer`` builds it)."""
    from passes.plan.datasets import load_dataset
    from passes.plan.policies import sized_homogeneous
    from passes.plan.pool import build_pool

    data = load_dataset(dataset)
    fixed = sized_homogeneous(parts.cost_model, parts.world, data.max_len)
    pool = build_pool(parts.cost_model, parts.world, data, global_tokens, fixed)
    return {s for strategy in [*pool, fixed] for s in strategy.schemes}


def _table(rows: list[dict]) -> str:
    head = (f"{'scheme':<12} {'stage':>5} {'tp_rank':>7} {'cap_tokens':>10} {'bucket':>7} {'charged GiB':>11} "
            f"{'tracked GiB':>11} {'ratio':>6}  {'params':>7} {'grads':>7} {'optim':>7} {'acts':>7} {'temps':>7}"
            f" {'pool':>4} {'wall s':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = r["tracked_peak_bytes"] / r["charged_bytes"] if r["charged_bytes"] else float("nan")
        cats = " ".join(f"{r[f'tracked_{c}_bytes'] / GIB:>7.2f}"
                        for c in ("parameters", "gradients", "optimizer", "activations", "temporaries"))
        pool = {True: "yes", False: "no", None: "-"}[r.get("in_pool")]
        charged, tracked = r["charged_bytes"] / GIB, r["tracked_peak_bytes"] / GIB
        lines.append(f"{r['scheme']:<12} {r['stage']:>5} {r['tp_rank']:>7} {r['cap_tokens']:>10} "
                     f"{r['bucket_tokens']:>7} {charged:>11.2f} {tracked:>11.2f} "
                     f"{ratio:>6.2f}  {cats} {pool:>4} {r['wall_s']:>6.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the command line (module docstring); 0 on success."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rehearse", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="llama-7b")
    parser.add_argument("--gpus", type=int, default=8, help="ranks of the job (the fake world's size)")
    parser.add_argument("--hardware", choices=sorted(GPU_PRESETS), default="a800-80g")
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="what each rank may fill (default: the preset's memory less the trainer's reserve)")
    parser.add_argument("--max-bucket", type=int, default=1 << 20, help="the largest token bucket (power of two)")
    parser.add_argument("--all-tp-ranks", action="store_true", help="every TP rank, not only the first and last")
    parser.add_argument("--scheme", action="append", default=None,
                        help="rehearse only this scheme, e.g. '(tp2,pp1)' (repeatable)")
    parser.add_argument("--dataset", default=None, help="say which schemes the planner's pool for it uses")
    parser.add_argument("--global-tokens", type=int, default=200_000, help="global batch tokens for the pool")
    parser.add_argument("--json", action="store_true", help="one JSON object per rehearsed rank per line")
    args = parser.parse_args(argv)
    if args.gpus < 1:
        parser.error(f"--gpus must be >= 1, got {args.gpus}")
    if args.max_bucket < 64 or args.max_bucket & (args.max_bucket - 1):
        parser.error(f"--max-bucket must be a power of two >= 64, got {args.max_bucket}")
    start = time.perf_counter()
    model = llama(args.model)
    memory = None if args.memory_gib is None else args.memory_gib * GIB
    parts = trainer_parts(model, args.gpus, hardware=args.hardware, memory_bytes=memory,
                          buckets=TokenBuckets.powers_of_two(64, args.max_bucket))
    print(f"# {args.model} on {args.gpus} x {args.hardware}: {parts.memory_bytes / GIB:.1f} GiB usable per rank "
          f"(reserve {parts.reserve_bytes / GIB:.1f} GiB), caps "
          + ", ".join(f"{s.describe()}={parts.cost_model.max_tokens(s)}" for s in parts.schemes())
          + f" ({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
    pool = None
    if args.dataset:
        from passes.plan.ir import PlanError

        try:
            pool = _pool_schemes(parts, args.dataset, args.global_tokens)
            print(f"# the planner's pool for {args.dataset} uses " + ", ".join(sorted(s.describe() for s in pool)),
                  file=sys.stderr, flush=True)
        except PlanError as exc:  # e.g. --max-bucket below the data's longest sequence
            print(f"# no pool for {args.dataset}: {exc}", file=sys.stderr, flush=True)
    places = rank_places(parts, args.all_tp_ranks)
    if args.scheme:
        wanted = set(args.scheme)
        places = [p for p in places if p[0].describe() in wanted]
        if not places:
            parser.error(f"--scheme {args.scheme} names none of " + ", ".join(s.describe() for s in parts.schemes()))
    rows = []
    for i, (scheme, stage, tp_rank) in enumerate(places):
        result = rehearse_rank(parts, scheme, stage, tp_rank)
        row = result.to_json()
        row["in_pool"] = None if pool is None else scheme in pool
        rows.append(row)
        print(f"# [{i + 1}/{len(places)}] {scheme.describe()} stage {stage} tp_rank {tp_rank}: tracked "
              f"{row['tracked_peak_bytes'] / GIB:.2f} GiB, charged {row['charged_bytes'] / GIB:.2f} GiB "
              f"({row['wall_s']:.1f} s)", file=sys.stderr, flush=True)
        if args.json:
            print(json.dumps(row), flush=True)
    if not args.json:
        print(_table(rows))
    print(f"# {len(rows)} ranks rehearsed in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
