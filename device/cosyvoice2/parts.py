"""The parts a CosyVoice family is made of: what CosyVoice2 and Fun-CosyVoice3 do differently, and nothing else.

Both families run one pipeline (`pipeline.CosyVoicePipeline`): the same LLM session wrapper and decode scheduler,
the flow with its Euler solver and quality presets, the stream loop (`streaming.stream_tokens`: chunk schedule,
bounded re-solve, chunk gate), voices and prompt features. A family contributes a `FamilyParts` (CosyVoice2:
`cosyvoice2/family.py`, Fun-CosyVoice3: `cosyvoice3/family.py`):

* `frontend`: text normalisation and BPE, and the prompt rules of the family's official frontend (how an
  instruction is framed, what the LLM's prompt must hold, the transcript of a registered voice);
* `decode`: the stop ids, the id masked before `min_len`, the length ratios and the sampler;
* `vocoder`: HiFT for a whole mel, and a fresh per-request streaming state (`ChunkVocoder`);
* `schedule`: the streaming hops and look-ahead the stream loop reads;
* `token_filter`: a fresh per-utterance filter of the LLM's tokens before the flow (all kept, or the v3 silent
  filter);
* voice rules: the modes, the shortest prompt recording, the saved-speaker quirk of instruct2.

A feature written in the pipeline or the stream loop therefore reaches both families, and a new part a family must
give (a field here, a method of a protocol) has to be given by both: the protocols are `runtime_checkable` and
`tests/device/test_cv_parts.py` checks both families' parts against them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np

from cosyedge.device.cosyvoice2.frontend import TextFrontend
from cosyedge.device.cosyvoice2.llm import DecodeConfig
from cosyedge.device.cosyvoice2.streaming import ChunkVocoder, ScheduleConfig, TokenFilter


@runtime_checkable
class Vocoder(Protocol):
    """mel -> waveform for a whole utterance, and a fresh streaming state per request.

    `noise` is the request's generator for the NSF source noise, None when the request is deterministic; a family
    whose noise is a fixed tensor of the release (Fun-CosyVoice3) documents that it draws nothing from it."""

    samples_per_frame: int

    def render(self, mel: np.ndarray, noise: np.random.Generator | None) -> np.ndarray: ...

    def stream(self, noise: np.random.Generator | None) -> ChunkVocoder: ...


@dataclass(frozen=True, eq=False)
class FamilyParts:
    """Everything one CosyVoice family gives the shared pipeline (module docstring)."""
    family: str                                # the manifest's family name
    frontend: TextFrontend
    decode: DecodeConfig
    vocoder: Vocoder
    schedule: ScheduleConfig
    token_filter: Callable[[], TokenFilter]    # a fresh filter per utterance
    modes: tuple[str, ...]
    min_prompt_seconds: float = 0.0            # beyond the voice store's own 1 s
    saved_speaker_quirk: bool = False          # instruct2 with a bundle voice: its prompt text replaces the instruction
    languages: tuple[str, ...] = ()            # what the family speaks, as Wyoming names languages
    attribution: tuple[str, str] = ("", "")    # who made the model and where it comes from: name, URL


class PartsBuilder(Protocol):
    """A family's `parts` function: the manifest config, the bundle's tokenizer.json and the two HiFT sessions
    (`hift_source`, `hift_decoder`) -> its parts."""

    def __call__(self, config: dict[str, Any], tokenizer: Path, hift: tuple[Any, Any],
                 sample_rate: int) -> FamilyParts: ...
