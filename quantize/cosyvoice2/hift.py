"""CosyVoice2 HiFT vocoder (NSF source + iSTFT HiFi-GAN) as a torch inference module.

The module mirrors the official `HiFTGenerator.inference` (SineGen2 source, ConvRNNF0Predictor) with the
official `hift.pt` key names after weight-norm folding, so `load_state_dict(release.checkpoint("hift.pt"))`
is strict. Every size is read from the release yaml. Differences from the official code, all by design:

* The f0 predictor and the NSF source are in hift_source.py (with their own deviations from the official code).
* STFT / iSTFT are a Conv1d / ConvTranspose1d with fixed DFT bases (ONNX has no iSTFT; TensorRT 10.3 parses
  no DFT): periodic Hann, n_fft and hop from the yaml, centred with reflect padding like `torch.stft`; the
  iSTFT divides by the overlap-added squared window and trims n_fft/2 samples at both ends (`torch.istft`).

The two ONNX graphs (source / decoder) and the streaming rules the runtime applies between them are in
hift_export.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cosyedge.device.errors import ReleaseError
from cosyedge.quantize.cosyvoice2.hift_source import RATE_GRID, ConvRNNF0Predictor, SourceModuleHnNSF
from cosyedge.quantize.cosyvoice2.release import Node, Release, check_state

HIFT_TARGET = "cosyvoice.hifigan.generator.HiFTGenerator"
F0_TARGET = "cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor"
CHECKPOINT_NAME = "hift.pt"


@dataclass(frozen=True)
class HiFTConfig:
    """Hyper-parameters of `HiFTGenerator` and its `ConvRNNF0Predictor`, as written in the release yaml."""
    in_channels: int
    base_channels: int
    nb_harmonics: int
    sampling_rate: int
    nsf_alpha: float
    nsf_sigma: float
    nsf_voiced_threshold: float
    upsample_rates: tuple[int, ...]
    upsample_kernel_sizes: tuple[int, ...]
    n_fft: int
    hop_len: int
    resblock_kernel_sizes: tuple[int, ...]
    resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    source_resblock_kernel_sizes: tuple[int, ...]
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    lrelu_slope: float
    audio_limit: float
    f0_cond_channels: int

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsample_rates) * self.hop_len

    @classmethod
    def from_hparams(cls, hparams: dict[str, Any], *, target: str = HIFT_TARGET, f0_target: str = F0_TARGET,
                     yaml_name: str = "cosyvoice2.yaml") -> "HiFTConfig":
        """Parse the yaml `hift:` entry. The targets are parameters so that CosyVoice3's causal HiFT, which has
        the same hyper-parameters (plus its own), is parsed by this one function."""
        node = hparams.get("hift")
        if not isinstance(node, Node) or node.target != target:
            found = node.target if isinstance(node, Node) else type(node).__name__
            raise ReleaseError(f"{yaml_name}: 'hift' must be {target}, found {found}")

        def arg(key: str, source: Node = node, where: str = "hift") -> Any:
            if key not in source.args:
                raise ReleaseError(f"{yaml_name}: {where}.{key} is missing")
            return source.args[key]

        f0 = arg("f0_predictor")
        if not isinstance(f0, Node) or f0.target != f0_target:
            raise ReleaseError(f"{yaml_name}: hift.f0_predictor must be {f0_target}")
        if int(arg("num_class", f0, "hift.f0_predictor")) != 1:
            raise ReleaseError(f"{yaml_name}: hift.f0_predictor.num_class must be 1 (one f0 value per frame)")
        if int(arg("in_channels", f0, "hift.f0_predictor")) != int(arg("in_channels")):
            raise ReleaseError(f"{yaml_name}: hift.f0_predictor.in_channels differs from hift.in_channels")
        sampling_rate = int(arg("sampling_rate"))
        if sampling_rate == 22050:
            raise ReleaseError(f"{yaml_name}: hift.sampling_rate 22050 selects the CosyVoice1 SineGen source, "
                               "which this converter does not implement")
        istft = arg("istft_params")
        cfg = cls(
            in_channels=int(arg("in_channels")),
            base_channels=int(arg("base_channels")),
            nb_harmonics=int(arg("nb_harmonics")),
            sampling_rate=sampling_rate,
            nsf_alpha=float(arg("nsf_alpha")),
            nsf_sigma=float(arg("nsf_sigma")),
            nsf_voiced_threshold=float(arg("nsf_voiced_threshold")),
            upsample_rates=tuple(int(v) for v in arg("upsample_rates")),
            upsample_kernel_sizes=tuple(int(v) for v in arg("upsample_kernel_sizes")),
            n_fft=int(istft["n_fft"]),
            hop_len=int(istft["hop_len"]),
            resblock_kernel_sizes=tuple(int(v) for v in arg("resblock_kernel_sizes")),
            resblock_dilation_sizes=tuple(tuple(int(d) for d in ds) for ds in arg("resblock_dilation_sizes")),
            source_resblock_kernel_sizes=tuple(int(v) for v in arg("source_resblock_kernel_sizes")),
            source_resblock_dilation_sizes=tuple(tuple(int(d) for d in ds)
                                                 for ds in arg("source_resblock_dilation_sizes")),
            lrelu_slope=float(arg("lrelu_slope")),
            audio_limit=float(arg("audio_limit")),
            f0_cond_channels=int(arg("cond_channels", f0, "hift.f0_predictor")),
        )
        if len(cfg.upsample_kernel_sizes) != len(cfg.upsample_rates) or \
                len(cfg.source_resblock_kernel_sizes) != len(cfg.upsample_rates):
            raise ReleaseError(f"{yaml_name}: hift upsample_rates, upsample_kernel_sizes and "
                               "source_resblock_kernel_sizes must have the same length")
        if cfg.samples_per_frame >= RATE_GRID:
            raise ReleaseError(f"{yaml_name}: hift upsamples {cfg.samples_per_frame} samples per frame; "
                               f"the exact phase arithmetic supports fewer than {int(RATE_GRID)}")
        return cfg


def get_padding(kernel_size: int, dilation: int) -> int:
    """'Same' padding of an odd dilated kernel."""
    return (kernel_size * dilation - dilation) // 2


class Snake(nn.Module):
    """x + sin^2(alpha x) / alpha with a per-channel alpha (linear scale, as in the official HiFT)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha[None, :, None]
        return x + (1.0 / (alpha + 1e-9)) * torch.sin(x * alpha).pow(2)


