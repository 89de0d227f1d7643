"""A complete training script, the way users write one:

    hcompile launch --nproc 4 benchmarks/train_tiny.py --steps 5
    torchrun --nproc-per-node 4 benchmarks/train_tiny.py      # the same under torchrun

Every rank builds the same tiny LLaMA-style model and the same global batches (lengths drawn from the
real python-code histogram, scaled to the model's context); the planner chooses a strategy per step.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import hcompile
from hcompile.models import Llama, LlamaConfig, init_weights_
from passes.datasets import load_dataset, sample_batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per global batch")
    parser.add_argument("--max-tokens", type=int, default=256, help="per-rank token cap")
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig(layers=2, hidden=64, ffn_hidden=128, heads=4, kv_heads=2, vocab=128)
    model = hcompile.compile(init_weights_(Llama(cfg), seed=0), loss="causal_lm", optimizer=torch.optim.AdamW,
                             optimizer_kwargs={"lr": 1e-3}, strategies="auto", max_tokens=args.max_tokens)
    data = load_dataset("python-code")
    scale = 4 * args.max_tokens / data.max_len  # the longest file needs every rank's memory
    lengths = sample_batches(data, int(args.tokens / scale), args.steps, seed=0)
    rng = np.random.default_rng(0)
    batches = [[torch.from_numpy(rng.integers(0, cfg.vocab, max(2, int(n * scale)))) for n in step]
               for step in lengths]
    for i, batch in enumerate(batches):
        stats = model.train_step(batch, next_batch=batches[i + 1] if i + 1 < len(batches) else None)
        if torch.distributed.get_rank() == 0:
            print(f"step {i}: loss {stats.loss:.4f} tokens {stats.tokens} strategy {stats.strategy} "
                  f"busy ms per rank {[round(b) for b in stats.busy_ms]}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
