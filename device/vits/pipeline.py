"""VITS (Piper) voices: normalised text -> espeak-ng phonemes -> phoneme ids -> waveform.

Phonemisation uses the espeak-ng build bundled with `piper-tts` (GPL-3.0). The bundle's graph has
an extra `frames` output (mel frames per item) so padded batches can be cut back to each item's
true length, a `seed` input from which it draws its noise (`noise.py`): a request's seed, or a fresh
random one per call when it gives none, and a `durations` output (frames per phoneme id) that times the words
of `word_segments` (`words.py`).
"""
from __future__ import annotations

import json
import secrets
import threading
from dataclasses import replace
from itertools import takewhile
from typing import Any, Iterator, Sequence

import numpy as np

from cosyedge.device.bundle import Bundle
from cosyedge.device.errors import EmptyTextError, UnsupportedOptionError
from cosyedge.device.options import Segment, SynthesisOptions, Word
from cosyedge.device.pipeline import Pipeline
from cosyedge.device.sessions import SessionConfig
from cosyedge.device.text import VITS_MAX_IDS, cut_to_bound
from cosyedge.device.vits.layout import NCHWC_THREADS_MAX
from cosyedge.device.vits.noise import SEED_INPUT
from cosyedge.device.vits.words import WordSpan, id_starts, word_spans


