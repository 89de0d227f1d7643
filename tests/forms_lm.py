"""A small causal LM written in the forms that Hugging Face decoders use and that tensor parallelism once got
wrong or refused, two layers of them, so that one run exercises every form:

layer 0 (the ``fused`` block): a fused q/k/v projection written as ``x @ w.T + b`` (a custom linear) and sliced
with getitem (Phi-3), per-head q/k RMSNorm weights (Qwen 3), interleaved rotary
(``stack(..., -1).flatten(-2)``, GPT-J/Cohere/GLM) and eager attention with a soft cap (Gemma 2);
layer 1 (the ``olmo`` block): separate projections with an RMSNorm over the whole q and k projections (OLMo 2),
a per-head fused projection chunked after a view (GPT-NeoX) for the MLP gate, and one key/value head (multi-
query, replicated under tensor parallelism) inside a fused projection (GPT-BigCode).
Nothing here knows about packing or sharding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, HEADS, HEAD_DIM = 64, 32, 4, 8


class _Linear(nn.Module):
    """A linear written as ``x @ w.T + b`` (not F.linear)."""

    def __init__(self, n_in: int, n_out: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / math.sqrt(n_in))
        self.bias = nn.Parameter(torch.randn(n_out) * 0.1) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias


class _RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + 1e-6))


def _positions(t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(t, device=device).float()
    freqs = pos[:, None] / (10000 ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM))  # (T, D/2)
    return freqs.cos(), freqs.sin()


def _causal_mask(t: int, device: torch.device) -> torch.Tensor:
    """Additive (T, T) mask built from positions as Hugging Face builds it: causal, and within the sequence that
    positions restarting at 0 delimit (so it stays right when sequences are packed)."""
    pos = torch.arange(t, device=device)
    seq = torch.cumsum((pos.diff(prepend=pos[:1] - 1) != 1).long(), 0)
    allowed = (pos[None, :] <= pos[:, None]) & (seq[None, :] == seq[:, None])
    return torch.zeros(t, t, device=device).masked_fill(~allowed, float("-inf"))


def _interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... of the head dim; x (B, H, T, D)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class _FusedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = _RMSNorm(HIDDEN)
        self.qkv = _Linear(HIDDEN, 3 * HIDDEN)
        self.q_norm, self.k_norm = _RMSNorm(HEAD_DIM), _RMSNorm(HEAD_DIM)
        self.out = _Linear(HIDDEN, HIDDEN, bias=False)
        self.softcap = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(self.norm(x))
        q, k, v = qkv[..., :HIDDEN], qkv[..., HIDDEN:2 * HIDDEN], qkv[..., 2 * HIDDEN:]
        q = self.q_norm(q.view(b, t, HEADS, HEAD_DIM)).transpose(1, 2)
        k = self.k_norm(k.view(b, t, HEADS, HEAD_DIM)).transpose(1, 2)
        v = v.view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
        cos, sin = _positions(t, x.device)
        q, k = _interleaved_rotary(q, cos, sin), _interleaved_rotary(k, cos, sin)
        scores = torch.matmul(q, k.transpose(2, 3)) * HEAD_DIM ** -0.5
        scores = torch.tanh(scores / self.softcap) * self.softcap
        probs = F.softmax(scores + _causal_mask(t, x.device), dim=-1, dtype=torch.float32).to(q.dtype)
        y = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, HIDDEN)
        return x + self.out(y)


class _OlmoBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.kv = nn.Linear(HIDDEN, 2 * HEAD_DIM)  # one key/value head: multi-query, fused
        self.q_norm, self.k_norm = _RMSNorm(HIDDEN), _RMSNorm(HEAD_DIM)
        self.o = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.gate_up = nn.Linear(HIDDEN, 2 * 2 * HIDDEN, bias=False)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)
        self.post_attn, self.post_mlp = _RMSNorm(HIDDEN), _RMSNorm(HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q(x)).view(b, t, HEADS, HEAD_DIM).transpose(1, 2)  # norm over all heads
        k, v = self.kv(x).split(HEAD_DIM, dim=-1)
        k = self.k_norm(k).view(b, t, 1, HEAD_DIM).transpose(1, 2)
        v = v.view(b, t, 1, HEAD_DIM).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.post_attn(self.o(y.transpose(1, 2).reshape(b, t, HIDDEN)))
        gate, up = self.gate_up(x).view(b, t, HEADS, -1).chunk(2, dim=-1)  # per head: [gate | up]
        h = (F.silu(gate) * up).reshape(b, t, 2 * HIDDEN)
        return x + self.post_mlp(self.down(h))


class FormsLM(nn.Module):
    """Token embedding, the two blocks, a final norm and an untied head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([_FusedBlock(), _OlmoBlock()])
        self.norm = _RMSNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
