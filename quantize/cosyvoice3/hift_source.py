"""Fun-CosyVoice3 HiFT excitation: the causal f0 predictor (run in float64) and the NSF source with the official
FIXED noise tensors, regenerated from their documented recipe instead of shipped.

Why float64 f0: the official `CausalHiFTGenerator.inference` casts the f0 predictor (weights included, so the
weight norm is folded in float64) and the mel to float64 ("precision is crucial for causal inference"); a float32
f0 is off by up to 4e-4 Hz and moves the waveform by ~1e-4. The weights arrive folded in float64 from
`Release3.hift_checkpoint`. f0 is cast back to float32 before the source, as officially.

Why this sine source differs from CosyVoice2's (cosyvoice2/hift_source.py, which is not reused): the causal
SineGen2 up-samples the accumulated phase with NEAREST (one phase value per frame, repeated over its samples),
adds `rand_ini` to sample 0, and its "noise" is a fixed uniform [0, 1) tensor created at construction - not a
fresh Gaussian. The phase is computed here with the official float32 op order (cumsum, x2, x pi, x upsample),
because its rounding at large phases is part of the golden values.

Fixed noise recipe (vectors/README.md section 4, verified bit-exact there): the tensors are torch CPU `rand`
draws from the MT19937 stream seeded 0 by the CFM, after every draw made between that seed and them in yaml
construction order: CFM randn(1, mel, 15000), the flow's input_embedding (normal_) and speaker Linear, then the
HiFT f0 predictor's convolutions and classifier; then rand_ini (nb_harmonics + 1) and sine_waves (7.2 M x 9).
One 32-bit output per float32: (u32 & 0xFFFFFF) * 2**-24. Only the rows a call needs are generated.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

CFM_NOISE_FRAMES = 15000        # the official fixed CFM noise: randn(1, mel, 15000)
SINE_NOISE_ROWS = 7_200_000     # the official sine_waves: rand(1, 7200000, H) (caps the vocoder at 300 s)
F0_FIRST_KERNEL = 4             # CausalConvRNNF0Predictor: condnet.0 k4 (right look-ahead 3), then 4 x k3
F0_KERNEL = 3
F0_LAYERS = 5


def _normal_draws(numel: int) -> int:
    """MT19937 outputs used by torch's CPU normal_ on a float32 tensor of >= 16 elements."""
    return numel + (16 if numel % 16 else 0)


@dataclass(frozen=True)
class NoiseSizes:
    """The sizes that decide how many random draws precede the HiFT noise (all read from the release)."""
    mel_bins: int
    flow_vocab: int
    flow_input_size: int
    spk_embed_dim: int
    f0_in_channels: int
    f0_cond_channels: int

    def draws_before(self) -> int:
        c, i = self.f0_cond_channels, self.f0_in_channels
        f0 = (i * c * F0_FIRST_KERNEL + c) + (F0_LAYERS - 1) * (c * c * F0_KERNEL + c) + (c + 1)
        return (_normal_draws(self.mel_bins * CFM_NOISE_FRAMES) + _normal_draws(self.flow_vocab * self.flow_input_size)
                + self.spk_embed_dim * self.mel_bins + self.mel_bins + f0)


