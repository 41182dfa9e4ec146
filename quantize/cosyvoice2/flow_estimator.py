"""CosyVoice2 flow estimator (`CausalConditionalDecoder`): the CFM velocity network, a one-level causal 1-D UNet.

Down stage, mid stages and an up stage with skip connection, each a causal ResNet block (time-conditioned) followed
by diffusers-style transformer blocks; key names are the official ones under `decoder.estimator.`. Convolutions
are causal and attention is chunk-causal when streaming (`static_chunk_size` frames, `num_decoding_left_chunks`
chunks back), so the mel of earlier streaming chunks does not change when later tokens arrive. Hidden positions
get a large finite additive bias (the official mask_to_bias), not -inf, so padded rows stay finite.

The prompt state (`PromptState`): because a streaming call's first whole chunks never see later frames, what the
network computes there is the same in every streaming call of a voice, for frames whose encoder output is fixed by
the prompt alone. A call may therefore start after `past` such frames: each transformer block takes their
normalised hidden states (its attention's keys and values are projected from them again, the queries are the new
frames' only) and each causal convolution its last `kernel - 1` input frames, and a call can hand the state of its
first `keep` frames back. With no past and keep 0 the arithmetic is the plain call's.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cosyedge.quantize.cosyvoice2.flow_config import EstimatorConfig, attention_visible

MASKED = -1.0e10            # additive attention bias of a hidden position (official mask_to_bias)


class PromptState:
    """One call's view of the prompt state: the past it reads (`hidden` [L, B or 1, P, D] for the L transformer
    blocks in call order, `conv` [B or 1, S, kernel - 1] for the causal convolutions in call order, their input
    channels concatenated) and, for `keep` > 0, the state of its own first `keep` frames, collected in the same
    order."""

    def __init__(self, hidden: torch.Tensor, conv: torch.Tensor, keep: torch.Tensor,
                 hidden_q: torch.Tensor | None = None, hidden_scale: torch.Tensor | None = None) -> None:
        self.hidden, self.conv, self.keep = hidden, conv, keep
        self.hidden_q, self.hidden_scale = hidden_q, hidden_scale
        self.kept_hidden: list[torch.Tensor] = []
        self.kept_conv: list[torch.Tensor] = []
        self._channel = 0

    @property
    def past(self) -> torch.Tensor:
        return self.hidden.shape[2] + (0 if self.hidden_q is None else self.hidden_q.shape[2])

    def keep_frames(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, T, D] -> past of the next block: the first `keep` frames of h; the block's own past is returned,
        broadcast to h's rows here, one block at a time (a whole-state broadcast up front copied every block's past
        at once: 20 MB more at the stream-on estimator call's peak, CosyVoice2-0.5B size). A past fed as int8
        (`hidden_q` [L, R, Q, D], `hidden_scale` [L, R, Q, 1]) is dequantized here too, one block at a time, and
        follows the float past's frames: the call's input is a quarter of the float one's size."""
        block = len(self.kept_hidden)
        past = self.hidden[block].expand(h.shape[0], -1, -1)
        if self.hidden_q is not None and self.hidden_scale is not None:
            dequantized = self.hidden_q[block].to(h.dtype) * self.hidden_scale[block]
            past = torch.cat([past, dequantized.expand(h.shape[0], -1, -1)], dim=1)
        self.kept_hidden.append(h.index_select(1, torch.arange(self.keep[0])))
        return past

    def conv_padded(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """x [B, C, T] -> [B, C, width + T]: this convolution's past frames before x, and the `width` input frames
        that end at frame `keep` kept for the next call."""
        cin = x.shape[1]
        past = self.conv[:, self._channel:self._channel + cin, :width].expand(x.shape[0], -1, -1)
        self._channel += cin
        padded = torch.cat([past, x], dim=2)
        self.kept_conv.append(padded.index_select(2, torch.arange(width) + self.keep[0]))
        return padded

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(present_hidden [L, B, keep, D], present_conv [B, S, kernel - 1])."""
        return torch.stack(self.kept_hidden), torch.cat(self.kept_conv, dim=1)


class Transpose(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


class CausalConv1d(nn.Conv1d):
    """Conv1d padded on the left only: output frame t sees input frames <= t."""

    def __init__(self, cin: int, cout: int, kernel: int = 3) -> None:
        super().__init__(cin, cout, kernel)

    def forward(self, x: torch.Tensor, state: PromptState | None = None) -> torch.Tensor:
        width = self.kernel_size[0] - 1
        return super().forward(F.pad(x, (width, 0)) if state is None else state.conv_padded(x, width))


class CausalBlock1D(nn.Module):
    """Causal conv, LayerNorm over channels, Mish; masked before and after."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.block = nn.Sequential(CausalConv1d(cin, cout), Transpose(), nn.LayerNorm(cout), Transpose(), nn.Mish())

    def forward(self, x: torch.Tensor, mask: torch.Tensor, state: PromptState | None = None) -> torch.Tensor:
        h = self.block[0](x * mask, state)
        for layer in self.block[1:]:
            h = layer(h)
        return h * mask


class CausalResnetBlock1D(nn.Module):
    def __init__(self, cin: int, cout: int, time_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, cout))
        self.block1 = CausalBlock1D(cin, cout)
        self.block2 = CausalBlock1D(cout, cout)
        self.res_conv = nn.Conv1d(cin, cout, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, t_emb: torch.Tensor, state: PromptState | None = None
                ) -> torch.Tensor:
        h = self.block1(x, mask, state) + self.mlp(t_emb).unsqueeze(-1)
        return self.block2(h, mask, state) + self.res_conv(x * mask)


