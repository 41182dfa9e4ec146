"""Fun-CosyVoice3 frontend on the device (no torch): text -> token ids per mode, the `<|endofprompt|>` rule, the
silent-token filter between the LLM and the flow, and the prompt features.

Shared with CosyVoice2 and reused, not copied: text normalisation and splitting (`cosyvoice2.frontend.TextFrontend`;
a text containing both `<|` and `|>`, e.g. any text with `<|endofprompt|>`, is neither normalised nor split), the
byte-level BPE (the bundle's `tokenizer.json`, written by `quantize/cosyvoice3/tokenizer.py` with the 280 v3
specials), and every prompt feature (`cosyvoice2.features`: torchaudio-equal resampling from any rate - 22.05 kHz,
44.1 kHz, 48 kHz ... - to 16 kHz for CAM++ and the speech tokenizer and to 24 kHz for the flow mel, Kaldi fbank,
Whisper log-mel, the 24 kHz alignment). The only feature difference is the flow mel's upper edge: the v3 yaml has
`fmax: null`, i.e. the Nyquist frequency (12 kHz at 24 kHz) instead of 8 kHz (`FLOW_MEL`).

Per mode (official `frontend_*` + `CosyVoice3LM.inference`), for each target-text segment:

| mode          | LLM prompt text                                 | LLM prompt speech | flow prompt (tokens, mel, emb) |
|---------------|-------------------------------------------------|-------------------|--------------------------------|
| zero_shot     | prompt text, normalised without splitting       | prompt tokens     | prompt                         |
| cross_lingual | none (the target text carries `<|endofprompt|>`) | none              | prompt                         |
| instruct2     | the instruction text as given (never normalised) | none              | prompt                         |

`<|endofprompt|>` must occur in LLM prompt text ++ target text (the official LLM asserts it; here: InputError).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import onnxruntime as ort

from cosyedge.device.cosyvoice2.features import FlowMelConfig, PromptFeatures, extract_prompt
from cosyedge.device.cosyvoice2.frontend import END_OF_PROMPT, TextFrontend
from cosyedge.device.errors import BundleError, InputError

ENDOFPROMPT = END_OF_PROMPT
SYSTEM_PROMPT = "You are a helpful assistant."   # the system part of every official v3 example prompt
MODES = ("zero_shot", "cross_lingual", "instruct2")

# CosyVoice3Model.silent_tokens: FSQ codes of silence / breath. A run of more than MAX_SILENT_RUN of them (any mix)
# is cut before the flow; the LLM keeps conditioning on all of them.
SILENT_TOKENS = frozenset((1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323))
MAX_SILENT_RUN = 5

# The v3 yaml `feat_extractor` (Matcha mel_spectrogram): 24 kHz, n_fft/win 1920, hop 480, 80 bins, fmin 0,
# fmax null (= sample_rate / 2). A bundle with another yaml passes its own FlowMelConfig.
FLOW_MEL = FlowMelConfig(n_fft=1920, hop=480, win=1920, n_mels=80, fmin=0.0, fmax=None, sample_rate=24000)


class TextFrontend3(TextFrontend):
    """CosyVoice2's normalise/split/encode over the v3 tokenizer, with the v3 prompt rules: the LLM's prompt must
    hold `<|endofprompt|>`, and an instruction or transcript without it gets the official system-prompt frame."""

    def __init__(self, tokenizer_json: str | Path) -> None:
        super().__init__(tokenizer_json)
        endofprompt = self._tokenizer.token_to_id(ENDOFPROMPT)
        if endofprompt is None:
            raise BundleError(f"the text tokenizer has no {ENDOFPROMPT} token: not a CosyVoice3 tokenizer")
        self.endofprompt_id = int(endofprompt)

    def check_endofprompt(self, prompt_text_ids: Iterable[int], text_ids: Iterable[int]) -> None:
        """The official LLM's assert, as an InputError that says how to fix the request."""
        if self.endofprompt_id not in list(prompt_text_ids) and self.endofprompt_id not in list(text_ids):
            raise InputError(f"CosyVoice3 needs {ENDOFPROMPT} in the prompt text, the instruction or (cross-lingual) "
                             f"the text, e.g. '{SYSTEM_PROMPT}{ENDOFPROMPT}' before the transcript")

    def check_prompt(self, prompt_text_ids: tuple[int, ...], text_ids: tuple[int, ...]) -> None:
        self.check_endofprompt(prompt_text_ids, text_ids)

    def instruction(self, text: str) -> str:
        """An instruction without the marker (the API's `instructions`, "speak cheerfully") gets the frame of every
        official instruct2 example: "You are a helpful assistant. <instruction><|endofprompt|>"; one with it is
        taken as given."""
        return text if ENDOFPROMPT in text else f"{SYSTEM_PROMPT} {text}{ENDOFPROMPT}"

    def voice_transcript(self, text: str) -> str:
        """A transcript without `<|endofprompt|>` gets the official system prompt before it (the v3 LLM needs the
        marker in the prompt text)."""
        return text if ENDOFPROMPT in text else f"{SYSTEM_PROMPT}{ENDOFPROMPT}{text}"


