"""The Qwen2 of the CosyVoice2 LLM (`Qwen2LM.llm`, keys `llm.model.*`): our own code, Hugging Face key names.

Why our own Qwen2 and not transformers: transformers 5.x attends wrongly in the official one-position KV-cache
decode call, and the exported graphs must be plain, shape-dynamic ONNX. Every size comes from the release's
`CosyVoice-BlankEN/config.json`; options we do not implement (another activation, sliding windows, rope scaling)
are refused rather than approximated. The layers take the causal mask, rotary tables and per-layer caches from
`Qwen2LM.forward` (llm.py), which owns positions and the cache layout of the graphs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cosyedge.device.errors import ReleaseError


@dataclass(frozen=True)
class Qwen2Config:
    """The Qwen2 body sizes, read from `CosyVoice-BlankEN/config.json`."""
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool

    @classmethod
    def from_json(cls, cfg: dict[str, Any]) -> "Qwen2Config":
        name = "CosyVoice-BlankEN/config.json"
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            config = cls(
                hidden_size=hidden,
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            )
        except KeyError as exc:
            raise ReleaseError(f"{name}: missing key {exc.args[0]!r}") from None
        if config.num_heads % config.num_kv_heads:
            raise ReleaseError(f"{name}: num_attention_heads {heads} is not a multiple of num_key_value_heads")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ReleaseError(f"{name}: hidden_act {cfg['hidden_act']!r} is not supported (expected 'silu')")
        if cfg.get("use_sliding_window"):
            raise ReleaseError(f"{name}: use_sliding_window is not supported")
        if cfg.get("rope_scaling"):
            raise ReleaseError(f"{name}: rope_scaling is not supported")
        return config


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Qwen2Attention(nn.Module):
    """Grouped-query attention: queries are grouped per key/value head, so K/V are never repeated."""

    def __init__(self, c: Qwen2Config) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=True)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=True)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=True)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor,
                past_key: torch.Tensor | None, past_value: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, k, v, _ = self.attend(x, cos, sin, allowed, past_key, past_value)
        return out, k, v

    def attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor,
               past_key: torch.Tensor | None, past_value: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward` and its attention weights [b, KV, group, n, P + n] (the word-timing pass reads them)."""
        c = self.c
        b, n = x.shape[0], x.shape[1]
        q = self.q_proj(x).reshape(b, n, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).reshape(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).reshape(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if past_key is not None:
            k = torch.cat((past_key, k), dim=2)
            v = torch.cat((past_value, v), dim=2)
        group = c.num_heads // c.num_kv_heads
        qg = q.reshape(b, c.num_kv_heads, group, n, c.head_dim)           # head h -> kv head h // group
        scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * (1.0 / math.sqrt(c.head_dim))
        # `where`, not an additive -inf: a fully padded query row stays finite instead of NaN.
        scores = torch.where(allowed, scores, torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores, dim=-1)
        out = torch.matmul(weights, v.unsqueeze(2))  # [b, kv, group, n, d]
        out = out.reshape(b, c.num_heads, n, c.head_dim).transpose(1, 2).reshape(b, n, c.num_heads * c.head_dim)
        return self.o_proj(out), k, v, weights


class Qwen2MLP(nn.Module):
    def __init__(self, c: Qwen2Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, c: Qwen2Config) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(c)
        self.mlp = Qwen2MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor,
                past_key: torch.Tensor | None, past_value: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, k, v, _ = self.attend(x, cos, sin, allowed, past_key, past_value)
        return x, k, v

    def attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor,
               past_key: torch.Tensor | None, past_value: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward` and the layer's attention weights (`Qwen2Attention.attend`)."""
        attn, k, v, weights = self.self_attn.attend(self.input_layernorm(x), cos, sin, allowed, past_key, past_value)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), k, v, weights


class Qwen2Body(nn.Module):
    """`llm.model.model`: text embedding table, decoder layers, final norm."""

    def __init__(self, c: Qwen2Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class TextHead(nn.Module):
    """`llm.model.lm_head`: held only so that official checkpoints load strictly; never computed."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


class Qwen2CausalLM(nn.Module):
    """`llm.model`: the Hugging Face Qwen2ForCausalLM layout (body + text head)."""

    def __init__(self, c: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2Body(c)
        head = self.model.embed_tokens.weight if c.tie_word_embeddings else \
            nn.Parameter(torch.empty(c.vocab_size, c.hidden_size).normal_(0.0, 0.02))
        self.lm_head = TextHead(head)


class Qwen2Encoder(nn.Module):
    """`llm`: the official wrapper around Qwen2ForCausalLM."""

    def __init__(self, c: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2CausalLM(c)
