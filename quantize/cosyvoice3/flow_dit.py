"""Fun-CosyVoice3 flow estimator: the DiT (`cosyvoice.flow.DiT.dit.DiT`) as our own torch module.

Official key names under `decoder.estimator.` so `flow.pt` loads strictly; every width from the yaml. What the
network does (facts sheet B2), and the two details a re-implementation easily gets wrong:

* input: Linear(concat[x, cond, mu, spks] -> dim), plus a causal grouped-conv position embedding
  (2 x [left pad k-1, Conv1d(k, groups), Mish]);
* time: 256-wide sinusoid of 1000 t -> Linear, SiLU, Linear; every block is AdaLN-Zero (6 chunks: shift, scale,
  gate for attention and for the FFN) with non-affine LayerNorm eps 1e-6; the final norm takes scale THEN shift;
* RoPE (x-transformers, interleaved pairs) is applied to the full-width q and k BEFORE the head split, so only
  the first `dim_head` channels (head 0) are rotated - an official quirk reproduced on purpose;
* attention masks: full, or chunk-causal over `static_chunk_size` frames when streaming (every earlier chunk
  visible: the official DiT hard-codes num_decoding_left_chunks -1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cosyedge.device.errors import ReleaseError
from cosyedge.quantize.cosyvoice2.flow_config import attention_visible

DIT_TARGET = "cosyvoice.flow.DiT.dit.DiT"
FREQ_EMBED_DIM = 256        # hard-coded in the official TimestepEmbedding
TIME_SCALE = 1000.0         # SinusPositionEmbedding scale
CONV_POS_KERNEL = 31        # hard-coded in the official InputEmbedding
CONV_POS_GROUPS = 16
LN_EPS = 1e-6
ROPE_BASE = 10000.0


@dataclass(frozen=True)
class DiTConfig:
    dim: int
    depth: int
    heads: int
    dim_head: int
    ff_mult: int
    mel_dim: int
    mu_dim: int
    spk_dim: int
    out_channels: int
    static_chunk_size: int

    @classmethod
    def from_node(cls, est: Any, yaml_name: str) -> "DiTConfig":
        if getattr(est, "target", None) != DIT_TARGET:
            raise ReleaseError(f"{yaml_name}: flow.decoder.estimator is {getattr(est, 'target', None)!r}, "
                               f"expected {DIT_TARGET!r}")
        try:
            c = cls(**{k: int(est[k]) for k in ("dim", "depth", "heads", "dim_head", "ff_mult", "mel_dim",
                                                 "mu_dim", "spk_dim", "out_channels", "static_chunk_size")})
        except KeyError as exc:
            raise ReleaseError(f"{yaml_name}: flow.decoder.estimator lacks {exc.args[0]!r}") from None
        # heads * dim_head may differ from dim: the official to_q/k/v map dim -> heads*dim_head and to_out maps back
        return c


def time_sinusoid(t: torch.Tensor, dim: int = FREQ_EMBED_DIM) -> torch.Tensor:
    """[B] -> [B, dim]: sin | cos of 1000 t * exp(-ln(10000) i / (dim/2 - 1)), in the official op order."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000.0) / (half - 1)))
    arg = TIME_SCALE * t.unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat((arg.sin(), arg.cos()), dim=-1)


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.time_mlp = nn.Sequential(nn.Linear(FREQ_EMBED_DIM, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.time_mlp(time_sinusoid(t))


class CausalConvPositionEmbedding(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, CONV_POS_KERNEL, groups=CONV_POS_GROUPS), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, CONV_POS_KERNEL, groups=CONV_POS_GROUPS), nn.Mish())

    def forward(self, x: torch.Tensor) -> torch.Tensor:     # [B, T, D] -> [B, T, D]
        h = x.transpose(1, 2)
        h = self.conv1(F.pad(h, (CONV_POS_KERNEL - 1, 0)))
        h = self.conv2(F.pad(h, (CONV_POS_KERNEL - 1, 0)))
        return h.transpose(1, 2)