class ResBlock(nn.Module):
    """Residual dilated-conv block with Snake activations: x += conv2(snake(conv1(snake(x)))) per dilation."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]):
        super().__init__()
        self.convs1 = nn.ModuleList(self.conv(channels, kernel_size, d) for d in dilations)
        self.convs2 = nn.ModuleList(self.conv(channels, kernel_size, 1) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    @staticmethod
    def conv(channels: int, kernel_size: int, dilation: int) -> nn.Module:
        """One of the block's convolutions: centred ("same") padding here; a causal block overrides it."""
        return nn.Conv1d(channels, channels, kernel_size, dilation=dilation, padding=get_padding(kernel_size, dilation))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = conv2(act2(conv1(act1(x)))) + x
        return x


def _hann(n_fft: int) -> np.ndarray:
    """Periodic Hann window (scipy get_window('hann', n, fftbins=True)), float64."""
    return 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)


def _dft_bases(n_fft: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(forward, inverse) real DFT kernels of shape [2*(n_fft/2+1), 1, n_fft], window included.

    Forward: channel k = w[n] cos(2 pi k n / N), channel bins+k = -w[n] sin(...) (torch.stft real | imag).
    Inverse: one-sided irfft (imag of DC and Nyquist ignored, 1/N scale) times the synthesis window.
    """
    bins = n_fft // 2 + 1
    n = np.arange(n_fft)
    k = np.arange(bins)[:, None]
    angle = 2 * np.pi * k * n / n_fft
    cos, sin = np.cos(angle), np.sin(angle)
    sin[0] = 0.0
    if n_fft % 2 == 0:
        sin[-1] = 0.0
    window = _hann(n_fft)
    forward = np.concatenate([cos, -sin]) * window
    scale = np.full((bins, 1), 2.0)
    scale[0] = 1.0
    if n_fft % 2 == 0:
        scale[-1] = 1.0
    inverse = np.concatenate([scale * cos, -scale * sin]) / n_fft * window
    return (torch.from_numpy(forward.astype(np.float32))[:, None, :],
            torch.from_numpy(inverse.astype(np.float32))[:, None, :])


class HiFTBase(nn.Module):
    """What every HiFT generator (CosyVoice2's, CosyVoice3's causal one) shares: its config and the centred STFT /
    iSTFT of the source and the output, as windowed-DFT convolutions (bases in non-persistent buffers)."""

    def __init__(self, cfg: HiFTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        stft_basis, istft_basis = _dft_bases(cfg.n_fft)
        self.register_buffer("stft_basis", stft_basis, persistent=False)
        self.register_buffer("istft_basis", istft_basis, persistent=False)
        self.register_buffer("window_square", torch.from_numpy(_hann(cfg.n_fft) ** 2).float()[None, None, :],
                             persistent=False)

    def stft(self, signal: torch.Tensor) -> torch.Tensor:
        """[B, 1, L] -> [B, 2*(n_fft/2+1), L/hop + 1]: real then imaginary parts of the centred STFT."""
        half = self.cfg.n_fft // 2
        return F.conv1d(F.pad(signal, (half, half), mode="reflect"), self.stft_basis, stride=self.cfg.hop_len)

    def istft(self, magnitude: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
        """Centred one-sided iSTFT by overlap-add: [B, bins, F] x 2 -> [B, hop * (F - 1)]."""
        magnitude = torch.clamp(magnitude, max=1e2)
        spec = torch.cat([magnitude * torch.cos(phase), magnitude * torch.sin(phase)], dim=1)
        frames = F.conv_transpose1d(spec, self.istft_basis, stride=self.cfg.hop_len)
        envelope = F.conv_transpose1d(torch.ones_like(spec[:1, :1, :]), self.window_square, stride=self.cfg.hop_len)
        half = self.cfg.n_fft // 2
        return (frames / envelope)[:, 0, half:-half]


class HiFTGenerator(HiFTBase):
    """HiFT inference: f0 -> NSF source -> source-conditioned HiFi-GAN -> magnitude/phase -> iSTFT."""

    def __init__(self, cfg: HiFTConfig):
        super().__init__(cfg)
        self.f0_predictor = ConvRNNF0Predictor(cfg.in_channels, cfg.f0_cond_channels)
        self.m_source = SourceModuleHnNSF(cfg)
        self.conv_pre = nn.Conv1d(cfg.in_channels, cfg.base_channels, 7, padding=3)
        stages = len(cfg.upsample_rates)
        channels = [cfg.base_channels // 2 ** i for i in range(stages + 1)]
        self.ups = nn.ModuleList(
            nn.ConvTranspose1d(channels[i], channels[i + 1], k, u, padding=(k - u) // 2)
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes)))
        spec_channels = cfg.n_fft + 2
        down_rates = np.cumprod([1, *cfg.upsample_rates[::-1][:-1]])[::-1]
        self.source_downs = nn.ModuleList(
            nn.Conv1d(spec_channels, channels[i + 1], 1) if int(u) == 1
            else nn.Conv1d(spec_channels, channels[i + 1], int(u) * 2, int(u), padding=int(u) // 2)
            for i, u in enumerate(down_rates))
        self.source_resblocks = nn.ModuleList(
            ResBlock(channels[i + 1], k, d)
            for i, (k, d) in enumerate(zip(cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes)))
        self.resblocks = nn.ModuleList(
            ResBlock(channels[i + 1], k, d) for i in range(stages)
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes))
        self.conv_post = nn.Conv1d(channels[-1], spec_channels, 7, padding=3)

    def f0(self, mel: torch.Tensor) -> torch.Tensor:
        """mel [B, 80, T] -> f0 [B, T] in Hz."""
        return self.f0_predictor(mel)

    def source(self, mel: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """mel [B, 80, T], noise [B, T*U, H] -> (source [B, 1, T*U], f0 [B, T])."""
        f0 = self.f0(mel)
        return self.m_source(f0, noise), f0

    def decode(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """mel [B, 80, T], source [B, 1, T*U] -> speech [B, T*U] clamped to +-audio_limit."""
        cfg = self.cfg
        spec = self.stft(source)
        x = self.conv_pre(mel)
        stages = len(self.ups)
        kernels = len(cfg.resblock_kernel_sizes)
        for i in range(stages):
            x = self.ups[i](F.leaky_relu(x, cfg.lrelu_slope))
            if i == stages - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](spec))
            xs = self.resblocks[i * kernels](x)
            for j in range(1, kernels):
                xs = xs + self.resblocks[i * kernels + j](x)
            x = xs / kernels
        x = self.conv_post(F.leaky_relu(x))
        bins = cfg.n_fft // 2 + 1
        speech = self.istft(torch.exp(x[:, :bins, :]), torch.sin(x[:, bins:, :]))
        return torch.clamp(speech, -cfg.audio_limit, cfg.audio_limit)

    def forward(self, mel: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """mel [B, 80, T], noise [B, T*U, H] -> speech [B, T*U] (non-streaming inference)."""
        source, _ = self.source(mel, noise)
        return self.decode(mel, source)


def build_hift_random(hparams: dict[str, Any]) -> HiFTGenerator:
    """The module from hyper-parameters alone, random weights (for random-weight full-size releases)."""
    return HiFTGenerator(HiFTConfig.from_hparams(hparams)).eval()


def load_hift_state(module: HiFTGenerator, state: dict[str, torch.Tensor], file_name: str = CHECKPOINT_NAME) -> None:
    """Strict load of a weight-norm-folded state: every official key with its shape, nothing else."""
    check_state(state, {k: tuple(v.shape) for k, v in module.state_dict().items()}, file_name)
    module.load_state_dict(state, strict=True)


def build_hift(release: Release) -> HiFTGenerator:
    """The release's HiFT with its `hift.pt` weights (float16 or float32 on disk, float32 here)."""
    module = build_hift_random(release.hparams)
    load_hift_state(module, release.checkpoint(CHECKPOINT_NAME))
    return module
