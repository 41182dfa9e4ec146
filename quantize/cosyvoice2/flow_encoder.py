"""CosyVoice2 flow encoder (`UpsampleConformerEncoder`): embedded speech tokens -> 2 hidden frames per token.

`input_embedding` output -> linear input layer (x sqrt(D), ESPnet relative positions) -> PreLookaheadLayer ->
Conformer blocks -> nearest x2 upsampling + causal conv -> second linear input layer -> 4 up-Conformer blocks ->
`after_norm`. Our own modules with the official `flow.pt` key names (under `encoder.`), limited to CosyVoice2's
configuration (no convolution module, no macaron FFN), so the graph holds only what the checkpoint uses.

Streaming: chunk-causal attention over chunks of `static_chunk_size` tokens before and x`token_mel_ratio` frames
after the upsampling; the last `pre_lookahead_len` inputs are look-ahead context only (zero padding on the final
call, `finalize`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cosyedge.quantize.cosyvoice2.flow_config import EncoderConfig, attention_visible

NUM_UP_BLOCKS = 4           # hard-coded in the official UpsampleConformerEncoder


class LinearInput(nn.Module):
    """wenet LinearNoSubsampling + EspnetRelPositionalEncoding: Linear, LayerNorm, x sqrt(D) (no absolute PE)."""

    def __init__(self, idim: int, odim: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5))
        self.xscale = math.sqrt(odim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.xscale


def relative_positions(size: torch.Tensor | int, dim: int) -> torch.Tensor:
    """ESPnet relative sinusoids [2*size-1, dim]: row r encodes distance size-1-r (sin even, cos odd channels)."""
    distance = torch.arange(size - 1, -size, -1).to(torch.float32).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * -(math.log(10000.0) / dim))
    angle = distance * div_term
    return torch.stack([torch.sin(angle), torch.cos(angle)], dim=-1).reshape(-1, dim)


# The attention runs in this many blocks of queries, one after the other: each block's score tensors ([B, H, rows,
# T] and [B, H, rows, 2T-1] against the sinusoids) are a quarter of the whole query range's. Whole, they were the
# flow encoder's peak: +77 MB over the engine for a 10 s stream-off request at CosyVoice2-0.5B size (the up-blocks'
# attention over 674 frames). A row's scores and softmax do not depend on the other rows, so the blocks give the
# same output (within float32 round-off of the products).
QUERY_BLOCKS = 4


def relative_shift(position: torch.Tensor, first_row: torch.Tensor | int = 0) -> torch.Tensor:
    """[B, H, R, 2T-1] scores of query rows first_row .. first_row+R-1 against the relative sinusoids -> [B, H, R, T],
    entry (r, j) from column T-1-i+j with i = first_row + r (distance i - j). One gather along the flattened last two
    axes with an [R*T] index: a per-element gather (`torch.gather`, ONNX GatherElements) needs an int64 index of the
    output's full [B, H, R, T] shape, twice the memory of the scores it picks (29.6 MB per layer for 680 frames at
    CosyVoice2-0.5B size, all rows at once)."""
    b, heads, rows, width = position.shape
    size = (width + 1) // 2
    row, column = torch.arange(rows).unsqueeze(1), torch.arange(size).unsqueeze(0)
    index = (row * (width - 1) + size - 1 - first_row + column).reshape(-1)   # r*(2T-1) + T-1-(first_row+r)+j
    return position.reshape(b, heads, rows * width).index_select(2, index).reshape(b, heads, rows, size)


class RelPositionAttention(nn.Module):
    """ESPnet relative-position self-attention with learnt biases pos_bias_u (content) and pos_bias_v (position)."""

    def __init__(self, heads: int, dim: int) -> None:
        super().__init__()
        self.heads, self.d_k = heads, dim // heads
        self.linear_q = nn.Linear(dim, dim)
        self.linear_k = nn.Linear(dim, dim)
        self.linear_v = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(heads, self.d_k))
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)

    def forward(self, x: torch.Tensor, pos_emb: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q = self.linear_q(x).view(b, -1, self.heads, self.d_k)
        k = self.linear_k(x).view(b, -1, self.heads, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, -1, self.heads, self.d_k).transpose(1, 2)
        p = self.linear_pos(pos_emb).view(-1, self.heads, self.d_k).permute(1, 2, 0)   # [H, d_k, 2T-1]
        with_u, with_v = (q + self.pos_bias_u).transpose(1, 2), (q + self.pos_bias_v).transpose(1, 2)
        size, blocks = x.shape[1], []
        for part in range(QUERY_BLOCKS):
            first, end = size * part // QUERY_BLOCKS, size * (part + 1) // QUERY_BLOCKS
            content = torch.matmul(with_u[:, :, first:end], k.transpose(-2, -1))
            position = torch.matmul(with_v[:, :, first:end], p)                     # [B, H, rows, 2T-1]
            scores = (content + relative_shift(position, first)) / math.sqrt(self.d_k)
            weights = torch.softmax(scores.masked_fill(~visible[first:end], float("-inf")), dim=-1)
            blocks.append(torch.matmul(weights, v))
        out = torch.cat(blocks, dim=2).transpose(1, 2).reshape(b, -1, self.heads * self.d_k)
        return self.linear_out(out)


class FeedForward(nn.Module):
    def __init__(self, dim: int, segments: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(dim, segments)
        self.w_2 = nn.Linear(segments, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-norm Conformer block without convolution module or macaron FFN (CosyVoice2's configuration)."""

    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.self_attn = RelPositionAttention(c.attention_heads, c.output_size)
        self.feed_forward = FeedForward(c.output_size, c.linear_units)
        self.norm_ff = nn.LayerNorm(c.output_size, eps=1e-12)
        self.norm_mha = nn.LayerNorm(c.output_size, eps=1e-12)

    def forward(self, x: torch.Tensor, pos_emb: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm_mha(x), pos_emb, visible)
        return x + self.feed_forward(self.norm_ff(x))


