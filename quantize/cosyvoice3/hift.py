"""Fun-CosyVoice3 vocoder (`CausalHiFTGenerator`) as a torch inference module.

Shared with CosyVoice2 and reused from cosyvoice2/hift.py: the yaml parser (`HiFTConfig.from_hparams` with the
causal class names), the Snake residual block (`ResBlock`, its convolutions made causal), and the STFT / iSTFT
with their windowed DFT bases (`HiFTBase`: n_fft 16, hop 4, periodic Hann, centred, overlap-add divided by the
squared window). Different here, because every convolution is causal:

* conv_pre: kernel `conv_pre_look_right` + 1 with that many frames of RIGHT context (zeros when finalizing);
* ups: nearest x u, left pad k-1, Conv1d (not ConvTranspose); source_downs: kernel 2u, stride u, left pad u-1;
  resblocks: left padding (k-1)*d; conv_post: left pad 6;
* the f0 predictor and the NSF source: hift_source.py (float64 f0, fixed noise).

`finalize=False` (streaming, the mel continues later): f0 uses the last 3 frames as look-ahead only, decode runs
on mel[:-3] with the last `conv_pre_look_right` frames as context, the source STFT loses those frames' worth
(look_right * U / hop) and the output its last U samples: (T - 8) * U samples that are an exact prefix of the
finalize=True output of any longer mel, which is what lets the runtime re-run HiFT and emit only new samples.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cosyedge.device.errors import ReleaseError
from cosyedge.quantize.cosyvoice2.hift import HiFTBase, HiFTConfig, ResBlock
from cosyedge.quantize.cosyvoice2.release import check_state
from cosyedge.quantize.cosyvoice3.hift_source import (SINE_NOISE_ROWS, CausalConv1d, CausalConvRNNF0Predictor,
                                                      NoiseSizes, SourceModuleHnNSF, fixed_sine_noise)
from cosyedge.quantize.cosyvoice3.release import YAML_NAME, Release3

CHECKPOINT_NAME = "hift.pt"
HIFT_TARGET = "cosyvoice.hifigan.generator.CausalHiFTGenerator"
F0_TARGET = "cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor"
CONV_POST_KERNEL = 7


@dataclass(frozen=True)
class HiFT3Config(HiFTConfig):
    conv_pre_look_right: int = 4

    @classmethod
    def from_release_hparams(cls, hparams: dict[str, Any]) -> "HiFT3Config":
        cfg = cls.from_hparams(hparams, target=HIFT_TARGET, f0_target=F0_TARGET, yaml_name=YAML_NAME)
        look = hparams["hift"].get("conv_pre_look_right")
        if look is None:
            raise ReleaseError(f"{YAML_NAME}: hift.conv_pre_look_right is missing")
        return replace(cfg, conv_pre_look_right=int(look))


def _keep(trace: dict[str, torch.Tensor] | None, name: str, value: torch.Tensor) -> None:
    """Record an intermediate for the parity tests (None: not recording)."""
    if trace is not None:
        trace[name] = value


class CausalResBlock(ResBlock):
    """CosyVoice2's block (x += conv2(snake(conv1(snake(x)))) per dilation), every conv left-padded (causal)."""

    @staticmethod
    def conv(channels: int, kernel_size: int, dilation: int) -> nn.Module:
        return CausalConv1d(channels, channels, kernel_size, dilation)


class CausalUpsample(nn.Conv1d):
    """Nearest x`rate`, left pad k-1, Conv1d (weight [out, in, k])."""

    def __init__(self, cin: int, cout: int, kernel: int, rate: int) -> None:
        super().__init__(cin, cout, kernel)
        self.rate = rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.repeat_interleave(x, self.rate, dim=2)
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class CausalDownsample(nn.Conv1d):
    """Left pad rate-1, Conv1d(kernel 2*rate, stride rate)."""

    def __init__(self, cin: int, cout: int, rate: int) -> None:
        super().__init__(cin, cout, 2 * rate, stride=rate)
        self.rate = rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.rate - 1, 0)))