class InputEmbedding(nn.Module):
    def __init__(self, c: DiTConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(2 * c.mel_dim + c.mu_dim + c.spk_dim, c.dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(c.dim)

    def forward(self, x: torch.Tensor, cond: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor) -> torch.Tensor:
        spks = spks.unsqueeze(1).expand(-1, x.shape[1], -1)
        h = self.proj(torch.cat((x, cond, mu, spks), dim=-1))
        return self.conv_pos_embed(h) + h


class RotaryEmbedding(nn.Module):
    """x-transformers RotaryEmbedding(dim_head): `inv_freq` is a persistent buffer (stored in flow.pt)."""

    def __init__(self, dim_head: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (ROPE_BASE ** (torch.arange(0, dim_head, 2).float() / dim_head))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, size: int) -> torch.Tensor:
        """[T, dim_head] angles, interleaved: freqs[p, 2m] = freqs[p, 2m+1] = p * inv_freq[m]."""
        freqs = torch.arange(size, dtype=self.inv_freq.dtype).unsqueeze(1) * self.inv_freq.unsqueeze(0)
        return torch.stack((freqs, freqs), dim=-1).reshape(size, -1)


def apply_rotary(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate the first freqs.shape[-1] channels of t [B, T, C] (interleaved pairs), leave the rest."""
    rot = freqs.shape[-1]
    head, rest = t[..., :rot], t[..., rot:]
    pairs = head.reshape(*head.shape[:-1], rot // 2, 2)
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).reshape(head.shape)
    return torch.cat((head * freqs.cos() + rotated * freqs.sin(), rest), dim=-1)


class AdaLayerNormZero(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 6 * dim)

    def forward(self, emb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.linear(F.silu(emb)).chunk(6, dim=1))


class Attention(nn.Module):
    def __init__(self, c: DiTConfig) -> None:
        super().__init__()
        self.heads, self.dim_head = c.heads, c.dim_head
        inner = c.heads * c.dim_head
        self.to_q = nn.Linear(c.dim, inner)
        self.to_k = nn.Linear(c.dim, inner)
        self.to_v = nn.Linear(c.dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, c.dim)])

    def forward(self, x: torch.Tensor, rope: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        b, n = x.shape[0], x.shape[1]
        q = apply_rotary(self.to_q(x), rope)
        k = apply_rotary(self.to_k(x), rope)
        v = self.to_v(x)
        q, k, v = (z.reshape(b, n, self.heads, self.dim_head).transpose(1, 2) for z in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        return self.to_out[0](out.transpose(1, 2).reshape(b, n, self.heads * self.dim_head))


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(approximate="tanh")),
                                nn.Identity(), nn.Linear(dim * mult, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(x)


class DiTBlock(nn.Module):
    def __init__(self, c: DiTConfig) -> None:
        super().__init__()
        self.dim = c.dim        # a static int: x.shape[-1:] would be traced as a dynamic (unexportable) size
        self.attn_norm = AdaLayerNormZero(c.dim)
        self.attn = Attention(c)
        self.ff = FeedForward(c.dim, c.ff_mult)

    def forward(self, x: torch.Tensor, t: torch.Tensor, rope: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(t)
        norm = F.layer_norm(x, (self.dim,), eps=LN_EPS)
        x = x + gate_msa.unsqueeze(1) * self.attn(norm * (1 + scale_msa[:, None]) + shift_msa[:, None], rope, visible)
        norm = F.layer_norm(x, (self.dim,), eps=LN_EPS) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return x + gate_mlp.unsqueeze(1) * self.ff(norm)


class AdaLayerNormFinal(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(emb)).chunk(2, dim=1)
        return F.layer_norm(x, (self.dim,), eps=LN_EPS) * (1 + scale)[:, None, :] + shift[:, None, :]


class DiT(nn.Module):
    """forward(x, mask, mu, t, spks, cond, streaming) -> velocity [B, out, T]; the same signature as the CosyVoice2
    estimator, so the CosyVoice2 CFM solver drives it unchanged. `mask` is all ones in the official flow."""

    def __init__(self, c: DiTConfig) -> None:
        super().__init__()
        self.config = c
        self.time_embed = TimestepEmbedding(c.dim)
        self.input_embed = InputEmbedding(c)
        self.rotary_embed = RotaryEmbedding(c.dim_head)
        self.transformer_blocks = nn.ModuleList(DiTBlock(c) for _ in range(c.depth))
        self.norm_out = AdaLayerNormFinal(c.dim)
        self.proj_out = nn.Linear(c.dim, c.out_channels)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                cond: torch.Tensor, streaming: torch.Tensor | bool = False) -> torch.Tensor:
        b, size = x.shape[0], x.shape[2]
        if t.dim() == 0:
            t = t.repeat(b)
        temb = self.time_embed(t)
        h = self.input_embed(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks)
        rope = self.rotary_embed(size)
        flag = torch.as_tensor([int(streaming)]) if isinstance(streaming, bool) else streaming
        # [B, 1, T, T]: chunk rule (or everything) and the key padding mask, as add_optional_chunk_mask builds it
        visible = attention_visible(size, self.config.static_chunk_size, flag)[None, None] & (mask > 0)[:, :, None, :]
        for block in self.transformer_blocks:
            h = block(h, temb, rope, visible)
        return self.proj_out(self.norm_out(h, temb)).transpose(1, 2) * mask
