"""The one contract every model family implements: `Pipeline`.

The engine turns text into segments (one per sentence) and a pipeline turns segments into waveforms. Every
capability a family may offer is listed here; the optional ones have defaults, so the engine and the API call
them directly and never probe with `getattr`. A new family (cosyvoice3) fills in the required five methods, sets
`supports_voice_registration` if it can clone voices, and overrides the defaults it does better.

Per-request state lives in `SynthesisOptions` and in local variables, never on the pipeline: pipelines are shared
by every request thread.
"""
from __future__ import annotations

import abc
import threading
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from cosyedge.device import text as textmod
from cosyedge.device.errors import FixedVoicesError, UnsupportedOptionError
from cosyedge.device.options import Segment, Stat, SynthesisOptions, Word

Job = tuple[Sequence[Segment], SynthesisOptions]


class Pipeline(abc.ABC):
    """A model family behind the engine: vits, cosyvoice2, cosyvoice3."""

    sample_rate: int
    supports_voice_registration: bool = False  # True: make_voice / add_voice / load_voice / remove_voice work
    # Padded batching bound: token ids (rows x longest row) in one model call of the default synthesize_many.
    # 0 = one segment per call, for a family whose padded batches do not pay on the device.
    batch_ids_max: int = 4096
    # True: requests may enter the pipeline one by one at any time and share model calls inside it (CosyVoice's
    # decode scheduler), so the API hands each request over at once instead of collecting closed batches.
    continuous_batching: bool = False
    # Who made the model and where it comes from (Wyoming's `info`, through `Engine.describe`): name, URL.
    attribution: tuple[str, str] = ("", "")

    # -- required ---------------------------------------------------------------------------
    @abc.abstractmethod
    def voices(self) -> list[str]:
        """Voice names in a stable order (numeric speaker ids index into it)."""

    @abc.abstractmethod
    def segments(self, text: str) -> list[Segment]:
        """Validated text -> segments; EmptyTextError if nothing is left to say."""

    @abc.abstractmethod
    def synthesize(self, segments: Sequence[Segment], options: SynthesisOptions) -> list[np.ndarray]:
        """Segments sharing one set of options -> one float32 waveform each."""

    @abc.abstractmethod
    def stream(self, segment: Segment, options: SynthesisOptions) -> Iterator[np.ndarray]:
        """Waveform chunks of one segment, each yielded as soon as it exists."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """Precision per stage, providers, sizes: for `cosyedge info`, the bench and /v1/models."""

    # -- optional, with defaults ------------------------------------------------------------
    def presets(self) -> list[str]:
        """Quality presets a request may name in `SynthesisOptions.preset` (default: none, only None is valid)."""
        return []

    def languages(self) -> list[str]:
        """The languages the voices speak, as Wyoming names them (en_US, zh); default: none declared."""
        return []

    def validate_text(self, text: object, max_chars: int) -> str:
        """Type, emptiness, length and something speakable; returns the text the family's `segments` expects
        (default: the generic NFKC clean-up; a family whose frontend normalises itself returns the raw text)."""
        return textmod.validate(text, max_chars)

    def check_options(self, options: SynthesisOptions) -> None:
        """Refuse options the family cannot honour, before any work is queued (default: no modes, no instruct);
        every door hands its options here, so a field is refused the same way whichever door it came through."""
        if options.mode is not None or options.instruct_text is not None:
            raise UnsupportedOptionError("this bundle's model family has no modes or instruct text")

    @property
    def times_words(self) -> bool:
        """Whether this bundle can time words (`word_segments` gives words; default: no)."""
        return False

    def word_segments(self, text: str) -> list[Segment]:
        """`segments`, each with the input words it speaks (`Segment.words`) where the family can time them
        (default: the segments without words). The ids, and so the audio, are those of `segments`."""
        return self.segments(text)

    def synthesize_words(self, segments: Sequence[Segment], options: SynthesisOptions, batch_max: int,
                         ) -> list[tuple[np.ndarray, tuple[Word, ...]]]:
        """Each segment's waveform, the one `synthesize_many` gives it, with its words timed from its first sample
        (default: no words, for a family without word times)."""
        return [(wave, ()) for wave in self.synthesize_many([(segments, options)], batch_max)[0]]

    def stream_words(self, segment: Segment, options: SynthesisOptions, stop: threading.Event | None,
                     batch_max: int) -> Iterator[tuple[np.ndarray, tuple[Word, ...]]]:
        """`stream_request`'s chunks, each with the words whose audio is complete once it has been sent (times from
        the segment's first sample; a word never comes after the chunk that ends it). Default: no words."""
        for chunk in self.stream_request(segment, options, stop or threading.Event(), batch_max):
            yield chunk, ()

    def reproducible(self, options: SynthesisOptions) -> bool:
        """Whether `options` give the same audio on every call (what a cache may keep); default: never promised."""
        return False

    def synthesize_many(self, jobs: Sequence[Job], batch_max: int) -> list[list[np.ndarray]]:
        """Several requests at once, one waveform per segment, in job order (what the API's queue feeds).

        Default: segments of equal options run together, sorted by length so padded batches waste little, at most
        `batch_max` per model call and at most `batch_ids_max` padded token ids (rows x longest row), so a batch's
        activations, and the memory the allocator keeps after it, stay bounded whatever the texts' lengths.
        A family that can mix options in one call (CosyVoice2) overrides this.
        """
        flat = [(job, segment, options) for job, (segments, options) in enumerate(jobs) for segment in segments]
        groups: dict[SynthesisOptions, list[int]] = {}
        for index, (_, _, options) in enumerate(flat):
            groups.setdefault(options, []).append(index)
        waves: dict[int, np.ndarray] = {}
        for options, indices in groups.items():
            indices.sort(key=lambda i: len(flat[i][1].ids))
            for chunk in self._padded_batches([len(flat[i][1].ids) for i in indices], batch_max):
                chosen = [indices[k] for k in chunk]
                waves.update(zip(chosen, self.synthesize([flat[i][1] for i in chosen], options)))
        per_job: list[list[np.ndarray]] = [[] for _ in jobs]
        for index, (job, _, _) in enumerate(flat):
            per_job[job].append(waves[index])
        return per_job

    def _padded_batches(self, lengths: Sequence[int], batch_max: int) -> list[list[int]]:
        """Consecutive positions of ascending `lengths`, cut where a batch would pass batch_max rows or
        batch_ids_max padded ids; a single segment always makes a batch of its own."""
        batches: list[list[int]] = []
        for position, length in enumerate(lengths):
            current = batches[-1] if batches else None
            if current is None or len(current) >= batch_max or (len(current) + 1) * length > self.batch_ids_max:
                batches.append([position])
            else:
                current.append(position)
        return batches

    def stream_request(self, segment: Segment, options: SynthesisOptions, stop: threading.Event,
                       batch_max: int) -> Iterator[np.ndarray]:
        """`stream`, for a request that may be withdrawn: once `stop` is set no further chunk is made (default:
        checked between chunks; CosyVoice2 withdraws its decode row before the next step). `batch_max` bounds the
        rows a family decodes together with this one."""
        for chunk in self.stream(segment, options):
            if stop.is_set():
                return
            yield chunk

    def warm(self, preset: str | None = None) -> bool:
        """Work done once ahead of the requests it speeds up (`Engine.warmup`, the bench before a run): CosyVoice2's
        streaming prompt state of the default voice under `preset` (None: the default one). True when there was
        some to do; default: none."""
        return False

    def decode_occupancy(self) -> dict[int, int]:
        """Decode steps run so far by rows in the step (CosyVoice2's scheduler; empty for other families)."""
        return {}

    def voice_kind(self, name: str) -> str:
        """How a voice was made: builtin (fixed speakers), sft, zero_shot."""
        return "builtin"

    def make_voice(self, name: str, wav: np.ndarray, sample_rate: int, prompt_text: str) -> Any:
        """A new voice from a prompt recording and its transcript (not yet added)."""
        raise self._fixed()

    def add_voice(self, voice: Any) -> None:
        """Make a voice from `make_voice` available to later requests."""
        raise self._fixed()

    def load_voice(self, name: str, path: Path) -> None:
        """Add a voice registered earlier (a file of the state directory)."""
        raise self._fixed()

    def remove_voice(self, name: str) -> None:
        """Forget a registered voice."""
        raise self._fixed()

    def stats(self) -> dict[str, Stat]:
        """Gauges for /metrics, by name (the API exposes each as `cosyedge_<name>` without knowing it); default
        none. CosyVoice: its decode scheduler's steps, rows per step, rows decoding, joined and withdrawn."""
        return {}

    @staticmethod
    def _fixed() -> FixedVoicesError:
        return FixedVoicesError("this bundle has fixed voices; registering a voice needs a CosyVoice bundle")
