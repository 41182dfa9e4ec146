"""ONNX export of the Fun-CosyVoice3 causal HiFT: the graph contract between the build host and the runtime.

Split at the excitation as for CosyVoice2 (`cosyvoice2.hift_export`): the source graph (f0 + NSF phase arithmetic,
kept fp32 / fp64 by every target) and the decoder graph (the convolutions precision targets may quantize). The
iSTFT is the same windowed-DFT overlap-add as CosyVoice2's (no ONNX op needed).

ONNX graphs written by `export_hift` (opset 17, standard ops only; dynamic batch B and mel frames T; U = samples
per mel frame (480), H = nb_harmonics + 1 (9)):

* `hift_source.onnx`
    inputs:  `mel`        float32 [B, 80, T]
             `sine_noise` float32 [L, H]    the release's FIXED uniform noise rows 0..L-1, L >= T*U (the official
                                            `sine_waves`; regenerate them with the MT19937 recipe from metadata
                                            `noise_draws_before`: skip that many draws after seeding 0, then H
                                            draws of rand_ini, then the rows). Shared by every batch row.
    outputs: `source`     float32 [B, 1, T*U]
             `f0`         float64 [B, T]    Hz, computed in float64 as officially (ORT has no float64 Conv, so
                                            the predictor's convolutions are float64 MatMuls over shifted copies)
    rand_ini (the first-sample phase offsets) is a constant of the graph. f0 uses zero right padding for its 3
    look-ahead frames (the official finalize=True).
* `hift_decoder.onnx`
    inputs:  `mel` float32 [B, 80, T], `source` float32 [B, 1, T*U]
    outputs: `speech` float32 [B, T*U]  24 kHz, clamped to +-audio_limit; conv_pre's look-ahead frames are zeros.

finalize=False (streaming: the accumulated mel continues later) needs no other graph, because every layer after
the two look-ahead convolutions is causal: for an accumulated mel of T frames, run `hift_source` on all T frames
and keep source[..., :(T - f0_lookahead) * U]; run `hift_decoder` on mel[..., :T - f0_lookahead] with that source
and keep speech[..., :(T - f0_lookahead - conv_pre_lookahead - 1) * U], i.e. (T - 8) * U samples: equal to the
official `inference(finalize=False)` output (tested), and an exact prefix of any later, longer run. The decoder
may start later than frame 0: from frame S on, its speech after frame S + `decoder_history_frames` (written to the
manifest as `hift_history_frames`) equals the whole run's, since no layer reaches further back; the source must
still run from frame 0 (its phase accumulates from the first sample).

Metadata (`metadata_props`, both files): samples_per_frame, harmonics, f0_lookahead, conv_pre_lookahead,
noise_draws_before, sine_noise_max_rows, sample_rate.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cosyedge.quantize.cosyvoice2.onnx_export import trace_to_onnx
from cosyedge.quantize.cosyvoice3.hift import CausalHiFTGenerator
from cosyedge.quantize.cosyvoice3.hift_source import SINE_NOISE_ROWS, CausalConv1d, CausalConvRNNF0Predictor

SOURCE_NAME = "hift_source"
DECODER_NAME = "hift_decoder"


class F0Float64(nn.Module):
    """The f0 predictor in float64 with MatMul / Exp / Where only: each Conv1d becomes a MatMul of the
    [C_out, C_in*K] weight with the K shifted copies of the padded input, ELU is where(x > 0, x, exp(x) - 1)."""

    def __init__(self, predictor: CausalConvRNNF0Predictor) -> None:
        super().__init__()
        self.convs: list[tuple[int, str]] = []
        for i, layer in enumerate(m for m in predictor.condnet if isinstance(m, CausalConv1d)):
            if layer.dilation[0] != 1:
                raise ValueError("the f0 predictor's convolutions are not dilated")
            w = layer.weight.detach().to(torch.float64)
            self.register_buffer(f"w{i}", w.reshape(w.shape[0], -1).clone())
            self.register_buffer(f"b{i}", layer.bias.detach().to(torch.float64).reshape(-1, 1).clone())
            self.convs.append((int(layer.kernel_size[0]), layer.side))
        self.register_buffer("wc", predictor.classifier.weight.detach().to(torch.float64).clone())
        self.register_buffer("bc", predictor.classifier.bias.detach().to(torch.float64).clone())

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """mel [B, C, T] -> f0 [B, T] float64 (finalize: zero right padding of the look-ahead conv)."""
        x = mel.to(torch.float64)
        for i, (k, side) in enumerate(self.convs):
            x = F.pad(x, (0, k - 1) if side == "right" else (k - 1, 0))
            shifted = [x[:, :, j:(j - k + 1) if j < k - 1 else None] for j in range(k)]
            cols = torch.stack(shifted, dim=2).flatten(1, 2)                 # [B, C_in*K, T], index c*K + j
            x = torch.matmul(getattr(self, f"w{i}"), cols) + getattr(self, f"b{i}")
            x = torch.where(x > 0, x, torch.exp(x) - 1)
        return torch.abs(torch.matmul(x.transpose(1, 2), self.wc.t()) + self.bc).squeeze(-1)


class _SourceGraph(nn.Module):
    def __init__(self, hift: CausalHiFTGenerator) -> None:
        super().__init__()
        self.f0 = F0Float64(hift.f0_predictor)
        self.m_source = hift.m_source
        self.register_buffer("rand_ini", hift.fixed_noise(0)[0].clone())

    def forward(self, mel: torch.Tensor, sine_noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f0 = self.f0(mel)
        return self.m_source(f0.to(torch.float32), self.rand_ini, sine_noise), f0


class _DecoderGraph(nn.Module):
    def __init__(self, hift: CausalHiFTGenerator) -> None:
        super().__init__()
        self.hift = hift

    def forward(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        return self.hift.decode(mel, source, finalize=True)


def hift_metadata(hift: CausalHiFTGenerator) -> dict[str, str]:
    cfg = hift.cfg
    return {"samples_per_frame": str(cfg.samples_per_frame), "harmonics": str(cfg.nb_harmonics + 1),
            "f0_lookahead": str(hift.f0_predictor.lookahead), "conv_pre_lookahead": str(cfg.conv_pre_look_right),
            "noise_draws_before": str(hift.noise_sizes.draws_before()), "sine_noise_max_rows": str(SINE_NOISE_ROWS),
            "sample_rate": str(cfg.sampling_rate)}


def streaming_lengths(hift: CausalHiFTGenerator, frames: int) -> tuple[int, int, int]:
    """finalize=False for `frames` accumulated mel frames: (decoder mel frames, source samples kept,
    speech samples kept) - the runtime's trimming rule stated in the module docstring."""
    cfg = hift.cfg
    mel_frames = frames - hift.f0_predictor.lookahead
    kept = mel_frames - cfg.conv_pre_look_right - 1
    return mel_frames, mel_frames * cfg.samples_per_frame, max(kept, 0) * cfg.samples_per_frame


