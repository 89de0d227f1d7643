"""Part (c) of ``python -m benchmarks.device_check``: a world-of-one training run of a ~125M LLaMA through the
whole stack (capture, packed attention, compiled variants, the runtime), against the same model in fp32 eager.

Owns :data:`LLAMA_125M`, the step batches (one fixed token stream cut into a different number of sequences each
step, so a recompilation on the sequence count would show and the loss falls as the stream is learnt), the
reference (:func:`reference_losses`: the model itself, fp32, eager, one sequence at a time, AdamW, the loss
divided by the batch's next-token pair count as the runtime divides it), the model FLOPs of a step
(:func:`step_flops`: 6 x the parameters that multiply x tokens, plus 3 x the causal attention FLOPs of every
layer) and :func:`run_training`, which trains ``hcompile.compile(model, compile_backend=...)`` with the
trainer's ``param_dtype`` on the same batches and returns a :class:`TrainRun` (losses, compilations after each
step, synchronised step times, and which packed-attention kernels ran: :func:`kernel_calls` counts the calls that
``codegen.op`` dispatches to each kernel). Runs on the CPU too (the tests use a tiny model, fp32, ``aot_eager``).
"""

from __future__ import annotations

import contextlib
import copy
import random
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import hcompile
from benchmarks.attention import attention_flops
from hcompile.models import Llama, LlamaConfig
from passes.graph.variant import TokenBuckets

__all__ = ["LLAMA_125M", "TrainSetup", "TrainRun", "step_batches", "init_small_", "matmul_params", "step_flops",
           "reference_losses", "kernel_calls", "run_training"]

LLAMA_125M = LlamaConfig(vocab=32000, layers=12, hidden=768, ffn_hidden=2048, heads=12, kv_heads=4)
"""124.7M parameters (untied embeddings, grouped-query attention with 4 kv heads, head dim 64)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSetup:
    """What one training run does."""

    model: LlamaConfig = LLAMA_125M
    """The model's shape."""
    tokens: int = 8192
    """Tokens per step: one micro-batch, the only token bucket (so one variant is compiled)."""
    steps: int = 5
    """Steps; the first includes the warm-up compilation and is left out of the throughput."""
    lr: float = 1e-3
    """AdamW's learning rate."""
    seed: int = 0
    """Seed of the weights and the token stream."""
    compile_backend: str = "inductor"
    """``hcompile.compile``'s backend for the variants."""
    param_dtype: torch.dtype = torch.bfloat16
    """The trainer's compute copies (master weights and optimiser state stay fp32)."""

    def __post_init__(self) -> None:
        if self.steps < 2:
            raise ValueError(f"steps must be at least 2 (the first warms up), got {self.steps!r}")
        if self.tokens < 4 * self.steps:
            raise ValueError(f"tokens {self.tokens!r} are too few to cut into {self.steps + 1} sequences")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainRun:
    """What a training run measured, per step."""

    losses: tuple[float, ...]
    """The trainer's loss of each step."""
    reference: tuple[float, ...]
    """The fp32 eager model's loss of each step."""
    compilations: tuple[int, ...]
    """``StepStats.compilations`` after each step (compilations so far)."""
    step_s: tuple[float, ...]
    """Wall time of each step, the device synchronised before and after."""
    tokens: tuple[int, ...]
    """Tokens of each step."""
    flops: tuple[float, ...]
    """Model FLOPs of each step (:func:`step_flops`)."""
    params: int
    """Parameters of the model."""
    kernel_calls: tuple[tuple[str, int], ...]
    """(kernel, packed-attention forward calls) during the trainer's steps (warm-up included)."""

    def kernels_run(self) -> tuple[str, ...]:
        """The packed-attention kernels that ran."""
        return tuple(kernel for kernel, calls in self.kernel_calls if calls > 0)

    def loss_errors(self) -> tuple[float, ...]:
        """Per step, ``|loss - reference| / |reference|``."""
        return tuple(abs(got - want) / max(abs(want), 1e-12) for got, want in zip(self.losses, self.reference))

    def compilations_after_warmup(self) -> int:
        """Compilations after the first step."""
        return self.compilations[-1] - self.compilations[0]

    def tokens_per_s(self) -> float:
        """Throughput of the steps after the first."""
        return sum(self.tokens[1:]) / sum(self.step_s[1:])

    def achieved_tflops(self) -> float:
        """Model TFLOP/s of the steps after the first."""
        return sum(self.flops[1:]) / sum(self.step_s[1:]) / 1e12

    def mfu(self, peak_tflops: float) -> float:
        """Model FLOPs utilisation against a peak of ``peak_tflops``."""
        return self.achieved_tflops() / peak_tflops


