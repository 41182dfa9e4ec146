"""HiFT excitation: the f0 predictor and the NSF harmonic source (SineGen2 merged to one channel).

This half of the vocoder is the `hift_source` graph, which every precision target keeps in fp32: its exact phase
arithmetic (below) relies on float32 rounding. Differences from the official code, all by design:

* The Gaussian noise of the NSF source is an explicit input (`noise`); zeros reproduce the golden "noise0".
* The random initial phase of SineGen2 is omitted: the 1/480 linear down-sampling reads sample positions
  480 i + 239.5 only, so sample 0 (where that phase is added) never contributes.
* The sine phase is computed in cycles modulo 1 from its exact definition (linear half-pixel interpolation
  of 2 pi U cumsum((k f0 / sr) mod 1) between frame centres), splitting values on power-of-two grids so that
  every product and cumulative sum is exact in float32 (valid below 2**14 frames = 327 s). Given the
  float32 increments it matches a float64 evaluation to ~1e-5 rad at any length and holds no large numbers
  (float32 CumSum in ONNX Runtime / TensorRT is exact here). The official float32 code accumulates the raw
  phase (~1e5 rad after a few seconds); its rounding alone moves the golden waveforms by up to 4.5e-3 from a
  float64 run, which is the size of the difference between this module and those goldens.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # annotations only: hift.py imports RATE_GRID from here
    from cosyedge.quantize.cosyvoice2.hift import HiFTConfig

# Grids that split phase quantities into parts whose products / cumulative sums are exact in float32:
# rates (cycles per sample, < 1) on 2**-12 times U (< 2**12) or sample offsets (< 2**12 halves);
# frame advances (< 2) on 2**-9 and 2**-18, summed exactly over up to 2**14 frames (327 s at 50 Hz).
RATE_GRID = 2.0 ** 12
ADVANCE_GRIDS = (2.0 ** 9, 2.0 ** 18)


class ConvRNNF0Predictor(nn.Module):
    """Five Conv1d(k3)+ELU layers, a per-frame Linear to one value, abs: f0 in Hz per mel frame."""

    def __init__(self, in_channels: int, cond_channels: int):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            layers += [nn.Conv1d(in_channels if i == 0 else cond_channels, cond_channels, 3, padding=1), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = self.condnet(mel).transpose(1, 2)
        return torch.abs(self.classifier(x).squeeze(-1))


class SourceModuleHnNSF(nn.Module):
    """SineGen2 harmonic source merged to one excitation channel: tanh(l_linear(sines * uv + noise))."""

    def __init__(self, cfg: HiFTConfig):
        super().__init__()
        self.sampling_rate = float(cfg.sampling_rate)
        self.upsample = cfg.samples_per_frame
        self.sine_amp = cfg.nsf_alpha
        self.noise_std = cfg.nsf_sigma
        self.voiced_threshold = cfg.nsf_voiced_threshold
        self.l_linear = nn.Linear(cfg.nb_harmonics + 1, 1)
        self.register_buffer("harmonics", torch.arange(1, cfg.nb_harmonics + 2, dtype=torch.float32),
                             persistent=False)
        # Distance in samples from the reference frame centre, for the samples of a frame before / from its
        # centre (the centre of frame f lies at sample U f + (U - 1) / 2): half-integers, exact in float32.
        half = self.upsample / 2
        self.register_buffer("offsets_before", torch.arange(self.upsample // 2, dtype=torch.float32)[:, None]
                             + (0.5 + half), persistent=False)
        self.register_buffer("offsets_after", torch.arange(self.upsample // 2, self.upsample, dtype=torch.float32)
                             [:, None] + (0.5 - half), persistent=False)

    def _frame_increments(self, f0: torch.Tensor) -> torch.Tensor:
        """Official per-sample phase increment in cycles, (k f0 / sr) mod 1, per frame: [B, T, H]."""
        rad = f0.unsqueeze(-1) * self.harmonics / self.sampling_rate
        return rad - torch.floor(rad)

    def _cycles(self, rad: torch.Tensor) -> torch.Tensor:
        """Sine phase in cycles (mod 1) of every sample, [B, T*U, H], from the increments [B, T, H].

        Official: phase = linear x U interpolation (half-pixel) of 2 pi U cumsum(rad) at the frame centres.
        Between the centres of frames f-1 and f the phase grows by rad[f] cycles per sample; before the first
        and after the last centre it is constant. Computed mod 1 from exactly summed grid parts, so float32
        keeps ~1e-7 cycles at any length (the official float32 phase grows to ~1e5 rad).
        """
        batch, frames, sines = rad.shape
        rad_coarse, rad_fine = _split(rad, RATE_GRID)
        # Advance over one frame, U * rad mod 1 (U * rad_coarse is exact).
        advance = _frac(self.upsample * rad_coarse) + self.upsample * rad_fine
        adv_1, rest = _split(advance, ADVANCE_GRIDS[0])
        adv_2, adv_3 = _split(rest, ADVANCE_GRIDS[1])
        centre = _frac(_frac(torch.cumsum(adv_1, dim=1)) + _frac(torch.cumsum(adv_2, dim=1))
                       + torch.cumsum(adv_3, dim=1))
        zero = torch.zeros_like(rad[:, :1])
        # Samples before the centre of frame f: from centre f-1 at rate rad[f] (frame 0: held).
        before = _ramp(torch.cat([centre[:, :1], centre[:, :-1]], dim=1),
                       torch.cat([zero, rad_coarse[:, 1:]], dim=1), torch.cat([zero, rad_fine[:, 1:]], dim=1),
                       self.offsets_before)
        # Samples from the centre of frame f on: from centre f at rate rad[f+1] (last frame: held).
        after = _ramp(centre, torch.cat([rad_coarse[:, 1:], zero], dim=1), torch.cat([rad_fine[:, 1:], zero], dim=1),
                      self.offsets_after)
        return torch.cat([before, after], dim=2).reshape(batch, frames * self.upsample, sines)

    def excitation(self, f0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """f0 [B, T] (Hz), noise [B, T*U, H] standard Gaussian -> sines * uv + noise_amp * noise, [B, T*U, H]."""
        batch, frames = f0.shape
        sines = torch.sin(self._cycles(self._frame_increments(f0)) * (2 * math.pi)) * self.sine_amp
        uv = (f0 > self.voiced_threshold).to(torch.float32)
        uv = uv[:, :, None, None].expand(batch, frames, self.upsample, 1).reshape(batch, -1, 1)
        noise_amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
        return sines * uv + noise_amp * noise

    def forward(self, f0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """f0 [B, T] (Hz), noise [B, T*U, H] standard Gaussian -> source [B, 1, T*U]."""
        return torch.tanh(self.l_linear(self.excitation(f0, noise))).transpose(1, 2)


def _frac(x: torch.Tensor) -> torch.Tensor:
    """x mod 1 for x >= 0 (exact in floating point)."""
    return x - torch.floor(x)


def _split(x: torch.Tensor, grid: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x = coarse + fine exactly, coarse on the 1/grid lattice, 0 <= fine < 1/grid (x >= 0)."""
    coarse = torch.floor(x * grid) / grid
    return coarse, x - coarse


def _ramp(base: torch.Tensor, rate_coarse: torch.Tensor, rate_fine: torch.Tensor,
          offsets: torch.Tensor) -> torch.Tensor:
    """(base + offset * rate) mod 1 for base, rate [B, T, H] and offsets [n, 1] -> [B, T, n, H]."""
    cycles = base[:, :, None] + _frac(offsets * rate_coarse[:, :, None]) + offsets * rate_fine[:, :, None]
    return _frac(cycles)
