"""What one synthesis call asks for (`SynthesisOptions`), the piece of text it works on (`Segment`), a word and
when it is heard (`Word`), a gauge the engine reports (`Stat`), and the limits of batched calls (`BatchLimits`).
Frozen: a value is private to its request and safe to share."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from cosyedge.device.errors import InputError

SPEED_RANGE = (0.25, 4.0)
SEED_MAX = 2**32 - 1  # numpy's SeedSequence takes any int >= 0; the API promises 32 bits, as OpenAI-style clients send
# CosyVoice instruct2: how to speak ("用四川话说这句话", "Speak cheerfully."). It is LLM prompt text, so it is bounded like
# a segment's text (after NFKC); a 60 kB instruction drove a worker past 4 GB in 2 s.
INSTRUCT_MAX_CHARS = 500


@dataclass(frozen=True)
class SynthesisOptions:
    """What one synthesis call asked for, after validation (`Engine.options`)."""
    voice: str
    speed: float = 1.0
    deterministic: bool = False
    seed: int | None = None
    sampling: str = "default"  # "default" (the release's sampler) or "greedy"
    mode: str | None = None  # CosyVoice: zero_shot, sft, cross_lingual, instruct2 (None = the voice's default)
    instruct_text: str | None = None  # CosyVoice instruct2: how to speak ("用四川话说这句话")
    preset: str | None = None  # CosyVoice2 flow quality preset (official, balanced, fast; None = the bundle default)


@dataclass(frozen=True)
class Segment:
    """A sentence-sized, model-ready piece of text: the sentence and its token ids (phoneme ids, BPE ids, ...)."""
    text: str
    ids: tuple[int, ...]
    # The input words it speaks, each with the range of `ids` it was read as, [start, end): only from
    # `Engine.segments(text, words=True)` on a family that can time words; the audio never depends on it.
    words: tuple[tuple[str, int, int], ...] = ()


@dataclass(frozen=True)
class Word:
    """A word of the input text and when it is heard: seconds from the first sample of the audio it is in."""
    text: str
    start_s: float
    end_s: float


def on_rate(words: Sequence[Word], sample_rate: int | None) -> list[Word]:
    """`words` on the clock of their audio converted to `sample_rate` (times rounded to its samples; None: as
    they are)."""
    if not sample_rate:
        return list(words)
    return [Word(w.text, round(w.start_s * sample_rate) / sample_rate, round(w.end_s * sample_rate) / sample_rate)
            for w in words]


@dataclass(frozen=True)
class Stat:
    """One gauge the engine reports (`Engine.stats`, from the pipeline): its value now and what it measures."""
    value: float
    help: str


@dataclass(frozen=True)
class BatchLimits:
    """Limits of one batched call: text length per item, items per model call, and the queue wait."""
    max_text_len: int = 2000
    batch_max: int = 8
    timeout: float = 0.05

    def __post_init__(self) -> None:
        if self.max_text_len < 1 or self.batch_max < 1 or self.timeout < 0:
            raise InputError("BatchLimits: max_text_len and batch_max must be >= 1 and timeout >= 0")
