"""A WebSocket session's audio clock (api/routes/websocket.py): the times its `segment` and `word` events carry.

Events are timed on the output audio's clock: the engine's samples spoken so far, in seconds. A `word` event
(`start` with `timestamps`, issue 23) must never promise audio the client does not have yet, so each word is held
until the output samples sent so far (binary frames, or pcm written into the encoder) reach its end. The
resampler keeps a few milliseconds of a sentence's end until more audio follows, so the words still held when a
sentence ends go out then, before its `segment` event, whose end_s has the same few milliseconds of lead.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Iterable

from cosyedge.device.options import Word, on_rate


class SessionClock:
    """The session's engine samples spoken and output samples sent, and the words waiting for their audio."""

    def __init__(self) -> None:
        self.rate = 0  # the engine's sample rate; 0 until `start`
        self.out_rate = 0  # the output audio's (the pcm going out as frames or into the encoder)
        self.samples = 0  # engine samples spoken so far
        self.sent = 0  # output samples sent so far
        self._held: deque[Word] = deque()

    def start(self, rate: int, out_rate: int) -> None:
        self.rate, self.out_rate = rate, out_rate

    def seconds(self, samples: int) -> float:
        """Engine samples as the events' seconds."""
        return round(samples / self.rate, 6) if self.rate else 0.0

    def hold(self, words: Iterable[Word], start: int) -> None:
        """A chunk's words (seconds from its sentence's first sample, which is `start` engine samples into the
        session), moved onto the session's clock and rounded to the output rate's samples."""
        offset = start / self.rate
        self._held.extend(on_rate([Word(w.text, offset + w.start_s, offset + w.end_s) for w in words], self.out_rate))

    def sent_out(self, samples: int) -> list[dict[str, Any]]:
        """`samples` more output samples are out: the events of the held words whose audio they complete."""
        self.sent += samples
        done: list[Word] = []
        while self._held and round(self._held[0].end_s * self.out_rate) <= self.sent:
            done.append(self._held.popleft())
        return [_event(w) for w in done]

    def rest(self) -> list[dict[str, Any]]:
        """The sentence's audio is all out (but for the resampler's few milliseconds): every word still held."""
        done, self._held = list(self._held), deque()
        return [_event(w) for w in done]


def _event(word: Word) -> dict[str, Any]:
    return {"type": "word", "text": word.text, "start_s": round(word.start_s, 6), "end_s": round(word.end_s, 6)}
