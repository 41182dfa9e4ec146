"""ONNX export of the CosyVoice2 HiFT vocoder: the graph contract between the build host and the runtime.

HiFT is split at the excitation so that the source graph (phase arithmetic, kept fp32 by every target) and the
decoder graph (the convolutions that precision targets quantize) can run at different precisions, and so that the
runtime can replace the start of the source with the previous chunk's when streaming.

ONNX graphs written by `export_hift` (opset 17, standard ops only, dynamic batch B and mel frames T;
U = prod(upsample_rates) * hop_len = 480 samples per mel frame, H = nb_harmonics + 1 = 9 sinusoids):

* `hift_source.onnx`
    inputs:  `mel`    float32 [B, 80, T]      (80 = yaml in_channels)
             `noise`  float32 [B, T*U, H]     standard Gaussian N(0, 1) draw, one value per sample and
                                              sinusoid (the official `randn_like(sine_waves)`); the graph
                                              scales it by nsf_sigma (voiced) or nsf_alpha/3 (unvoiced).
                                              All zeros = the official output with the noise switched off.
    outputs: `source` float32 [B, 1, T*U]     NSF excitation tanh(l_linear(sines * uv + noise))
             `f0`     float32 [B, T]          predicted f0 in Hz (>= 0)
* `hift_decoder.onnx`
    inputs:  `mel`    float32 [B, 80, T]
             `source` float32 [B, 1, T*U]     the source above; for streaming, its first samples may be
                                              replaced by the cached source of the previous chunk
    outputs: `speech` float32 [B, T*U]        24 kHz waveform, clamped to +-audio_limit

Streaming (official v2 rules, done by the runtime between the two graphs): mel = last 8 frames of the
previous HiFT input ++ new mel; source[:, :, :8*U] = previous chunk's source[:, :, -8*U:]; decode; the first
8*U output samples are cross-faded with the previous tail (Hamming window of 16*U points).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from cosyedge.quantize.cosyvoice2.hift import HiFTGenerator
from cosyedge.quantize.cosyvoice2.onnx_export import trace_to_onnx


class _SourceGraph(nn.Module):
    def __init__(self, hift: HiFTGenerator):
        super().__init__()
        self.hift = hift

    def forward(self, mel: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.hift.source(mel, noise)


class _DecoderGraph(nn.Module):
    def __init__(self, hift: HiFTGenerator):
        super().__init__()
        self.hift = hift

    def forward(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        return self.hift.decode(mel, source)


def export_hift(module: HiFTGenerator, out_dir: Path) -> dict[str, Path]:
    """Write `hift_source.onnx` and `hift_decoder.onnx` (signatures in the module docstring)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = module.cfg
    frames = 6  # example length only; the time axis is dynamic
    mel = torch.zeros(1, cfg.in_channels, frames)
    noise = torch.zeros(1, frames * cfg.samples_per_frame, cfg.nb_harmonics + 1)
    source = torch.zeros(1, 1, frames * cfg.samples_per_frame)
    graphs = {
        "hift_source": (_SourceGraph(module), (mel, noise), ["mel", "noise"], ["source", "f0"],
                        {"mel": {0: "B", 2: "T"}, "noise": {0: "B", 1: "TU"},
                         "source": {0: "B", 2: "TU"}, "f0": {0: "B", 1: "T"}}),
        "hift_decoder": (_DecoderGraph(module), (mel, source), ["mel", "source"], ["speech"],
                         {"mel": {0: "B", 2: "T"}, "source": {0: "B", 2: "TU"}, "speech": {0: "B", 1: "TU"}}),
    }
    was_training = module.training
    module.eval()
    paths = {name: trace_to_onnx(graph, args, out_dir / f"{name}.onnx", inputs, outputs, axes)
             for name, (graph, args, inputs, outputs, axes) in graphs.items()}
    module.train(was_training)
    return paths