class Attention(nn.Module):
    """diffusers-style self-attention: q/k/v without bias, additive bias on the scores."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.to_q = nn.Linear(dim, heads * head_dim, bias=False)
        self.to_k = nn.Linear(dim, heads * head_dim, bias=False)
        self.to_v = nn.Linear(dim, heads * head_dim, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(heads * head_dim, dim)])

    def forward(self, x: torch.Tensor, bias: torch.Tensor, past: torch.Tensor | None = None) -> torch.Tensor:
        """Queries from x [B, T, D]; keys and values from `past` [B, P, D] (frames before x) and x."""
        b = x.shape[0]
        context = x if past is None else torch.cat([past, x], dim=1)
        q, k, v = (proj(source).view(b, -1, self.heads, self.head_dim).transpose(1, 2)
                   for proj, source in ((self.to_q, x), (self.to_k, context), (self.to_v, context)))
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

    def forward(self, x: torch.Tensor, bias: torch.Tensor, state: PromptState | None = None) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn1(h, bias, None if state is None else state.keep_frames(h))
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

    def layers(self) -> int:
        """Transformer blocks in one call (the prompt state's L)."""
        return sum(len(stage[1]) for stage in (*self.down_blocks, *self.mid_blocks, *self.up_blocks))

    def conv_channels(self) -> int:
        """Input channels of the causal convolutions in one call (the prompt state's S)."""
        return sum(m.in_channels for m in self.modules() if isinstance(m, CausalConv1d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                cond: torch.Tensor, streaming: torch.Tensor, state: PromptState | None = None) -> torch.Tensor:
        """The velocity of x's frames; with a `state`, of the frames after its past ones (mask: x's frames)."""
        c = self.config
        t_emb = self.time_mlp(timestep_sinusoid(t, c.in_channels))
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.shape[2]), cond], dim=1)
        past = 0 if state is None else state.past
        visible = attention_visible(x.shape[2], c.static_chunk_size, streaming, c.num_decoding_left_chunks, past)
        keys = mask if state is None else torch.cat([torch.ones_like(mask[:, :, :1]).expand(-1, -1, past), mask], 2)
        bias = (1.0 - (visible.unsqueeze(0) & (keys > 0)).to(x.dtype)) * MASKED    # [B, T, P + T] over keys

        def transformers(h: torch.Tensor, blocks: nn.ModuleList) -> torch.Tensor:
            h = h.transpose(1, 2)
            for block in blocks:
                h = block(h, bias.unsqueeze(1), state)
            return h.transpose(1, 2)

        resnet, blocks, conv = self.down_blocks[0]
        skip = transformers(resnet(h, mask, t_emb, state), blocks)
        h = conv(skip * mask, state)
        for resnet, blocks in self.mid_blocks:
            h = transformers(resnet(h, mask, t_emb, state), blocks)
        resnet, blocks, conv = self.up_blocks[0]
        h = transformers(resnet(torch.cat([h, skip], dim=1), mask, t_emb, state), blocks)
        h = conv(h * mask, state)
        h = self.final_block(h, mask, state)
        return self.final_proj(h * mask) * mask