@dataclass(frozen=True)
class SegmentInputs:
    """Everything the LLM and the flow take for one text segment (int64 ids, float32 arrays).

    text: target text ids; prompt_text: LLM prompt text ids; llm_prompt_speech: LLM prompt speech tokens (empty
    outside zero-shot); flow_prompt_speech / prompt_mel (2P, 80) / embedding (192,): the flow's prompt."""
    text: np.ndarray
    prompt_text: np.ndarray
    llm_prompt_speech: np.ndarray
    flow_prompt_speech: np.ndarray
    prompt_mel: np.ndarray
    embedding: np.ndarray

    def min_max_len(self, min_ratio: float = 2.0, max_ratio: float = 20.0) -> tuple[int, int]:
        """Official length limits of the generated tokens: over the target text only."""
        return int(self.text.shape[0] * min_ratio), int(self.text.shape[0] * max_ratio)


def _ids(values: Iterable[int]) -> np.ndarray:
    return np.asarray(list(values), dtype=np.int64).reshape(-1)


def prompt_text_ids(frontend: TextFrontend3, mode: str, prompt_text: str = "") -> np.ndarray:
    """LLM prompt text ids of a request: zero_shot normalises (no split), instruct2 takes the text raw."""
    if mode == "zero_shot":
        return _ids(frontend.encode(frontend.normalize(prompt_text, split=False)[0]))
    if mode == "instruct2":
        return _ids(frontend.encode(prompt_text))
    if mode == "cross_lingual":
        return _ids(())
    raise InputError(f"unknown CosyVoice3 mode {mode!r}; expected one of {', '.join(MODES)}")


def text_segments(frontend: TextFrontend3, text: str) -> list[np.ndarray]:
    """Target text -> ids of each normalised segment (a text with `<|...|>` markup is one raw segment)."""
    return [_ids(frontend.encode(segment)) for segment in frontend.normalize(text, split=True)]


def segment_inputs(frontend: TextFrontend3, mode: str, text_ids: np.ndarray, prompt_ids: np.ndarray,
                   prompt: PromptFeatures) -> SegmentInputs:
    """One segment's inputs for `mode` (table in the module docstring), `<|endofprompt|>` checked."""
    if mode not in MODES:
        raise InputError(f"unknown CosyVoice3 mode {mode!r}; expected one of {', '.join(MODES)}")
    frontend.check_endofprompt(prompt_ids, text_ids)
    tokens = _ids(prompt.tokens)
    return SegmentInputs(text=_ids(text_ids), prompt_text=_ids(prompt_ids),
                         llm_prompt_speech=tokens if mode == "zero_shot" else _ids(()),
                         flow_prompt_speech=tokens, prompt_mel=np.asarray(prompt.mel, np.float32),
                         embedding=np.asarray(prompt.embedding, np.float32).reshape(-1))


class SilentFilter:
    """Streaming form of the official filter: feed each LLM token in order, `keep` says whether the flow gets it."""

    def __init__(self, silent: frozenset[int] = SILENT_TOKENS, max_run: int = MAX_SILENT_RUN) -> None:
        self.silent, self.max_run, self.run = silent, max_run, 0

    def keep(self, token: int) -> bool:
        if int(token) in self.silent:
            self.run += 1
            return self.run <= self.max_run
        self.run = 0
        return True


def filter_silent(tokens: Iterable[int]) -> list[int]:
    """LLM tokens -> the tokens sent to the flow (silent runs cut after MAX_SILENT_RUN)."""
    f = SilentFilter()
    return [int(t) for t in tokens if f.keep(t)]


def prompt_features(wav: np.ndarray, sr: int, campplus: ort.InferenceSession, speech_tokenizer: ort.InferenceSession,
                    mel_config: FlowMelConfig = FLOW_MEL) -> PromptFeatures:
    """CosyVoice2's prompt extraction with the v3 flow mel (fmax = Nyquist); the speech tokenizer is the release's
    speech_tokenizer_v3.onnx (same inputs; output int32 or int64, flattened)."""
    return extract_prompt(wav, sr, campplus, speech_tokenizer, mel_config)
