"""The one door into the engine: a request is a `Job`, its audio a `Stream` of `Chunk`s.

HTTP (whole file and streamed), WebSocket, Wyoming (standalone and inside `serve`), `synth-batch` and
`cosyedge cache warm` all open their jobs here and read chunks; none of them runs the engine itself. What the
pipeline can do reaches every one of them the same way:

* a pipeline with continuous batching (CosyVoice): a job enters the engine at once, on a thread of its own, and
  its decode rows join the running decode steps (the pipeline's scheduler; `BatchLimits.batch_max` rows at most),
  so nobody waits for another's batch. A chunked job gets the pipeline's chunks (hops of 25, 50, 100 speech
  tokens) as each is vocoded; a whole job (`chunked=False`: a file) is rendered on the non-streaming path, and
  when the engine is idle the first whole job waits `gather_s` for company (up to `batch_max` jobs), so that the
  jobs that arrived together share one prefill.
* any other pipeline (VITS): one engine thread renders one segment (a sentence) at a time and takes the open jobs
  in turn (round robin: a long text does not hold a short one back). It never waits for company: one call per
  sentence is VITS's fastest and smallest (issue 10), so waiting would only add latency.

Each job's chunks wait for its reader in its stream; the engine thread renders at most `AHEAD` segments beyond
what the reader has taken, so a reader that stalls costs neither work nor memory. `Stream.close()` (or setting
the job's `stop` event) withdraws the job before its next piece of work; a CosyVoice decode row leaves before the
next step. A job whose `deadline` passes before its work starts ends with `DeadlineError`; a failure in the
engine ends that job's stream with the error (a `CosyedgeError` as raised, anything else as `SynthesisFailed`,
whose message is the detail for a dead-letter file), and the other jobs go on.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from cosyedge.device.engine import Engine
from cosyedge.device.errors import CosyedgeError, DeadlineError, DoorClosed, SynthesisFailed
from cosyedge.device.options import Segment, SynthesisOptions, Word

log = logging.getLogger(__name__)

AHEAD = 2  # segments the engine thread renders beyond what a job's reader has taken
_POLL_S = 0.05  # a reader waiting for its next chunk notices a `stop` set from outside within this
_END = object()


@dataclass(frozen=True)
class Job:
    """One request as the engine sees it: validated segments and options, how its audio is made, and by when
    its work must start (`time.monotonic()`; None: no deadline)."""
    segments: Sequence[Segment]
    options: SynthesisOptions
    chunked: bool = True  # False: each segment rendered whole on the non-streaming path (a file's quality)
    deadline: float | None = None
    words: bool = False  # chunks carry word times (the segments come from `Engine.segments(text, words=True)`)

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(self.segments))


@dataclass(frozen=True)
class Chunk:
    """A piece of a job's audio: float32 at the engine's sample rate, the index of the segment it belongs to,
    and whether that segment's audio is complete with it (`last`; a streaming pipeline learns that a segment
    ended only after its last chunk, so then the `last` chunk is empty). `words`, for a job that asks for them,
    are the words whose audio is complete with this chunk, timed in seconds from the job's first sample (the
    family's own times: none for a family without word times)."""
    audio: np.ndarray
    segment: int
    last: bool
    words: tuple[Word, ...] = ()


class Observer:
    """What the door reports to its owner (the service's metrics); the defaults ignore it. Called on the door's
    threads: keep it quick."""

    def rendered(self, jobs: int, audio_s: float, compute_s: float) -> None:
        """One engine call (or one chunked job) for `jobs` jobs made `audio_s` of audio in `compute_s`."""

    def expired(self) -> None:
        """A job's deadline passed before its work started."""

    def failed(self) -> None:
        """The engine failed on a job."""


