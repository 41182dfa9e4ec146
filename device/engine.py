"""`Engine`: the public face of the runtime. Load a bundle, then synthesize, stream or batch."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from pydub import AudioSegment

from cosyedge.device import text as textmod
from cosyedge.device.audio import to_audio_segment
from cosyedge.device.bundle import Bundle
from cosyedge.device.errors import (BundleError, CosyedgeError, FixedVoicesError, InputError, InvalidVoiceError,
                                    UnknownVoiceError, VoiceExistsError)
from cosyedge.device.pipeline import SPEED_RANGE, Pipeline, SynthesisOptions, Segment
from cosyedge.device.sessions import SessionConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchLimits:
    """Limits of one batched call: text length per item, items per model call, and the queue wait."""
    max_text_len: int = 2000
    batch_max: int = 8
    timeout: float = 0.05

    def __post_init__(self) -> None:
        if self.max_text_len < 1 or self.batch_max < 1 or self.timeout < 0:
            raise InputError("BatchLimits: max_text_len and batch_max must be >= 1 and timeout >= 0")


def _load_pipeline(bundle: Bundle, precision: str, sessions: SessionConfig) -> Pipeline:
    family = bundle.manifest.family
    if family == "vits":
        from cosyedge.device.vits import VitsPipeline
        return VitsPipeline(bundle, precision, sessions)
    if family == "cosyvoice2":
        from cosyedge.device.cosyvoice2.pipeline import CosyVoice2Pipeline
        return CosyVoice2Pipeline(bundle, precision, sessions)
    raise BundleError(f"bundle {bundle.root.name!r}: family {family!r} is not supported by this runtime yet")


# Which quantize target suits which execution provider, best first.
_TARGET_FOR_PROVIDER = (("tensorrt", "trt-int8"), ("cuda", "gpu-fp16"), ("cpu", "cpu"))
_TARGETS = ("cpu", "gpu-fp16", "trt-int8")


def _auto_selection(bundle: Bundle, sessions: SessionConfig) -> str:
    """`precision="auto"`: the bundle's target for the best available provider, else its measured default."""
    available = sessions.available()
    for provider, target in _TARGET_FOR_PROVIDER:
        if provider in available and target in bundle.targets:
            return target
    return bundle.manifest.default_precision


