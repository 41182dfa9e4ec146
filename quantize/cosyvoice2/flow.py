"""CosyVoice2 flow stage (`CausalMaskedDiffWithXvec`): speech tokens -> mel, as a torch inference module.

Our own modules with the official `flow.pt` key names (strict load), built from the release's
`cosyvoice2.yaml` `flow:` entry alone (the same code builds the tiny test release and CosyVoice2-0.5B):

* speaker: `spks = spk_embed_affine_layer(normalize(embedding))`;
* encoder (`UpsampleConformerEncoder`, flow_encoder.py): `encoder_proj` of its output gives `mu` (80 channels,
  2 frames per token);
* estimator (`CausalConditionalDecoder`, flow_estimator.py): a one-level causal 1-D UNet with transformer blocks;
* CFM: 10 Euler steps on the cosine grid t_k = 1 - cos(pi/2 * k/10) from the fixed noise, classifier-free guidance
  v = (1 + r) v(x, mu, spks, cond) - r v(x, 0, 0, 0) with r = `inference_cfg_rate` from the yaml.

Streaming (official `CosyVoice2Model` loop): each chunk re-runs the flow on all tokens so far with `streaming`
(chunk-causal attention: encoder chunks of `static_chunk_size` tokens before and x`token_mel_ratio` frames after the
upsampling, estimator chunks of its own `static_chunk_size` frames; a position sees every earlier chunk and its own)
and `finalize` False: the last `pre_lookahead_len` (3) tokens are only look-ahead context of the PreLookaheadLayer and
produce no mel. The final call uses finalize True (the look-ahead is zero padding) and, as the official loop does,
streaming False. The fixed noise makes the mel of earlier chunks reproducible.

The ONNX graphs, and the Euler recipe the runtime runs around the estimator graph, are in flow_export.py.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cosyedge.quantize.cosyvoice2.flow_config import EstimatorConfig, FlowConfig
from cosyedge.quantize.cosyvoice2.flow_encoder import UpsampleConformerEncoder
from cosyedge.quantize.cosyvoice2.flow_estimator import CausalConditionalDecoder, PromptState
from cosyedge.quantize.cosyvoice2.release import Release, check_state

CHECKPOINT_NAME = "flow.pt"
N_TIMESTEPS = 10            # hard-coded in the official flow.inference
NOISE_FRAMES = 15000        # the official fixed CFM noise: seed 0, randn(1, 80, 15000)


def fixed_noise() -> np.ndarray:
    """The official CFM noise: float32 (1, 80, 15000) drawn by `torch.manual_seed(0); torch.randn(1, 80, 15000)`."""
    generator = torch.Generator().manual_seed(0)  # same stream as the global seed-0 generator, state left untouched
    return torch.randn(1, 80, NOISE_FRAMES, generator=generator).numpy()


class CausalConditionalCFM(nn.Module):
    """Holds the estimator (key prefix `decoder.estimator.`); the fixed noise is an explicit input, not a buffer."""

    def __init__(self, c: EstimatorConfig) -> None:
        super().__init__()
        self.estimator = CausalConditionalDecoder(c)


def cosine_t_span(n_timesteps: int = N_TIMESTEPS) -> torch.Tensor:
    t = torch.linspace(0, 1, n_timesteps + 1, dtype=torch.float32)
    return 1 - torch.cos(t * 0.5 * torch.pi)


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
                 cond: torch.Tensor, streaming: torch.Tensor, state: PromptState | None = None) -> torch.Tensor:
        """The `flow_estimator` graph (with a prompt state: its frames after the state's past; flow_estimator.py)."""
        return self.decoder.estimator(x, mask, mu, t, spks, cond, streaming, state)

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
