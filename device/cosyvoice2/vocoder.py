"""CosyVoice2 HiFT vocoder on ONNX Runtime, and its per-request streaming cache (the family's `Vocoder` part).

Graph signatures: quantize/cosyvoice2/hift_export.py. The NSF source noise is an input: zeros for deterministic
requests, else a standard normal draw from the request's own generator.

Streaming (official v2 rules): each chunk's mel is prefixed with the last `mel_cache_frames` mel frames of the
previous HiFT input; the first `source_cache_samples` samples of the new source are replaced by the previous
source's tail; the first `crossfade_samples` output samples are cross-faded with the previous output tail using
a Hamming window of twice that length (first half on the new samples, second half on the cached ones); a
non-final chunk keeps its last `crossfade_samples` samples back for the next cross-fade.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np
import onnxruntime as ort

from cosyedge.device.cosyvoice2.flow import StepRunner


# HiFT decoding in windows (`decode_bounded`: a whole mel, or a stream chunk longer than a window). The decoder's memory
# grows with its input: 0.27 MB per mel frame at 0.5B (the int8 decoder, 2 threads: +134 MB over a 10 s call, +29 MB
# over 2 s), from its full-rate activations and convolution buffers. Its receptive field is under 16 mel frames (conv_pre
# reaches 3 frames, the first upsampling stage's dilated resblocks 7.5, the later stages 2 more): with 16 frames of
# context either side a window's samples equal one whole call's bit for bit (fp32 and int8 decoders at full size, the
# int8 one again at 500 and 700 frames; the tiny release in test_cv2_pipeline.py; 12 frames differ by 6e-4), so 16 it
# is: a 10 s segment goes in 4 windows of 125 frames and decodes 1.19x its frames (24 frames: 1.29x; the full-size int8
# decoder, 2 threads, 500 frames, 5 alternated runs: 1.25 s against 1.34 s). 150 frames = 3 s. A 10 s render at full
# size (int8 decoder, 2 threads, random weights, 24 frames of context): 250 frames, +100 MB over the engine and 1.25 s;
# 150, +57 MB and 1.40-1.45 s (under the flow encoder's +77 MB, the stream-off request's next peak); 100, +49 MB and
# 1.58 s.
WINDOW_FRAMES = 150
CONTEXT_FRAMES = 16


def decode_in_windows(decode: Callable[[np.ndarray, np.ndarray], np.ndarray], mel: np.ndarray, source: np.ndarray,
                      samples_per_frame: int, width: int, before: int, after: int) -> np.ndarray:
    """A HiFT decoder over [1, M, T] `mel` and its source, `width` frames kept per call, each call decoding from
    `before` frames earlier to `after` past its end (within the mel): [T * U] samples, equal to one call's when
    `before` and `after` cover the decoder's reach (both families' whole-mel rendering)."""
    frames, u = mel.shape[2], samples_per_frame
    speech = np.empty(frames * u, np.float32)
    for begin in range(0, frames, width):
        end = min(begin + width, frames)
        start, stop = max(begin - before, 0), min(end + after, frames)
        window = decode(np.ascontiguousarray(mel[:, :, start:stop]),
                        np.ascontiguousarray(source[:, :, start * u:stop * u]))
        speech[begin * u:end * u] = window[0, (begin - start) * u:(end - start) * u]
    return speech


def decode_bounded(decode: Callable[[np.ndarray, np.ndarray], np.ndarray], mel: np.ndarray, source: np.ndarray,
                   samples_per_frame: int) -> np.ndarray:
    """[1, M, T] mel and its source -> [T * U] samples: one call up to `WINDOW_FRAMES`, past it equal windows with
    `CONTEXT_FRAMES` either side (a whole mel, or a long stream chunk: the same samples as one call)."""
    frames = mel.shape[2]
    if frames <= WINDOW_FRAMES:
        return decode(mel, source)[0]
    width = -(-frames // -(-frames // WINDOW_FRAMES))  # equal windows, none longer than WINDOW_FRAMES
    return decode_in_windows(decode, mel, source, samples_per_frame, width, CONTEXT_FRAMES, CONTEXT_FRAMES)


@dataclass(frozen=True)
class HiftCache:
    """The streaming cache sizes (`manifest.config["stream"]`, beside the schedule's hops and look-ahead)."""
    mel_cache_frames: int
    source_cache_samples: int
    crossfade_samples: int

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "HiftCache":
        return cls(mel_cache_frames=int(cfg["mel_cache_frames"]), source_cache_samples=int(cfg["source_cache_samples"]),
                   crossfade_samples=int(cfg["crossfade_samples"]))


class HiftStages(Protocol):
    """The two HiFT calls a stream needs (the runtime's `Vocoder`, or the bench's torch reference)."""

    def source(self, mel: np.ndarray, rng: np.random.Generator | None) -> np.ndarray: ...

    def decode(self, mel: np.ndarray, source: np.ndarray, options: ort.RunOptions | None = None) -> np.ndarray: ...


class Vocoder:
    """`hift_source` then `hift_decoder`."""

    def __init__(self, source: ort.InferenceSession, decoder: ort.InferenceSession, samples_per_frame: int,
                 cache: HiftCache) -> None:
        self._source = source
        self._decoder = decoder
        self.samples_per_frame = samples_per_frame
        self.cache = cache
        self._harmonics = int({i.name: i for i in source.get_inputs()}["noise"].shape[2])

    def source(self, mel: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
        """[1, 1, frames * U] NSF excitation; rng None = noise switched off (deterministic)."""
        shape = (mel.shape[0], mel.shape[2] * self.samples_per_frame, self._harmonics)
        noise = np.zeros(shape, np.float32) if rng is None else rng.standard_normal(shape, dtype=np.float32)
        source, _f0 = self._source.run(None, {"mel": mel, "noise": noise})
        return source

    def decode(self, mel: np.ndarray, source: np.ndarray, options: ort.RunOptions | None = None) -> np.ndarray:
        (speech,) = self._decoder.run(None, {"mel": mel, "source": source}, options)
        return speech

    def render(self, mel: np.ndarray, noise: np.random.Generator | None) -> np.ndarray:
        """[1, M, T] mel -> [T * U] float32 waveform (non-streaming); noise None: the NSF noise switched off. The
        source is made for the whole mel (its phase runs on from sample to sample); past `WINDOW_FRAMES` the
        decoder runs window by window, each with `CONTEXT_FRAMES` of mel and source either side, and keeps its
        own frames' samples: the same samples as one call, in bounded memory."""
        mel = np.ascontiguousarray(mel, np.float32)
        return decode_bounded(self.decode, mel, self.source(mel, noise), self.samples_per_frame)

    def stream(self, noise: np.random.Generator | None) -> "VocoderStream":
        return VocoderStream(self, self.cache, noise, windows_of=self.samples_per_frame)


class VocoderStream:
    """The HiFT caches of ONE streaming request (never shared between requests)."""

    def __init__(self, vocoder: HiftStages, config: HiftCache, rng: np.random.Generator | None,
                 windows_of: int | None = None) -> None:
        """`windows_of`: the samples per frame of a decoder whose chunks past `WINDOW_FRAMES` are decoded in
        windows (`decode_bounded`); None: one call per chunk, as the official runtime (the bench's reference)."""
        self._vocoder = vocoder
        self._windows_of = windows_of
        self._config = config
        self._rng = rng
        self._window = np.hamming(2 * config.crossfade_samples)  # float64, as the official cross-fade
        self._mel: np.ndarray | None = None
        self._source: np.ndarray | None = None
        self._speech: np.ndarray | None = None

    def chunk(self, mel: np.ndarray, final: bool, run_step: StepRunner | None = None) -> np.ndarray:
        """The waveform to emit for this chunk's new mel [1, M, F]; `run_step` runs each decoder call (the
        source call, 0.01-0.02 s, draws the request's noise and runs as it is)."""
        c = self._config
        if self._mel is not None:
            mel = np.concatenate([self._mel, mel], axis=2)
        mel = np.ascontiguousarray(mel, np.float32)
        source = self._vocoder.source(mel, self._rng)
        if self._source is not None:
            source[:, :, :self._source.shape[2]] = self._source
        decode = self._vocoder.decode if run_step is None else \
            lambda m, s: run_step(lambda options: self._vocoder.decode(m, s, options))
        if self._windows_of is None:
            speech = decode(mel, source)
        else:
            speech = decode_bounded(decode, mel, source, self._windows_of)[None]
        if self._speech is not None:
            overlap = c.crossfade_samples
            faded = speech[:, :overlap] * self._window[:overlap] + self._speech * self._window[overlap:]
            speech[:, :overlap] = faded.astype(np.float32)
        if final:
            return speech[0]
        # copies, not views: a view of a graph's output holds that output's whole arena region until freed
        self._mel = mel[:, :, -c.mel_cache_frames:].copy()
        self._source = source[:, :, -c.source_cache_samples:].copy()
        self._speech = speech[:, -c.crossfade_samples:].copy()
        return speech[0, :-c.crossfade_samples]
