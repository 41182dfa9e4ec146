"""CosyVoice2 voices and inference modes: which prompt inputs go to the LLM and to the flow.

A voice file (voices/<name>.npz, docs/bundle_cosyvoice2.md) is either `sft` (a speaker embedding only) or
`zero_shot` (prompt text ids, prompt speech tokens, prompt mel, embeddings). Modes (official v2 frontends):

| mode          | LLM prompt text          | LLM prompt speech | flow prompt tokens + mel | flow embedding |
|---------------|--------------------------|-------------------|--------------------------|----------------|
| sft           | -                        | -                 | -                        | embedding      |
| zero_shot     | the voice's prompt text  | prompt tokens     | prompt tokens + mel      | flow_embedding |
| cross_lingual | -                        | -                 | prompt tokens + mel      | flow_embedding |
| instruct2     | the instruct text (raw)  | -                 | prompt tokens + mel      | flow_embedding |

The LLM does not use a speaker embedding in v2. Voices made at run time from a prompt recording
(`CosyVoicePipeline.make_voice`) are zero-shot voices with the same file format (`Voice.save`).
"""
from __future__ import annotations

import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from cosyedge.device.cosyvoice2.flow import FlowPrompt
from cosyedge.device.errors import BundleError, InputError

MODES = ("zero_shot", "sft", "cross_lingual", "instruct2")


@dataclass(frozen=True, eq=False)
class ModeInputs:
    """Everything one request adds around the target text."""
    prompt_text: tuple[int, ...]
    prompt_speech: tuple[int, ...]
    flow: FlowPrompt


@dataclass(frozen=True, eq=False)
class Voice:
    name: str
    kind: str                          # "sft" or "zero_shot"
    flow_embedding: np.ndarray         # [E]
    prompt_text: str = ""
    prompt_text_ids: tuple[int, ...] = ()
    llm_prompt_speech: tuple[int, ...] = ()
    flow_prompt_speech: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    prompt_mel: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # [ratio * P, M]

    @classmethod
    def load(cls, name: str, path: Path) -> "Voice":
        try:
            with np.load(path, allow_pickle=False) as z:
                kind = str(z["kind"])
                if kind == "sft":
                    return cls(name, kind, z["embedding"].astype(np.float32).reshape(-1))
                if kind == "zero_shot":
                    return cls(name, kind, z["flow_embedding"].astype(np.float32).reshape(-1),
                               prompt_text=str(z["prompt_text"]),
                               prompt_text_ids=tuple(int(i) for i in z["prompt_text_ids"].reshape(-1)),
                               llm_prompt_speech=tuple(int(i) for i in z["llm_prompt_speech_token"].reshape(-1)),
                               flow_prompt_speech=z["flow_prompt_speech_token"].astype(np.int64).reshape(-1),
                               prompt_mel=z["prompt_speech_feat"].astype(np.float32))
        except (KeyError, ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:  # torn or flipped
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc  # no paths in messages
            raise BundleError(f"voice {name!r}: malformed voice file ({type(exc).__name__}: {reason})") from None
        raise BundleError(f"voice {name!r}: unknown kind {kind!r} (expected sft or zero_shot)")

    def save(self, target: Path | BinaryIO) -> None:
        """Write the voice file format of docs/bundle_cosyvoice2.md (runtime-registered voices use it too)."""
        if self.kind == "sft":
            arrays = {"kind": np.array("sft"), "embedding": self.flow_embedding}
        else:
            arrays = {"kind": np.array("zero_shot"), "prompt_text": np.array(self.prompt_text),
                      "prompt_text_ids": np.asarray(self.prompt_text_ids, np.int64),
                      "llm_prompt_speech_token": np.asarray(self.llm_prompt_speech, np.int64),
                      "flow_prompt_speech_token": self.flow_prompt_speech, "prompt_speech_feat": self.prompt_mel,
                      "llm_embedding": self.flow_embedding, "flow_embedding": self.flow_embedding}
        np.savez(target, **arrays)

    @property
    def default_mode(self) -> str:
        return "sft" if self.kind == "sft" else "zero_shot"

    def inputs(self, mode: str | None, instruct_ids: tuple[int, ...], mel_bins: int) -> ModeInputs:
        """LLM and flow prompt inputs of `mode` (None = the voice's default) for this voice."""
        mode = mode or self.default_mode
        if mode not in MODES:
            raise InputError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        if self.kind == "sft":
            if mode != "sft":
                raise InputError(f"voice {self.name!r} is an sft voice (no prompt audio): only mode 'sft' is "
                                 f"available; use a zero-shot voice for {mode}")
            flow = FlowPrompt(np.zeros(0, np.int64), np.zeros((0, mel_bins), np.float32), self.flow_embedding)
            return ModeInputs((), (), flow)
        if mode == "sft":
            raise InputError(f"voice {self.name!r} is a zero-shot voice: mode 'sft' needs an sft voice; use "
                             "zero_shot, cross_lingual or instruct2")
        flow = FlowPrompt(self.flow_prompt_speech, self.prompt_mel, self.flow_embedding)
        if mode == "zero_shot":
            return ModeInputs(self.prompt_text_ids, self.llm_prompt_speech, flow)
        if mode == "cross_lingual":
            return ModeInputs((), (), flow)
        if not instruct_ids:
            raise InputError("mode 'instruct2' needs an instruct text, e.g. 'Speak slowly.'")
        return ModeInputs(instruct_ids, (), flow)