def fixed_sine_noise(sizes: NoiseSizes, harmonics: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(rand_ini [H] with [0] = 0, sine_waves [rows, H]) exactly as the official construction draws them."""
    if rows > SINE_NOISE_ROWS:
        raise ValueError(f"{rows} source samples exceed the official fixed noise ({SINE_NOISE_ROWS})")
    bits = np.random.MT19937()
    bits._legacy_seeding(0)
    bits.random_raw(sizes.draws_before())
    raw = bits.random_raw(harmonics + harmonics * rows)
    vals = ((raw & 0xFFFFFF).astype(np.float64) * 2.0 ** -24).astype(np.float32)
    rand_ini = vals[:harmonics].copy()
    rand_ini[0] = 0.0
    return rand_ini, vals[harmonics:].reshape(rows, harmonics)


class CausalConv1d(nn.Conv1d):
    """Conv1d with zero padding of (k-1)*d on one side: 'left' (causal) or 'right' (look-ahead), where the right
    side may instead be real look-ahead frames (`context`) when the input does not end the utterance."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, side: str = "left") -> None:
        super().__init__(cin, cout, kernel, dilation=dilation)
        self.pad = (kernel - 1) * dilation
        self.side = side

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        if self.side == "left":
            return super().forward(F.pad(x, (self.pad, 0)))
        if context is None or context.shape[2] == 0:
            return super().forward(F.pad(x, (0, self.pad)))
        return super().forward(torch.cat([x, context], dim=2))


class CausalConvRNNF0Predictor(nn.Module):
    """condnet: k4 look-ahead conv + ELU, 4 x (causal k3 conv + ELU); classifier Linear(C, 1); abs -> f0 (Hz)."""

    def __init__(self, in_channels: int, cond_channels: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [CausalConv1d(in_channels, cond_channels, F0_FIRST_KERNEL, side="right"), nn.ELU()]
        for _ in range(F0_LAYERS - 1):
            layers += [CausalConv1d(cond_channels, cond_channels, F0_KERNEL), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, 1)

    @property
    def lookahead(self) -> int:
        return self.condnet[0].pad

    def forward(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """mel [B, in, T] -> f0 [B, T] (finalize) or [B, T - lookahead] (the last frames are context only)."""
        k = self.lookahead
        x = self.condnet[0](mel) if finalize else self.condnet[0](mel[:, :, :-k], mel[:, :, -k:])
        for layer in list(self.condnet)[1:]:
            x = layer(x)
        return torch.abs(self.classifier(x.transpose(1, 2)).squeeze(-1))


def downsample_linear(x: torch.Tensor, factor: int) -> torch.Tensor:
    """[B, L, H] -> [B, L / factor, H]: exactly torch's `interpolate(scale_factor=1/factor, mode="linear")`
    (half-pixel): output j samples position j*factor + (factor-1)/2, i.e. the mean of the two middle samples of
    block j (even factor, weights 0.5 each: bit-exact) or its middle sample (odd factor). Written with slices
    because ONNX Resize forms the weights from a float32 1/factor and is off by an ulp."""
    blocks = x.reshape(x.shape[0], x.shape[1] // factor, factor, x.shape[2])   # sizes traced, not frozen
    mid = factor // 2
    if factor % 2:
        return blocks[:, :, mid]
    return (blocks[:, :, mid - 1] + blocks[:, :, mid]) * 0.5


class SourceModuleHnNSF(nn.Module):
    """Causal SineGen2 + merge: f0 [B, T] (float32) -> source [B, 1, T*U]. Noise tensors are explicit inputs."""

    def __init__(self, sampling_rate: int, upsample: int, harmonics: int, sine_amp: float, noise_std: float,
                 voiced_threshold: float) -> None:
        super().__init__()
        self.sampling_rate, self.upsample = sampling_rate, upsample
        self.sine_amp, self.noise_std, self.voiced_threshold = sine_amp, noise_std, voiced_threshold
        self.l_linear = nn.Linear(harmonics, 1)
        self.register_buffer("harmonic_index", torch.arange(1, harmonics + 1, dtype=torch.float32)[None, None],
                             persistent=False)

    def sines(self, f0_up: torch.Tensor, rand_ini: torch.Tensor) -> torch.Tensor:
        """Unit sines [B, L, H] of the per-sample f0 [B, L, 1] (official `_f02sine`, causal)."""
        rad = torch.remainder(f0_up * self.harmonic_index / self.sampling_rate, 1)
        rad = torch.cat([rad[:, :1] + rand_ini, rad[:, 1:]], dim=1)
        rad = downsample_linear(rad, self.upsample)
        # torch's CPU cumsum accumulates float32 in float64 (each output rounded once); writing the float64 cumsum
        # explicitly is bit-identical in torch and makes ONNX Runtime (whose CumSum accumulates in the input
        # type) reproduce it too
        phase = torch.cumsum(rad.to(torch.float64), dim=1).to(rad.dtype) * 2 * np.pi
        phase = F.interpolate(phase.transpose(1, 2) * self.upsample, scale_factor=self.upsample,
                              mode="nearest").transpose(1, 2)
        return torch.sin(phase)

    def forward(self, f0: torch.Tensor, rand_ini: torch.Tensor, sine_noise: torch.Tensor) -> torch.Tensor:
        """f0 [B, T], rand_ini [H], sine_noise [>= T*U, H] (the fixed uniform tensor) -> source [B, 1, T*U]."""
        f0_up = torch.repeat_interleave(f0, self.upsample, dim=1).unsqueeze(-1)          # nearest x U
        waves = self.sines(f0_up, rand_ini) * self.sine_amp
        uv = (f0_up > self.voiced_threshold).to(waves.dtype)
        noise_amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
        waves = waves * uv + noise_amp * sine_noise[None, :waves.shape[1]]
        return torch.tanh(self.l_linear(waves)).transpose(1, 2)
