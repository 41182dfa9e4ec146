"""Fun-CosyVoice3 flow stage (`CausalMaskedDiffWithDiT`): speech tokens -> mel, as a torch inference module.

What is shared with CosyVoice2, and therefore inherited from `cosyvoice2.flow.CausalMaskedDiffWithXvec` rather
than rewritten: the speaker projection, the CFM (fixed seed-0 noise, cosine grid, 10 Euler steps, classifier-free
guidance with the yaml's `inference_cfg_rate`), the prompt `cond`, the official `inference` token handling
(prompt ++ tokens, zero look-ahead placeholders on the final call) and the output trimming of the prompt frames.

What differs (facts sheet B2), and is all this module holds: there is no Conformer encoder and no `encoder_proj`;
`mu` = repeat_interleave(PreLookaheadLayer(input_embedding(tokens)), token_mel_ratio) with an 80 -> C -> 80
PreLookaheadLayer (the CosyVoice2 layer, widened by its `hidden` parameter); the estimator is the DiT
(flow_dit.py). Streaming (finalize False) keeps the last `pre_lookahead_len` tokens as look-ahead context only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cosyedge.device.errors import ReleaseError
from cosyedge.quantize.cosyvoice2.flow import CausalMaskedDiffWithXvec, fixed_noise, prompt_condition
from cosyedge.quantize.cosyvoice2.flow_config import FlowSizes
from cosyedge.quantize.cosyvoice2.flow_encoder import PreLookaheadLayer
from cosyedge.quantize.cosyvoice2.release import check_state
from cosyedge.quantize.cosyvoice3.flow_dit import DiT, DiTConfig
from cosyedge.quantize.cosyvoice3.release import YAML_NAME, Release3

CHECKPOINT_NAME = "flow.pt"
FLOW_TARGET = "cosyvoice.flow.flow.CausalMaskedDiffWithDiT"
PRELOOKAHEAD_TARGET = "cosyvoice.transformer.upsample_encoder.PreLookaheadLayer"

__all__ = ["CausalMaskedDiffWithDiT", "Flow3Config", "build_flow", "build_flow_random", "fixed_noise",
           "prompt_condition"]


@dataclass(frozen=True)
class Flow3Config(FlowSizes):
    pre_lookahead_channels: int
    estimator: DiTConfig

    @classmethod
    def from_hparams(cls, hparams: dict[str, Any]) -> "Flow3Config":
        flow = cls.flow_entry(hparams, FLOW_TARGET, YAML_NAME)
        try:
            pre, dec = flow["pre_lookahead_layer"], flow["decoder"]
            cfm = dec["cfm_params"]["content"]
            if getattr(pre, "target", None) != PRELOOKAHEAD_TARGET:
                raise ReleaseError(f"{YAML_NAME}: flow.pre_lookahead_layer must be {PRELOOKAHEAD_TARGET}")
            cls.check_cfm(cfm, YAML_NAME)
            c = cls(**cls.read(flow, cfm), pre_lookahead_channels=int(pre["channels"]),
                    estimator=DiTConfig.from_node(dec["estimator"], YAML_NAME))
        except (KeyError, TypeError) as exc:
            raise ReleaseError(f"{YAML_NAME}: flow entry lacks {exc.args[0]!r}") from None
        if int(pre["pre_lookahead_len"]) != c.pre_lookahead_len or int(pre["in_channels"]) != c.input_size:
            raise ReleaseError(f"{YAML_NAME}: flow.pre_lookahead_layer disagrees with flow input_size / "
                               "pre_lookahead_len")
        if c.input_size != c.mel_bins or c.estimator.mu_dim != c.mel_bins:
            raise ReleaseError(f"{YAML_NAME}: without an encoder, flow input_size, output_size and the estimator "
                               "mu_dim must be equal")
        return c


class CausalConditionalCFM(nn.Module):
    """Holds the estimator (key prefix `decoder.estimator.`); the fixed noise is an explicit input."""

    def __init__(self, c: DiTConfig) -> None:
        super().__init__()
        self.estimator = DiT(c)


class CausalMaskedDiffWithDiT(CausalMaskedDiffWithXvec):
    """The v3 flow. Inherits `speaker`, `solve` and `inference` from CosyVoice2's flow; only the modules (built
    here, so the parent's encoder is never created) and `encode` / `velocity` differ."""

    def __init__(self, c: Flow3Config) -> None:  # noqa: super-init-not-called - the parent's modules differ
        nn.Module.__init__(self)
        self.config = c  # type: ignore[assignment]  # duck-typed: pre_lookahead_len, inference_cfg_rate
        self.input_embedding = nn.Embedding(c.vocab_size, c.input_size)
        self.spk_embed_affine_layer = nn.Linear(c.spk_embed_dim, c.mel_bins)
        self.pre_lookahead_layer = PreLookaheadLayer(c.input_size, c.pre_lookahead_len, c.pre_lookahead_channels)
        self.decoder = CausalConditionalCFM(c.estimator)

    def prelookahead(self, token: torch.Tensor, finalize: torch.Tensor) -> torch.Tensor:
        """token [1, N + K] (last K = look-ahead, or placeholders when finalize) -> h [1, N, input_size]."""
        k = self.config.pre_lookahead_len
        emb = self.input_embedding(torch.clamp(token, min=0))
        lookahead = emb[:, -k:] * (finalize == 0).to(emb.dtype)   # finalize: zero right padding
        return self.pre_lookahead_layer(emb[:, :-k], lookahead)

    def encode(self, token: torch.Tensor, embedding: torch.Tensor, finalize: torch.Tensor, streaming: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (mu [1, M, ratio*N], spks [1, M]); `streaming` does not change mu (no attention before the DiT)."""
        h = self.prelookahead(token, finalize)
        mu = torch.repeat_interleave(h, self.config.token_mel_ratio, dim=1).transpose(1, 2)
        return mu, self.speaker(embedding)

    def velocity(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                 cond: torch.Tensor, streaming: torch.Tensor) -> torch.Tensor:
        return self.decoder.estimator(x, mask, mu, t, spks, cond, streaming)


def build_flow_random(hparams: dict[str, Any]) -> CausalMaskedDiffWithDiT:
    """The module from hyper-parameters alone, random weights (for random-weight full-size releases)."""
    return CausalMaskedDiffWithDiT(Flow3Config.from_hparams(hparams)).eval()


def load_flow_state(module: CausalMaskedDiffWithDiT, state: dict[str, torch.Tensor],
                    file_name: str = CHECKPOINT_NAME) -> None:
    """Strict load: every official key with its shape, nothing else (ReleaseError naming file and key)."""
    check_state(state, {k: tuple(v.shape) for k, v in module.state_dict().items()}, file_name)
    module.load_state_dict(state, strict=True)


def build_flow(release: Release3) -> CausalMaskedDiffWithDiT:
    """The module with the release's `flow.pt` weights (float16 or float32 on disk, float32 here)."""
    module = build_flow_random(release.hparams)
    load_flow_state(module, release.checkpoint(CHECKPOINT_NAME))
    return module
