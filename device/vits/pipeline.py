"""VITS (Piper) voices: normalised text -> espeak-ng phonemes -> phoneme ids -> waveform.

Phonemisation uses the espeak-ng build bundled with `piper-tts` (GPL-3.0). The bundle's graph has
an extra `frames` output (mel frames per item) so padded batches can be cut back to each item's
true length.
"""
from __future__ import annotations

import json
import threading
from typing import Any, Iterator, Sequence

import numpy as np

from cosyedge.device.bundle import Bundle
from cosyedge.device.errors import EmptyTextError
from cosyedge.device.options import Segment, SynthesisOptions
from cosyedge.device.pipeline import Pipeline
from cosyedge.device.sessions import SessionConfig


class VitsPipeline(Pipeline):
    """One Piper voice model; phonemiser and session shared, per-request values passed in."""

    # Padded batches do not pay for VITS on a CPU: 8 paragraph requests (5 sentences each) took 28.6 s and
    # 1825 MB RSS batched 8 at a time, 21.7 s and 363 MB one sentence per call (2 threads, one run, issue 10).
    # One call per sentence also makes batched results bit-identical to single ones.
    batch_ids_max = 0

    def __init__(self, bundle: Bundle, precision: str, sessions: SessionConfig) -> None:
        from piper.phoneme_ids import phonemes_to_ids
        from piper.phonemize_espeak import EspeakPhonemizer

        cfg = bundle.manifest.config
        self.sample_rate = bundle.manifest.sample_rate
        self._voices = list(bundle.manifest.voices)
        self._speaker_ids = {name: index for index, name in enumerate(self._voices)}
        self._espeak_voice = cfg["espeak_voice"]
        self._scales = (float(cfg["noise_scale"]), float(cfg["length_scale"]), float(cfg["noise_w"]))
        self._hop = int(cfg["hop_length"])
        self._id_map = json.loads(bundle.asset("phoneme_id_map").read_text(encoding="utf-8"))
        self._phonemes_to_ids = phonemes_to_ids
        self._phonemizer = EspeakPhonemizer()
        self._espeak_lock = threading.Lock()  # espeak-ng keeps global state: one caller at a time
        component = bundle.component("vits", precision)
        self._session = sessions.create(bundle.path(component.file))
        self._has_sid = any(i.name == "sid" for i in self._session.get_inputs())
        self._precision = precision

    def voices(self) -> list[str]:
        return list(self._voices)

    def segments(self, text: str) -> list[Segment]:
        with self._espeak_lock:
            sentences = self._phonemizer.phonemize(self._espeak_voice, text)
        segments = []
        for phonemes in sentences:
            if not any(p.isalpha() for p in phonemes):
                continue
            ids = self._phonemes_to_ids(phonemes, self._id_map)
            segments.append(Segment(text="".join(phonemes), ids=tuple(ids)))
        if not segments:
            raise EmptyTextError("text contains nothing speakable for this voice")
        return segments

    def synthesize(self, segments: Sequence[Segment], options: SynthesisOptions) -> list[np.ndarray]:
        lengths = np.array([len(u.ids) for u in segments], dtype=np.int64)
        ids = np.zeros((len(segments), int(lengths.max())), dtype=np.int64)
        for row, segment in enumerate(segments):
            ids[row, : len(segment.ids)] = segment.ids
        noise, length, noise_w = self._scales
        if options.deterministic:
            noise, noise_w = 0.0, 0.0
        feeds: dict[str, np.ndarray] = {"input": ids, "input_lengths": lengths,
                                        "scales": np.array([noise, length / options.speed, noise_w], dtype=np.float32)}
        if self._has_sid:
            feeds["sid"] = np.full(len(segments), self._speaker_ids.get(options.voice, 0), dtype=np.int64)
        audio, frames = self._session.run(["output", "frames"], feeds)
        samples = np.asarray(frames).reshape(-1).astype(np.int64) * self._hop
        return [audio[row].reshape(-1)[: samples[row]].astype(np.float32) for row in range(len(segments))]

    def stream(self, segment: Segment, options: SynthesisOptions) -> Iterator[np.ndarray]:
        yield self.synthesize([segment], options)[0]

    def reproducible(self, options: SynthesisOptions) -> bool:
        """Only without noise: the graph draws its own noise, which no seed reaches."""
        return options.deterministic

    def describe(self) -> dict[str, Any]:
        return {"family": "vits", "precision": {"vits": self._precision}, "providers": self._session.get_providers()}
