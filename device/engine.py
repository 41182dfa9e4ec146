"""`Engine`: the public face of the runtime. Load a bundle, then synthesize, stream or batch.

The engine validates every request once (`options`, `segments`) and hands the family's `Pipeline` only
validated values; it calls the pipeline's contract directly, so what a family can do is declared there,
never guessed here.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import IO, Collection, Iterator, Sequence

import numpy as np

from cosyedge.device import families, request
from cosyedge.device.audio import AudioSegment, to_audio_segment
from cosyedge.device.bundle import PRECISIONS, TARGETS, Bundle
from cosyedge.device.bundle_store import hold
from cosyedge.device.errors import (BundleError, Cancelled, CosyedgeError, FixedVoicesError, InputError, InvalidVoiceError,
                                    ReservedVoiceNameError, TextTooLongError, UnknownPresetError, UnknownVoiceError,
                                    VoiceExistsError)
from cosyedge.device.options import BatchLimits, Segment, Stat, SynthesisOptions, Word, on_rate
from cosyedge.device.paths import state_dir as default_state_dir
from cosyedge.device.pipeline import Pipeline
from cosyedge.device.sessions import SessionConfig
from cosyedge.device.text import SPOKEN_EXPANSION
from cosyedge.device.voice_store import VoiceStore, check_voice_name, read_prompt_audio

log = logging.getLogger(__name__)

# Which build target suits which execution provider, best first.
# `auto`: the first target the bundle has for the best available provider. On a CPU `cpu-int4` comes first where its
# own gate kept the LLM at int4 (4-bit blocks of 128: a full-size `fastest` stream, one run of `cosyedge bench`, gave
# first audio in 1.15 against 1.52 s alone and 2.76 / 3.44 against 3.39 / 4.40 s p50 / p95 with four streams, 1.68
# against 1.19 s of audio per second, peak 758 against 930 MB), else `cpu`.
_TARGET_FOR_PROVIDER = (("tensorrt", "trt-int8"), ("cuda", "gpu-fp16"), ("cpu", "cpu-int4"), ("cpu", "cpu"))
# a target auto takes only where this graph kept this precision (cpu-int4: its LLM at either 4-bit rung)
_DEFINING_GRAPH = {"cpu-int4": ("llm", "int4")}


def check_selection(precision: str, target: str | None) -> None:
    """A numeric precision (fp32, fp16, int8, int4, auto) or a build target (cpu, cpu-int4, gpu-fp16, trt-int8),
    never both."""
    if precision in TARGETS:
        raise InputError(f"{precision!r} is a build target; use target")
    if precision != "auto" and precision not in PRECISIONS:
        raise InputError(f"unknown precision {str(precision)[:32]!r}; choose auto, {', '.join(PRECISIONS)}")
    if target is not None and target not in TARGETS:
        raise InputError(f"unknown target {str(target)[:32]!r}; choose {', '.join(TARGETS)}")
    if target is not None and precision != "auto":
        raise InputError("give a precision or a target, not both")


def selection(name: str) -> dict[str, str | None]:
    """One name of a mixed list (fp32, int8, cpu, trt-int8: the bench's --precisions) as `Engine.load` arguments."""
    return {"precision": "auto", "target": name} if name in TARGETS else {"precision": name, "target": None}


def choose_graphs(bundle: Bundle, precision: str, target: str | None, sessions: SessionConfig) -> str:
    """The selection to load (checked by `check_selection`): the target, the precision, or for `auto` the bundle's
    target for the best available provider (`_TARGET_FOR_PROVIDER`), else its measured default precision."""
    if target is not None or precision != "auto":
        return target or precision
    available = sessions.available()
    for provider, name in _TARGET_FOR_PROVIDER:
        graph, kept = _DEFINING_GRAPH.get(name, (None, None))
        if provider in available and name in bundle.targets and \
                (graph is None or bundle.targets[name].get("graphs", {}).get(graph, {}).get("precision") == kept):
            return name
    return bundle.manifest.default_precision


def _speaker(voice: object, voices: list[str]) -> str:
    """A voice name, or a speaker id (an int, or a string of ASCII digits) indexing the voice list."""
    if voice is None or voice == "":
        return voices[0]
    if isinstance(voice, bool):
        raise UnknownVoiceError("voice must be a name or a numeric speaker id")
    if isinstance(voice, str) and voice.isascii() and voice.isdigit():
        voice = int(voice)  # "²" or "٣" are digits to str.isdigit, but names here
    if isinstance(voice, int):
        if voice < 0:
            raise UnknownVoiceError(f"speaker id {voice} is negative")
        return voices[voice % len(voices)]
    if isinstance(voice, str) and voice in voices:
        return voice
    raise UnknownVoiceError(f"unknown voice {str(voice)[:64]!r}; available: {', '.join(voices[:20])}")


class Engine:
    """One loaded bundle. Thread-safe: requests share only read-only state and ORT sessions."""

    def __init__(self, bundle: Bundle, pipeline: Pipeline, precision: str, limits: BatchLimits | None = None,
                 state_dir: Path | None = None) -> None:
        self.bundle = bundle
        self._held: IO[bytes] | None = None  # Engine.load's hold on the bundle (bundle_store.hold)
        self.pipeline = pipeline
        self.precision = precision  # the selection actually loaded: a precision or a target name
        self.limits = limits or BatchLimits()
        self.state_dir = state_dir  # registered voices live here (None: paths.state_dir())
        self._registering: set[str] = set()  # names whose registration is under way
        self._registering_lock = threading.Lock()

    @classmethod
    def load(cls, bundle_path: Path | str | None = None, precision: str = "auto", target: str | None = None,
             sessions: SessionConfig | None = None, limits: BatchLimits | None = None, warmup: bool = True,
             state_dir: Path | str | None = None, strict_voices: bool = False) -> "Engine":
        """Validate the bundle, create the ORT sessions once, and warm them up.

        With no `bundle_path`, the embedded default voice is used (built offline on first use).
        A registered voice file that cannot be loaded is skipped with a warning (the CLI: other voices still
        work), or with `strict_voices` (the service: it must not come up with a voice missing) a BundleError.
        """
        check_selection(precision, target)  # before a first-use build of the default voice
        sessions = sessions or SessionConfig.from_env()
        if bundle_path is None:
            bundle_path = families.default_bundle()
        held = hold(Path(bundle_path))  # from before its files are read: `bundle install` never prunes it meanwhile
        chosen = choose_graphs(Bundle.load(bundle_path, verify=False), precision, target, sessions)
        bundle = Bundle.load(bundle_path, precision=chosen)
        engine = cls(bundle, families.load_pipeline(bundle, chosen, sessions), chosen, limits,
                     Path(state_dir) if state_dir else None)
        engine._held = held  # for as long as this engine lives
        engine._load_registered_voices(strict_voices)
        if warmup:
            engine.warmup()
        return engine

    # -- properties -------------------------------------------------------------------------
    @property
    def sample_rate(self) -> int:
        return self.pipeline.sample_rate

    def voices(self) -> list[str]:
        return self.pipeline.voices()

    def describe(self) -> dict[str, object]:
        """The pipeline's description plus which bundle and which graph selection are loaded, the languages its
        voices speak and who made the model (Wyoming's `info`)."""
        name, url = self.pipeline.attribution
        return {**self.pipeline.describe(), "bundle": self.bundle.manifest.name, "selection": self.precision,
                "languages": self.pipeline.languages(), "attribution": {"name": name or self.bundle.manifest.family,
                                                                        "url": url}}

    def stats(self) -> dict[str, Stat]:
        """The pipeline's gauges for /metrics, by name (empty for families without any)."""
        return self.pipeline.stats()

    @property
    def continuous_batching(self) -> bool:
        """Whether requests should enter at once, one by one, and share model calls inside the engine (CosyVoice),
        rather than be collected into closed batches for `synthesize_many` (VITS)."""
        return self.pipeline.continuous_batching

    @property
    def times_words(self) -> bool:
        """Whether this bundle can time words (a bundle converted before word times cannot: its words are empty)."""
        return self.pipeline.times_words

    def decode_occupancy(self) -> dict[int, int]:
        """Decode steps so far by rows decoded together (CosyVoice; empty for other families)."""
        return self.pipeline.decode_occupancy()

    def warmup(self, preset: str | None = None) -> bool:
        """The pipeline's own work ahead of requests (`Pipeline.warm`: a CosyVoice2 default voice's streaming state
        for `preset`, else the bundle's default), then one short synthesis so the first real request does not pay
        for lazy ORT initialisation. In that order: the state's graph calls leave arena regions that only a later
        flow or HiFT call hands back (sessions.py; a full-size `cpu` engine warmed 932 MB the other way round, 897 MB
        this way). True when the pipeline built something."""
        start = time.perf_counter()
        built = self.pipeline.warm(preset)
        self.synthesize("Hello.", deterministic=True)
        log.info("warm-up took %.2f s", time.perf_counter() - start)
        return built

    # -- request validation -----------------------------------------------------------------
    def options(self, voice: str | int | None = None, speed: float = 1.0, deterministic: bool = False,
                seed: int | None = None, sampling: str = "default", mode: str | None = None,
                instruct_text: str | None = None, preset: str | None = None) -> SynthesisOptions:
        """Validate per-request options once, with the request declaration's checks (`request.FIELDS`: the same
        types, bounds and error codes as every door); the result is immutable and private to the request."""
        field = request.BY_NAME
        preset = field["preset"].check(preset)
        if preset is not None and preset not in self.pipeline.presets():
            offered = ", ".join(self.pipeline.presets()) or "none (this model has no quality presets)"
            raise UnknownPresetError(f"unknown preset {preset[:32]!r}; this bundle offers: {offered}")
        deterministic, seed = field["deterministic"].check(deterministic), field["seed"].check(seed)
        if deterministic and seed is None:
            seed = request.DETERMINISTIC_SEED  # a sampler that needs a seed gets one: the same text, the same audio
        options = SynthesisOptions(voice=_speaker(voice, self.voices()), speed=field["speed"].check(speed),
                                   deterministic=deterministic, seed=seed, sampling=field["sampling"].check(sampling),
                                   mode=field["mode"].check(mode), instruct_text=field["instruct_text"].check(instruct_text),
                                   preset=preset)
        self.pipeline.check_options(options)
        return options

    def segments(self, text: object, max_chars: int | None = None, words: bool = False) -> list[Segment]:
        """Validated text -> the family's segments (EmptyTextError, TextTooLongError for unusable text); with
        `words`, each segment also names the input words it speaks, where the family can time them.

        Work per request is bounded whatever the text: its length is counted after NFKC (`text.validate`), what
        the family speaks after its own normalisation (numbers spelled out; VITS: phonemes) may be at most
        SPOKEN_EXPANSION times the limit, and each segment holds at most the family's model-call bound."""
        limit = max_chars or self.limits.max_text_len
        valid = self.pipeline.validate_text(text, limit)
        segments = self.pipeline.word_segments(valid) if words else self.pipeline.segments(valid)
        spoken = sum(len(segment.text) for segment in segments)
        if spoken > SPOKEN_EXPANSION * limit:
            raise TextTooLongError(f"the text reads out as {spoken} characters (or phonemes) once numbers and symbols "
                                   f"are spelled out; the limit is {SPOKEN_EXPANSION} x {limit}: split it into "
                                   "several requests")
        return segments

    # -- synthesis --------------------------------------------------------------------------
    def synthesize_waveform(self, text: str, **options) -> np.ndarray:
        """The whole text as one float32 waveform at the bundle's sample rate."""
        validated = self.options(**options)
        return self._many([(self.segments(text), validated)], self.limits.batch_max)[0]

    def synthesize_words(self, text: str, sample_rate: int | None = None, **options) -> tuple[np.ndarray, list[Word]]:
        """`synthesize_waveform`'s waveform (the same samples) and the words of the text, timed in seconds from
        its start; with `sample_rate`, on the clock of that audio converted to that rate (times rounded to its
        samples). No words for a family without word times."""
        validated = self.options(**options)
        timed = self.pipeline.synthesize_words(self.segments(text, words=True), validated, self.limits.batch_max)
        words, offset = [], 0
        for wave, segment_words in timed:
            words += [Word(w.text, offset / self.sample_rate + w.start_s, offset / self.sample_rate + w.end_s)
                      for w in segment_words]
            offset += wave.size
        words = on_rate(words, sample_rate)
        waves = [wave for wave, _ in timed]
        return (np.concatenate(waves) if waves else np.zeros(0, np.float32)), words

    def synthesize(self, text: str, voice: str | int | None = None, speed: float = 1.0, **options) -> AudioSegment:
        """The whole text as one AudioSegment at the bundle's sample rate."""
        return to_audio_segment(self.synthesize_waveform(text, voice=voice, speed=speed, **options), self.sample_rate)

    def stream(self, text: str, voice: str | int | None = None, speed: float = 1.0,
               stop: threading.Event | None = None, **options) -> Iterator[np.ndarray]:
        """float32 chunks, each yielded as soon as it is made (a sentence for VITS). Closing the iterator, or
        setting `stop`, ends the work for it (CosyVoice: its decode row leaves before the next step)."""
        validated = self.options(voice=voice, speed=speed, **options)
        yield from self.stream_segments(self.segments(text), validated, stop)

    def stream_segments(self, segments: Sequence[Segment], options: SynthesisOptions,
                        stop: threading.Event | None = None) -> Iterator[np.ndarray]:
        """`stream` for validated segments and options (what the API holds); at most `limits.batch_max` rows
        are decoded together. Once `stop` is set, no further chunk is made."""
        stop = stop or threading.Event()
        for segment in segments:
            if stop.is_set():
                return
            for chunk, _ in self.stream_segment(segment, options, stop):
                yield chunk

    def stream_segment(self, segment: Segment, options: SynthesisOptions,
                       stop: threading.Event, words: bool = False) -> Iterator[tuple[np.ndarray, tuple[Word, ...]]]:
        """One validated segment's chunks as the pipeline makes them (the door's streaming unit), each with the
        words its audio completes when `words` (times from the segment's first sample; the segment comes from
        `segments(text, words=True)`); once `stop` is set no further chunk is made and the iterator ends quietly."""
        try:
            if words:
                yield from self.pipeline.stream_words(segment, options, stop, self.limits.batch_max)
            else:
                for chunk in self.pipeline.stream_request(segment, options, stop, self.limits.batch_max):
                    yield chunk, ()
        except Cancelled:
            if not stop.is_set():
                raise

    def render(self, jobs: Sequence[tuple[Sequence[Segment], SynthesisOptions]]) -> list[list[np.ndarray]]:
        """Validated requests rendered whole (the non-streaming path: what a file gets), one float32 waveform per
        segment, in job order; the jobs share model calls as the pipeline allows (the door's file unit)."""
        return self.pipeline.synthesize_many(jobs, self.limits.batch_max)

    def render_words(self, segments: Sequence[Segment], options: SynthesisOptions,
                     ) -> list[tuple[np.ndarray, tuple[Word, ...]]]:
        """`render` of one request whose segments come from `segments(text, words=True)`: each segment's waveform
        (the same samples) with its words, timed from the segment's first sample."""
        return self.pipeline.synthesize_words(segments, options, self.limits.batch_max)

    def stream_words(self, segments: Sequence[Segment], options: SynthesisOptions,
                     stop: threading.Event | None = None) -> Iterator[tuple[np.ndarray, list[Word]]]:
        """`stream_segments` for segments from `segments(text, words=True)`: each chunk with the words whose audio
        it completes, timed in seconds from the stream's first sample (a word never comes after the chunk that ends
        it; no words for a family without word times)."""
        stop = stop or threading.Event()
        offset = 0
        try:
            for segment in segments:
                if stop.is_set():
                    return
                start = offset / self.sample_rate
                for chunk, words in self.pipeline.stream_words(segment, options, stop, self.limits.batch_max):
                    offset += chunk.size
                    yield chunk, [Word(w.text, start + w.start_s, start + w.end_s) for w in words]
        except Cancelled:
            if not stop.is_set():
                raise

    def synthesize_many(self, jobs: Sequence[tuple[list[Segment], SynthesisOptions]]) -> list[np.ndarray]:
        """Several validated requests at once, one waveform each in job order; what the API's queue calls."""
        return self._many(jobs, self.limits.batch_max)

    def synthesize_batch(self, texts: Sequence[str], limits: BatchLimits | None = None,
                         voice: str | int | None = None, speed: float = 1.0, **options) -> list[AudioSegment]:
        """Many texts with one set of options, batched across texts; the list comes back in input order."""
        limits = limits or self.limits
        validated = self.options(voice=voice, speed=speed, **options)
        jobs = [(self.segments(text, limits.max_text_len), validated) for text in texts]
        return [to_audio_segment(wave, self.sample_rate) for wave in self._many(jobs, limits.batch_max)]

    def _many(self, jobs: Sequence[tuple[list[Segment], SynthesisOptions]], batch_max: int) -> list[np.ndarray]:
        return [np.concatenate(waves) if waves else np.zeros(0, np.float32)
                for waves in self.pipeline.synthesize_many(jobs, batch_max)]

    # -- voices registered at run time ----------------------------------------------------------
    def _voice_store(self) -> VoiceStore:
        return VoiceStore.for_bundle(self.bundle, self.state_dir or default_state_dir())

    def _load_registered_voices(self, strict: bool = False) -> None:
        if not self.pipeline.supports_voice_registration:
            return
        store = self._voice_store()
        for partial in store.remove_stale_partials():  # a registration killed mid-save never became a voice
            log.info("removed %s (an interrupted voice registration)", partial.name)
        for name, path in store.files():
            try:
                self.pipeline.load_voice(name, path)
            except CosyedgeError as exc:
                where = f"voices/{store.root.name}/{path.name} in the state directory"
                if strict:  # never the path itself: logs and errors carry no absolute paths
                    raise BundleError(f"registered voice {name!r} ({where}) cannot be loaded: {exc}; restore the "
                                      "file from a backup, or delete it to drop the voice") from None
                log.warning("registered voice %s skipped (%s): %s", name, where, exc)

    def add_voice(self, name: str, audio: bytes, prompt_text: str, replace: bool = False,
                  reserved: Collection[str] = ()) -> str:
        """Register a zero-shot voice from a 1-30 s recording (any common format) and its transcript.

        Its tokens, mel and embedding are computed once, stored in the state directory and kept across restarts.
        A name is registered by one caller at a time: a second registration of a name under way is refused
        (VoiceExistsError), and the file is created exclusively, so two services sharing a state directory cannot
        overwrite each other either. Names no request could select are refused (ReservedVoiceNameError): all
        ASCII digits (a request's digits are a speaker id) and `reserved` (the API's voice aliases).
        """
        if not self.pipeline.supports_voice_registration:
            raise FixedVoicesError(f"{self.bundle.manifest.family} bundles have fixed voices; registering a voice "
                                   "needs a CosyVoice bundle")
        check_voice_name(name)
        if name.isdigit():
            raise ReservedVoiceNameError(f"voice name {name!r} is all digits, which select a speaker id; "
                                         "give the name a letter")
        if name in reserved:
            raise ReservedVoiceNameError(f"voice name {name!r} is an alias of this service (it selects another "
                                         "voice); choose another name")
        if not isinstance(prompt_text, str) or not prompt_text.strip():
            raise InvalidVoiceError("the transcript of the prompt audio is missing; zero-shot voices need it")
        with self._registering_lock:
            if name in self._registering:
                raise VoiceExistsError(f"voice {name!r} is being registered by another request; choose another name")
            if name in self.voices() and not replace:
                raise VoiceExistsError(f"voice {name!r} already exists; remove it first or choose another name")
            self._registering.add(name)
        try:
            wav, rate = read_prompt_audio(audio)
            voice = self.pipeline.make_voice(name, wav, rate, prompt_text)
            self._voice_store().save(name, voice.save, replace=replace)
            self.pipeline.add_voice(voice)
        finally:
            with self._registering_lock:
                self._registering.discard(name)
        return name

    def voice_catalog(self) -> list[dict[str, object]]:
        """Every voice with its speaker id, kind (sft, zero_shot, builtin) and whether it was registered here."""
        registered = {name for name, _ in self._voice_store().files()}
        return [{"name": name, "speaker_id": index, "kind": self.pipeline.voice_kind(name),
                 "registered": name in registered} for index, name in enumerate(self.voices())]

    def reproducible(self, options: SynthesisOptions) -> bool:
        """Whether these options give the same audio on every call (the API's phrase cache keeps only those)."""
        return self.pipeline.reproducible(options)

    def voice_file(self, name: str) -> Path | None:
        """A registered voice's file (None for a bundle voice): what depends on the voice can key on its content."""
        return dict(self._voice_store().files()).get(name) if self.pipeline.supports_voice_registration else None

    def remove_voice(self, name: str) -> None:
        """Delete a registered voice (bundle voices cannot be removed: FixedVoicesError)."""
        check_voice_name(name)
        if not self.pipeline.supports_voice_registration:
            raise FixedVoicesError(f"{self.bundle.manifest.family} bundles have fixed voices")
        self.pipeline.remove_voice(name)
        self._voice_store().remove(name)