class Stream:
    """One job's chunks, in order, as the engine makes them: iterate (blocking) or ask `ready(timeout)` first.

    Iteration ends after the job's last chunk, or at once once the job was withdrawn (`close()` or its `stop`);
    an engine failure, a deadline passed or the door closing is raised by `next()` in place of further chunks.
    """

    def __init__(self, door: "Door", job: Job, stop: threading.Event) -> None:
        self.job, self.stop = job, stop
        self.opened = time.monotonic()
        self.started: float | None = None  # when the engine began work on it
        self.delivered = 0  # segments whose last chunk the reader has taken
        self._door = door
        self._cond = threading.Condition()
        self._items: deque = deque()
        self._ended = False  # the reader has seen the end, an error, or withdrew
        self._expired = False  # its deadline passed before work started
        self._next_segment = 0  # one-by-one engine: the segment it renders next
        self._made = 0  # samples the door has put
        self._segment_start = 0.0  # seconds: where the segment being made starts on the job's clock

    # -- the reader's side ---------------------------------------------------------------------
    def __iter__(self) -> "Stream":
        return self

    def ready(self, timeout: float | None = None) -> bool:
        """Whether `next()` would return (or raise, or end) without waiting; waits up to `timeout` for it. A job
        still waiting for its turn when its deadline passes is withdrawn then (DeadlineError), not at its turn."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._answerable():
                now = time.monotonic()
                deadline = self.job.deadline if self.started is None else None
                if deadline is not None and now >= deadline:
                    self._expire()
                    break
                if end is not None and now >= end:
                    return False
                self._cond.wait(min([_POLL_S, *(t - now for t in (end, deadline) if t is not None)]))
            return True

    def __next__(self) -> Chunk:
        self.ready()
        with self._cond:
            if self._ended or self.stop.is_set():
                self._ended = True
                raise StopIteration
            item = self._items.popleft()
        self._door._taken()
        if item is _END or isinstance(item, BaseException):
            self._ended = True
            if item is _END:
                raise StopIteration
            raise item
        if item.last:
            self.delivered += 1
        return item

    def close(self) -> None:
        """Withdraw the job: no further work is done for it (a stream already ended is left as it is)."""
        with self._cond:
            if self._ended:
                return
            self._ended = True
            self.stop.set()
            self._cond.notify_all()
        self._door._taken()

    @property
    def skipped(self) -> int:
        """Segments whose audio the reader has not (wholly) taken."""
        return len(self.job.segments) - self.delivered

    # -- the door's side -----------------------------------------------------------------------
    def _dropped(self) -> bool:
        """Whether the door should do no (further) work for the job."""
        return self._ended or self._expired or self.stop.is_set()

    def _answerable(self) -> bool:
        return bool(self._items) or self._ended or self.stop.is_set()

    def _expire(self) -> None:
        """(holding the lock) The deadline passed before work started: the reader gets DeadlineError, the door
        drops the job."""
        self._items.append(DeadlineError("the request waited past its deadline before work could start"))
        self._expired = True
        self._door._observer.expired()

    def _begin(self) -> bool:
        """The door is about to start work: False when the job was withdrawn or its deadline has passed."""
        with self._cond:
            if self._dropped():
                return False
            if self.job.deadline is not None and time.monotonic() > self.job.deadline:
                self._expire()
                self._cond.notify_all()
                return False
            self.started = time.monotonic()
            return True

    def _put(self, item: object) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()

    def _put_audio(self, wave: np.ndarray, segment: int, last: bool, words: Sequence[Word] = ()) -> int:
        """(the door's thread) A chunk, its words moved from its segment's clock to the job's; its samples."""
        start = self._segment_start if words else 0.0
        self._put(Chunk(np.asarray(wave, np.float32), segment, last,
                        tuple(Word(w.text, start + w.start_s, start + w.end_s) for w in words)))
        self._made += len(wave)
        if last:
            self._segment_start = self._made / self._door.engine.sample_rate
        return len(wave)

    def _end(self, error: BaseException | None = None) -> None:
        self._put(_END if error is None else error)

    def _backlog(self) -> int:
        with self._cond:
            return len(self._items)


class Door:
    """The engine's one entrance (module docstring). Thread-safe; `close()` (or `with`) ends its thread."""

    def __init__(self, engine: Engine, gather_s: float = 0.0, observer: Observer | None = None,
                 heartbeat: Callable[[], None] | None = None, heartbeat_s: float = 1.0) -> None:
        """`gather_s`: how long the first whole job on an idle continuous-batching engine waits for company;
        `heartbeat` is called every `heartbeat_s` from the door's thread (systemd's watchdog: a hung one-by-one
        engine stops the pings)."""
        self.engine = engine
        self.continuous = engine.continuous_batching
        self.gather_s = gather_s
        self.batch_max = engine.limits.batch_max
        self._observer = observer or Observer()
        self._heartbeat, self._heartbeat_s = heartbeat, heartbeat_s
        self._cond = threading.Condition()
        self._queue: deque[Stream] = deque()  # one-by-one: the jobs taking turns; continuous: whole jobs waiting
        self._running = 0  # continuous: jobs on threads of their own
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="cosyedge-door" if self.continuous else
                                        "cosyedge-engine", daemon=True)
        self._thread.start()

    def __enter__(self) -> "Door":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- jobs ----------------------------------------------------------------------------------
    def open(self, job: Job, stop: threading.Event | None = None) -> Stream:
        """Hand the job to the engine now and return its stream (DoorClosed once the door is closing)."""
        stream = Stream(self, job, stop or threading.Event())
        if not job.segments:
            stream._end()
            return stream
        with self._cond:
            if self._closed:
                raise DoorClosed("the engine is shutting down")
            if self.continuous and job.chunked:
                self._running += 1
            else:
                self._queue.append(stream)
                self._cond.notify_all()
                return stream
        threading.Thread(target=self._run_chunks, args=(stream,), name="cosyedge-stream", daemon=True).start()
        return stream

    def stream(self, job: Job, stop: threading.Event | None = None) -> Iterator[Chunk]:
        """`open(job)`'s chunks; leaving the loop early withdraws the job."""
        opened = self.open(job, stop)
        try:
            yield from opened
        finally:
            opened.close()

    def waiting(self) -> int:
        """Jobs handed over whose work has not started."""
        with self._cond:
            return sum(stream.started is None for stream in self._queue)

    def in_flight(self) -> int:
        """Jobs handed over and not finished."""
        with self._cond:
            return len(self._queue) + self._running

    def alive(self) -> bool:
        """Whether the door's thread runs (it stops only when the door is closed)."""
        return self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking jobs; jobs not finished by the door's own thread end with DoorClosed (jobs already on a
        thread of their own finish)."""
        with self._cond:
            self._closed = True
            left, self._queue = list(self._queue), deque()
            self._cond.notify_all()
        for stream in left:
            stream._end(DoorClosed("the engine is shutting down"))
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- the door's thread ---------------------------------------------------------------------
    def _taken(self) -> None:
        """A reader took a chunk or left: the one-by-one engine may have a turn to give."""
        with self._cond:
            self._cond.notify_all()

    def _loop(self) -> None:
        next_beat = 0.0
        while True:
            if self._heartbeat is not None and time.monotonic() >= next_beat:
                self._heartbeat()
                next_beat = time.monotonic() + self._heartbeat_s
            wake_at = next_beat if self._heartbeat is not None else None
            if self.continuous:
                self._start_group(self._gather(wake_at))
            elif (stream := self._turn(wake_at)) is not None:
                self._render_turn(stream)
            if self._closed:
                return

    def _wait(self, wake_at: float | None) -> bool:
        """Wait (holding the lock) for a change, the next heartbeat or, while jobs are open, a `stop` set from
        outside; False when it is time to beat."""
        remaining = None if wake_at is None else wake_at - time.monotonic()
        if remaining is not None and remaining <= 0:
            return False
        if self._queue:
            remaining = _POLL_S if remaining is None else min(remaining, _POLL_S)
        self._cond.wait(remaining)
        return True

    # -- one segment at a time, jobs in turn (pipelines without continuous batching) -------------
    def _turn(self, wake_at: float | None) -> Stream | None:
        """The next job to render a segment of (round robin over the jobs whose reader keeps up); None when it is
        time for the heartbeat, or once closed."""
        with self._cond:
            while not self._closed:
                for _ in range(len(self._queue)):
                    stream = self._queue.popleft()
                    if stream._dropped():
                        stream._end()  # withdrawn or expired: dropped before any further work
                        continue
                    self._queue.append(stream)
                    if stream._backlog() < AHEAD:
                        return stream
                if not self._wait(wake_at):
                    return None
            return None

    def _render_turn(self, stream: Stream) -> None:
        job = stream.job
        if stream.started is None and not stream._begin():
            self._retire(stream)  # withdrawn or expired: no work for it
            return
        index = stream._next_segment
        begin = time.perf_counter()
        try:
            (wave, words), = self._whole(job.segments[index:index + 1], job)
        except Exception as exc:  # noqa: BLE001 - the job fails, the engine thread goes on
            self._retire(stream, _failure(exc))
            return
        self._observer.rendered(1, len(wave) / self.engine.sample_rate, time.perf_counter() - begin)
        stream._next_segment += 1
        stream._put_audio(wave, index, True, words)
        if stream._next_segment == len(job.segments):
            self._retire(stream)

    def _retire(self, stream: Stream, error: BaseException | None = None) -> None:
        with self._cond:
            if stream in self._queue:
                self._queue.remove(stream)
        if error is not None:
            self._observer.failed()
        stream._end(error)

    # -- continuous batching: every job on a thread of its own -------------------------------------
    def _gather(self, wake_at: float | None) -> list[Stream]:
        """Whole jobs to start together: on an idle engine the first one waits `gather_s` for company (up to
        batch_max), else one; none when it is time for the heartbeat, or once closed."""
        with self._cond:
            while not self._queue and not self._closed:
                if not self._wait(wake_at):
                    return []
            if self._closed:
                return []
            close_at = self._queue[0].opened + self.gather_s
            while (len(self._queue) < self.batch_max and not self._closed and not self._running
                   and (remaining := close_at - time.monotonic()) > 0):
                self._cond.wait(remaining)
            take = 1 if self._running else min(self.batch_max, len(self._queue))
            group = [self._queue.popleft()]  # a job with word times goes alone: its times need their own call
            while len(group) < take and not group[0].job.words and not self._queue[0].job.words:
                group.append(self._queue.popleft())
            self._running += len(group)  # counted before the lock drops: in_flight never dips
        return group

    def _start_group(self, group: list[Stream]) -> None:
        live = []
        for stream in group:
            if stream._begin():
                live.append(stream)
            else:  # withdrawn or expired: no work for it
                stream._end()
                self._finished(1)
        if live:
            threading.Thread(target=self._run_group, args=(live,), name="cosyedge-render", daemon=True).start()

    def _finished(self, jobs: int) -> None:
        with self._cond:
            self._running -= jobs
            self._cond.notify_all()

    def _run_group(self, streams: list[Stream]) -> None:
        try:
            self._render_group(streams)
        finally:
            self._finished(len(streams))

    def _render_group(self, streams: list[Stream]) -> None:
        """The whole jobs that started together, in one engine call (one prefill); a failure is isolated by
        rendering them one by one."""
        begin = time.perf_counter()
        try:
            if len(streams) == 1:
                renders = [self._whole(streams[0].job.segments, streams[0].job)]
            else:  # jobs with word times are never gathered (`_gather`): these share one engine call
                renders = [[(wave, ()) for wave in waves] for waves in
                           self.engine.render([(stream.job.segments, stream.job.options) for stream in streams])]
        except Exception as exc:  # noqa: BLE001 - find the failing job, the others are rendered again
            if len(streams) > 1:
                for stream in streams:
                    self._render_group([stream])
                return
            self._observer.failed()
            streams[0]._end(_failure(exc))
            return
        audio = sum(len(wave) for render in renders for wave, _ in render)
        self._observer.rendered(len(streams), audio / self.engine.sample_rate, time.perf_counter() - begin)
        for stream, render in zip(streams, renders):
            for index, (wave, words) in enumerate(render):
                stream._put_audio(wave, index, True, words)
            stream._end()

    def _whole(self, segments: Sequence[Segment], job: Job) -> list[tuple[np.ndarray, tuple[Word, ...]]]:
        """`segments` of `job` rendered whole, each with its words when the job asks for them."""
        if job.words:
            return self.engine.render_words(segments, job.options)
        return [(wave, ()) for wave in self.engine.render([(segments, job.options)])[0]]

    def _run_chunks(self, stream: Stream) -> None:
        """A chunked job on a thread of its own: each chunk goes to the reader as soon as it exists."""
        job = stream.job
        if not stream._begin():
            stream._end()
            self._finished(1)
            return
        begin, samples = time.perf_counter(), 0
        try:
            for index, segment in enumerate(job.segments):
                for wave, words in self.engine.stream_segment(segment, job.options, stream.stop, job.words):
                    samples += stream._put_audio(wave, index, False, words)
                if stream.stop.is_set():
                    break
                stream._put_audio(np.zeros(0, np.float32), index, True)
            stream._end()
        except Exception as exc:  # noqa: BLE001 - reported on the job's stream
            self._observer.failed()
            stream._end(_failure(exc))
        finally:
            self._observer.rendered(1, samples / self.engine.sample_rate, time.perf_counter() - begin)
            self._finished(1)


def _failure(exc: BaseException) -> BaseException:
    """What a job's reader gets for an engine failure: a device error as raised, anything else as
    SynthesisFailed with the detail (for the dead-letter file; the API shows clients none of it)."""
    if isinstance(exc, CosyedgeError):
        return exc
    log.error("synthesis failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
    return SynthesisFailed(f"{type(exc).__name__}: {exc}")


def collect(chunks: Iterable[Chunk]) -> np.ndarray:
    """A stream's audio as one float32 waveform (a whole file)."""
    parts = [chunk.audio for chunk in chunks]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)