class Engine:
    """One loaded bundle. Thread-safe: requests share only read-only state and ORT sessions."""

    def __init__(self, bundle: Bundle, pipeline: Pipeline, precision: str, limits: BatchLimits,
                 state_dir: Path | None = None) -> None:
        self.bundle = bundle
        self.pipeline = pipeline
        self.precision = precision
        self.limits = limits
        self.state_dir = state_dir  # registered voices live here (None: device.default_voice.state_dir())

    @classmethod
    def load(cls, bundle_path: Path | str | None = None, precision: str = "auto", target: str | None = None,
             sessions: SessionConfig | None = None, limits: BatchLimits | None = None,
             warmup: bool = True, state_dir: Path | str | None = None) -> "Engine":
        """Validate the bundle, create the ORT sessions once, and warm them up.

        With no `bundle_path`, the embedded default voice is used (built offline on first use).
        """
        if bundle_path is None:
            from cosyedge.device.default_voice import default_bundle
            bundle_path = default_bundle()
        sessions = sessions or SessionConfig.from_env()
        manifest_only = Bundle.load(bundle_path, verify=False)
        if precision in _TARGETS:
            raise InputError(f"{precision!r} is a build target; use target")
        if target is not None and precision != "auto":
            raise InputError("give a precision or a target, not both")
        chosen = target or (_auto_selection(manifest_only, sessions) if precision == "auto" else precision)
        bundle = Bundle.load(bundle_path, precision=chosen)
        engine = cls(bundle, _load_pipeline(bundle, chosen, sessions), chosen,
                     limits or BatchLimits(), Path(state_dir) if state_dir else None)
        engine._load_registered_voices()
        if warmup:
            engine.warmup()
        return engine

    # -- voices registered at run time ----------------------------------------------------------
    def _voice_store(self):
        from cosyedge.device.default_voice import state_dir
        from cosyedge.device.voice_store import VoiceStore
        return VoiceStore.for_bundle(self.bundle, self.state_dir or state_dir())

    def _load_registered_voices(self) -> None:
        load = getattr(self.pipeline, "load_voice", None)
        if load is None:
            return
        for name, path in self._voice_store().files():
            try:
                load(name, path)
            except CosyedgeError as exc:  # one broken file must not stop the service
                log.warning("registered voice %s skipped: %s", name, exc)

    def add_voice(self, name: str, audio: bytes, prompt_text: str, replace: bool = False) -> str:
        """Register a zero-shot voice from a 1-30 s recording (any common format) and its transcript.

        Its tokens, mel and embedding are computed once, stored in the state directory and kept across restarts.
        """
        from cosyedge.device.voice_store import check_voice_name, read_prompt_audio
        make = getattr(self.pipeline, "make_voice", None)
        if make is None:
            raise FixedVoicesError(f"{self.bundle.manifest.family} bundles have fixed voices; registering a voice needs a "
                                   "CosyVoice bundle")
        check_voice_name(name)
        if name in self.voices() and not replace:
            raise VoiceExistsError(f"voice {name!r} already exists; remove it first or choose another name")
        if not isinstance(prompt_text, str) or not prompt_text.strip():
            raise InvalidVoiceError("the transcript of the prompt audio is missing; zero-shot voices need it")
        wav, rate = read_prompt_audio(audio)
        voice = make(name, wav, rate, prompt_text)
        self._voice_store().save(name, voice.save)
        self.pipeline.add_voice(voice)
        return name

    def voice_catalog(self) -> list[dict[str, object]]:
        """Every voice with its speaker id, kind (sft, zero_shot, builtin) and whether it was registered here."""
        registered = {name for name, _ in self._voice_store().files()}
        kind = getattr(self.pipeline, "voice_kind", lambda name: "builtin")
        return [{"name": name, "speaker_id": index, "kind": kind(name), "registered": name in registered}
                for index, name in enumerate(self.voices())]

    def remove_voice(self, name: str) -> None:
        from cosyedge.device.voice_store import check_voice_name
        check_voice_name(name)
        remove = getattr(self.pipeline, "remove_voice", None)
        if remove is None:
            raise FixedVoicesError(f"{self.bundle.manifest.family} bundles have fixed voices")
        remove(name)
        self._voice_store().remove(name)

    # -- properties -------------------------------------------------------------------------
    @property
    def sample_rate(self) -> int:
        return self.pipeline.sample_rate

    def voices(self) -> list[str]:
        return self.pipeline.voices()

    def stats(self) -> dict[str, float]:
        """The pipeline's counters for /metrics (stand-in until the Pipeline base class gives `stats()`)."""
        decode_stats = getattr(self.pipeline, "decode_stats", None)
        if decode_stats is None:
            return {}
        stats = decode_stats()
        return {"decode_steps": float(stats["decode_steps"]), "decode_rows_mean": float(stats["mean_rows"]),
                "decode_active_rows": float(stats["active_rows"])}

    def warmup(self) -> float:
        """One short synthesis so the first real request does not pay for lazy ORT initialisation."""
        start = time.perf_counter()
        self.synthesize("Hello.", deterministic=True)
        elapsed = time.perf_counter() - start
        log.info("warm-up took %.2f s", elapsed)
        return elapsed

    # -- request validation -----------------------------------------------------------------
    def options(self, voice: str | int | None = None, speed: float = 1.0, deterministic: bool = False,
                seed: int | None = None, sampling: str = "default", mode: str | None = None,
                instruct_text: str | None = None) -> SynthesisOptions:
        """Validate per-request options once; the result is immutable and private to the request."""
        voices = self.voices()
        if voice is None or voice == "":
            name = voices[0]
        elif isinstance(voice, bool):
            raise UnknownVoiceError("voice must be a name or a numeric speaker id")
        elif isinstance(voice, int) or (isinstance(voice, str) and voice.isdigit()):
            index = int(voice)
            if index < 0:
                raise UnknownVoiceError(f"speaker id {index} is negative")
            name = voices[index % len(voices)]
        elif voice in voices:
            name = voice
        else:
            raise UnknownVoiceError(f"unknown voice {str(voice)[:64]!r}; available: {', '.join(voices[:20])}")
        try:
            speed = float(speed)
        except (TypeError, ValueError):
            raise InputError("speed must be a number") from None
        if not SPEED_RANGE[0] <= speed <= SPEED_RANGE[1] or speed != speed:
            raise InputError(f"speed {speed} is out of range {SPEED_RANGE[0]}-{SPEED_RANGE[1]}")
        if sampling not in ("default", "greedy"):
            raise InputError(f"unknown sampling {sampling!r}; choose default or greedy")
        if instruct_text is not None and not isinstance(instruct_text, str):
            raise InputError("instruct_text must be a string")
        request = SynthesisOptions(voice=name, speed=speed, deterministic=deterministic, seed=seed, sampling=sampling,
                          mode=mode or None, instruct_text=instruct_text or None)
        check = getattr(self.pipeline, "check_request", None)  # family-specific options (modes, instruct text)
        if check is not None:
            check(request)
        elif request.mode is not None or request.instruct_text is not None:
            raise InputError("this bundle's model family has no modes or instruct text")
        return request

    request = options  # stand-in: jobs.py and the bench call request() until H1's engine lands

    def segments(self, text: object) -> list[Segment]:
        return self.pipeline.segments(self._validate_text(text, self.limits.max_text_len))

    def _validate_text(self, text: object, max_chars: int) -> str:
        """The generic checks and clean-up, or the pipeline's own (`validate_text`) when its frontend needs raw text."""
        own = getattr(self.pipeline, "validate_text", None)
        return own(text, max_chars) if own is not None else textmod.validate(text, max_chars)

    # -- synthesis --------------------------------------------------------------------------
    def synthesize_waveform(self, text: str, **request_options) -> np.ndarray:
        request = self.options(**request_options)
        segments = self.segments(text)
        return np.concatenate(self.pipeline.synthesize(segments, request))

    def synthesize(self, text: str, voice: str | int | None = None, speed: float = 1.0, **request_options) -> AudioSegment:
        """The whole text as one AudioSegment at the bundle's sample rate."""
        return to_audio_segment(self.synthesize_waveform(text, voice=voice, speed=speed, **request_options), self.sample_rate)

    def stream(self, text: str, voice: str | int | None = None, speed: float = 1.0, **request_options) -> Iterator[np.ndarray]:
        """float32 chunks, each yielded as soon as it is made (a sentence for VITS)."""
        request = self.options(voice=voice, speed=speed, **request_options)
        for segment in self.segments(text):
            yield from self.pipeline.stream(segment, request)

    def synthesize_many(self, jobs: Sequence[tuple[list[Segment], SynthesisOptions]]) -> list[np.ndarray]:
        """Several validated requests at once, results in job order; this is what the API's batch queue calls.

        A pipeline with `synthesize_many` (CosyVoice2: every request decodes in shared LLM steps whatever its options)
        takes them all; otherwise segments of equal request options run as one batch.
        """
        synthesize_many = getattr(self.pipeline, "synthesize_many", None)
        if synthesize_many is not None:
            return [np.concatenate(waves) if waves else np.zeros(0, np.float32)
                    for waves in synthesize_many([(list(segments), req) for segments, req in jobs])]
        flat: list[tuple[int, Segment, SynthesisOptions]] = [(j, segment, req) for j, (segments, req) in enumerate(jobs) for segment in segments]
        rendered: dict[int, np.ndarray] = {}
        groups: dict[SynthesisOptions, list[int]] = {}
        for index, (_, _, req) in enumerate(flat):
            groups.setdefault(req, []).append(index)
        for req, indices in groups.items():
            indices.sort(key=lambda i: len(flat[i][1].ids))  # similar lengths pad less
            for start in range(0, len(indices), self.limits.batch_max):
                chunk = indices[start:start + self.limits.batch_max]
                for index, wave in zip(chunk, self.pipeline.synthesize([flat[i][1] for i in chunk], req)):
                    rendered[index] = wave
        per_job: list[list[np.ndarray]] = [[] for _ in jobs]
        for index, (job, _, _) in enumerate(flat):
            per_job[job].append(rendered[index])
        return [np.concatenate(parts) if parts else np.zeros(0, np.float32) for parts in per_job]

    def synthesize_batch(self, texts: Sequence[str], options: BatchLimits | None = None,
                         voice: str | int | None = None, speed: float = 1.0, **request_options) -> list[AudioSegment]:
        """Many texts, batched across texts; the list comes back in input order."""
        options = options or self.limits
        request = self.options(voice=voice, speed=speed, **request_options)
        jobs = [(self.pipeline.segments(self._validate_text(t, options.max_text_len)), request) for t in texts]
        engine = self if options == self.limits else Engine(self.bundle, self.pipeline, self.precision, options,
                                                             self.state_dir)
        return [to_audio_segment(wave, self.sample_rate) for wave in engine.synthesize_many(jobs)]
