"""The synthesis queue: request threads submit work, the engine renders it.

Closed batches (VITS): the worker takes the oldest item, then waits (on a condition, never a sleep) until
`batch_max` items are there or `timeout` has passed since the oldest one arrived, and hands the lot to
`Engine.synthesize_many`, which groups compatible requests into model calls. `capacity` bounds the items waiting.

Continuous batching (CosyVoice, `Engine.continuous_batching`): no request waits for another's batch. When the
engine is idle the first arrival may wait `timeout` for company (up to `batch_max` items), and those start in one
engine call on a thread of their own (one prefill); while anything runs, each new item is handed over at once to a
thread of its own, and the engine's decode scheduler lets its rows join the running decode steps (`batch_max`
bounds the rows decoded together). `capacity` bounds the requests in flight: waiting, rendering
and streams (`admit`); beyond it, 503 with a Retry-After from the completions per second measured lately.

Each item's `Future` carries its waveform or its error back to the waiting request thread. Items whose deadline
passed or whose client left are skipped before any work is done for them.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from cosyedge.api.errors import DeadlineExceeded, QueueFull, ShuttingDown
from cosyedge.api.metrics import Metrics
from cosyedge.device.engine import Engine
from cosyedge.device.options import Segment, SynthesisOptions

log = logging.getLogger(__name__)


class SynthesisError(Exception):
    """The engine failed on an accepted item. `detail` (type and message) goes to the dead-letter file only."""

    def __init__(self, detail: str) -> None:
        super().__init__("synthesis failed")
        self.detail = detail


@dataclass
class Item:
    segments: list[Segment]
    request: SynthesisOptions
    deadline: float
    enqueued: float = field(default_factory=time.monotonic)
    future: Future = field(default_factory=Future)


class SynthesisQueue:
    """Bounded queue + the dispatching worker thread (+ one thread per request rendering, continuous mode)."""

    def __init__(self, engine: Engine, metrics: Metrics, capacity: int, batch_max: int, timeout: float,
                 heartbeat: Callable[[], None] | None = None, heartbeat_interval: float | None = None) -> None:
        self.engine, self.metrics = engine, metrics
        self.capacity, self.batch_max, self.timeout = capacity, batch_max, timeout
        self._heartbeat, self._heartbeat_interval = heartbeat, heartbeat_interval
        self._items: deque[Item] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._batch_seconds = 0.1  # running estimate for Retry-After
        self._finished: deque[float] = deque(maxlen=32)  # completion times: the measured throughput
        self.continuous = engine.continuous_batching
        self._running = 0  # continuous mode: items rendering + streams admitted
        self._pool = ThreadPoolExecutor(capacity, "cosyedge-request") if self.continuous else None
        self._thread = threading.Thread(target=self._run, name="cosyedge-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop after the batch in progress; items still queued are answered 503 instead of hanging."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        with self._cond:
            left, self._items = list(self._items), deque()
        for item in left:
            if item.future.set_running_or_notify_cancel():
                item.future.set_exception(ShuttingDown())

    def alive(self) -> bool:
        return self._thread.is_alive()

    def depth(self) -> int:
        return len(self._items)

    def in_flight(self) -> int:
        """Requests waiting or being rendered or streamed (continuous mode; waiting only for closed batches)."""
        return len(self._items) + self._running

    def retry_after(self, items: int) -> int:
        """Seconds until `items` more would likely fit: from the completions per second measured lately, else
        from the batches ahead and the mean batch time."""
        done = list(self._finished)
        if len(done) >= 2 and done[-1] > done[0]:
            rate = (len(done) - 1) / (done[-1] - done[0])
            return max(1, math.ceil(items / rate))
        return max(1, math.ceil(math.ceil((len(self._items) + items) / self.batch_max) * self._batch_seconds))

    def _refuse(self, items: int) -> QueueFull:
        self.metrics.inc("cosyedge_queue_rejected_total", items)
        return QueueFull(retry_after=self.retry_after(items))

    def admit(self) -> Callable[[], None]:
        """A stream's place among the requests in flight (continuous mode), or QueueFull; call the returned
        function (once) when the engine is done with the stream."""
        with self._cond:
            if self.in_flight() + 1 > self.capacity:
                raise self._refuse(1)
            self._running += 1
        return self._done

    def _done(self) -> None:
        with self._cond:
            self._running -= 1
            self._finished.append(time.monotonic())
            self._cond.notify_all()

    def submit(self, jobs: Sequence[tuple[list[Segment], SynthesisOptions]], deadline: float, admitted: bool = False) -> list[Future]:
        """Queue all jobs or none; QueueFull (503 + Retry-After) at once if they do not fit.

        `admitted` work (the next sentence of a stream already under way) skips the capacity check:
        each stream holds at most one item, so the overshoot is bounded by the HTTP thread count.
        """
        items = [Item(list(segments), request, deadline) for segments, request in jobs]
        with self._cond:
            waiting = self.in_flight() if self.continuous else len(self._items)
            if not admitted and waiting + len(items) > self.capacity:
                raise self._refuse(len(items))
            self._items.extend(items)
            self._cond.notify()
        return [item.future for item in items]

    def wait(self, future: Future, deadline: float) -> np.ndarray:
        """The item's waveform. Past the deadline, an item not yet started is withdrawn (504)."""
        try:
            return future.result(timeout=max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            if future.cancel():
                self.metrics.inc("cosyedge_deadline_expired_total")
                raise DeadlineExceeded() from None
            return future.result()

    # -- worker ------------------------------------------------------------------------------
    def _run(self) -> None:
        next_beat = 0.0
        while True:
            now = time.monotonic()
            if self._heartbeat is not None and now >= next_beat:
                self._heartbeat()
                next_beat = now + (self._heartbeat_interval or 1.0)
            batch = self._collect(next_beat if self._heartbeat is not None else None)
            if batch is None:
                return
            if batch and self._pool is not None:
                self._pool.submit(self._render_apart, batch)
            elif batch:
                try:
                    self._render(batch)
                except Exception as exc:  # noqa: BLE001 - the worker must survive anything
                    log.exception("engine worker: unexpected error")
                    for item in batch:
                        if not item.future.done():
                            item.future.set_exception(SynthesisError(f"{type(exc).__name__}: {exc}"))

    def _collect(self, wake_at: float | None) -> list[Item] | None:
        """Up to batch_max live items; [] when woken for the heartbeat; None when stopping."""
        with self._cond:
            while not self._items and not self._stopping:
                remaining = None if wake_at is None else wake_at - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return []
                self._cond.wait(remaining)
            if self._stopping:
                return None
            close_at = self._items[0].enqueued + self.timeout
            while len(self._items) < self.batch_max and not self._stopping and not (self.continuous and self._running):
                remaining = close_at - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            take = 1 if self.continuous and self._running else min(self.batch_max, len(self._items))
            batch = [self._items.popleft() for _ in range(take)]
            if self.continuous:
                self._running += len(batch)  # counted before the lock drops: in_flight never dips
        now = time.monotonic()
        live = []
        for item in batch:
            if not item.future.set_running_or_notify_cancel():
                self._skip()
                continue  # its client left (stream closed) or gave up
            if now > item.deadline:
                self.metrics.inc("cosyedge_deadline_expired_total")
                item.future.set_exception(DeadlineExceeded())
                self._skip()
                continue
            live.append(item)
        return live

    def _skip(self) -> None:
        if self.continuous:
            with self._cond:
                self._running -= 1

    def _render_apart(self, batch: list[Item]) -> None:
        """Continuous mode, on a thread of its own: the items that arrived together (those that waited for company
        on an idle engine, else one) start in one engine call, and their rows join the running decode steps."""
        try:
            self._render(batch)
        except Exception as exc:  # noqa: BLE001 - a request thread must not leave a future unset
            log.exception("request worker: unexpected error")
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(SynthesisError(f"{type(exc).__name__}: {exc}"))
        finally:
            for _ in batch:
                self._done()

    def _render(self, batch: list[Item]) -> None:
        start = time.perf_counter()
        try:
            waves = self.engine.synthesize_many([(item.segments, item.request) for item in batch])
        except Exception as exc:  # noqa: BLE001 - isolate the failing item(s) by rendering one by one
            if len(batch) == 1:
                log.exception("synthesis failed")
                self.metrics.inc("cosyedge_synthesis_failures_total")
                batch[0].future.set_exception(SynthesisError(f"{type(exc).__name__}: {exc}"))
                return
            for item in batch:
                self._render([item])
            return
        elapsed = time.perf_counter() - start
        self._batch_seconds = 0.8 * self._batch_seconds + 0.2 * elapsed
        if not self.continuous:  # continuous mode: `_done` notes each completion
            self._finished.extend([time.monotonic()] * len(batch))
        audio = sum(len(w) for w in waves) / self.engine.sample_rate
        self.metrics.observe("cosyedge_batch_size", len(batch))
        self.metrics.inc("cosyedge_batches_total")
        self.metrics.inc("cosyedge_audio_seconds_total", audio)
        self.metrics.inc("cosyedge_compute_seconds_total", elapsed)
        for item, wave in zip(batch, waves):
            item.future.set_result(np.asarray(wave, dtype=np.float32))
