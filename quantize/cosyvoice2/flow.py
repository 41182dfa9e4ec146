"""CosyVoice2 flow stage (`CausalMaskedDiffWithXvec`): speech tokens -> mel, and its ONNX export.

Our own modules with the official `flow.pt` key names (strict load), built from the release's
`cosyvoice2.yaml` `flow:` entry alone (the same code builds the tiny test release and CosyVoice2-0.5B):

* speaker: `spks = spk_embed_affine_layer(normalize(embedding))`;
* encoder (`UpsampleConformerEncoder`): `input_embedding` -> linear input layer (x sqrt(D), ESPnet relative
  positions) -> PreLookaheadLayer -> Conformer blocks -> nearest x2 upsampling + causal conv -> second linear input
  layer -> 4 up-Conformer blocks -> `after_norm`; `encoder_proj` gives `mu` (80 channels, 2 frames per token);
* estimator (`CausalConditionalDecoder`): a one-level causal 1-D UNet with transformer blocks;
* CFM: 10 Euler steps on the cosine grid t_k = 1 - cos(pi/2 * k/10) from the fixed noise, classifier-free guidance
  v = (1 + r) v(x, mu, spks, cond) - r v(x, 0, 0, 0) with r = `inference_cfg_rate` from the yaml.

Streaming (official `CosyVoice2Model` loop): each chunk re-runs the flow on all tokens so far with `streaming`
(chunk-causal attention: encoder chunks of `static_chunk_size` tokens before and x`token_mel_ratio` frames after the
upsampling, estimator chunks of its own `static_chunk_size` frames; a position sees every earlier chunk and its own)
and `finalize` False: the last `pre_lookahead_len` (3) tokens are only look-ahead context of the PreLookaheadLayer and
produce no mel. The final call uses finalize True (the look-ahead is zero padding) and, as the official loop does,
streaming False. The fixed noise makes the mel of earlier chunks reproducible.

ONNX graphs written by `export_flow` (opset 17, standard ops, float32). Symbols: N tokens that produce mel (prompt
tokens ++ generated tokens), K = pre_lookahead_len (3; metadata `pre_lookahead_len`), T = token_mel_ratio * N mel
frames (metadata `token_mel_ratio`, 2), B batch (the CFG pair, or several requests stacked), E = spk_embed_dim (192),
M = mel bins (80). Flags are int64 [1] with value 0 or 1 (one graph covers both modes; no second variant).

`flow_encoder.onnx` (batch 1)
  inputs   token      int64   [1, N + K]  prompt tokens ++ generated tokens ++ K look-ahead tokens. When finalize=1
                                          the last K entries are placeholders (any id, e.g. 0): the official zero
                                          padding replaces them.
           embedding  float32 [1, E]      speaker embedding (CAM++ / spk2info), not normalised
           finalize   int64   [1]         1: last call of a request (zero look-ahead); 0: streaming chunk whose last K
                                          tokens are look-ahead context
           streaming  int64   [1]         1: chunk-causal attention (streaming chunks); 0: full attention
                                          (non-streaming requests and the final streaming call)
  outputs  mu         float32 [1, M, T]   CFM condition (encoder_proj output, channels first)
           spks       float32 [1, M]      projected speaker embedding

`flow_estimator.onnx` (one velocity evaluation; the Euler loop runs outside, in numpy)
  inputs   x          float32 [B, M, T]   current sample
           mask       float32 [B, 1, T]   1 on real frames, 0 on right padding (rows of different lengths)
           mu         float32 [B, M, T]   encoder output (zeros in the unconditional CFG row)
           t          float32 [B]         flow time of this step
           spks       float32 [B, M]      speaker vector (zeros in the unconditional row)
           cond       float32 [B, M, T]   prompt mel in the first frames, zeros after (all zeros in the uncond. row)
           streaming  int64   [1]         1: chunk-causal attention with metadata `estimator_chunk` frames; 0: full
  outputs  velocity   float32 [B, M, T]

Graph metadata (`metadata_props`): pre_lookahead_len, token_mel_ratio, n_timesteps, inference_cfg_rate,
encoder_chunk, estimator_chunk, estimator_left_chunks, mel_bins, spk_embed_dim.

The Euler loop for one request, exactly as the official `solve_euler` (float32 throughout):
  t_span = 1 - cos(linspace(0, 1, n_timesteps + 1) * pi/2); x = noise[:, :, :T]   (fixed noise, `fixed_noise()`)
  t = t_span[0]; dt = t_span[1] - t_span[0]
  for step in 1..n_timesteps:
      v = velocity(x=[x, x], mask=[1, 1], mu=[mu, 0], t=[t, t], spks=[spks, 0], cond=[cond, 0])
      x = x + dt * ((1 + r) * v[0] - r * v[1]);  t = t + dt;  dt = t_span[step + 1] - t  (if step < n_timesteps)
  mel = x[:, :, token_mel_ratio * P:]   (P prompt tokens; cond = prompt mel (1, 2P, M) transposed, zero-padded to T)
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from torch import nn

from cosyedge.device.errors import ReleaseError
from cosyedge.quantize.cosyvoice2.release import Release, check_state

CHECKPOINT_NAME = "flow.pt"
FLOW_TARGET = "cosyvoice.flow.flow.CausalMaskedDiffWithXvec"
ENCODER_NAME = "flow_encoder"
ESTIMATOR_NAME = "flow_estimator"
ONNX_OPSET = 17
N_TIMESTEPS = 10            # hard-coded in the official flow.inference
NUM_UP_BLOCKS = 4           # hard-coded in the official UpsampleConformerEncoder
NOISE_FRAMES = 15000        # the official fixed CFM noise: seed 0, randn(1, 80, 15000)
MASKED = -1.0e10            # additive attention bias of a hidden position (official mask_to_bias)


@dataclass(frozen=True)
class EncoderConfig:
    """UpsampleConformerEncoder sizes (yaml `flow.encoder`); channel counts inside are all `output_size`."""
    input_size: int
    output_size: int
    attention_heads: int
    linear_units: int
    num_blocks: int
    static_chunk_size: int


@dataclass(frozen=True)
class EstimatorConfig:
    """CausalConditionalDecoder sizes (yaml `flow.decoder.estimator`)."""
    in_channels: int
    out_channels: int
    channels: int
    attention_head_dim: int
    num_heads: int
    n_blocks: int
    num_mid_blocks: int
    static_chunk_size: int
    num_decoding_left_chunks: int


@dataclass(frozen=True)
class FlowConfig:
    vocab_size: int
    input_size: int
    mel_bins: int
    spk_embed_dim: int
    token_mel_ratio: int
    pre_lookahead_len: int
    inference_cfg_rate: float
    encoder: EncoderConfig
    estimator: EstimatorConfig

    @classmethod
    def from_hparams(cls, hparams: dict[str, Any]) -> "FlowConfig":
        flow = hparams.get("flow")
        if getattr(flow, "target", None) != FLOW_TARGET:
            raise ReleaseError(f"cosyvoice2.yaml: flow is {getattr(flow, 'target', None)!r}, expected {FLOW_TARGET!r}")
        try:
            enc, dec = flow["encoder"], flow["decoder"]
            est, cfm = dec["estimator"], dec["cfm_params"]["content"]
            for key, want in (("input_layer", "linear"), ("pos_enc_layer_type", "rel_pos_espnet"),
                              ("selfattention_layer_type", "rel_selfattn"), ("normalize_before", True),
                              ("use_cnn_module", False), ("macaron_style", False)):
                if enc.get(key, want) != want:
                    raise ReleaseError(f"cosyvoice2.yaml: flow.encoder {key} {enc[key]!r} is not supported "
                                       f"(expected {want!r})")
            for key, want in (("solver", "euler"), ("t_scheduler", "cosine")):
                if cfm.get(key, want) != want:
                    raise ReleaseError(f"cosyvoice2.yaml: flow cfm_params {key} {cfm[key]!r} is not supported")
            if est.get("act_fn", "gelu") != "gelu":
                raise ReleaseError(f"cosyvoice2.yaml: estimator act_fn {est['act_fn']!r} is not supported")
            channels = list(est["channels"])
            if len(channels) != 1:
                raise ReleaseError(f"cosyvoice2.yaml: estimator channels {channels} (only one UNet level, as in "
                                   "CosyVoice2, is supported)")
            return cls(
                vocab_size=int(flow["vocab_size"]), input_size=int(flow["input_size"]),
                mel_bins=int(flow["output_size"]), spk_embed_dim=int(flow["spk_embed_dim"]),
                token_mel_ratio=int(flow["token_mel_ratio"]), pre_lookahead_len=int(flow["pre_lookahead_len"]),
                inference_cfg_rate=float(cfm["inference_cfg_rate"]),
                encoder=EncoderConfig(
                    input_size=int(enc["input_size"]), output_size=int(enc["output_size"]),
                    attention_heads=int(enc["attention_heads"]), linear_units=int(enc["linear_units"]),
                    num_blocks=int(enc["num_blocks"]), static_chunk_size=int(enc["static_chunk_size"])),
                estimator=EstimatorConfig(
                    in_channels=int(est["in_channels"]), out_channels=int(est["out_channels"]),
                    channels=int(channels[0]), attention_head_dim=int(est["attention_head_dim"]),
                    num_heads=int(est["num_heads"]), n_blocks=int(est["n_blocks"]),
                    num_mid_blocks=int(est["num_mid_blocks"]), static_chunk_size=int(est["static_chunk_size"]),
                    num_decoding_left_chunks=int(est["num_decoding_left_chunks"])),
            )
        except (KeyError, TypeError) as exc:
            raise ReleaseError(f"cosyvoice2.yaml: flow entry lacks {exc.args[0]!r}") from None


def fixed_noise() -> np.ndarray:
    """The official CFM noise: float32 (1, 80, 15000) drawn by `torch.manual_seed(0); torch.randn(1, 80, 15000)`."""
    generator = torch.Generator().manual_seed(0)  # same stream as the global seed-0 generator, state left untouched
    return torch.randn(1, 80, NOISE_FRAMES, generator=generator).numpy()


def attention_visible(size: torch.Tensor | int, chunk: int, streaming: torch.Tensor, left_chunks: int = -1
                      ) -> torch.Tensor:
    """[size, size] bool, query i x key j. `streaming` (int64 [1]) 1: the official static chunk mask (i sees its
    own chunk and the `left_chunks` before it, every earlier one when negative); 0: everything."""
    pos = torch.arange(size)
    block = torch.div(pos, chunk, rounding_mode="floor").unsqueeze(1)
    visible = pos.unsqueeze(0) < (block + 1) * chunk
    if left_chunks >= 0:
        visible = visible & (pos.unsqueeze(0) >= torch.clamp(block - left_chunks, min=0) * chunk)
    return visible | (streaming == 0)


# ---------------------------------------------------------------------------------------------- encoder

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
        b, size = x.shape[0], x.shape[1]
        q = self.linear_q(x).view(b, -1, self.heads, self.d_k)
        k = self.linear_k(x).view(b, -1, self.heads, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, -1, self.heads, self.d_k).transpose(1, 2)
        p = self.linear_pos(pos_emb).view(-1, self.heads, self.d_k).permute(1, 2, 0)   # [H, d_k, 2T-1]
        content = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        position = torch.matmul((q + self.pos_bias_v).transpose(1, 2), p)              # [B, H, T, 2T-1]
        pos = torch.arange(size)
        shift = (size - 1 - pos.unsqueeze(1) + pos.unsqueeze(0)).expand(b, self.heads, size, size)
        position = torch.gather(position, 3, shift)                                    # distance i - j
        scores = (content + position) / math.sqrt(self.d_k)
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(b, -1, self.heads * self.d_k)
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
    """conv1 (kernel K+1) over [x, look-ahead], LeakyReLU, causal conv2 (kernel 3), residual."""

    def __init__(self, channels: int, lookahead: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(channels, channels, lookahead + 1)
        self.conv2 = nn.Conv1d(channels, channels, 3)

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


# -------------------------------------------------------------------------------------------- estimator

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


class CausalConditionalCFM(nn.Module):
    """Holds the estimator (key prefix `decoder.estimator.`); the fixed noise is an explicit input, not a buffer."""

    def __init__(self, c: EstimatorConfig) -> None:
        super().__init__()
        self.estimator = CausalConditionalDecoder(c)


def cosine_t_span(n_timesteps: int = N_TIMESTEPS) -> torch.Tensor:
    t = torch.linspace(0, 1, n_timesteps + 1, dtype=torch.float32)
    return 1 - torch.cos(t * 0.5 * torch.pi)


# --------------------------------------------------------------------------------------------------- flow

class CausalMaskedDiffWithXvec(nn.Module):
    def __init__(self, c: FlowConfig) -> None:
        super().__init__()
        self.config = c
        self.input_embedding = nn.Embedding(c.vocab_size, c.input_size)
        self.spk_embed_affine_layer = nn.Linear(c.spk_embed_dim, c.mel_bins)
        self.encoder = UpsampleConformerEncoder(c.encoder, c.pre_lookahead_len, c.token_mel_ratio)
        self.encoder_proj = nn.Linear(c.encoder.output_size, c.mel_bins)
        self.decoder = CausalConditionalCFM(c.estimator)

    def speaker(self, embedding: torch.Tensor) -> torch.Tensor:
        return self.spk_embed_affine_layer(F.normalize(embedding, dim=1))

    def encode_hidden(self, token: torch.Tensor, finalize: torch.Tensor, streaming: torch.Tensor) -> torch.Tensor:
        """token [1, N + K] (last K = look-ahead, or placeholders when finalize) -> encoder output [1, ratio*N, D]."""
        k = self.config.pre_lookahead_len
        emb = self.input_embedding(torch.clamp(token, min=0))
        return self.encoder(emb[:, :-k], emb[:, -k:], finalize, streaming)

    def encode(self, token: torch.Tensor, embedding: torch.Tensor, finalize: torch.Tensor, streaming: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The `flow_encoder` graph: -> (mu [1, M, T], spks [1, M])."""
        mu = self.encoder_proj(self.encode_hidden(token, finalize, streaming)).transpose(1, 2)
        return mu, self.speaker(embedding)

    def velocity(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                 cond: torch.Tensor, streaming: torch.Tensor) -> torch.Tensor:
        """The `flow_estimator` graph."""
        return self.decoder.estimator(x, mask, mu, t, spks, cond, streaming)

    def solve(self, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, noise: torch.Tensor,
              streaming: torch.Tensor) -> torch.Tensor:
        """Official solve_euler with CFG: 10 steps from noise[:, :, :T]; returns the full mel incl. prompt frames."""
        t_span = cosine_t_span()
        rate = self.config.inference_cfg_rate
        size = mu.shape[2]
        x = noise[:, :, :size].to(mu.dtype)
        zeros = torch.zeros_like(mu)
        mask = torch.ones(2, 1, size, dtype=mu.dtype)
        t, dt = t_span[:1], t_span[1] - t_span[0]
        for step in range(1, len(t_span)):
            v = self.velocity(torch.cat([x, x]), mask, torch.cat([mu, zeros]), t.expand(2),
                              torch.cat([spks, torch.zeros_like(spks)]), torch.cat([cond, zeros]), streaming)
            x = x + dt * ((1.0 + rate) * v[:1] - rate * v[1:])
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
        return x

    @torch.no_grad()
    def inference(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                  embedding: torch.Tensor, noise: torch.Tensor, streaming: bool = False, finalize: bool = True
                  ) -> torch.Tensor:
        """Official `flow.inference` (batch 1): token [1, N], prompt_token [1, P], prompt_feat [1, ratio*P, M],
        embedding [1, E], noise [1, M, >= T] -> mel [1, M, ratio*N] (ratio*(N-K) when not finalize)."""
        k = self.config.pre_lookahead_len
        token = torch.cat([prompt_token, token], dim=1).to(torch.int64)
        if finalize:
            token = torch.cat([token, torch.zeros(1, k, dtype=torch.int64)], dim=1)
        flags = torch.tensor([int(finalize)]), torch.tensor([int(streaming)])
        mu, spks = self.encode(token, embedding, *flags)
        cond = prompt_condition(prompt_feat, mu.shape[2])
        return self.solve(mu, spks, cond, noise, flags[1])[:, :, prompt_feat.shape[1]:]


