"""CosyVoice2 streaming: when a chunk of speech tokens is ready, and how it becomes audio.

Official v2 schedule, kept per request (the official model stores the hop on the shared instance and never
resets it; here every request starts again at the first hop): the first hop is hops[0] + pad, where pad brings
prompt + first hop to a hops[0] boundary; later hops follow `hops` (25, 50, 100, 100, ...). A chunk is made when
the tokens not yet voiced reach hop + look-ahead; the flow then re-runs on tokens[:offset + hop + look-ahead]
(streaming attention, finalize off: the look-ahead tokens are context only) and the new mel starts at
ratio * offset. When the LLM stops, one final call voices every remaining token (finalize on, full attention).

Fairness between concurrent streams (`ChunkGate`): the flow + HiFT work of one chunk waits for its turn, and the
turn goes to the stream that has emitted the fewest chunks, then to the one that began first, so a new request's
first chunk never waits behind another request's later chunks. The priority lives in the waiting ticket (a
local of the stream), never on the shared gate. While a first chunk's work runs, the LLM decode loop waits before
its next step (`wait_first_chunks`, called by the `DecodeScheduler`), so on a small CPU the cores go to the chunk
that ends the listener's silence rather than to tokens that are not needed yet.
"""
from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from contextlib import contextmanager
from typing import Iterable, Iterator

import numpy as np

from cosyedge.device.cosyvoice2.flow import Flow, FlowPrompt
from cosyedge.device.cosyvoice2.presets import Preset
from cosyedge.device.cosyvoice2.vocoder import StreamConfig, Vocoder, VocoderStream


class ChunkSchedule:
    """Token offsets of one streaming request."""

    def __init__(self, prompt_tokens: int, config: StreamConfig) -> None:
        first = config.hops[0]
        self._config = config
        self._pad = math.ceil(prompt_tokens / first) * first - prompt_tokens
        self._index = 0
        self.offset = 0

    @property
    def hop(self) -> int:
        """Tokens voiced by the next non-final chunk."""
        hops = self._config.hops
        hop = hops[min(self._index, len(hops) - 1)]
        return hop + self._pad if self._index == 0 else hop

    def ready(self, available: int) -> int | None:
        """Tokens to give the flow if a chunk can be made from `available` tokens, else None."""
        needed = self.hop + self._config.lookahead
        return self.offset + needed if available - self.offset >= needed else None

    def advance(self) -> None:
        self.offset += self.hop
        self._index += 1


class ChunkGate:
    """Turns for chunk work (flow + HiFT) of concurrent streams: at most `slots` at once, the waiting ticket with
    the lowest (chunks emitted, start time) first. One slot suits a CPU, where parallel calls only share cores."""

    def __init__(self, slots: int = 1) -> None:
        self._cond = threading.Condition()
        self._free = slots
        self._waiting: list[tuple[int, float, int]] = []  # heap of tickets
        self._order = itertools.count()
        self._first_running = 0  # slots held by first chunks

    def waiting(self) -> int:
        """Tickets waiting for a turn (tests, metrics)."""
        with self._cond:
            return len(self._waiting)

    @contextmanager
    def turn(self, emitted: int, began: float) -> Iterator[None]:
        """Hold a slot for one chunk's work; `emitted` and `began` are the waiting stream's own values."""
        ticket = (emitted, began, next(self._order))
        with self._cond:
            heapq.heappush(self._waiting, ticket)
            self._cond.wait_for(lambda: self._free > 0 and self._waiting[0] == ticket)
            heapq.heappop(self._waiting)
            self._free -= 1
            self._first_running += emitted == 0
            self._cond.notify_all()  # with slots left, the next ticket may go too
        try:
            yield
        finally:
            with self._cond:
                self._free += 1
                self._first_running -= emitted == 0
                self._cond.notify_all()

    def wait_first_chunks(self) -> None:
        """Block while any stream's first chunk is in flow + HiFT (the decode loop calls this before each step)."""
        with self._cond:
            self._cond.wait_for(lambda: self._first_running == 0)


def stream_tokens(tokens: Iterable[int], prompt: FlowPrompt, flow: Flow, vocoder: Vocoder, config: StreamConfig,
                  rng: np.random.Generator | None, gate: ChunkGate | None = None,
                  preset: Preset | None = None) -> Iterator[np.ndarray]:
    """Waveform chunks for a token stream, each yielded as soon as its tokens have arrived.

    `tokens` is consumed lazily (the LLM decoder, or any token source), so decoding and chunk emission interleave
    in the caller's thread; rng None switches the NSF noise off. With a `gate`, each chunk's flow + HiFT work
    waits for its turn among the concurrent streams (fewest chunks emitted first). A preset with a
    `stream_window` re-solves only the prompt and the tokens from `preset.window_start` on (bounded re-solve;
    presets.py).
    """
    ratio = flow.config.token_mel_ratio
    schedule = ChunkSchedule(len(prompt.tokens), config)
    hift = VocoderStream(vocoder, config, rng)
    gate = gate or ChunkGate()  # a private gate: never waits
    began, emitted = time.monotonic(), 0
    got: list[int] = []
    for token in tokens:
        got.append(int(token))
        size = schedule.ready(len(got))
        if size is None:
            continue
        start = preset.window_start(schedule.offset, config.hops[0]) if preset else 0
        with gate.turn(emitted, began):
            mel = flow.mel(prompt, np.asarray(got[:size], np.int64), False, True, preset, start)
            chunk = hift.chunk(mel[:, :, ratio * (schedule.offset - start):], final=False)
        emitted += 1
        yield chunk
        schedule.advance()
    if not got:
        return
    start = preset.window_start(schedule.offset, config.hops[0]) if preset else 0
    with gate.turn(emitted, began):
        mel = flow.mel(prompt, np.asarray(got, np.int64), True, False, preset, start)
        chunk = hift.chunk(mel[:, :, ratio * (schedule.offset - start):], final=True)
    yield chunk
