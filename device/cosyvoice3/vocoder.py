"""Fun-CosyVoice3 causal HiFT on ONNX Runtime, its fixed sine noise, and per-request streaming (the family's
`Vocoder` part).

Graph signatures and the finalize=False trimming rule: quantize/cosyvoice3/hift_export.py. The NSF noise is the
release's FIXED uniform tensor (official `SineGen2.sine_waves`), not shipped in the bundle: it is regenerated
here from the manifest's recipe (`hift_noise`: MT19937 seeded 0 as numpy's legacy seeding, `draws_before` outputs
discarded, `harmonics` draws of rand_ini, then the rows; value = (u32 & 0xFFFFFF) * 2^-24) and checked against the
first row the build host stored. rand_ini is a constant inside `hift_source`.

Streaming (official CosyVoice3Model.tts, rules in the golden vectors' README): the chunk schedule and the stream loop
are the shared ones (`cosyvoice2.streaming.stream_tokens`: hop 25 + prompt pad, then 50, 100, ...; 3 look-ahead
tokens, counted over the tokens that pass the silent filter); `RerunStream` appends each chunk's new mel to the
request's accumulated mel, re-runs HiFT on it (finalize=False except for the last chunk) and yields only the
samples after those already emitted. No cross-fade, no source cache: causality and the fixed noise make every
re-run reproduce the prefix. The source re-runs on all of it; the decoder (nearly all of HiFT's cost) only from
`hift_history_frames` before the first unsent sample (the decoder reaches no further back: measured when the bundle
is built), so a stream's HiFT work grows with its length, not with its square; the samples are the same.
"""
from __future__ import annotations

import threading
from typing import Any, Protocol

import numpy as np
import onnxruntime as ort

from cosyedge.device.cosyvoice2.flow import StepRunner, run_graph
from cosyedge.device.cosyvoice2.vocoder import decode_in_windows
from cosyedge.device.errors import BundleError, InputError

GROW_SECONDS = 60  # the noise grows a minute at a time
# Mel frames the decoder renders per call in whole (non-streamed) synthesis where the bundle gives the decoder's
# reach: a full-size 500-frame call raised the peak RSS by 300 MB; windows bound it whatever the length.
RENDER_WINDOW = 150


class SineNoise:
    """The fixed sine noise rows [L, H], regenerated from the recipe once and grown on demand (thread-safe)."""

    def __init__(self, recipe: dict[str, Any], sample_rate: int) -> None:
        if recipe.get("generator") != "mt19937":
            raise BundleError(f"unknown HiFT noise generator {recipe.get('generator')!r}; re-create the bundle")
        self._seed = int(recipe["seed"])
        self._skip = int(recipe["draws_before"])
        self.harmonics = int(recipe["harmonics"])
        self.max_rows = int(recipe["max_rows"])
        self._first_row = np.asarray(recipe["first_row"], np.float32)
        self._step = GROW_SECONDS * sample_rate
        self._rows = np.zeros((0, self.harmonics), np.float32)
        self._lock = threading.Lock()

    def rows(self, count: int) -> np.ndarray:
        """The first `count` rows (InputError beyond the official tensor: 300 s at 24 kHz)."""
        if count > self.max_rows:
            raise InputError(f"the utterance needs {count} vocoder samples; the model supports at most "
                             f"{self.max_rows}: use a shorter text")
        rows = self._rows
        if rows.shape[0] < count:
            with self._lock:
                if self._rows.shape[0] < count:
                    self._rows = self._generate(min(max(count, self._rows.shape[0] + self._step), self.max_rows))
                rows = self._rows
        return rows[:count]

    def _generate(self, count: int) -> np.ndarray:
        bits = np.random.MT19937()
        bits._legacy_seeding(self._seed)
        if self._skip:
            bits.random_raw(self._skip)
        raw = bits.random_raw(self.harmonics * (count + 1))[self.harmonics:]
        rows = ((raw & 0xFFFFFF).astype(np.float64) * 2.0 ** -24).astype(np.float32).reshape(count, self.harmonics)
        if count and not np.array_equal(rows[0], self._first_row):
            raise BundleError("the regenerated HiFT noise does not match the bundle's check row; re-create the bundle")
        return rows


