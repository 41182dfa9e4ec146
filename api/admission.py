"""Admission: how many requests may be in flight at once, and when a refused client should come back.

Every door asks here before anything is queued: an HTTP request (each item of a batch on its own), a WebSocket
session (from `start` to its end), a Wyoming `synthesize` and a Wyoming streaming request (`synthesize-start` to
its last audio). A request holds its place until its answer is delivered; `queue_size` (the capacity) bounds the
requests waiting, rendering and streaming together, whatever the protocol. Beyond it the door answers with its
protocol's queue-full error (HTTP 503 `queue_full`, a WebSocket or Wyoming `error` event) and a Retry-After
computed from the completions measured lately (the mean time a place was held when there are too few).

A request admitted now must have its work started by `deadline()` (`request_timeout_s` later): the engine's door
(`device/door.py`) refuses to start a job past it (HTTP 504 `deadline_exceeded`). This is also where the
connection-level bounds of the hostile-client issue (a deadline for `start`, caps per connection) belong.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque

from cosyedge.api.errors import QueueFull
from cosyedge.api.metrics import Metrics

_MEASURED = 32  # completions kept for the Retry-After estimate


class Ticket:
    """One admitted request's place in flight; `release()` (idempotent) gives it back once its answer is out."""

    def __init__(self, admission: "Admission", deadline: float) -> None:
        self.deadline = deadline
        self.admitted = time.monotonic()
        self._admission = admission
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release(self)


class Admission:
    """The capacity shared by every door of one service. Thread-safe."""

    def __init__(self, capacity: int, timeout_s: float, metrics: Metrics) -> None:
        self.capacity, self.timeout_s, self.metrics = capacity, timeout_s, metrics
        self._lock = threading.Lock()
        self._in_flight = 0
        self._finished: deque[float] = deque(maxlen=_MEASURED)  # completion times: the measured throughput
        self._held: deque[float] = deque(maxlen=_MEASURED)  # how long each place was held

    def admit(self, count: int = 1) -> list[Ticket]:
        """Places for `count` requests, all or none; QueueFull (with its Retry-After) when they do not fit."""
        with self._lock:
            if self._in_flight + count > self.capacity:
                retry_after = self._retry_after(count)
            else:
                self._in_flight += count
                deadline = self.deadline()
                return [Ticket(self, deadline) for _ in range(count)]
        self.metrics.inc("cosyedge_queue_rejected_total", count)
        raise QueueFull(retry_after=retry_after)

    def deadline(self) -> float:
        """By when work admitted now must start (`time.monotonic()`)."""
        return time.monotonic() + self.timeout_s

    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def retry_after(self, count: int = 1) -> int:
        """Seconds until `count` more requests would likely fit."""
        with self._lock:
            return self._retry_after(count)

    def _retry_after(self, count: int) -> int:
        done = list(self._finished)
        if len(done) >= 2 and done[-1] > done[0]:
            rate = (len(done) - 1) / (done[-1] - done[0])  # completions per second lately
            return max(1, math.ceil(count / rate))
        held = list(self._held)
        return max(1, math.ceil(sum(held) / len(held))) if held else 1

    def _release(self, ticket: Ticket) -> None:
        now = time.monotonic()
        with self._lock:
            self._in_flight -= 1
            self._finished.append(now)
            self._held.append(now - ticket.admitted)
