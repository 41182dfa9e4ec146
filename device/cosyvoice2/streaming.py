"""CosyVoice streaming (both families): when a chunk of speech tokens is ready, and how it becomes audio.

Official schedule, kept per request (the official model stores the hop on the shared instance and never resets
it; here every request starts again at the first hop): the first hop is hops[0] + pad, where pad brings prompt +
first hop to a hops[0] boundary; later hops follow `hops` (25, 50, 100, 100, ...), counted over the tokens the
family's token filter keeps (Fun-CosyVoice3 drops long silent runs). A chunk is made when the tokens not yet voiced
reach hop + look-ahead; the flow then re-runs on tokens[:offset + hop + look-ahead] (streaming attention, finalize
off: the look-ahead tokens are context only) and the new mel starts at ratio * offset. When the LLM stops, one final
call voices every remaining token (finalize on, full attention). A preset with a `stream_window` re-solves only the
prompt and a bounded window of recent tokens (presets.py); one with `first_hop_pad` off drops the pad (first chunk
after hops[0] tokens, whatever the prompt's length). The family's `ChunkVocoder` turns each chunk's new mel
into the samples to emit (CosyVoice2: HiFT caches and cross-fade; Fun-CosyVoice3: HiFT re-run on the accumulated
mel).

Fairness between concurrent streams (`ChunkGate`): the flow + HiFT work of one chunk waits for its turn, and the
turn goes to the stream that has emitted the fewest chunks, then to the one that began first, so a new request's
first chunk never waits behind another request's later chunks; nor for the end of a chunk's work already running
(`first_beside`): one first chunk at a time starts beside it, since a later chunk's call can be long (an official
stream re-solves its whole history) and the newcomer's listener hears nothing meanwhile. The priority lives in the
waiting ticket (a local of the stream), never on the shared gate. While a first chunk's work runs, the LLM decode
loop waits before its next step (`before_decode_step`, called by the `DecodeScheduler`), so on a small CPU the cores
go to the chunk that ends the listener's silence rather than to tokens that are not needed yet. On the CPU provider
it waits for every chunk's work (`decode_yields_always`) unless a stream still waits for its first tokens
(`awaiting_first`, so a newcomer's first audio is not held behind others' later chunks): decode steps and chunk work
then take turns, each with all the cores, instead of running at once on oversubscribed cores (2 cores, full-size
CosyVoice2 cpu, each session 2 threads: a decode step beside a looping estimator call took 37-47 ms against 14.5 ms
alone, and the estimator ran 0.71-0.97 calls/s against 2.2 alone). For the same reason a later chunk's graph calls
(the flow's encoder call and estimator steps, HiFT's decoder calls) give way while a stream waits for its first
tokens or a first chunk's work runs (`later_step`): a step waits before it starts, and a step already running is
stopped (ONNX Runtime's `RunOptions.terminate`, checked between nodes) and runs again afterwards with the same
inputs, so the newcomer's prefill, first tokens and first chunk get the cores at once instead of sharing them with
the rest of a re-solve's step (up to a second on a small CPU). A stream's decoder runs ahead only while its consumer
waits for tokens, so it still interleaves with the chunks.

First chunks together (`ChunkGate.first_mel`): the stream whose first chunk gets the turn solves, in one flow call,
the first chunks of every stream waiting then with the same preset and the same lengths (at most `first_batch`);
the others take their mel and only run their own HiFT chunk. Streams that arrive together (their rows decoded in
the same batch) then wait for one flow call, not one each. Only rows of one length share a call: a right-padded row
differs from its solo call by float rounding (1e-6 in the mel, amplified by HiFT), an unpadded one does not, so
every stream's audio is exactly what it gets alone. That holds only where the estimator keeps rows apart
(`flow.rows_independent`): the cpu targets' dynamic int8 estimator quantizes a call's activations with one scale,
so there `first_batch` is 1 and each first chunk has its own call.
"""
from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol, TypeVar, runtime_checkable

import numpy as np
import onnxruntime as ort

from cosyedge.device.cosyvoice2.flow import Flow, FlowPrompt, StepRunner
from cosyedge.device.cosyvoice2.presets import Preset

