"""Quality metrics that prove a quantized graph still sounds like its fp32 original: numpy only.

The device measures them when it converts the default voice on first use; the build host (`cosyedge.quantize`)
reuses them for its gates and adds the torch-based speaker similarity.
"""
from __future__ import annotations

import math

import numpy as np


def _mel_filters(sample_rate: int, n_fft: int, n_mels: int) -> np.ndarray:
    """Triangular HTK-scale mel filters (n_mels, n_fft // 2 + 1)."""
    def hz_to_mel(hz: np.ndarray) -> np.ndarray:
        return 2595.0 * np.log10(1.0 + hz / 700.0)

    mels = np.linspace(hz_to_mel(np.array(0.0)), hz_to_mel(np.array(sample_rate / 2)), n_mels + 2)
    hz = 700.0 * (10 ** (mels / 2595.0) - 1.0)
    bins = np.fft.rfftfreq(n_fft, 1.0 / sample_rate)
    filters = np.zeros((n_mels, bins.size))
    for m in range(n_mels):
        lo, mid, hi = hz[m], hz[m + 1], hz[m + 2]
        filters[m] = np.clip(np.minimum((bins - lo) / (mid - lo), (hi - bins) / (hi - mid)), 0.0, None)
    return filters


def mel_cepstrum(wave: np.ndarray, sample_rate: int, n_coeffs: int = 25, n_mels: int = 40) -> np.ndarray:
    """(frames, n_coeffs) mel cepstra: 25 ms Hann frames every 5 ms, natural-log mel amplitudes, DCT-II scaled by 2/N.

    The 2/N scale and log amplitude make c1.. the usual real-cepstrum coefficients, so MCD lands on the
    familiar dB scale (about 2-8 dB between two different vocoders of the same voice).
    """
    n_fft = 1 << math.ceil(math.log2(0.025 * sample_rate))
    hop = int(0.005 * sample_rate)
    if wave.size < n_fft:
        wave = np.pad(wave, (0, n_fft - wave.size))
    frames = np.lib.stride_tricks.sliding_window_view(wave.astype(np.float64), n_fft)[::hop]
    power = np.abs(np.fft.rfft(frames * np.hanning(n_fft), axis=1)) ** 2
    log_mel = 0.5 * np.log(np.maximum(power @ _mel_filters(sample_rate, n_fft, n_mels).T, 1e-10))
    k = np.arange(n_mels)
    dct = np.cos(np.pi / n_mels * (k[None, :] + 0.5) * np.arange(n_coeffs)[:, None]) * (2.0 / n_mels)
    return log_mel @ dct.T


def mel_cepstral_distortion(reference: np.ndarray, test: np.ndarray, sample_rate: int) -> float:
    """MCD in dB over time-aligned frames (c0, the energy, excluded), on frames where the reference speaks."""
    a, b = mel_cepstrum(reference, sample_rate), mel_cepstrum(test, sample_rate)
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    energy = a[:, 0]
    voiced = energy > energy.max() - 3.0  # ignore near-silent frames, where log energies are noise
    diff = a[voiced, 1:] - b[voiced, 1:]
    return float(np.mean(10.0 / math.log(10.0) * np.sqrt(2.0 * np.sum(diff ** 2, axis=1))))


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    n = min(reference.size, test.size)
    noise = np.sum((reference[:n] - test[:n]) ** 2)
    return float(10.0 * math.log10(np.sum(reference[:n] ** 2) / max(noise, 1e-20)))
