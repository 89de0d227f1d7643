"""A complete training script, the way users write one: an unmodified Hugging Face model, real text, a loss
that falls.

    python benchmarks/train_tiny.py                                 # one process: a world of one
    hcompile launch --nproc 4 benchmarks/train_tiny.py --steps 30   # 4 local ranks (gloo)
    torchrun --nproc-per-node 4 benchmarks/train_tiny.py           # the same under torchrun

Every rank builds the same small ``transformers.LlamaForCausalLM`` (sdpa attention, grouped-query heads) and
reads the same global batches: the running Python's standard library sources, one document per function or
class, as byte tokens, shuffled with a fixed seed. The planner picks a heterogeneous strategy per step; a
checkpoint (``--save``) keeps the data position, so ``--resume`` continues with the very next batch.
"""

from __future__ import annotations

import argparse
import os

import torch

import hcompile
from hcompile.data import ByteTokenizer, Corpus, TokenBatches, python_stdlib
from passes.plan.datasets import LengthDataset


def build_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per global batch")
    parser.add_argument("--max-tokens", type=int, default=256, help="per-rank token cap")
    parser.add_argument("--save", help="checkpoint folder written after the last step")
    parser.add_argument("--resume", help="checkpoint folder to continue from")
    args = parser.parse_args()
    corpus = Corpus.from_paths(python_stdlib(), split_python=True)
    # documents longer than two ranks' cap are cut: the longest need a tp2 replica, most fit one rank
    ranks = int(os.environ.get("WORLD_SIZE", 1))  # what the launcher starts; a plain process is one rank
    data = TokenBatches(corpus, ByteTokenizer(), tokens_per_batch=args.tokens, max_len=min(2, ranks) * args.max_tokens,
                        seed=0)
    lengths = LengthDataset.from_lengths("stdlib", [len(s) for doc in corpus.documents for s in data.sequences(doc)])
    trainer = hcompile.compile(build_model()).trainer(loss="causal_lm", optimizer=torch.optim.AdamW,
                               optimizer_kwargs={"lr": 3e-3}, strategies="auto", tokens_per_rank=args.max_tokens,
                               dataset=lengths)  # the strategy pool is built from the data's lengths
    start = 0
    if args.resume:
        meta = trainer.load(args.resume)
        data.load_state_dict(meta["data_position"])
        start = meta["step"]
    def report(step: int, stats) -> None:
        if trainer.ctx.rank == 0:
            print(f"step {start + step}: loss {stats.loss:.4f}  {stats.tokens} tokens  {stats.strategy}  "
                  f"planned {'while the previous step ran' if stats.plan_hidden else 'before it'}", flush=True)

    trainer.fit(data, steps=args.steps, on_step=report)  # each batch planned while the previous one trains
    if args.save:  # fit takes no batch past its last step: the position is the first batch not trained on
        trainer.save(args.save, step=start + args.steps, data_position=data.state_dict())


if __name__ == "__main__":
    main()
