"""CosyVoice bundles (both families): text -> BPE ids -> speech tokens (LLM) -> token filter -> mel (flow) -> 24 kHz
waveform (HiFT).

One pipeline, built from the family's parts (`parts.FamilyParts`: frontend, decode settings, vocoder, stream
schedule, token filter, voice rules; CosyVoice2's in `family.py`, Fun-CosyVoice3's in `cosyvoice3/family.py`), so
whatever is written here (presets, streaming, batching, cancellation) serves both families.

Torch-free: numpy + ONNX Runtime only. Every per-request value (voice inputs, random generator, streaming
caches and chunk offsets) lives in local variables of the call; the pipeline holds only read-only tables and
the ORT sessions, so any number of request threads may share it.

Randomness: one `numpy.random.Generator` per call, seeded by `request.seed` (fresh entropy when None), drives the
RAS sampler and, unless the request is deterministic, the NSF source noise (rendering: after the last token;
streaming: a second Generator spawned from the same seed, since chunks are voiced while the LLM still samples).
`sampling="greedy"` takes the argmax after the eos rule; `deterministic` switches the source noise off. Both
together reproduce the official greedy, noise-free output.

The LLM decodes through one `DecodeScheduler` per pipeline: the rows of every render and stream in flight share
decode steps, and each request keeps its own sampler state, so its tokens do not depend on the others.
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from cosyedge.device import text as textmod
from cosyedge.device.bundle import Bundle
from cosyedge.device.cosyvoice2.alignment import StreamWords, segment_words, token_edges
from cosyedge.device.cosyvoice2.attention import AttentionPass, SegmentPass
from cosyedge.device.cosyvoice2.features import FlowMelConfig, extract_prompt
from cosyedge.device.cosyvoice2.flow import Flow, FlowConfig, FlowPrompt, rows_independent, stretch_mel
from cosyedge.device.cosyvoice2.llm import SpeechLM
from cosyedge.device.cosyvoice2.parts import FamilyParts, PartsBuilder
from cosyedge.device.cosyvoice2.presets import Preset, bundle_presets
from cosyedge.device.cosyvoice2.prompt_cache import PromptCache
from cosyedge.device.cosyvoice2.scheduler import DecodeScheduler, Prefix
from cosyedge.device.cosyvoice2.streaming import ChunkGate, first_chunk_tokens, stream_tokens
from cosyedge.device.cosyvoice2.voices import ModeInputs, Voice
from cosyedge.device.errors import (BundleError, Cancelled, EmptyTextError, FixedVoicesError, InputError,
                                    InvalidVoiceError, UnknownVoiceError)
from cosyedge.device.options import Segment, Stat, SynthesisOptions, Word
from cosyedge.device.pipeline import Pipeline
from cosyedge.device.sessions import SessionConfig
from cosyedge.device.voice_store import check_voice_name

MAX_PROMPT_TEXT = 2000  # characters of a prompt transcript
DECODE_ROWS = 16  # rows one decode step may hold (requests beyond wait for a row to stop)
FLOW_ROWS = 8  # rows of one padded flow batch
STAGES = ("llm", "flow_encoder", "flow_estimator", "hift_source", "hift_decoder")
ALIGN_GRAPH = "llm_align"  # the word-timing pass (optional: bundles written before it give no words)


@dataclass(frozen=True)
class PinnedOptions(SynthesisOptions):
    """The bench's request (not a public field): every segment decodes exactly `pin_tokens` speech tokens, no stop
    id can be chosen, because random-weight bundles never stop sensibly."""
    pin_tokens: int | None = None


def pinned(options: SynthesisOptions, tokens: int | None) -> PinnedOptions:
    """`options` with every segment pinned to `tokens` speech tokens (None: lengths follow the model)."""
    return PinnedOptions(**asdict(options), pin_tokens=tokens)


def pinned_tokens(request: SynthesisOptions) -> int | None:
    return request.pin_tokens if isinstance(request, PinnedOptions) else None


class CosyVoicePipeline(Pipeline):
    """One CosyVoice bundle of either family: sessions and tables shared, everything per request passed in."""

    supports_voice_registration = True
    continuous_batching = True
    instruct2_uses_instruction = False  # True: a family's saved-speaker quirk is not reproduced (not official)

    def __init__(self, bundle: Bundle, precision: str, sessions: SessionConfig, parts: PartsBuilder) -> None:
        manifest = bundle.manifest
        cfg = manifest.config
        self.sample_rate = manifest.sample_rate
        self._frontend_lock = threading.Lock()  # the wetext normalisers are built lazily and are not known thread-safe
        graphs = bundle.selected(precision)  # a precision (fp32, int8) or a quantize target (cpu, trt-int8)
        missing = [name for name in STAGES if name not in graphs]
        if missing:
            raise BundleError(f"bundle {bundle.root.name!r} has no graph {missing[0]!r} for {precision!r}; bundles "
                              "written before the one `llm` graph hold two LLM graphs: re-create it with "
                              "cosyedge quantize")
        self._precision = {name: graphs[name].precision for name in STAGES}
        # rows of different requests share a flow call only where the estimator keeps rows apart (not dynamic int8);
        # only an int8 graph can quantize at run time, and its nodes are read before any session holds memory
        estimator = graphs["flow_estimator"]
        shared_rows = estimator.precision != "int8" or rows_independent(bundle.path(estimator.file))
        self._sessions = {name: sessions.create(bundle.path(graphs[name].file)) for name in STAGES}
        s = self._sessions
        # concurrent streams' chunk work, first chunks first (decode waits for them; on a CPU for every chunk)
        self._chunk_gate = ChunkGate(first_batch=4 if shared_rows else 1,
                                     decode_yields_always=sessions.available()[:1] == ["cpu"], first_beside=True)
        try:
            self._parts: FamilyParts = parts(cfg, bundle.asset("tokenizer"), (s["hift_source"], s["hift_decoder"]),
                                             manifest.sample_rate)
            self.family, self.attribution = self._parts.family, self._parts.attribution
            self._frontend = self._parts.frontend
            self._lm = SpeechLM(s["llm"], bundle.asset("embed_tokens"), bundle.asset("speech_embedding"),
                                bundle.asset("llm_embedding"), self._parts.decode)
            self._aligner = AttentionPass(bundle.path(graphs[ALIGN_GRAPH].file), sessions,
                                          self._lm.speech_embedding) if ALIGN_GRAPH in graphs else None
            self._decoder = DecodeScheduler(self._lm, sessions.row_limit(DECODE_ROWS),
                                            before_step=self._chunk_gate.before_decode_step)
            # TensorRT profiles cap rows and frames (device/trt)
            self._flow_rows = sessions.flow_row_limit(FLOW_ROWS) if shared_rows else 1
            noise = np.load(bundle.asset("cfm_noise"))
            noise = noise[:, :, :sessions.frame_limit(noise.shape[2])]  # longer utterances: InputError
            self._flow = Flow(s["flow_encoder"], s["flow_estimator"], noise, FlowConfig.from_config(cfg),
                              PromptCache(sessions.prompt_cache_mb << 20),
                              quantized_state=not shared_rows)
            self._presets, self._default_preset, self._presets_measured = bundle_presets(cfg)
            self._vocoder = self._parts.vocoder
            self._schedule = self._parts.schedule
            self._mel_bins = int(cfg["mel"]["n_mels"])
            self._mel_config = FlowMelConfig(**cfg["mel"])
        except (KeyError, TypeError, ValueError) as exc:
            raise BundleError(f"bundle {bundle.root.name!r}: manifest config is incomplete ({type(exc).__name__}: "
                              f"{exc}); re-create the bundle") from None
        self._voices = {name: Voice.load(name, bundle.asset(f"voice:{name}")) for name in manifest.voices}
        if not self._voices:
            raise BundleError(f"bundle {bundle.root.name!r} has no voices; re-create the bundle")
        self._bundle_voices = frozenset(self._voices)
        self._voices_lock = threading.Lock()  # registrations and removals from request threads: none is lost
        self._bundle = bundle
        self._session_config = sessions
        self._prompt_models: tuple[Any, Any] | None = None
        self._prompt_lock = threading.Lock()

    def _lm_input(self, segment: Segment, inputs: ModeInputs) -> np.ndarray:
        self._frontend.check_prompt(inputs.prompt_text, segment.ids)
        return self._lm.lm_input(segment.ids, inputs.prompt_text, inputs.prompt_speech)

    def _flow_tokens(self, tokens: list[int]) -> list[int]:
        """The LLM's tokens of one utterance -> the tokens the flow voices (the family's token filter)."""
        keep = self._parts.token_filter().keep
        return [int(t) for t in tokens if keep(t)]

    # -- Pipeline contract ------------------------------------------------------------------
    def voices(self) -> list[str]:
        with self._voices_lock:
            return list(self._voices)

    def _voice(self, name: str) -> Voice | None:
        with self._voices_lock:
            return self._voices.get(name)

    def presets(self) -> list[str]:
        return list(self._presets)

    def warm(self, preset: str | None = None) -> bool:
        """The default voice's prompt state for streaming under `preset` (prompt_cache.py), kept in the cache."""
        prompt = self._mode_inputs(SynthesisOptions(voice=self.voices()[0])).flow
        chosen = self._presets.get(preset or self._default_preset)
        if chosen is None or self._flow.prompt_state(prompt, chosen, build=False) is not None:
            return False
        return self._flow.prompt_state(prompt, chosen) is not None

    def languages(self) -> list[str]:
        return list(self._parts.languages)

    def _preset(self, request: SynthesisOptions) -> Preset:
        """The request's flow preset (Engine.options checked the name), else the bundle default."""
        return self._presets[request.preset or self._default_preset]

    def validate_text(self, text: object, max_chars: int) -> str:
        """The engine's checks (type, empty, length, something speakable), but the raw text is kept: the
        CosyVoice2 frontend normalises it itself, and the generic NFKC pass would change its tokens."""
        textmod.validate(text, max_chars)
        return str(text)

    def reproducible(self, options: SynthesisOptions) -> bool:
        """A seed fixes the sampler and the source noise; greedy and noise-free need none."""
        return options.seed is not None or (options.sampling == "greedy" and options.deterministic)

    def check_options(self, options: SynthesisOptions) -> None:
        """Refuse mode / voice combinations up front (InputError), before any work is queued."""
        self._mode_inputs(options)

    def segments(self, text: str) -> list[Segment]:
        with self._frontend_lock:
            segments = self._frontend.normalize(text, split=True)
        segments = [Segment(text=segment, ids=tuple(self._frontend.encode(segment))) for segment in segments]
        segments = [segment for segment in segments if segment.ids]
        if not segments:
            raise EmptyTextError("text contains nothing speakable for this voice")
        return segments

    def synthesize(self, segments: Sequence[Segment], request: SynthesisOptions) -> list[np.ndarray]:
        return self.synthesize_many([(segments, request)], DECODE_ROWS)[0]

    def synthesize_many(self, jobs: Sequence[tuple[Sequence[Segment], SynthesisOptions]],
                        batch_max: int) -> list[list[np.ndarray]]:
        """Several requests at once, one waveform per segment, whatever their options. `batch_max` bounds the
        rows decoded together (within DECODE_ROWS); the flow batches (FLOW_ROWS) size themselves. Every job's
        segments go to the decode scheduler as one group (one Generator), all groups at once before any job waits,
        so they share a prefill and decode steps; then the segments of all jobs run through the flow in padded
        batches of similar lengths (each row with its own voice prompt; one by one where the estimator quantizes
        activations per call, `flow.rows_independent`), and through HiFT one by one (its non-causal convolutions
        would see another row's padding). A job's result is what it gives alone."""
        return self._render(jobs, batch_max)[0]

    def _render(self, jobs: Sequence[tuple[Sequence[Segment], SynthesisOptions]], batch_max: int,
                prefixes: Sequence[Sequence[Prefix]] | None = None
                ) -> tuple[list[list[np.ndarray]], list[list[list[int]]]]:
        """`synthesize_many`'s waveforms, and the LLM's speech tokens of every segment (before the token filter);
        `prefixes[job][segment]` receives the segment's prefill cache for the word-timing pass."""
        pending = []
        for job, (segments, request) in enumerate(jobs):
            inputs = self._mode_inputs(request)
            rng = np.random.default_rng(request.seed)
            lm_inputs = [self._lm_input(segment, inputs) for segment in segments]
            group = self._decoder.group(lm_inputs, [len(segment.ids) for segment in segments],
                                        request.sampling == "greedy", rng, pinned_tokens(request), batch_max,
                                        prefixes=prefixes[job] if prefixes else None) if segments else None
            pending.append((inputs, rng, group))
        self._decoder.enqueue([group for _, _, group in pending if group is not None])  # one prefill if they fit
        spoken = []  # (job, segment, prompt, tokens) of every segment that has speech tokens
        decoded: list[list[list[int]]] = []
        for job, (inputs, _, group) in enumerate(pending):
            decoded.append([list(tokens) for tokens in (group.results() if group is not None else [])])
            for segment, tokens in enumerate(decoded[-1]):
                tokens = self._flow_tokens(tokens)
                if tokens:
                    spoken.append((job, segment, inputs.flow, np.asarray(tokens, np.int64)))
        mels = {}
        for preset in dict.fromkeys(self._preset(request) for _, request in jobs):  # one Euler recipe per batch
            rows = [row for row in spoken if self._preset(jobs[row[0]][1]) == preset]
            for batch in self._flow_batches(rows, self._flow_rows):
                for (job, segment, _, _), mel in zip(batch, self._flow.mels([s[2] for s in batch],
                                                                            [s[3] for s in batch], preset)):
                    mels[job, segment] = mel
        out = []
        for job, ((segments, request), (_, rng, _)) in enumerate(zip(jobs, pending)):
            waves = [np.zeros(0, np.float32) for _ in segments]
            for segment in range(len(segments)):
                mel = mels.get((job, segment))
                if mel is None:
                    continue
                if request.speed != 1.0:
                    mel = stretch_mel(mel, request.speed)
                waves[segment] = self._vocoder.render(mel, None if request.deterministic else rng)
            out.append(waves)
        return out, decoded

    # -- word times (alignment.py, attention.py) ----------------------------------------------
    @property
    def times_words(self) -> bool:
        return self._aligner is not None

    def word_segments(self, text: str) -> list[Segment]:
        """`segments`, each with its words as ranges of its BPE ids (`TextFrontend.words`: the normalised text's
        words, as the model reads them); a bundle without the word-timing pass gets none."""
        segments = self.segments(text)
        if self._aligner is None:
            return segments
        return [Segment(s.text, s.ids, self._frontend.words(s.text)) for s in segments]

    def synthesize_words(self, segments: Sequence[Segment], options: SynthesisOptions, batch_max: int,
                         ) -> list[tuple[np.ndarray, tuple[Word, ...]]]:
        """`synthesize_many`'s waveforms (one render of the request), each segment's words from one pass over its
        prompt, text and speech tokens; the audio's length spread over the tokens the flow voiced."""
        if self._aligner is None:
            return super().synthesize_words(segments, options, batch_max)
        prefixes = [Prefix(self._aligner.depth) for _ in segments]
        (waves,), (decoded,) = self._render([(segments, options)], batch_max, [prefixes])
        inputs = self._mode_inputs(options)
        out = []
        for segment, wave, tokens, prefix in zip(segments, waves, decoded, prefixes):
            seconds = wave.size / self.sample_rate
            kept = self._kept(tokens)
            attention = self._segment_pass(segment, inputs, tokens, prefix).attention
            edges = token_edges(kept, seconds / max(sum(kept), 1))
            out.append((wave, segment_words(attention, segment.words, edges, seconds)))
        return out

    def stream_words(self, segment: Segment, request: SynthesisOptions, stop: threading.Event | None,
                     batch_max: int) -> Iterator[tuple[np.ndarray, tuple[Word, ...]]]:
        """`stream_request`'s chunks, each with the words whose audio ends in the audio sent so far: after every
        chunk the pass takes the tokens decoded since the last one (one call on its cache), the path is re-solved
        from the last word handed out (`alignment.StreamWords`), and the last chunk takes the rest."""
        if self._aligner is None or not segment.words:
            yield from super().stream_words(segment, request, stop, batch_max)
            return
        if request.speed != 1.0:  # rendered whole (stream_request): its words with it
            yield from self.synthesize_words([segment], request, batch_max)
            return
        inputs = self._mode_inputs(request)
        heard: list[int] = []
        ended = threading.Event()
        prefix = Prefix(self._aligner.depth)
        state = self._segment_pass(segment, inputs, (), prefix)
        words = StreamWords(segment.words, settle=self._schedule.lookahead)
        per_token = self._vocoder.samples_per_frame * self._flow.config.token_mel_ratio / self.sample_rate
        emitted = 0
        for chunk in self._stream(segment, inputs, request, stop, batch_max, _tapped(heard, ended), prefix):
            emitted += chunk.size
            state.extend(heard)
            edges = token_edges(self._kept(heard), per_token)
            if ended.is_set():  # the LLM has stopped: this is the segment's last chunk
                yield chunk, words.finish(state.attention, edges, emitted / self.sample_rate)
            else:
                yield chunk, words.update(state.attention, edges, emitted / self.sample_rate)

    def _segment_pass(self, segment: Segment, inputs: ModeInputs, tokens: Sequence[int],
                      prefix: Prefix | None = None) -> SegmentPass:
        """A word-timing pass over `segment` as the LLM read it (prompt, text), after `tokens`, from the prompt's
        cache the prefill left in `prefix`."""
        state = self._aligner.begin(self._lm_input(segment, inputs),
                                    1 + len(inputs.prompt_text) + np.arange(len(segment.ids)), prefix)
        state.extend(tokens)
        return state

    def _kept(self, tokens: Sequence[int]) -> list[bool]:
        keep = self._parts.token_filter().keep
        return [keep(int(t)) for t in tokens]

    @staticmethod
    def _flow_batches(rows: list[tuple[int, int, FlowPrompt, np.ndarray]], limit: int) -> list[list]:
        """Flow rows grouped by frame count (prompt + generated tokens): at most `limit` per batch, and a new
        batch where padding would exceed a third of the longest row, so that batching saves calls, not adds work."""
        ordered = sorted(rows, key=lambda r: len(r[2].tokens) + len(r[3]))
        batches: list[list] = []
        for row in ordered:
            size = len(row[2].tokens) + len(row[3])
            if batches and len(batches[-1]) < limit and \
                    3 * (len(batches[-1][0][2].tokens) + len(batches[-1][0][3])) >= 2 * size:
                batches[-1].append(row)
            else:
                batches.append([row])
        return batches

    def stream(self, segment: Segment, request: SynthesisOptions) -> Iterator[np.ndarray]:
        yield from self.stream_request(segment, request, None, DECODE_ROWS)

    def stream_request(self, segment: Segment, request: SynthesisOptions, stop: threading.Event | None,
                       batch_max: int) -> Iterator[np.ndarray]:
        """Chunks of one segment; setting `stop` withdraws the decode row before the next step (Cancelled)."""
        if request.speed != 1.0:  # the official streaming path has no speed change: render the segment whole
            yield from self.synthesize_many([([segment], request)], batch_max)[0]
            return
        yield from self._stream(segment, self._mode_inputs(request), request, stop, batch_max)

    def _stream(self, segment: Segment, inputs: ModeInputs, request: SynthesisOptions, stop: threading.Event | None,
                batch_max: int, tap: Callable[[Iterable[int]], Iterator[int]] | None = None,
                prefix: Prefix | None = None) -> Iterator[np.ndarray]:
        """The chunks of one segment at speed 1; `tap` sees every token on its way to the stream loop; `prefix`
        receives the prefill's cache (the word-timing pass)."""
        seeds = np.random.SeedSequence(request.seed)
        noise = None if request.deterministic else np.random.default_rng(seeds.spawn(1)[0])
        first = first_chunk_tokens(len(inputs.flow.tokens), self._schedule, self._preset(request))
        tokens: Iterable[int] = self._tokens(segment, inputs, request, np.random.default_rng(seeds), batch_max, stop,
                                             prefix, urgent_tokens=first)
        if stop is not None:
            tokens = _until(tokens, stop)
        yield from self.stream_tokens(tap(tokens) if tap else tokens, request, noise)

    def decode_occupancy(self) -> dict[int, int]:
        return dict(self._decoder.stats()["rows_per_step"])  # type: ignore[arg-type]

    def stats(self) -> dict[str, Stat]:
        """The decode scheduler's gauges for /metrics (cross-request LLM batching at work). `describe()["decode"]`
        has the full counters."""
        stats = self._decoder.stats()
        return {"decode_steps": Stat(float(stats["decode_steps"]), "LLM decode steps run so far (batched)"),
                "decode_rows_mean": Stat(float(stats["mean_rows"]), "mean requests' rows per LLM decode step"),
                "decode_active_rows": Stat(float(stats["active_rows"]), "rows decoding right now"),
                "decode_rows_joined": Stat(float(stats["joined_running"]),
                                           "rows that joined a decode batch already running"),
                "decode_rows_cancelled": Stat(float(stats["cancelled_rows"]),
                                              "decode rows withdrawn before their end (clients that left)")}

    def describe(self) -> dict[str, Any]:
        return {"family": self.family, "precision": dict(self._precision),
                "providers": {name: s.get_providers()[0] for name, s in self._sessions.items()},
                "sample_rate": self.sample_rate, "voices": len(self.voices()), "modes": list(self._parts.modes),
                "llm_hidden_size": self._lm.hidden_size, "stream": asdict(self._schedule),
                "presets": {name: p.to_config() for name, p in self._presets.items()},
                "default_preset": self._default_preset, "presets_measured": self._presets_measured,
                "decode": self._decoder.stats()}

    # -- voices -----------------------------------------------------------------------------
    def make_voice(self, name: str, wav: np.ndarray, sample_rate: int, prompt_text: str) -> Voice:
        """A zero-shot voice from a prompt recording and its transcript, as the official zero-shot frontend
        prepares them (speech tokens, flow mel and CAM++ embedding; the transcript normalised, not split, after
        the family's frontend framed it)."""
        check_voice_name(name)
        shortest = self._parts.min_prompt_seconds
        if wav.size < shortest * sample_rate:
            raise InvalidVoiceError(f"prompt audio is {wav.size / sample_rate:.2f} s long; {self.family} voices "
                                    f"need {shortest:.0f}-30 s of speech")
        text = self._frontend.voice_transcript(self.validate_text(prompt_text, MAX_PROMPT_TEXT))
        with self._frontend_lock:
            normalised = self._frontend.normalize(text, split=False)[0]
        features = extract_prompt(wav, sample_rate, *self._prompt_sessions(), self._mel_config)
        return Voice(name, "zero_shot", features.embedding, prompt_text=normalised,
                     prompt_text_ids=tuple(self._frontend.encode(normalised)),
                     llm_prompt_speech=tuple(int(t) for t in features.tokens),
                     flow_prompt_speech=features.tokens, prompt_mel=features.mel)

    def add_voice(self, voice: Voice) -> None:
        """Make a voice available to later requests (bundle voices cannot be replaced)."""
        if voice.name in self._bundle_voices:
            raise FixedVoicesError(f"voice {voice.name!r} is part of the bundle; choose another name")
        with self._voices_lock:  # a new dict: an iteration of the old one never sees it resized
            self._voices = {**self._voices, voice.name: voice}

    def voice_kind(self, name: str) -> str:
        with self._voices_lock:
            return self._voices[name].kind

    def load_voice(self, name: str, path: Path) -> None:
        """A voice registered earlier (state directory), in the bundle's voice file format."""
        self.add_voice(Voice.load(name, path))

    def remove_voice(self, name: str) -> None:
        if name in self._bundle_voices:
            raise FixedVoicesError(f"voice {name!r} is part of the bundle and cannot be removed")
        with self._voices_lock:
            self._voices = {k: v for k, v in self._voices.items() if k != name}

    def _prompt_sessions(self) -> tuple[Any, Any]:
        """CAM++ and the speech tokenizer, created on first use (CPU: the official code runs them there)."""
        with self._prompt_lock:
            if self._prompt_models is None:
                cpu = SessionConfig(providers=("cpu",), intra_op_threads=self._session_config.intra_op_threads,
                                    session_factory=self._session_config.session_factory)
                self._prompt_models = tuple(
                    cpu.create(self._bundle.path(self._bundle.component(name, "fp32").file))
                    for name in ("campplus", "speech_tokenizer"))
            return self._prompt_models

    # -- building blocks (also used by tests and tools) -------------------------------------
    def speech_tokens(self, segment: Segment, request: SynthesisOptions, rng: np.random.Generator | None = None) -> list[int]:
        """The LLM's speech tokens for one segment (greedy ones are reproducible: the golden tests compare them)."""
        rng = rng if rng is not None else np.random.default_rng(request.seed)
        return list(self._tokens(segment, self._mode_inputs(request), request, rng))

    def stream_tokens(self, tokens: Iterable[int], request: SynthesisOptions,
                      rng: np.random.Generator | None = None) -> Iterator[np.ndarray]:
        """Streaming synthesis of a given token stream (any source) in the request's voice and mode."""
        inputs = self._mode_inputs(request)
        if not request.deterministic and rng is None:
            rng = np.random.default_rng(request.seed)
        yield from stream_tokens(tokens, inputs.flow, self._flow,
                                 self._vocoder.stream(None if request.deterministic else rng), self._schedule,
                                 self._parts.token_filter(), self._chunk_gate, self._preset(request))

    def _tokens(self, segment: Segment, inputs: ModeInputs, request: SynthesisOptions, rng: np.random.Generator,
                batch_max: int = DECODE_ROWS, stop: threading.Event | None = None,
                prefix: Prefix | None = None, urgent_tokens: int = 0) -> Iterator[int]:
        """The segment's tokens from the decode loop; `urgent_tokens`: a stream's tokens before its first chunk,
        which the loop decodes ahead of other rows."""
        lm_input = self._lm_input(segment, inputs)
        return self._decoder.stream(lm_input, len(segment.ids), request.sampling == "greedy", rng, pinned_tokens(request),
                                    batch_max, stop, prefix, urgent_tokens)

    def _mode_inputs(self, request: SynthesisOptions) -> ModeInputs:
        voice = self._voice(request.voice)
        if voice is None:
            raise UnknownVoiceError(f"unknown voice {request.voice[:64]!r}; available: {', '.join(self.voices())}")
        instruct = request.instruct_text or ""
        mode = request.mode or ("instruct2" if instruct else None)
        if instruct and mode != "instruct2":
            raise InputError(f"an instruct text is only used by mode 'instruct2', not {mode!r}")
        if mode is not None and mode not in self._parts.modes:
            raise InputError(f"unknown mode {mode!r} for {self.family}; choose from {', '.join(self._parts.modes)}")
        instruct_ids = tuple(self._frontend.encode(self._frontend.instruction(instruct))) if instruct else ()
        inputs = voice.inputs(mode, instruct_ids, self._mel_bins)
        if (mode == "instruct2" and self._parts.saved_speaker_quirk and not self.instruct2_uses_instruction
                and request.voice in self._bundle_voices):
            return ModeInputs(voice.prompt_text_ids, (), inputs.flow)  # official: spk2info's prompt_text wins
        return inputs


def _tapped(heard: list[int], ended: threading.Event) -> Callable[[Iterable[int]], Iterator[int]]:
    """A tap that records every token into `heard` and sets `ended` once the source is exhausted (the stream loop
    then makes only its final chunk)."""
    def tap(tokens: Iterable[int]) -> Iterator[int]:
        for token in tokens:
            heard.append(int(token))
            yield token
        ended.set()
    return tap


def _until(tokens: Iterable[int], stop: threading.Event) -> Iterator[int]:
    """`tokens` while `stop` is clear: once set, the next read raises Cancelled, so no further chunk (not even
    the final one) goes through the flow and HiFT for a request nobody waits for."""
    for token in tokens:
        if stop.is_set():
            break
        yield token
    if stop.is_set():
        raise Cancelled("the request was withdrawn")