class Vocoder3:
    """`hift_source` then `hift_decoder`, finalize on (whole mel) or off (streaming: the look-ahead trimmed).
    `history_frames` (the manifest's `hift_history_frames`; None for bundles without it): how far back the
    decoder reaches, which bounds a stream's decoder re-runs (`RerunStream`)."""

    def __init__(self, source: ort.InferenceSession, decoder: ort.InferenceSession, noise: SineNoise,
                 samples_per_frame: int, f0_lookahead: int, conv_pre_lookahead: int,
                 history_frames: int | None = None) -> None:
        self._source = source
        self._decoder = decoder
        self._noise = noise
        self.samples_per_frame = samples_per_frame
        self._f0_lookahead = f0_lookahead
        self._conv_pre_lookahead = conv_pre_lookahead
        self._history_frames = history_frames

    def run(self, mel: np.ndarray, finalize: bool, start: int = 0, run_step: StepRunner | None = None
            ) -> np.ndarray:
        """[1, M, T] mel -> float32 waveform [T * U] (finalize) or [(T - f0_la - conv_la - 1) * U], from sample
        `start` * U on: the source runs on every frame (its phase accumulates from the first sample), the decoder
        from mel frame `start` (what it gives before `start` + history_frames is not the whole run's). `run_step`
        (a stream's later chunk) runs both calls (the noise is fixed: a call run again gives the same)."""
        u = self.samples_per_frame
        mel = np.ascontiguousarray(mel, np.float32)
        frames = mel.shape[2]
        source, _f0 = run_graph(self._source, None, {"mel": mel, "sine_noise": self._noise.rows(frames * u)}, run_step)
        if not finalize:
            frames -= self._f0_lookahead
        if frames - start <= 0:
            return np.zeros(0, np.float32)
        if start or not finalize:
            mel = np.ascontiguousarray(mel[:, :, start:frames])
            source = np.ascontiguousarray(source[:, :, start * u:frames * u])
        (speech,) = run_graph(self._decoder, None, {"mel": mel, "source": source}, run_step)
        if not finalize:
            return speech[0, :max(frames - start - self._conv_pre_lookahead - 1, 0) * u]
        return speech[0]

    def render(self, mel: np.ndarray, noise: np.random.Generator | None) -> np.ndarray:
        """Non-streaming. `noise` is not drawn from: the v3 NSF noise is the release's fixed tensor, so the
        output is the same whatever the request's seed or `deterministic`. With `history_frames`, the decoder
        renders RENDER_WINDOW frames per call, each call started `history_frames` earlier and running past the
        window's end by conv_pre's look-ahead (+1, as a stream's trimming): the samples equal one call over the
        whole mel, and the decoder's activations stay bounded."""
        frames = mel.shape[2]
        if self._history_frames is None or frames <= RENDER_WINDOW:
            return self.run(mel, finalize=True)
        u = self.samples_per_frame
        mel = np.ascontiguousarray(mel, np.float32)
        source, _f0 = self._source.run(None, {"mel": mel, "sine_noise": self._noise.rows(frames * u)})
        return decode_in_windows(lambda m, s: self._decoder.run(None, {"mel": m, "source": s})[0], mel, source, u,
                                 RENDER_WINDOW, self._history_frames, self._conv_pre_lookahead + 1)

    def stream(self, noise: np.random.Generator | None) -> "RerunStream":
        return RerunStream(self, self.samples_per_frame, self._history_frames)


class CausalHift(Protocol):
    """What a v3 stream calls (the runtime's `Vocoder3`, or the bench's torch reference)."""

    def run(self, mel: np.ndarray, finalize: bool, start: int = 0, run_step: StepRunner | None = None
            ) -> np.ndarray: ...


class RerunStream:
    """The accumulated mel and emitted sample count of ONE streaming request (never shared). With
    `history_frames`, each re-run's decoder starts that many frames before the first sample not yet sent (the
    samples it sends equal a re-run from frame 0: nothing reaches further back), so a chunk costs its own frames
    plus the history, not the whole utterance so far; None: the official re-run from frame 0."""

    def __init__(self, vocoder: CausalHift, samples_per_frame: int, history_frames: int | None = None) -> None:
        self._vocoder = vocoder
        self._samples_per_frame = samples_per_frame
        self._history_frames = history_frames
        self._mel: np.ndarray | None = None
        self._emitted = 0

    def chunk(self, mel: np.ndarray, final: bool, run_step: StepRunner | None = None) -> np.ndarray:
        """HiFT re-run on the mel so far (finalize on the last chunk); the samples not yet emitted. `run_step`:
        `ChunkVocoder.chunk`."""
        self._mel = mel if self._mel is None else np.concatenate([self._mel, mel], axis=2)
        start = 0
        if self._history_frames is not None:
            start = max(0, self._emitted // self._samples_per_frame - self._history_frames)
        speech = self._vocoder.run(self._mel, final, start, run_step)
        first = start * self._samples_per_frame
        out = speech[self._emitted - first:]
        self._emitted = max(self._emitted, first + speech.shape[0])
        return out