T = TypeVar("T")


@dataclass(frozen=True)
class ScheduleConfig:
    """The chunk schedule's constants (`manifest.config["stream"]`: `hops`, `lookahead`)."""
    hops: tuple[int, ...]
    lookahead: int

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "ScheduleConfig":
        return cls(hops=tuple(int(h) for h in cfg["hops"]), lookahead=int(cfg["lookahead"]))


@runtime_checkable
class TokenFilter(Protocol):
    """Fed every LLM token of one utterance in order; `keep` says whether the flow voices it."""

    def keep(self, token: int) -> bool: ...


class KeepAll:
    """CosyVoice2: the flow voices every token the LLM gives."""

    def keep(self, token: int) -> bool:
        return True


@runtime_checkable
class ChunkVocoder(Protocol):
    """The HiFT state of ONE streaming request (never shared): each chunk's new mel in, the samples to emit out."""

    def chunk(self, mel: np.ndarray, final: bool, run_step: StepRunner | None = None) -> np.ndarray:
        """`run_step` (a later chunk's: `ChunkGate.later_step`) runs the costly graph calls; it may wait, and stop a
        call and run it again with the same inputs (so a call it runs must not draw from the request's rng)."""


class ChunkSchedule:
    """Token offsets of one streaming request."""

    def __init__(self, prompt_tokens: int, config: ScheduleConfig, pad_first: bool = True) -> None:
        first = config.hops[0]
        self._config = config
        self._pad = math.ceil(prompt_tokens / first) * first - prompt_tokens if pad_first else 0
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


def first_chunk_tokens(prompt_tokens: int, config: ScheduleConfig, preset: Preset | None) -> int:
    """The tokens a stream needs for its first chunk (its first hop and the look-ahead; a family's token filter
    may drop some, so the stream may need a few more)."""
    return ChunkSchedule(prompt_tokens, config, preset.first_hop_pad if preset else True).hop + config.lookahead


@dataclass(eq=False)
class FirstChunk:
    """One stream's first-chunk flow call, waiting to be solved alone or with other streams' first chunks."""
    prompt: FlowPrompt
    tokens: np.ndarray
    preset: Preset | None
    mel: np.ndarray | None = None
    error: BaseException | None = None
    claimed: bool = False  # in the batch of the stream that solves it
    done: bool = False

    def fits(self, other: "FirstChunk") -> bool:
        """Whether the two share a flow call exactly: same preset and token counts (no padded row)."""
        return (self.preset == other.preset and self.prompt.tokens.size == other.prompt.tokens.size
                and self.prompt.mel.shape == other.prompt.mel.shape and self.tokens.size == other.tokens.size)

    def result(self) -> np.ndarray:
        if self.error is not None:
            raise self.error
        assert self.mel is not None
        return self.mel