def prompt_condition(prompt_feat: torch.Tensor, frames: int) -> torch.Tensor:
    """CFM `cond` [1, M, frames]: the prompt mel [1, F, M] transposed into the first F frames, zeros after."""
    cond = torch.zeros(1, prompt_feat.shape[2], frames, dtype=torch.float32)
    cond[:, :, :prompt_feat.shape[1]] = prompt_feat.transpose(1, 2)
    return cond


def build_flow_random(hparams: dict[str, Any]) -> CausalMaskedDiffWithXvec:
    """The module from hyper-parameters alone, random weights (for random-weight full-size releases)."""
    return CausalMaskedDiffWithXvec(FlowConfig.from_hparams(hparams)).eval()


def load_flow_state(module: CausalMaskedDiffWithXvec, state: dict[str, torch.Tensor],
                    file_name: str = CHECKPOINT_NAME) -> None:
    """Strict load: every official key with its shape, nothing else (ReleaseError naming file and key)."""
    check_state(state, {k: tuple(v.shape) for k, v in module.state_dict().items()}, file_name)
    module.load_state_dict(state, strict=True)


def build_flow(release: Release) -> CausalMaskedDiffWithXvec:
    """The module with the release's `flow.pt` weights (float16 or float32 on disk, float32 here)."""
    module = build_flow_random(release.hparams)
    load_flow_state(module, release.checkpoint(CHECKPOINT_NAME))
    return module


