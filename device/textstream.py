"""Text that arrives piecewise (an LLM's output, a WebSocket client) -> sentences as soon as each is complete.

The cut is `text.SENTENCE_END`, the rule `split_sentences` applies to a whole text: fed the same text in any
pieces, a stream yields the sentences `split_sentences` finds in it (tests/device/test_textstream.py). Two
exceptions, both for latency: the first sentence may be cut early, at a clause boundary once it has
`first_min_chars` (speech starts sooner); and a sentence that grows past `max_chars` without ending is cut at its
last clause or word boundary (nothing waits for ever, nothing exceeds the engine's text limit). Each sentence
then goes through `Engine.segments`, the family's own frontend rules, as an HTTP request's text does.
"""
from __future__ import annotations

import re

from cosyedge.device.text import SENTENCE_END, speakable

CLAUSE_END = re.compile(r"(?<=[,;:])\s+|(?<=[，；：、])")  # "1,000" is no boundary: ASCII needs a space after
_SPACE = re.compile(r"\s+")


class SentenceStream:
    """`feed(piece)` -> the sentences it completed; `flush()` -> the unfinished tail (at the end of the text).

    Only speakable sentences (a letter or a number) come out; state is this object's, one per client stream.
    """

    def __init__(self, first_min_chars: int | None = 40, max_chars: int = 400) -> None:
        if max_chars < 2 or (first_min_chars is not None and not 0 < first_min_chars < max_chars):
            raise ValueError("SentenceStream: need 0 < first_min_chars < max_chars")
        self.first_min_chars, self.max_chars = first_min_chars, max_chars
        self._buffer = ""
        self._emitted = 0

    def feed(self, piece: str) -> list[str]:
        self._buffer += piece
        out: list[str] = []
        while (match := SENTENCE_END.search(self._buffer)) is not None:
            self._emit(self._buffer[:match.start()], out)
            self._buffer = self._buffer[match.end():]
        while len(self._buffer) > self.max_chars:
            self._cut(self._last_boundary(self._buffer[:self.max_chars]) or self.max_chars, out)
        if not self._emitted and not out and self.first_min_chars is not None:
            early = self._early_cut()
            if early:
                self._cut(early, out)
        return out

    @property
    def held(self) -> int:
        """Characters fed and not yet cut into a sentence (a stream's bound on unspoken text counts them)."""
        return len(self._buffer)

    def flush(self) -> list[str]:
        out: list[str] = []
        self._emit(self._buffer, out)
        self._buffer = ""
        return out

    def _early_cut(self) -> int | None:
        """The first clause boundary after at least `first_min_chars` characters of the first sentence."""
        for match in CLAUSE_END.finditer(self._buffer):
            if len(self._buffer[:match.start()].strip()) >= self.first_min_chars:  # type: ignore[operator]
                return match.end()
        return None

    @staticmethod
    def _last_boundary(text: str) -> int | None:
        for pattern in (CLAUSE_END, _SPACE):
            ends = [m.end() for m in pattern.finditer(text) if text[:m.start()].strip()]
            if ends:
                return ends[-1]
        return None

    def _cut(self, at: int, out: list[str]) -> None:
        self._emit(self._buffer[:at], out)
        self._buffer = self._buffer[at:]

    def _emit(self, sentence: str, out: list[str]) -> None:
        sentence = sentence.strip()
        if sentence and speakable(sentence):
            out.append(sentence)
            self._emitted += 1
