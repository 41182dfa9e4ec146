"""The word-timing pass on ONNX Runtime: the `llm_align` graph (signature and why it is a graph of its own:
quantize/cosyvoice2/llm_align.py) run teacher-forced over a segment's LLM input and its speech tokens.

Each speech token's row is the attention of the position that CHOSE it (the one before it: the task id or last
prompt token for the first, then each earlier speech token) on the segment's text tokens, so a row says where in
the text the model was when it decided what to say next. A segment's pass is one call; a stream's is one call per
chunk over the new tokens only, with the pass's own key/value cache, so streaming costs what one call costs.

The prompt (sos, prompt text, text, task id, prompt speech: a third or more of the sequence) is not run again: the
LLM's prefill already computed its keys and values, and the decode scheduler leaves a copy of the pass's layers
(`scheduler.Prefix`), so the first call starts from the prompt's last position. The prefill is the LLM graph of
the engine's target (int8 on cpu, fp32, fp16), the pass int8: the cache is that precision's, within its gate of the
pass's own (tests/device/test_cv_words.py compares the two).

The session is created on first use: an engine that never times words never pays its memory. It runs on the CPU
provider whatever the engine's (int8 weights; like CAM++ it has no TensorRT profile and no place in a GPU's memory
plan), with the engine's thread count.
"""
from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from cosyedge.device.cosyvoice2.scheduler import Prefix
from cosyedge.device.cosyvoice2.table_rows import TableRows
from cosyedge.device.sessions import SessionConfig


class AttentionPass:
    """The `llm_align` graph of a bundle, shared by every request (per-request state lives in `SegmentPass`)."""

    def __init__(self, path: Path, sessions: SessionConfig, speech_embedding: TableRows) -> None:
        self._path = path
        self._sessions = dataclasses.replace(sessions, providers=("cpu",), trt=None)
        self._speech_embedding = speech_embedding  # the LLM's table (`SpeechLM.speech_embedding`), not a second copy
        self._session: Any = None
        self._lock = threading.Lock()

    def session(self) -> Any:
        with self._lock:
            if self._session is None:
                self._session = self._sessions.create(self._path)
            return self._session

    @property
    def depth(self) -> int:
        """The LLM layers the pass runs (the prefix the decode scheduler keeps for it)."""
        return int(next(i.shape for i in self.session().get_inputs() if i.name == "past_key")[0])

    def begin(self, lm_input: np.ndarray, text_positions: np.ndarray, prefix: Prefix | None = None) -> "SegmentPass":
        """A new pass over one segment: `lm_input` [1, L, H] as the LLM got it, the positions of its text tokens,
        and where the prefill leaves the prompt's cache (None, or not filled by the first `extend`: computed)."""
        return SegmentPass(self, lm_input, np.asarray(text_positions, np.int64), prefix)

    def embed(self, tokens: Sequence[int]) -> np.ndarray:
        return self._speech_embedding.rows(tokens).astype(np.float32, copy=False)


class SegmentPass:
    """One segment's pass (never shared): `extend(tokens)` with all speech tokens known so far computes the rows of
    the new ones; `attention` is [tokens so far, text tokens]."""

    def __init__(self, owner: AttentionPass, lm_input: np.ndarray, text_positions: np.ndarray,
                 prefix: Prefix | None) -> None:
        self._owner = owner
        self._prefix = prefix
        self._lm_input = lm_input
        self._text = text_positions
        self._cache: tuple[np.ndarray, np.ndarray] | None = None
        self._rows: list[np.ndarray] = []
        self.count = 0  # speech tokens with a row

    @property
    def attention(self) -> np.ndarray:
        if not self._rows:
            return np.zeros((0, len(self._text)), np.float32)
        if len(self._rows) > 1:
            self._rows = [np.concatenate(self._rows)]
        return self._rows[0]

    def extend(self, tokens: Sequence[int]) -> None:
        """Rows for tokens[count:]: the positions that chose them are fed (lm_input first, then each speech token
        before the newest), after the cache of earlier calls."""
        if len(tokens) <= self.count:
            return
        session = self._owner.session()
        if self._cache is None:
            new = self._owner.embed(tokens[:len(tokens) - 1]).reshape(-1, self._lm_input.shape[2])
            prefix = self._prefix
            if prefix is not None and prefix.key is not None:  # the prefill's cache: start at the prompt's end
                embeds = np.concatenate([self._lm_input[0, -1:], new])[None]
                past, skip = (prefix.key, prefix.value), 0
            else:
                embeds = np.concatenate([self._lm_input[0], new])[None]
                depth, _, heads, _, dim = next(i.shape for i in session.get_inputs() if i.name == "past_key")
                empty = np.zeros((depth, 1, heads, 0, dim), np.float32)
                past = (empty, empty)
                skip = self._lm_input.shape[1] - 1  # the prompt's rows before the one that chose the first token
        else:
            embeds = self._owner.embed(tokens[self.count - 1:len(tokens) - 1])[None]
            past, skip = self._cache, 0
        embeds = np.ascontiguousarray(embeds, np.float32)
        start, length = past[0].shape[3], embeds.shape[1]
        attention, key, value = session.run(None, {
            "inputs_embeds": embeds, "past_key": past[0], "past_value": past[1],
            "attention_mask": np.ones((1, start + length), np.int64),
            "position_ids": np.arange(start, start + length, dtype=np.int64)[None], "text_positions": self._text})
        self._cache = (key, value)
        self._rows.append(attention[skip:])
        self.count = len(tokens)