# ------------------------------------------------------------------------------------------------ export

class EncoderGraph(nn.Module):
    def __init__(self, flow: CausalMaskedDiffWithXvec) -> None:
        super().__init__()
        self.flow = flow

    def forward(self, token: torch.Tensor, embedding: torch.Tensor, finalize: torch.Tensor, streaming: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.flow.encode(token, embedding, finalize, streaming)


class EstimatorGraph(nn.Module):
    def __init__(self, flow: CausalMaskedDiffWithXvec) -> None:
        super().__init__()
        self.flow = flow

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                cond: torch.Tensor, streaming: torch.Tensor) -> torch.Tensor:
        return self.flow.velocity(x, mask, mu, t, spks, cond, streaming)


def graph_metadata(c: FlowConfig) -> dict[str, str]:
    """What the runtime needs beside the graphs (written into both files' metadata_props)."""
    return {
        "pre_lookahead_len": str(c.pre_lookahead_len), "token_mel_ratio": str(c.token_mel_ratio),
        "n_timesteps": str(N_TIMESTEPS), "inference_cfg_rate": repr(c.inference_cfg_rate),
        "encoder_chunk": str(c.encoder.static_chunk_size), "estimator_chunk": str(c.estimator.static_chunk_size),
        "estimator_left_chunks": str(c.estimator.num_decoding_left_chunks), "mel_bins": str(c.mel_bins),
        "spk_embed_dim": str(c.spk_embed_dim),
    }