class ChunkGate:
    """Turns for chunk work (flow + HiFT) of concurrent streams: at most `slots` at once, the waiting ticket with
    the lowest (chunks emitted, start time) first. One slot suits a CPU, where parallel calls only share cores;
    with `first_beside` one first chunk more may run beside them (the pipeline's choice: first audio sooner).
    First chunks of one length waiting at once share one flow call of at most `first_batch` rows (`first_mel`).
    The decode loop waits before each step while a first chunk's work runs, and with `decode_yields_always` (CPU)
    while any chunk's work runs unless a stream still waits for the tokens of its first chunk
    (`before_decode_step`)."""

    def __init__(self, slots: int = 1, first_batch: int = 4, decode_yields_always: bool = False,
                 first_beside: bool = False) -> None:
        self._cond = threading.Condition()
        self._free = slots
        self._first_beside = first_beside
        self._waiting: list[tuple[int, float, int]] = []  # heap of tickets
        self._order = itertools.count()
        self._decode_yields_always = decode_yields_always
        self._first_running = 0  # slots held by first chunks' work
        self._later_running = 0  # slots held by later chunks' work
        self._awaiting_first = 0  # streams that have not emitted a chunk yet (`awaiting_first`)
        self._first_batch = first_batch
        self._firsts: list[FirstChunk] = []  # first chunks waiting for their flow call
        self._calls: set[ort.RunOptions] = set()  # options of the later chunks' graph calls in flight
        self.preempted = 0  # later calls stopped midway for a first chunk (tests, profiles)

    def _may_start(self, emitted: int) -> bool:
        """A free slot, or with `first_beside` for a first chunk while no other first chunk runs: a turn beside the
        running later chunk, so a newcomer's first audio does not wait for the end of another's long call."""
        return self._free > 0 or (self._first_beside and emitted == 0 and self._first_running == 0)

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
            self._cond.wait_for(lambda: self._may_start(emitted) and self._waiting[0] == ticket)
            heapq.heappop(self._waiting)
            self._free -= 1
            self._first_running += emitted == 0
            self._later_running += emitted > 0
            if emitted == 0:
                self._preempt()
            self._cond.notify_all()  # with slots left, the next ticket may go too
        try:
            yield
        finally:
            with self._cond:
                self._free += 1
                self._first_running -= emitted == 0
                self._later_running -= emitted > 0
                self._cond.notify_all()

    @contextmanager
    def awaiting_first(self) -> Iterator[Callable[[], None]]:
        """Count a stream as waiting for its first chunk until it calls the yielded `done` (or ends): meanwhile
        the decode loop does not wait for other streams' later chunks, so first tokens come promptly."""
        pending = [True]

        def done() -> None:
            if pending[0]:
                pending[0] = False
                with self._cond:
                    self._awaiting_first -= 1
                    self._cond.notify_all()

        with self._cond:
            self._awaiting_first += 1
            self._preempt()
            self._cond.notify_all()  # a decode loop held by a later chunk's turn goes on for the newcomer now
        try:
            yield done
        finally:
            done()

    def first_mel(self, flow: Flow, job: FirstChunk, began: float) -> np.ndarray:
        """The mel of a stream's first chunk (as `flow.mel(prompt, tokens, False, True, preset)`). When this stream's
        ticket gets a slot it solves its own and the other waiting first chunks that fit it in one call; when another
        stream solved it first, the result is taken without a turn."""
        ticket = (0, began, next(self._order))
        with self._cond:
            heapq.heappush(self._waiting, ticket)
            self._firsts.append(job)
            self._cond.wait_for(lambda: job.done or (not job.claimed and self._may_start(0)
                                                      and self._waiting[0] == ticket))
            self._waiting.remove(ticket)
            heapq.heapify(self._waiting)
            if job.done:
                self._cond.notify_all()  # the ticket left the head of the heap
                return job.result()
            batch = [job] + [j for j in self._firsts if j is not job and job.fits(j)][:self._first_batch - 1]
            self._firsts = [j for j in self._firsts if j not in batch]
            for member in batch:
                member.claimed = True
            self._free -= 1
            self._first_running += 1
            self._preempt()
            self._cond.notify_all()
        mels: list[np.ndarray] = []
        error: BaseException | None = None
        try:
            mels = flow.mels([j.prompt for j in batch], [j.tokens for j in batch], job.preset, True)
        except BaseException as exc:  # noqa: BLE001 - every stream of the batch gets the error
            error = exc
        finally:
            with self._cond:
                for index, member in enumerate(batch):
                    member.mel, member.error, member.done = (mels[index] if mels else None), error, True
                self._free += 1
                self._first_running -= 1
                self._cond.notify_all()
        return job.result()

    def _first_pending(self) -> bool:
        """A stream waits for the tokens of its first chunk, or a first chunk's work runs (caller holds the lock)."""
        return self._awaiting_first > 0 or self._first_running > 0

    def _preempt(self) -> None:
        """Stop the later chunks' graph calls in flight, where the decoder yields always (caller holds the lock)."""
        for options in self._calls:
            options.terminate = True

    def later_step(self, call: Callable[[ort.RunOptions | None], T]) -> T:
        """One graph call of a later chunk (the flow's encoder call or an estimator step, a HiFT decoder call):
        `call` runs the graph with the run options given. Where the decoder yields always (CPU), the step waits
        while a first chunk is pending (a stream waits for its first tokens, or a first chunk's work runs), and
        a step in flight when one becomes pending is stopped and runs again once it is not. Why: an official
        later chunk re-solves its whole history (a second a step on a small CPU), and a newcomer's prefill,
        first tokens and first chunk beside it ran on oversubscribed cores. No wait elsewhere: the decode loop
        runs while a stream awaits first tokens, and a first chunk may start beside the held turn
        (`first_beside`)."""
        if not self._decode_yields_always:
            return call(None)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: not self._first_pending())
                options = ort.RunOptions()
                self._calls.add(options)
            try:
                return call(options)
            except Exception:
                if not options.terminate:
                    raise
                with self._cond:
                    self.preempted += 1   # stopped for a first chunk: the same inputs go again after it
            finally:
                with self._cond:
                    self._calls.discard(options)

    def before_decode_step(self) -> None:
        """Block while chunk work the decode loop yields to is in flow + HiFT: a first chunk's, or with
        `decode_yields_always` a later chunk's while no stream waits for its first tokens (the decode loop calls
        this before each step)."""
        with self._cond:
            self._cond.wait_for(lambda: self._first_running == 0 and (
                not self._decode_yields_always or self._later_running == 0 or self._awaiting_first > 0))