class PreLookaheadLayer(nn.Module):
    """conv1 (kernel K+1) over [x, look-ahead], LeakyReLU, causal conv2 (kernel 3), residual.

    `hidden` is the width between the two convolutions: `channels` in CosyVoice2, wider in CosyVoice3
    (80 -> 1024 -> 80), where this layer alone turns token embeddings into `mu`."""

    def __init__(self, channels: int, lookahead: int, hidden: int | None = None) -> None:
        super().__init__()
        hidden = channels if hidden is None else hidden
        self.conv1 = nn.Conv1d(channels, hidden, lookahead + 1)
        self.conv2 = nn.Conv1d(hidden, channels, 3)

    def forward(self, x: torch.Tensor, lookahead: torch.Tensor) -> torch.Tensor:
        h = torch.cat([x, lookahead], dim=1).transpose(1, 2)
        h = F.leaky_relu(self.conv1(h))
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))
        return h.transpose(1, 2) + x


class Upsample(nn.Module):
    """Nearest upsampling by `stride` in time, then a causal conv of kernel 2*stride+1."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, 2 * stride + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # [B, C, T] -> [B, C, stride*T]
        b, c = x.shape[0], x.shape[1]
        x = x.unsqueeze(-1).expand(-1, -1, -1, self.stride).reshape(b, c, -1)
        return self.conv(F.pad(x, (2 * self.stride, 0)))


class UpsampleConformerEncoder(nn.Module):
    def __init__(self, c: EncoderConfig, pre_lookahead_len: int, stride: int) -> None:
        super().__init__()
        self.config, self.stride = c, stride
        self.embed = LinearInput(c.input_size, c.output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(c.output_size, pre_lookahead_len)
        self.encoders = nn.ModuleList(ConformerLayer(c) for _ in range(c.num_blocks))
        self.up_layer = Upsample(c.output_size, stride)
        self.up_embed = LinearInput(c.output_size, c.output_size)
        self.up_encoders = nn.ModuleList(ConformerLayer(c) for _ in range(NUM_UP_BLOCKS))
        self.after_norm = nn.LayerNorm(c.output_size, eps=1e-5)

    def forward(self, x: torch.Tensor, lookahead: torch.Tensor, finalize: torch.Tensor, streaming: torch.Tensor
                ) -> torch.Tensor:
        """x [B, N, D] embedded tokens, lookahead [B, K, D] embedded look-ahead tokens -> [B, stride*N, D]."""
        c = self.config
        x = self.embed(x)
        lookahead = self.embed(lookahead) * (1 - finalize).to(x.dtype)   # finalize: the official zero padding
        x = self.pre_lookahead_layer(x, lookahead)
        size = x.shape[1]
        pos_emb = relative_positions(size, c.output_size)
        visible = attention_visible(size, c.static_chunk_size, streaming)
        for layer in self.encoders:
            x = layer(x, pos_emb, visible)
        x = self.up_layer(x.transpose(1, 2)).transpose(1, 2)
        x = self.up_embed(x)
        size = x.shape[1]
        pos_emb = relative_positions(size, c.output_size)
        visible = attention_visible(size, c.static_chunk_size * self.stride, streaming)
        for layer in self.up_encoders:
            x = layer(x, pos_emb, visible)
        return self.after_norm(x)
