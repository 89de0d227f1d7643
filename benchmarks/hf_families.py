"""``python -m benchmarks.hf_families``: which Hugging Face decoder families train under TP/PP equal to one
device, and which are refused; never a silent mismatch.

Each family is a tiny random config of an unmodified ``transformers`` model (sdpa attention where the family
has it, else eager). For each strategy a fresh trainer on 4 local gloo ranks runs two SGD steps with the
strategy forced, and every parameter (not only the loss) is compared with plain single-process SGD on the same
batches. A case ends as

- ``ok``: loss and every parameter within 1e-5 (relative; 1e-6 absolute);
- ``refused``: the trainer raised before its first step changed anything (the message's first line is shown);
- ``MISMATCH``: it trained and some value differs: the defect this project must never have;
- ``error``: it failed in some other way (a crash after training began, a timeout).

Prints a table (families by strategies), appends stamped JSON lines to ``results/hf_families.jsonl``;
``--json`` prints them; exits 1 when any case is a ``MISMATCH``. ``--smoke``: three families, two strategies.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.provenance import commit

VOCAB = 64
STRATEGIES = ("4x(tp1)", "1x(tp2)+2x(tp1)", "2x(tp2)", "1x(tp2,pp2)")
SMOKE_STRATEGIES = ("2x(tp2)", "1x(tp2,pp2)")
PIPELINE_ONLY = "2x(pp2)"
"""Also run, by default, for the families tensor parallelism refuses (mixtures of experts): pipeline stages alone."""
LENS = ([14, 22, 15, 23, 13, 20, 24, 3, 9], [9, 23, 21, 2, 17, 24, 11, 6])
LR = 0.5

_LLAMA_LIKE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256)
_MHA = dict(_LLAMA_LIKE, num_key_value_heads=4)
WINDOW = 8
"""Hugging Face ``sliding_window`` (and Llama 4's chunk) of the limited families: shorter than most sequences."""
_TWO_KINDS = ["sliding_attention", "full_attention"]
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (transformers model class, config kwargs); the config class is the model's own config_class
    "llama": ("LlamaForCausalLM", _LLAMA_LIKE),
    "mistral": ("MistralForCausalLM", dict(_LLAMA_LIKE, sliding_window=WINDOW)),
    "qwen2": ("Qwen2ForCausalLM", _LLAMA_LIKE),
    "qwen3": ("Qwen3ForCausalLM", dict(_LLAMA_LIKE, head_dim=8)),
    "gpt2": ("GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=4, n_positions=256, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)),
    "phi3": ("Phi3ForCausalLM", dict(_LLAMA_LIKE, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)),
    "gpt_neox": ("GPTNeoXForCausalLM", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, max_position_embeddings=256, rotary_pct=0.5,
                                            hidden_dropout=0.0, attention_dropout=0.0)),
    "olmo": ("OlmoForCausalLM", _LLAMA_LIKE),
    "olmo2": ("Olmo2ForCausalLM", _LLAMA_LIKE),
    "gemma": ("GemmaForCausalLM", dict(_LLAMA_LIKE, head_dim=8)),
    "gemma2": ("Gemma2ForCausalLM", dict(_LLAMA_LIKE, head_dim=8, sliding_window=WINDOW, query_pre_attn_scalar=8)),
    "gemma3": ("Gemma3ForCausalLM", dict(_LLAMA_LIKE, head_dim=8, sliding_window=WINDOW, query_pre_attn_scalar=8,
                                         layer_types=_TWO_KINDS)),
    "granite": ("GraniteForCausalLM", _LLAMA_LIKE),
    "starcoder2": ("Starcoder2ForCausalLM", dict(_LLAMA_LIKE, residual_dropout=0.0, embedding_dropout=0.0,
                                                 sliding_window=WINDOW)),
    "stablelm": ("StableLmForCausalLM", dict(_LLAMA_LIKE, partial_rotary_factor=0.5, hidden_dropout=0.0)),
    "stablelm_qk_norm": ("StableLmForCausalLM", dict(_LLAMA_LIKE, partial_rotary_factor=0.5, hidden_dropout=0.0,
                                                     qk_layernorm=True)),
    "phi": ("PhiForCausalLM", dict(_MHA, resid_pdrop=0.0, embd_pdrop=0.0, partial_rotary_factor=0.5)),
    "cohere": ("CohereForCausalLM", dict(_LLAMA_LIKE, use_qk_norm=False)),
    "cohere_qk_norm": ("CohereForCausalLM", dict(_MHA, use_qk_norm=True)),
    "helium": ("HeliumForCausalLM", dict(_LLAMA_LIKE, head_dim=8)),
    "smollm3": ("SmolLM3ForCausalLM", _LLAMA_LIKE),
    "glm": ("GlmForCausalLM", dict(_LLAMA_LIKE, head_dim=8)),
    "nemotron": ("NemotronForCausalLM", dict(_LLAMA_LIKE, head_dim=8, partial_rotary_factor=0.5)),
    "gptj": ("GPTJForCausalLM", dict(n_embd=32, n_layer=2, n_head=4, n_positions=256, rotary_dim=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "gpt_bigcode": ("GPTBigCodeForCausalLM", dict(n_embd=32, n_layer=2, n_head=4, n_positions=256,
                                                  multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0,
                                                  attn_pdrop=0.0)),
    "opt": ("OPTForCausalLM", dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                   max_position_embeddings=256, word_embed_proj_dim=32, dropout=0.0,
                                   attention_dropout=0.0)),
    "codegen": ("CodeGenForCausalLM", dict(n_embd=32, n_layer=2, n_head=4, n_positions=256, rotary_dim=4,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "falcon": ("FalconForCausalLM", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         new_decoder_architecture=True, num_kv_heads=2, max_position_embeddings=256,
                                         hidden_dropout=0.0, attention_dropout=0.0, alibi=False)),
    "bloom": ("BloomForCausalLM", dict(hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0,
                                       attention_dropout=0.0)),
    "exaone4": ("Exaone4ForCausalLM", dict(_LLAMA_LIKE, head_dim=8, sliding_window=WINDOW, sliding_window_pattern=2)),
    "seed_oss": ("SeedOssForCausalLM", dict(_LLAMA_LIKE, head_dim=8, attention_dropout=0.0, residual_dropout=0.0)),
    "arcee": ("ArceeForCausalLM", _LLAMA_LIKE),
    "apertus": ("ApertusForCausalLM", dict(_LLAMA_LIKE, head_dim=8)),
    "olmo3": ("Olmo3ForCausalLM", dict(_LLAMA_LIKE, sliding_window=WINDOW)),
    "ernie4_5": ("Ernie4_5ForCausalLM", dict(_LLAMA_LIKE, head_dim=8)),
    # attention limited to a window, to chunks, or given sinks (every layer, or per layer_types)
    "qwen2_swa": ("Qwen2ForCausalLM", dict(_LLAMA_LIKE, use_sliding_window=True, sliding_window=WINDOW,
                                           max_window_layers=1)),
    "qwen3_swa": ("Qwen3ForCausalLM", dict(_LLAMA_LIKE, head_dim=8, use_sliding_window=True, sliding_window=WINDOW,
                                           max_window_layers=1)),
    "phi3_swa": ("Phi3ForCausalLM", dict(_LLAMA_LIKE, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                                         sliding_window=20)),  # longer than the old 16-token probe's sequences
    "cohere2": ("Cohere2ForCausalLM", dict(_LLAMA_LIKE, sliding_window=WINDOW, layer_types=_TWO_KINDS)),
    "llama4_chunked": ("Llama4ForCausalLM", dict(_LLAMA_LIKE, head_dim=8, attention_chunk_size=WINDOW,
                                                 intermediate_size_mlp=64, moe_layers=[],
                                                 layer_types=["chunked_attention", "full_attention"],
                                                 no_rope_layers=[1, 0], attention_dropout=0.0)),
    "granite_swa": ("GraniteSWAForCausalLM", dict(_LLAMA_LIKE, sliding_window=WINDOW, layer_types=_TWO_KINDS)),
    "granitemoe_swa": ("GraniteMoeSWAForCausalLM", dict(_LLAMA_LIKE, sliding_window=WINDOW, layer_types=_TWO_KINDS,
                                                        **_MOE)),
    "gpt_oss": ("GptOssForCausalLM", dict(_LLAMA_LIKE, head_dim=8, sliding_window=WINDOW, layer_types=_TWO_KINDS,
                                          **_MOE)),
    # mixtures of experts
    "mixtral": ("MixtralForCausalLM", dict(_LLAMA_LIKE, **_MOE)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(_LLAMA_LIKE, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    "olmoe": ("OlmoeForCausalLM", dict(_LLAMA_LIKE, num_experts=4, num_experts_per_tok=2)),
    # position biases
    "mpt": ("MptForCausalLM", dict(d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=256)),
    "falcon_alibi": ("FalconForCausalLM", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                               new_decoder_architecture=True, num_kv_heads=2,
                                               max_position_embeddings=256, hidden_dropout=0.0,
                                               attention_dropout=0.0, alibi=True)),
}
SMOKE_FAMILIES = ("llama", "qwen3", "gpt2")
MIXTURES_OF_EXPERTS = ("gpt_oss", "granitemoe_swa", "mixtral", "qwen2_moe", "olmoe")


@dataclass(frozen=True, slots=True)
class Case:
    """One family under one strategy."""

    family: str
    strategy: str
    outcome: str
    """``ok``, ``refused``, ``MISMATCH`` or ``error``."""
    detail: str
    """The worst relative difference (ok, MISMATCH), or the error's first line."""
    seconds: float
    """The family's job time over its number of strategies."""


def make_model(family: str) -> torch.nn.Module:
    """The family's tiny random model (seed 0, no dropout), sdpa attention where it has it."""
    import transformers

    cls_name, kwargs = FAMILIES[family]
    cls = getattr(transformers, cls_name)
    torch.manual_seed(0)
    for attn in ("sdpa", "eager"):
        config = cls.config_class(vocab_size=VOCAB, attn_implementation=attn, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, **kwargs)
        try:
            return cls(config)
        except ValueError as e:  # the family has no sdpa path
            if attn == "eager" or "attention implementation" not in str(e):
                raise
    raise AssertionError("unreachable")


def batches() -> list[list[torch.Tensor]]:
    """The global batches every case trains on."""
    g = torch.Generator().manual_seed(21)
    return [[torch.randint(0, VOCAB, (n,), generator=g) for n in lens] for lens in LENS]


def reference(family: str) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Plain single-process SGD: per step the mean next-token loss over the batch; losses and parameters."""
    model = make_model(family)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, states = [], []
    for batch in batches():
        pairs = sum(len(s) - 1 for s in batch)
        loss = sum(F.cross_entropy(model(s[None]).logits[0, :-1], s[1:], reduction="sum") for s in batch) / pairs
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        states.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, states


def _train(rank: int, world: int, family: str, strategies: list[str]) -> list[dict]:
    """One rank: per strategy, a trainer forced to it (all over one compiled model, so captures are shared);
    what happened before and after its first step."""
    import hcompile
    from passes.graph.variant import TokenBuckets

    compiled = hcompile.compile(make_model(family), buckets=TokenBuckets.powers_of_two(16, 128))
    out = []
    for strategy in strategies:
        steps: list = []
        try:
            trainer = compiled.trainer(loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": LR},
                                       strategies=[strategy], tokens_per_rank=24, calibrate=False)
            for batch in batches():
                stats = trainer.train_step(batch, strategy=strategy)
                steps.append((stats.loss, trainer.full_state_dict()))
        except Exception as e:  # noqa: BLE001 - what failed, and when, is the result
            out.append({"steps": steps, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"})
            continue
        out.append({"steps": steps, "error": None})
    return out


def _compare(steps: list, ref_losses: list[float], ref_states: list[dict]) -> tuple[bool, str]:
    worst, where = 0.0, ""
    for i, (loss, state) in enumerate(steps):
        err = abs(loss - ref_losses[i]) / max(abs(ref_losses[i]), 1e-12)
        if err > worst:
            worst, where = err, f"loss at step {i}"
        for name, want in ref_states[i].items():
            got = state[name]
            diff = float(((got - want).abs() - 1e-6).clamp(min=0).max() / want.abs().max().clamp(min=1e-12))
            if diff > worst:
                worst, where = diff, f"{name} after step {i}"
    return worst <= 1e-5, f"{worst:.1e} ({where})" if where else "0"


def run_family(family: str, strategies: list[str], timeout_s: float) -> list[Case]:
    """``family`` under each strategy on 4 local gloo ranks (one job) against single-process SGD."""
    from hcompile.tools.spawn import RankError, run_local_ranks

    started = time.perf_counter()
    try:
        results = run_local_ranks(4, _train, family, strategies, timeout_s=timeout_s)
    except RankError as e:
        seconds = time.perf_counter() - started
        return [Case(family, s, "error", str(e).strip().splitlines()[-1][:300], seconds) for s in strategies]
    seconds = (time.perf_counter() - started) / len(strategies)
    ref_losses, ref_states = reference(family)
    cases = []
    for i, strategy in enumerate(strategies):
        per_rank = [r[i] for r in results]
        errors = {r["error"] for r in per_rank if r["error"]}
        trained = max(len(r["steps"]) for r in per_rank)
        if errors and trained == 0:
            outcome, detail = "refused", sorted(errors)[0]
        elif errors:
            outcome, detail = "error", f"after {trained} step(s): {sorted(errors)[0]}"
        else:
            checks = [_compare(r["steps"], ref_losses, ref_states) for r in per_rank]
            outcome = "ok" if all(ok for ok, _ in checks) else "MISMATCH"
            detail = max((d for _, d in checks), key=lambda d: float(d.split()[0]))
        cases.append(Case(family, strategy, outcome, detail, seconds))
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hf_families", description=__doc__.split("\n")[0])
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES), help="repeat; default: all")
    parser.add_argument("--strategy", action="append", help=f"repeat; default: {', '.join(STRATEGIES)}")
    parser.add_argument("--smoke", action="store_true", help="three families, two strategies (CI)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per family (all its strategies)")
    parser.add_argument("--json", action="store_true", help="print the JSON lines")
    args = parser.parse_args(argv)
    families = args.family or (SMOKE_FAMILIES if args.smoke else tuple(FAMILIES))
    strategies = args.strategy or (SMOKE_STRATEGIES if args.smoke else STRATEGIES)
    os.environ.setdefault("HCOMPILE_TIMEOUT_S", "60")  # a rank left waiting on a failed peer gives up soon
    cases = []
    for family in families:
        extra = [PIPELINE_ONLY] if not args.strategy and not args.smoke and family in MIXTURES_OF_EXPERTS else []
        for case in run_family(family, [*strategies, *extra], args.timeout_s):
            cases.append(case)
            print(f"{family:<18} {case.strategy:<16} {case.outcome:<9} {case.seconds:6.1f}s  {case.detail}", flush=True)
    stamp = {"commit": commit(), "torch": torch.__version__, "transformers": _transformers_version()}
    lines = [json.dumps({**asdict(c), **stamp}) for c in cases]
    out = Path("results/hf_families.jsonl")
    out.parent.mkdir(exist_ok=True)
    with out.open("a") as f:
        f.writelines(line + "\n" for line in lines)
    if args.json:
        print("\n".join(lines))
    counts = {o: sum(c.outcome == o for c in cases) for o in ("ok", "refused", "MISMATCH", "error")}
    print(" ".join(f"{k}={v}" for k, v in counts.items()))
    return 1 if counts["MISMATCH"] else 0


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    sys.exit(main())
