"""Llama-family building blocks shared by the target runner and the drafters.

Owns RMSNorm, rotary embeddings (default, linear, dynamic-NTK, YaRN, Llama-3 scaling), the
attention projection block (GQA, optional q/k/v bias, optional Qwen3 q/k norm) and the SwiGLU MLP.
The score/softmax part of attention is delegated to an :class:`AttentionBackend` so the same
layer runs over a static KV cache with a tree mask (rollout), over packed documents (training) or
over a plain causal sequence.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tlt.drafter.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., dim]
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _inv_freq(rope: dict, head_dim: int, max_pos: int, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the cos/sin scale for one RoPE variant."""
    base = float(rope["rope_theta"])
    dim = head_dim
    exps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    kind = rope.get("rope_type", "default")
    scale = 1.0
    if kind == "dynamic":
        # NTK-aware base stretch once the sequence outgrows the trained context.
        factor = float(rope["factor"])
        seq = max(seq_len or max_pos, max_pos)
        base = base * ((factor * seq / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    inv = 1.0 / (base ** exps)
    if kind == "linear":
        inv = inv / float(rope["factor"])
    elif kind == "llama3":
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        inv = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        orig = float(rope["original_max_position_embeddings"])
        factor = float(rope.get("factor") or max_pos / orig)
        mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")

        def get_mscale(s: float, m: float = 1.0) -> float:
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        scale = rope.get("attention_factor") or (
            get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
            if mscale and mscale_all else get_mscale(factor)
        )
        beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

        def corr_dim(rot: float) -> float:
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
        if rope.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        extrap = 1 - ramp
        inv = (inv / factor) * (1 - extrap) + inv * extrap
    return inv, float(scale)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for explicit position ids (tree nodes get depth-based positions)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.rope = dict(cfg.rope_parameters)
        self.head_dim = cfg.head_dim
        self.max_pos = cfg.max_position_embeddings
        inv, scale = _inv_freq(self.rope, cfg.head_dim, cfg.max_position_embeddings, None)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.scale = scale

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids: [B, T] -> cos, sin: [B, T, head_dim]
        inv = self.inv_freq
        if self.rope.get("rope_type") == "dynamic":
            seq_len = int(position_ids.max()) + 1
            if seq_len > self.max_pos:
                inv, _ = _inv_freq(self.rope, self.head_dim, self.max_pos, seq_len)
                inv = inv.to(position_ids.device)
        freqs = position_ids.float()[..., None] * inv.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, heads, T, D]; cos/sin: [B, T, D]
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class AttentionBackend(Protocol):
    """Turns projected, rotated q/k/v of one layer into the attention output.

    Implementations own where keys/values live (a static KV cache, packed documents, earlier
    training-time-test steps) and which keys each query may see.
    """

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [B, H, T, D]; k, v: [B, KV, T, D] -> [B, H, T, D]
        ...


class CausalBackend:
    """Plain causal attention within the given tokens, optionally with an additive mask."""

    def __init__(self, mask: torch.Tensor | None = None) -> None:
        self.mask = mask  # [B, 1, T, T] additive float, or None for causal

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask.to(q.dtype), enable_gqa=True)


class Attention(nn.Module):
    """Projection half of self-attention; ``input_size`` differs from hidden for EAGLE-3 (2H)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, input_size: int | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d_in = input_size or cfg.hidden_size
        self.q_proj = nn.Linear(d_in, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d_in, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d_in, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        # x: [B, T, d_in] -> [B, T, hidden]
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        out = backend(self.layer_idx, q, k, v.transpose(1, 2))
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer; HF parameter names (``self_attn``, ``mlp``, ``*_layernorm``)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        # x: [B, T, H] -> [B, T, H]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend)
        return x + self.mlp(self.post_attention_layernorm(x))
