"""A tiny causal LM written functionally with explicit pipeline stages, used to test the runtime without
the compiler: embedding + learned positions, ``layers`` pre-norm blocks with causal attention per sequence
(SDPA on each sequence of a packed batch) and an MLP, a final norm and an LM head."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from passes.graph.tensor_parallel import ParamSlice

VOCAB, HIDDEN, HEADS, LAYERS, MAX_POS = 61, 32, 4, 4, 256


def init_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = {"emb": torch.randn(VOCAB, HIDDEN, generator=g) * 0.1, "pos": torch.randn(MAX_POS, HIDDEN, generator=g) * 0.1}
    for i in range(LAYERS):
        p[f"b{i}.ln"] = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
        p[f"b{i}.qkv"] = torch.randn(3 * HIDDEN, HIDDEN, generator=g) / math.sqrt(HIDDEN)
        p[f"b{i}.proj"] = torch.randn(HIDDEN, HIDDEN, generator=g) / math.sqrt(HIDDEN)
        p[f"b{i}.up"] = torch.randn(2 * HIDDEN, HIDDEN, generator=g) / math.sqrt(HIDDEN)
        p[f"b{i}.down"] = torch.randn(HIDDEN, 2 * HIDDEN, generator=g) / math.sqrt(2 * HIDDEN)
    p["ln_f"] = torch.ones(HIDDEN)
    p["head"] = torch.randn(VOCAB, HIDDEN, generator=g) * 0.1
    return p


def _block(p, i, x, cu):
    h = F.layer_norm(x, (HIDDEN,), p[f"b{i}.ln"])
    q, k, v = F.linear(h, p[f"b{i}.qkv"]).split(HIDDEN, dim=-1)
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        heads = [t[a:b].view(b - a, HEADS, -1).transpose(0, 1) for t in (q, k, v)]  # (heads, len, dim)
        outs.append(F.scaled_dot_product_attention(*heads, is_causal=True).transpose(0, 1).reshape(b - a, HIDDEN))
    x = x + F.linear(torch.cat(outs), p[f"b{i}.proj"])
    h = F.layer_norm(x, (HIDDEN,), p[f"b{i}.ln"])
    return x + F.linear(F.gelu(F.linear(h, p[f"b{i}.up"])), p[f"b{i}.down"])


def _positions(cu):
    return torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])


def stage_layers(stage: int, pp: int) -> list[int]:
    per = LAYERS // pp
    return list(range(stage * per, (stage + 1) * per))


class StagedProgram:
    """Stage ``stage`` of ``pp``: a StageProgram over full (tp = 1) parameters."""

    def __init__(self, stage: int, pp: int):
        self.stage, self.pp = stage, pp
        names = [n for i in stage_layers(stage, pp) for n in init_params(0) if n.startswith(f"b{i}.")]
        if stage == 0:
            names = ["emb", "pos"] + names
        if stage == pp - 1:
            names += ["ln_f", "head"]
        shapes = {n: tuple(t.shape) for n, t in init_params(0).items()}
        self.param_slices = {n: ParamSlice(name=n, full_shape=shapes[n]) for n in names}
        self.params: dict[str, torch.Tensor] = {}
        self.gate = None  # set by the runtime in a step's first forward: asked before each layer's parameters

    def bind(self, params):
        self.params = dict(params)

    def boundary_in(self, tokens):
        return [((tokens, HIDDEN), torch.float32)] if self.stage > 0 else []

    def __call__(self, ids, cu_seqlens, max_seqlen, boundary):
        return (forward_stage(self.params, self.stage, self.pp, boundary[0] if boundary else ids, cu_seqlens,
                              self.gate),)


def forward_stage(p, stage, pp, x, cu_seqlens, gate=None):
    """The stage's forward; ``gate(names)``, when given, is called before the named parameters are read."""
    def read(*names):
        if gate is not None:
            gate(names)

    if stage == 0:
        read("emb", "pos")
        x = p["emb"][x] + p["pos"][_positions(cu_seqlens)]
    for i in stage_layers(stage, pp):
        read(*(n for n in p if n.startswith(f"b{i}.")))
        x = _block(p, i, x, cu_seqlens)
    if stage == pp - 1:
        read("ln_f", "head")
        x = F.linear(F.layer_norm(x, (HIDDEN,), p["ln_f"]), p["head"])
    return x


class StagedPrograms:
    """Stage programs of the staged LM (tensor parallel degree 1 only): one per (pp, stage)."""

    def __init__(self):
        self.programs = {}

    def program(self, plan, rank):
        """The program of ``rank``'s place in ``plan``."""
        replica, stage, _ = plan.position_of(rank)
        scheme = plan.replicas[replica].scheme
        if scheme.tp != 1:
            raise ValueError(f"the staged test LM has no tensor-parallel form, got {scheme.describe()}")
        return self.programs.setdefault((scheme.pp, stage), StagedProgram(stage, scheme.pp))


def reference_loss(p, batch):
    """Single-process mean next-token loss over the whole batch (per-sequence, no packing)."""
    total, pairs = 0.0, 0
    for seq in batch:
        cu = torch.tensor([0, len(seq)], dtype=torch.int32)
        logits = forward_stage(p, 0, 1, seq, cu)
        total = total + F.cross_entropy(logits[:-1], seq[1:], reduction="sum")
        pairs += len(seq) - 1
    return total / pairs