def decoder_history_frames(hift: CausalHiFTGenerator, frames: int = 64, limit: int = 4096) -> int:
    """How far back the decoder looks, in mel frames: a change to mel frame 0, or to source frame 0, leaves every
    speech sample from frame `history` on as it was (its layers are causal but for conv_pre's look-ahead, so the
    reach is finite). A stream may then re-run the decoder from `history` frames before its first unsent sample
    instead of from the first frame (device/cosyvoice3/vocoder.RerunStream). Measured by perturbation on the
    module, so it holds for any stage count, kernel and dilation; the window grows until the reach lies well
    inside it."""
    graph, u = _DecoderGraph(hift).eval(), hift.cfg.samples_per_frame
    generator = torch.Generator().manual_seed(0)
    while frames <= limit:
        mel = torch.randn(1, hift.cfg.in_channels, frames, generator=generator)
        source = torch.rand(1, 1, frames * u, generator=generator) * 0.2 - 0.1
        moved_mel, moved_source = mel.clone(), source.clone()
        moved_mel[:, :, 0] += 1.0
        moved_source[:, :, :u] += 0.5
        with torch.no_grad():
            base = graph(mel, source)
            reach = max(_last_change(base, graph(moved_mel, source)), _last_change(base, graph(mel, moved_source)))
        if reach // u + 1 < frames // 2:
            return reach // u + 1
        frames *= 2
    raise ValueError(f"the HiFT decoder's reach exceeds {limit // 2} frames: it is not causal")


def _last_change(base: torch.Tensor, moved: torch.Tensor) -> int:
    """The last sample where `moved` differs from `base` beyond float round-off (-1: none)."""
    changed = torch.nonzero((moved - base).abs()[0] > 1e-7 * float(base.abs().max()))
    return int(changed.max()) if changed.numel() else -1


def export_hift(module: CausalHiFTGenerator, out_dir: Path) -> dict[str, Path]:
    """Write `hift_source.onnx` and `hift_decoder.onnx` (signatures in the module docstring)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = module.cfg
    frames, u, h = 13, cfg.samples_per_frame, cfg.nb_harmonics + 1   # example sizes only; time axes are dynamic
    mel = torch.randn(2, cfg.in_channels, frames)
    noise = torch.rand(frames * u + 7, h)
    source = torch.zeros(2, 1, frames * u)
    graphs = {
        SOURCE_NAME: (_SourceGraph(module), (mel, noise), ["mel", "sine_noise"], ["source", "f0"],
                      {"mel": {0: "B", 2: "T"}, "sine_noise": {0: "L"}, "source": {0: "B", 2: "TU"},
                       "f0": {0: "B", 1: "T"}}),
        DECODER_NAME: (_DecoderGraph(module), (mel, source), ["mel", "source"], ["speech"],
                       {"mel": {0: "B", 2: "T"}, "source": {0: "B", 2: "TU"}, "speech": {0: "B", 1: "TU"}}),
    }
    was_training = module.training
    module.eval()
    paths = {name: trace_to_onnx(graph, args, out_dir / f"{name}.onnx", inputs, outputs, axes, hift_metadata(module))
             for name, (graph, args, inputs, outputs, axes) in graphs.items()}
    module.train(was_training)
    return paths
