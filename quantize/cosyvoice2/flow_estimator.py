"""CosyVoice2 flow estimator (`CausalConditionalDecoder`): the CFM velocity network, a one-level causal 1-D UNet.

Down stage, mid stages and an up stage with skip connection, each a causal ResNet block (time-conditioned) followed
by diffusers-style transformer blocks; key names are the official ones under `decoder.estimator.`. Convolutions
are causal and attention is chunk-causal when streaming (`static_chunk_size` frames, `num_decoding_left_chunks`
chunks back), so the mel of earlier streaming chunks does not change when later tokens arrive. Hidden positions
get a large finite additive bias (the official mask_to_bias), not -inf, so padded rows stay finite.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cosyedge.quantize.cosyvoice2.flow_config import EstimatorConfig, attention_visible

MASKED = -1.0e10            # additive attention bias of a hidden position (official mask_to_bias)


class Transpose(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


class CausalConv1d(nn.Conv1d):
    """Conv1d padded on the left only: output frame t sees input frames <= t."""

    def __init__(self, cin: int, cout: int, kernel: int = 3) -> None:
        super().__init__(cin, cout, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class CausalBlock1D(nn.Module):
    """Causal conv, LayerNorm over channels, Mish; masked before and after."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.block = nn.Sequential(CausalConv1d(cin, cout), Transpose(), nn.LayerNorm(cout), Transpose(), nn.Mish())

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.block(x * mask) * mask


class CausalResnetBlock1D(nn.Module):
    def __init__(self, cin: int, cout: int, time_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, cout))
        self.block1 = CausalBlock1D(cin, cout)
        self.block2 = CausalBlock1D(cout, cout)
        self.res_conv = nn.Conv1d(cin, cout, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        h = self.block1(x, mask) + self.mlp(t_emb).unsqueeze(-1)
        return self.block2(h, mask) + self.res_conv(x * mask)


class Attention(nn.Module):
    """diffusers-style self-attention: q/k/v without bias, additive bias on the scores."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.to_q = nn.Linear(dim, heads * head_dim, bias=False)
        self.to_k = nn.Linear(dim, heads * head_dim, bias=False)
        self.to_v = nn.Linear(dim, heads * head_dim, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(heads * head_dim, dim)])

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q, k, v = (proj(x).view(b, -1, self.heads, self.head_dim).transpose(1, 2)
                   for proj in (self.to_q, self.to_k, self.to_v))
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim)) + bias
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.to_out[0](out.transpose(1, 2).reshape(b, -1, self.heads * self.head_dim))


class GELUProjection(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class TransformerFeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        # net.1 is the official (inactive) dropout slot: kept so that the second Linear is `net.2`
        self.net = nn.Sequential(GELUProjection(dim, 4 * dim), nn.Identity(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = TransformerFeedForward(dim)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x), bias)
        return x + self.ff(self.norm3(x))


def timestep_sinusoid(t: torch.Tensor, dim: int, scale: float = 1000.0) -> torch.Tensor:
    """[B] -> [B, dim]: sin half then cos half, frequencies exp(-ln(10000) i / (dim/2 - 1))."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000) / (half - 1)))
    angle = scale * t.unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat([angle.sin(), angle.cos()], dim=-1)


class TimestepEmbedding(nn.Module):
    def __init__(self, cin: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(cin, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


def _stage(c: EstimatorConfig, cin: int, time_dim: int, with_conv: bool) -> nn.ModuleList:
    parts: list[nn.Module] = [
        CausalResnetBlock1D(cin, c.channels, time_dim),
        nn.ModuleList(BasicTransformerBlock(c.channels, c.num_heads, c.attention_head_dim) for _ in range(c.n_blocks)),
    ]
    if with_conv:
        parts.append(CausalConv1d(c.channels, c.channels))
    return nn.ModuleList(parts)


class CausalConditionalDecoder(nn.Module):
    """The CFM velocity network: one-level causal UNet (down stage, mid stages, up stage with skip)."""

    def __init__(self, c: EstimatorConfig) -> None:
        super().__init__()
        self.config = c
        time_dim = 4 * c.channels
        self.time_mlp = TimestepEmbedding(c.in_channels, time_dim)
        self.down_blocks = nn.ModuleList([_stage(c, c.in_channels, time_dim, True)])
        self.mid_blocks = nn.ModuleList(_stage(c, c.channels, time_dim, False) for _ in range(c.num_mid_blocks))
        self.up_blocks = nn.ModuleList([_stage(c, 2 * c.channels, time_dim, True)])
        self.final_block = CausalBlock1D(c.channels, c.channels)
        self.final_proj = nn.Conv1d(c.channels, c.out_channels, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                cond: torch.Tensor, streaming: torch.Tensor) -> torch.Tensor:
        c = self.config
        t_emb = self.time_mlp(timestep_sinusoid(t, c.in_channels))
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.shape[2]), cond], dim=1)
        visible = attention_visible(x.shape[2], c.static_chunk_size, streaming, c.num_decoding_left_chunks)
        bias = (1.0 - (visible.unsqueeze(0) & (mask > 0)).to(x.dtype)) * MASKED    # [B, T, T] over keys

        def transformers(h: torch.Tensor, blocks: nn.ModuleList) -> torch.Tensor:
            h = h.transpose(1, 2)
            for block in blocks:
                h = block(h, bias.unsqueeze(1))
            return h.transpose(1, 2)

        resnet, blocks, conv = self.down_blocks[0]
        skip = transformers(resnet(h, mask, t_emb), blocks)
        h = conv(skip * mask)
        for resnet, blocks in self.mid_blocks:
            h = transformers(resnet(h, mask, t_emb), blocks)
        resnet, blocks, conv = self.up_blocks[0]
        h = transformers(resnet(torch.cat([h, skip], dim=1), mask, t_emb), blocks)
        h = conv(h * mask)
        h = self.final_block(h, mask)
        return self.final_proj(h * mask) * mask
