"""The one interface every model family implements, and the per-request options it receives.

The engine turns text into a list of segments (one per sentence or segment); a pipeline renders
segments into waveforms. Per-request state lives in `SynthesisOptions` and in local variables, never on the
pipeline: pipelines are shared by every request thread.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence

import numpy as np

SPEED_RANGE = (0.25, 4.0)


@dataclass(frozen=True)
class SynthesisOptions:
    """What one synthesis call asked for, after validation."""
    voice: str
    speed: float = 1.0
    deterministic: bool = False
    seed: int | None = None
    sampling: str = "default"  # "default" (the release's sampler) or "greedy"
    mode: str | None = None  # CosyVoice: zero_shot, sft, cross_lingual, instruct2 (None = the voice's default)
    instruct_text: str | None = None  # CosyVoice instruct2: how to speak ("用四川话说这句话")
    pin_tokens: int | None = None  # CosyVoice bench: generate exactly this many speech tokens per segment (no stop)


@dataclass(frozen=True)
class Segment:
    """A model-ready piece of text: the sentence and its token ids (phoneme ids, BPE ids, ...)."""
    text: str
    ids: tuple[int, ...]


class Pipeline(Protocol):
    """A model family behind the engine: vits, cosyvoice2, cosyvoice3."""

    sample_rate: int

    def voices(self) -> list[str]:
        """Voice names in a stable order (numeric speaker ids index into it)."""

    def segments(self, text: str) -> list[Segment]:
        """Normalised text -> segments; InputError if nothing is left to say."""

    def synthesize(self, segments: Sequence[Segment], request: SynthesisOptions) -> list[np.ndarray]:
        """Units of one request or of several compatible requests -> one float32 waveform each."""

    def stream(self, segment: Segment, request: SynthesisOptions) -> Iterator[np.ndarray]:
        """Waveform chunks of one segment, each yielded as soon as it exists."""

    def describe(self) -> dict[str, Any]:
        """Precision per stage, providers, sizes: for `cosyedge info` and the bench."""