class CausalHiFTGenerator(HiFTBase):
    cfg: HiFT3Config

    def __init__(self, cfg: HiFT3Config, noise_sizes: NoiseSizes) -> None:
        super().__init__(cfg)
        self.noise_sizes = noise_sizes
        harmonics = cfg.nb_harmonics + 1
        self.f0_predictor = CausalConvRNNF0Predictor(cfg.in_channels, cfg.f0_cond_channels).double()
        self.m_source = SourceModuleHnNSF(cfg.sampling_rate, cfg.samples_per_frame, harmonics, cfg.nsf_alpha,
                                          cfg.nsf_sigma, cfg.nsf_voiced_threshold)
        self.conv_pre = CausalConv1d(cfg.in_channels, cfg.base_channels, cfg.conv_pre_look_right + 1, side="right")
        stages = len(cfg.upsample_rates)
        ch = [cfg.base_channels // 2 ** i for i in range(stages + 1)]
        self.ups = nn.ModuleList(CausalUpsample(ch[i], ch[i + 1], k, u)
                                 for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes)))
        spec = cfg.n_fft + 2
        down = np.cumprod([1, *cfg.upsample_rates[::-1][:-1]])[::-1]
        self.source_downs = nn.ModuleList(CausalConv1d(spec, ch[i + 1], 1) if int(u) == 1
                                          else CausalDownsample(spec, ch[i + 1], int(u)) for i, u in enumerate(down))
        self.source_resblocks = nn.ModuleList(
            CausalResBlock(ch[i + 1], k, d)
            for i, (k, d) in enumerate(zip(cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes)))
        self.resblocks = nn.ModuleList(CausalResBlock(ch[i + 1], k, d) for i in range(stages)
                                       for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes))
        self.conv_post = CausalConv1d(ch[-1], spec, CONV_POST_KERNEL)
        self._noise: tuple[torch.Tensor, torch.Tensor] | None = None

    def fixed_noise(self, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rand_ini [H], sine_waves [>= samples, H]), generated once and grown on demand."""
        if self._noise is None or self._noise[1].shape[0] < samples:
            # a minute at a time; beyond the official tensor fixed_sine_noise refuses (ValueError)
            rows = max(samples, min(60 * self.cfg.sampling_rate, SINE_NOISE_ROWS))
            ini, waves = fixed_sine_noise(self.noise_sizes, self.cfg.nb_harmonics + 1, rows)
            self._noise = torch.from_numpy(ini), torch.from_numpy(waves)
        return self._noise

    def f0(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """float64 f0 [B, T] (finalize) or [B, T - 3]."""
        return self.f0_predictor(mel.to(torch.float64), finalize)

    def source(self, f0: torch.Tensor) -> torch.Tensor:
        """f0 [B, F] (any float dtype; cast to float32 as officially) -> source [B, 1, F*U]."""
        f0 = f0.to(torch.float32)
        ini, waves = self.fixed_noise(f0.shape[1] * self.cfg.samples_per_frame)
        return self.m_source(f0, ini, waves)

    def decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool = True,
               trace: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """mel [B, in, T'] (already without the f0 look-ahead when not finalizing), source [B, 1, T'*U]."""
        cfg, look = self.cfg, self.cfg.conv_pre_look_right
        spec = self.stft(source)
        if finalize:
            x = self.conv_pre(mel)
        else:
            x = self.conv_pre(mel[:, :, :-look], mel[:, :, -look:])
            spec = spec[:, :, :-(look * cfg.samples_per_frame // cfg.hop_len)]
        _keep(trace, "conv_pre", x)
        kernels = len(cfg.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, cfg.lrelu_slope))
            _keep(trace, f"ups{i}", x)
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            branch = self.source_resblocks[i](self.source_downs[i](spec))
            _keep(trace, f"source_branch{i}", branch)
            x = x + branch
            xs = self.resblocks[i * kernels](x)
            for j in range(1, kernels):
                xs = xs + self.resblocks[i * kernels + j](x)
            x = xs / kernels
        x = self.conv_post(F.leaky_relu(x))
        _keep(trace, "conv_post", x)
        bins = cfg.n_fft // 2 + 1
        speech = self.istft(torch.exp(x[:, :bins, :]), torch.sin(x[:, bins:, :]))
        _keep(trace, "istft_out", speech)
        if not finalize:
            speech = speech[:, :-cfg.samples_per_frame]
        return torch.clamp(speech, -cfg.audio_limit, cfg.audio_limit)

    @torch.no_grad()
    def inference(self, mel: torch.Tensor, finalize: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Official `inference`: mel [B, in, T] -> (speech, source, f0 float64)."""
        f0 = self.f0(mel, finalize)
        source = self.source(f0)
        x = mel if finalize else mel[:, :, :-self.f0_predictor.lookahead]
        return self.decode(x, source, finalize), source, f0


def noise_sizes(hparams: dict[str, Any], cfg: HiFT3Config) -> NoiseSizes:
    """The sizes that place the HiFT noise in the torch random stream (from the yaml's flow and hift entries)."""
    flow = hparams["flow"]
    return NoiseSizes(mel_bins=int(flow["output_size"]), flow_vocab=int(flow["vocab_size"]),
                      flow_input_size=int(flow["input_size"]), spk_embed_dim=int(flow["spk_embed_dim"]),
                      f0_in_channels=cfg.in_channels, f0_cond_channels=cfg.f0_cond_channels)


def build_hift_random(hparams: dict[str, Any]) -> CausalHiFTGenerator:
    cfg = HiFT3Config.from_release_hparams(hparams)
    return CausalHiFTGenerator(cfg, noise_sizes(hparams, cfg)).eval()


def load_hift_state(module: CausalHiFTGenerator, generator: dict[str, torch.Tensor],
                    f0: dict[str, torch.Tensor], file_name: str = CHECKPOINT_NAME) -> None:
    """Strict load of folded states: the generator (float32) and the f0 predictor (float64, keys unprefixed)."""
    merged = {**generator, **{"f0_predictor." + k: v for k, v in f0.items()}}
    check_state(merged, {k: tuple(v.shape) for k, v in module.state_dict().items()}, file_name)
    module.load_state_dict(merged, strict=True)    # copies into each parameter's dtype: f0 stays float64


def build_hift(release: Release3) -> CausalHiFTGenerator:
    module = build_hift_random(release.hparams)
    load_hift_state(module, *release.hift_checkpoint())
    return module