class VitsPipeline(Pipeline):
    """One Piper voice model; phonemiser and session shared, per-request values passed in."""

    # Padded batches do not pay for VITS on a CPU: 8 paragraph requests (5 sentences each) took 28.6 s and
    # 1825 MB RSS batched 8 at a time, 21.7 s and 363 MB one sentence per call (2 threads, one run, issue 10).
    # One call per sentence also makes batched results bit-identical to single ones.
    batch_ids_max = 0

    def __init__(self, bundle: Bundle, precision: str, sessions: SessionConfig) -> None:
        from piper import espeakbridge
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
        self._espeak = espeakbridge  # initialised by the phonemizer: one token at a time for word_segments
        self._espeak_lock = threading.Lock()  # espeak-ng keeps global state: one caller at a time
        component = bundle.component("vits", precision)
        if sessions.threads() > NCHWC_THREADS_MAX:  # the wide convolutions' blocked layout would idle threads
            sessions = replace(sessions, disabled_optimizers=(*sessions.disabled_optimizers, "NchwcTransformer"))
        self._session = sessions.create(bundle.path(component.file))
        inputs = {i.name for i in self._session.get_inputs()}
        self._has_sid = "sid" in inputs
        self._seeded = SEED_INPUT in inputs  # False: converted before seeds were honoured
        self._timed = "durations" in {o.name for o in self._session.get_outputs()}  # False: converted before it
        self._precision = precision

    attribution = ("Piper (rhasspy / OHF-Voice)", "https://github.com/OHF-Voice/piper1-gpl")

    def voices(self) -> list[str]:
        return list(self._voices)

    def languages(self) -> list[str]:
        """The voice's espeak language as Wyoming writes it: en-us -> en_US."""
        code = str(self._espeak_voice).split("-")
        return ["_".join([code[0], *[c.upper() for c in code[1:]]])]

    def segments(self, text: str) -> list[Segment]:
        """espeak-ng's sentences, each cut to at most VITS_MAX_IDS phoneme ids (after a clause, else at a word)."""
        with self._espeak_lock:
            sentences = self._phonemizer.phonemize(self._espeak_voice, text)
        return self._segments(self._bounded(sentences, VITS_MAX_IDS))

    @property
    def times_words(self) -> bool:
        return self._timed

    def word_segments(self, text: str) -> list[Segment]:
        """`segments`, each with the words of `text` it speaks as ranges of its ids (`words.py`); a bundle converted
        before the `durations` output cannot time them and gets none."""
        if not self._timed:
            return self.segments(text)
        tokens = text.split()
        with self._espeak_lock:
            sentences = self._phonemizer.phonemize(self._espeak_voice, text)
            self._espeak.set_voice(self._espeak_voice)
            isolated = ["".join(clause for clause, _, _ in self._espeak.get_phonemes(token)) for token in tokens]
        spoken = [phonemes for phonemes in self._bounded(sentences, VITS_MAX_IDS) if self._speakable(phonemes)]
        return self._segments(spoken, word_spans(spoken, tokens, isolated, self._id_map))

    @staticmethod
    def _speakable(phonemes: list[str]) -> bool:
        return any(p.isalpha() for p in phonemes)

    def _bounded(self, sentences: list[list[str]], limit: int) -> list[list[str]]:
        """Each sentence whose ids would pass `limit` cut into pieces (`_cuts`)."""
        return [piece for phonemes in sentences for _, piece in self._cuts(phonemes, limit)]

    def _cuts(self, phonemes: Sequence[str], limit: int) -> list[tuple[int, list[str]]]:
        """A sentence whose ids would pass `limit` cut into pieces (after a clause, else at a word, else between
        phonemes), without the spaces at their cuts, each with the index of its first phoneme; a sentence that fits
        stays as piper speaks it."""
        pieces = cut_to_bound(phonemes, limit, self._id_count)
        if len(pieces) == 1:
            return [(0, list(phonemes))]
        cuts, start = [], 0
        for piece in pieces:
            lead = next((i for i, phoneme in enumerate(piece) if phoneme != " "), len(piece))
            cuts.append((start + lead, list("".join(piece).strip(" "))))
            start += len(piece)
        return cuts

    def _id_count(self, phonemes: Sequence[str]) -> int:
        """The ids `phonemes_to_ids` makes: BOS, pad, each known phoneme's ids and a pad, EOS."""
        return 3 + sum(len(self._id_map[p]) + 1 for p in phonemes if p in self._id_map)

    def _pieces(self, segment: Segment, speed: float) -> list[tuple[int, Segment]]:
        """A segment cut to one call's bound at this speed: a slower speed makes more frames per id, so the bound
        shrinks with it (a call's memory follows its frames); a segment of `segments` holds its phonemes. Each
        piece comes with the index of its first phoneme in the segment's."""
        limit = max(16, int(VITS_MAX_IDS * min(1.0, speed)))
        if len(segment.ids) <= limit:
            return [(0, segment)]
        cuts = [(start, phonemes) for start, phonemes in self._cuts(list(segment.text), limit)
                if self._speakable(phonemes)]
        if not cuts:
            return [(0, segment)]
        return list(zip((start for start, _ in cuts), self._segments([phonemes for _, phonemes in cuts])))

    def _segments(self, sentences: list[list[str]], words: list[tuple[WordSpan, ...]] | None = None,
                  ) -> list[Segment]:
        segments = [Segment(text="".join(phonemes), ids=tuple(self._phonemes_to_ids(phonemes, self._id_map)),
                            words=words[index] if words else ())
                    for index, phonemes in enumerate(s for s in sentences if self._speakable(s))]
        if not segments:
            raise EmptyTextError("text contains nothing speakable for this voice")
        return segments

    def synthesize(self, segments: Sequence[Segment], options: SynthesisOptions) -> list[np.ndarray]:
        pieces = [self._pieces(segment, options.speed) for segment in segments]
        if all(len(p) == 1 for p in pieces):
            return self._run(segments, options, ["output", "frames"])[0]
        return [np.concatenate([self._run([piece], options, ["output", "frames"])[0][0] for _, piece in parts])
                for parts in pieces]

    def synthesize_words(self, segments: Sequence[Segment], options: SynthesisOptions, batch_max: int,
                         ) -> list[tuple[np.ndarray, tuple[Word, ...]]]:
        """One model call per piece of each segment (`_pieces`, as `synthesize` and `stream` cut them at this
        speed), so the audio is theirs; the words timed by `_timed_pieces`."""
        if not self._timed:
            return super().synthesize_words(segments, options, batch_max)
        timed = []
        for segment in segments:
            chunks = list(self._timed_pieces(segment, options))
            timed.append((np.concatenate([wave for wave, _ in chunks]), tuple(w for _, words in chunks for w in words)))
        return timed

    def _timed_pieces(self, segment: Segment, options: SynthesisOptions, stop: threading.Event | None = None,
                      ) -> Iterator[tuple[np.ndarray, tuple[Word, ...]]]:
        """Each piece's waveform with the words it completes, timed from the segment's first sample: a word's times
        are the summed frames of the phoneme ids before its first id and through its last, in seconds. A piece's
        phonemes are the segment's and its ids laid out alike, so its `durations` land on the segment's ids; its
        own start (BOS, pad) and end (EOS) frames go to the ids just before and after it, so the times never go
        back and add up to the audio. Once `stop` is set no further piece is made."""
        starts = id_starts(segment.text, self._id_map)
        frames = np.zeros(len(segment.ids), dtype=np.float64)
        pieces, done, before = self._pieces(segment, options.speed), 0, 0
        for index, (offset, piece) in enumerate(pieces):
            if stop is not None and stop.is_set():
                return
            (wave,), durations = self._run([piece], options, ["output", "frames", "durations"])
            spent = durations[0].reshape(-1)[: len(piece.ids)].astype(np.float64)
            own = id_starts(piece.text, self._id_map)
            first, last = starts[offset], starts[offset + len(piece.text)]
            frames[first:last] += spent[own[0]:own[-1]]
            frames[max(first - 1, before)] += spent[: own[0]].sum()
            frames[last] += spent[own[-1]:].sum()
            before = last
            seconds = np.concatenate([[0.0], np.cumsum(frames)]) * (self._hop / self.sample_rate)
            final = index == len(pieces) - 1
            ready = list(takewhile(lambda word: final or word[2] <= last, segment.words[done:]))
            done += len(ready)
            yield wave, tuple(Word(text, float(seconds[start]), float(seconds[end])) for text, start, end in ready)

    def _run(self, segments: Sequence[Segment], options: SynthesisOptions, outputs: list[str],
             ) -> tuple[list[np.ndarray], np.ndarray | None]:
        """One padded model call: each segment's waveform, cut to its frames, and the durations when asked for."""
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
        if self._seeded:
            seed = secrets.randbits(32) if options.seed is None else options.seed
            feeds[SEED_INPUT] = np.full(len(segments), seed, dtype=np.int64)
        audio, frames, *durations = self._session.run(outputs, feeds)
        samples = np.asarray(frames).reshape(-1).astype(np.int64) * self._hop
        waves = [audio[row].reshape(-1)[: samples[row]].astype(np.float32) for row in range(len(segments))]
        return waves, (durations[0] if durations else None)

    def stream(self, segment: Segment, options: SynthesisOptions) -> Iterator[np.ndarray]:
        for _, piece in self._pieces(segment, options.speed):
            yield self._run([piece], options, ["output", "frames"])[0][0]

    def stream_words(self, segment: Segment, options: SynthesisOptions, stop: threading.Event | None,
                     batch_max: int) -> Iterator[tuple[np.ndarray, tuple[Word, ...]]]:
        """A piece is one chunk (as `stream`), with the words it completes."""
        if not self._timed:
            yield from super().stream_words(segment, options, stop, batch_max)
            return
        yield from self._timed_pieces(segment, options, stop)

    def check_options(self, options: SynthesisOptions) -> None:
        """A seed needs a graph that takes one; an older bundle's graph draws its own noise, which no seed reaches
        (a deterministic request draws none, so its seed, the engine's default one included, is moot)."""
        super().check_options(options)
        if options.seed is not None and not options.deterministic and not self._seeded:
            raise UnsupportedOptionError("this bundle was converted before seeds were honoured; rebuild it "
                                         "(cosyedge quantize --force, or --piper-model ... --out) to use seed")

    def reproducible(self, options: SynthesisOptions) -> bool:
        """Without noise, or with a fixed seed for the graph's noise."""
        return options.deterministic or (options.seed is not None and self._seeded)

    def describe(self) -> dict[str, Any]:
        return {"family": "vits", "precision": {"vits": self._precision}, "providers": self._session.get_providers()}
