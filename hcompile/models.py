"""Reference models for tests and benchmarks, written in plain PyTorch the way users write them.

Owns two model families and their configs:

- ``GPT``: nanoGPT-style (learned absolute positions, LayerNorm, GELU MLP, fused QKV projection, tied
  embeddings).
- ``Llama``: LLaMA-style (RoPE computed from ``torch.arange`` positions or a ``position_ids`` argument,
  RMSNorm, SwiGLU MLP, grouped-query attention through ``enable_gqa``).

Both take ``input_ids`` of shape (batch, seq_len) and return logits (batch, seq_len, vocab); attention is
``F.scaled_dot_product_attention(..., is_causal=True)``. Nothing here knows about packing or sharding: the
compiler passes specialise these models without editing them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "LlamaConfig", "Llama", "llama_preset"]


def _check(name: str, value: int, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class GPTConfig:
    """Shape of a nanoGPT-style model."""

    vocab: int = 96
    """Vocabulary size."""
    block_size: int = 128
    """Longest sequence (learned position table size)."""
    layers: int = 2
    """Transformer blocks."""
    heads: int = 4
    """Attention heads."""
    hidden: int = 64
    """Model width; a multiple of ``heads``."""
    bias: bool = True
    """Biases in linears and LayerNorms."""

    def __post_init__(self) -> None:
        for name in ("vocab", "block_size", "layers", "heads", "hidden"):
            _check(name, getattr(self, name))
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden!r} is not a multiple of heads {self.heads!r}")


class _GPTAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.n_head = cfg.heads
        self.n_embd = cfg.hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hd)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class _GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.attn = _GPTAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.c_fc = nn.Linear(cfg.hidden, 4 * cfg.hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.hidden, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    """nanoGPT-style decoder: ``input_ids`` (B, T) -> logits (B, T, vocab)."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or GPTConfig()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.block_size, cfg.hidden)
        self.h = nn.ModuleList(_GPTBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.size()
        pos = torch.arange(0, t, dtype=torch.long, device=input_ids.device)  # (T,)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaConfig:
    """Shape of a LLaMA-style model."""

    vocab: int = 96
    """Vocabulary size."""
    layers: int = 2
    """Transformer blocks."""
    hidden: int = 64
    """Model width; a multiple of ``heads``."""
    ffn_hidden: int = 128
    """SwiGLU inner width."""
    heads: int = 4
    """Query heads."""
    kv_heads: int = 2
    """Key/value heads (grouped-query attention); divides ``heads``."""
    rope_theta: float = 10000.0
    """RoPE base."""
    eps: float = 1e-5
    """RMSNorm epsilon."""

    def __post_init__(self) -> None:
        for name in ("vocab", "layers", "hidden", "ffn_hidden", "heads", "kv_heads"):
            _check(name, getattr(self, name))
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden!r} is not a multiple of heads {self.heads!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads!r} is not a multiple of kv_heads {self.kv_heads!r}")

    @property
    def head_dim(self) -> int:
        """Width of one head."""
        return self.hidden // self.heads


def llama_preset(name: str) -> LlamaConfig:
    """The LLaMA shapes of the published profiles: ``7b``, ``13b`` or ``32b`` (multi-head attention)."""
    shapes = {
        "7b": dict(layers=32, hidden=4096, ffn_hidden=11008, heads=32),
        "13b": dict(layers=40, hidden=5120, ffn_hidden=13824, heads=40),
        "32b": dict(layers=60, hidden=6656, ffn_hidden=17920, heads=64),
    }
    if name not in shapes:
        raise ValueError(f"unknown llama preset {name!r}; known: {sorted(shapes)}")
    s = shapes[name]
    return LlamaConfig(vocab=30592, kv_heads=s["heads"], **s)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        y = y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim)  # (B, T, nh*hd)
        return self.o_proj(y)


class _LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.self_attn = _LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.gate_proj = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    """LLaMA-style decoder: ``input_ids`` (B, T) [, ``position_ids`` (B, T)] -> logits (B, T, vocab)."""

    def __init__(self, cfg: LlamaConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or LlamaConfig()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(_LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).unsqueeze(0)  # (1, T)
        freqs = position_ids[..., None].float() * self.inv_freq  # (B|1, T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B|1, T, hd)
        x = self.embed_tokens(input_ids)
        cos, sin = emb.cos()[:, None].to(x.dtype), emb.sin()[:, None].to(x.dtype)  # (B|1, 1, T, hd)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def init_weights_(model: nn.Module, seed: int = 0, std: float = 0.2) -> nn.Module:
    """Deterministic, larger-than-default init so that test differences are not hidden by tiny values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.device.type == "meta":
                continue
            p.copy_(torch.randn(p.shape, generator=gen) * std / math.sqrt(max(1, p.shape[-1] / 32)))
    return model


__all__.append("init_weights_")
__all__.append("RMSNorm")