def export_flow(module: CausalMaskedDiffWithXvec, out_dir: Path) -> dict[str, Path]:
    """Write flow_encoder.onnx and flow_estimator.onnx (signatures in the module docstring) into out_dir.

    Traced with the TorchScript exporter; example shapes use distinct sizes so that no dynamic dimension is
    specialised, and both flags are graph inputs (one graph covers streaming and non-streaming calls).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    module = module.eval()
    c = module.config
    b, size = 3, 2 * 7
    flag = torch.ones(1, dtype=torch.int64)
    jobs = {
        ENCODER_NAME: (
            EncoderGraph(module),
            (torch.randint(0, c.vocab_size, (1, 7 + c.pre_lookahead_len)), torch.randn(1, c.spk_embed_dim), flag,
             flag),
            ["token", "embedding", "finalize", "streaming"], ["mu", "spks"],
            {"token": {1: "tokens"}, "mu": {2: "frames"}}),
        ESTIMATOR_NAME: (
            EstimatorGraph(module),
            (torch.randn(b, c.mel_bins, size), torch.ones(b, 1, size), torch.randn(b, c.mel_bins, size),
             torch.rand(b), torch.randn(b, c.mel_bins), torch.randn(b, c.mel_bins, size), flag),
            ["x", "mask", "mu", "t", "spks", "cond", "streaming"], ["velocity"],
            {name: {0: "batch", 2: "frames"} for name in ("x", "mask", "mu", "cond", "velocity")}
            | {"t": {0: "batch"}, "spks": {0: "batch"}}),
    }
    paths: dict[str, Path] = {}
    for name, (graph, args, inputs, outputs, axes) in jobs.items():
        path = out_dir / f"{name}.onnx"
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer notices
            torch.onnx.export(graph, args, str(path), dynamo=False, opset_version=ONNX_OPSET, input_names=inputs,
                              output_names=outputs, dynamic_axes=axes, do_constant_folding=True)
        model = onnx.load(str(path))
        if name == ENCODER_NAME:  # the tracer leaves mu's batch axis unnamed; it is 1
            model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 1
        onnx.helper.set_model_props(model, graph_metadata(c))
        onnx.save(model, str(path))
        paths[name] = path
    return paths