def stream_tokens(tokens: Iterable[int], prompt: FlowPrompt, flow: Flow, vocoder: ChunkVocoder,
                  schedule_config: ScheduleConfig, token_filter: TokenFilter | None = None,
                  gate: ChunkGate | None = None, preset: Preset | None = None) -> Iterator[np.ndarray]:
    """Waveform chunks for a token stream, each yielded as soon as its tokens have arrived.

    `tokens` is consumed lazily (the LLM decoder, or any token source), so decoding and chunk emission interleave
    in the caller's thread. `vocoder` is the request's own streaming state; `token_filter` (default: keep all)
    says which tokens the flow voices (dropped ones do not count for the schedule). With a `gate`, each chunk's
    flow + HiFT work waits for its turn among the concurrent streams (fewest chunks emitted first). A preset with
    a `stream_window` re-solves only the prompt and the tokens from `preset.window_start` on (bounded re-solve);
    one with `first_hop_pad` off makes its first chunk from hops[0] tokens, unpadded.
    """
    ratio = flow.config.token_mel_ratio
    schedule = ChunkSchedule(len(prompt.tokens), schedule_config, preset.first_hop_pad if preset else True)
    keep = (token_filter or KeepAll()).keep
    gate = gate or ChunkGate()  # a private gate: never waits
    began, emitted = time.monotonic(), 0
    got: list[int] = []
    with gate.awaiting_first() as first_done:
        for token in tokens:
            if not keep(int(token)):
                continue
            got.append(int(token))
            size = schedule.ready(len(got))
            if size is None:
                continue
            if emitted == 0:  # whole history, nothing voiced yet: the flow call may be shared with other first chunks
                first_done()
                mel = gate.first_mel(flow, FirstChunk(prompt, np.asarray(got[:size], np.int64), preset), began)
                with gate.turn(emitted, began):
                    chunk = vocoder.chunk(mel, final=False)
            else:
                start = preset.window_start(schedule.offset, schedule_config.hops[0]) if preset else 0
                with gate.turn(emitted, began):
                    mel = flow.mel(prompt, np.asarray(got[:size], np.int64), False, True, preset, start,
                                   run_step=gate.later_step)
                    chunk = vocoder.chunk(mel[:, :, ratio * (schedule.offset - start):], final=False,
                                          run_step=gate.later_step)
            emitted += 1
            yield chunk
            schedule.advance()
    if not got:
        return
    start = preset.window_start(schedule.offset, schedule_config.hops[0]) if preset else 0
    run_step = gate.later_step if emitted else None     # no chunk yet: this turn is a first chunk's, never paused
    with gate.turn(emitted, began):
        mel = flow.mel(prompt, np.asarray(got, np.int64), True, False, preset, start, run_step=run_step)
        chunk = vocoder.chunk(mel[:, :, ratio * (schedule.offset - start):], final=True, run_step=run_step)
    yield chunk