def step_batches(setup: TrainSetup) -> list[list[torch.Tensor]]:
    """Per step, one fixed stream of ``setup.tokens`` token ids cut into 2 + (3 i mod ``steps``) sequences of at
    least 2 tokens at random places (host tensors)."""
    generator = torch.Generator().manual_seed(setup.seed + 1)
    stream = torch.randint(0, setup.model.vocab, (setup.tokens,), generator=generator)
    rng = random.Random(setup.seed)
    batches = []
    for step in range(setup.steps):
        pieces = 2 + (3 * step) % setup.steps
        cuts = sorted(rng.sample(range(1, setup.tokens // 2), pieces - 1))
        edges = [0, *(2 * c for c in cuts), setup.tokens]  # even cuts: every piece holds 2 tokens or more
        batches.append([stream[a:b] for a, b in zip(edges[:-1], edges[1:])])
    return batches


def init_small_(model: nn.Module, seed: int, std: float = 0.02) -> nn.Module:
    """Deterministic GPT-style init: every matrix drawn from N(0, std^2), vectors (norm scales) left alone."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    return model


def matmul_params(model: nn.Module) -> int:
    """Parameters that multiply: every matrix but the embedding tables (a lookup is no FLOPs)."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in tables)


def step_flops(cfg: LlamaConfig, multiplying: int, lengths: Sequence[int]) -> float:
    """Model FLOPs of a training step: 6 x ``multiplying`` parameters x tokens (forward 2, backward 4) plus, per
    layer, 3 x the forward FLOPs of causal attention over each sequence."""
    lengths = list(lengths)
    attention = attention_flops(lengths, cfg.heads, cfg.head_dim, causal=True)
    return 6.0 * multiplying * sum(lengths) + 3.0 * cfg.layers * attention


def reference_losses(model: nn.Module, batches: Sequence[Sequence[torch.Tensor]], lr: float,
                     device: torch.device) -> list[float]:
    """Each step's loss of a copy of ``model`` trained in fp32, eager, one sequence at a time, with AdamW."""
    net = copy.deepcopy(model).to(device=device, dtype=torch.float32)
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr)
    losses = []
    for batch in batches:
        pairs = sum(len(s) - 1 for s in batch)
        loss = sum(F.cross_entropy(net(s[None].to(device))[0, :-1], s[1:].to(device), reduction="sum")
                   for s in batch if len(s) > 1) / pairs
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    del net, optimizer
    return losses


_KERNEL_FUNCTIONS = {"triton": "triton_forward", "cpu-flash": "cpu_flash_forward", "reference": "reference_forward"}
"""The functions of ``codegen.op`` its forward op dispatches to, by kernel."""


@contextlib.contextmanager
def kernel_calls() -> Iterator[dict[str, int]]:
    """While open, counts the packed-attention forward calls per kernel (the custom op's implementation looks
    its kernel functions up in ``codegen.op`` at each call, compiled or not; they are wrapped, then restored)."""
    import codegen.op as op

    counts = dict.fromkeys(_KERNEL_FUNCTIONS, 0)
    saved = {kernel: getattr(op, name) for kernel, name in _KERNEL_FUNCTIONS.items()}

    def counting(kernel: str, function: Callable) -> Callable:
        def call(*args, **kwargs):
            counts[kernel] += 1
            return function(*args, **kwargs)
        return call

    try:
        for kernel, name in _KERNEL_FUNCTIONS.items():
            setattr(op, name, counting(kernel, saved[kernel]))
        yield counts
    finally:
        for kernel, name in _KERNEL_FUNCTIONS.items():
            setattr(op, name, saved[kernel])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_training(setup: TrainSetup) -> TrainRun:
    """Train the model of ``setup`` with the trainer and with the fp32 eager reference, on the same batches."""
    model = init_small_(Llama(setup.model), seed=setup.seed)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    batches = step_batches(setup)
    reference = reference_losses(model, batches, setup.lr, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    compiled = hcompile.compile(model, compile_backend=setup.compile_backend,
                                buckets=TokenBuckets(sizes=(setup.tokens,)))
    trainer = compiled.trainer(loss="causal_lm", optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": setup.lr},
                               strategies=["1x(tp1)"], tokens_per_rank=setup.tokens, param_dtype=setup.param_dtype)
    losses, compilations, step_s = [], [], []
    with kernel_calls() as calls:
        for batch in batches:
            _synchronize(device)
            started = time.perf_counter()
            stats = trainer.train_step(batch)
            _synchronize(device)
            step_s.append(time.perf_counter() - started)
            losses.append(stats.loss)
            compilations.append(stats.compilations)
    multiplying = matmul_params(model)
    return TrainRun(losses=tuple(losses), reference=tuple(reference), compilations=tuple(compilations),
                    step_s=tuple(step_s), tokens=tuple(sum(len(s) for s in b) for b in batches),
                    flops=tuple(step_flops(setup.model, multiplying, [len(s) for s in b]) for b in batches),
                    params=sum(p.numel() for p in model.parameters()), kernel_calls=tuple(calls.items()))
