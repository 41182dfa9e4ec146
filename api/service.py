"""The service behind the routes: lifecycle (start, readiness, drain, stop), metrics and the journal.

One `Service` per app, kept in `app.extensions["cosyedge"]`; routes reach it through `current_service()`.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from flask import current_app

from cosyedge.api.batcher import SynthesisQueue
from cosyedge.api.config import OPENAI_VOICES, ConfigError, ServiceConfig
from cosyedge.api.errors import NotReady
from cosyedge.api.journal import Journal
from cosyedge.api.metrics import Metrics
from cosyedge.api.ratelimit import RateLimiter
from cosyedge.device.audio import encode, to_audio_segment
from cosyedge.device.engine import Engine
from cosyedge.device.paths import state_dir

log = logging.getLogger(__name__)

ENGINE_GAUGES = {"cosyedge_decode_steps": "decode_steps", "cosyedge_decode_rows_mean": "decode_rows_mean",
                 "cosyedge_decode_active_rows": "decode_active_rows",
                 "cosyedge_decode_rows_cancelled": "decode_rows_cancelled"}  # gauge -> key of Engine.stats()


class Service:
    """State shared by every request: config, metrics, the engine and its batch queue once ready."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.engine: Engine | None = None
        self.batcher: SynthesisQueue | None = None
        self.aliases: dict[str, str] = {}
        self.ready = threading.Event()
        self.limiter = RateLimiter(config.rate_limit_per_s, config.rate_limit_burst) if config.rate_limit_per_s else None
        self.journal = Journal(Path(config.state_dir) if config.state_dir else state_dir())
        self._inflight = 0
        self._idle = threading.Condition()
        self.metrics.gauge("cosyedge_ready", lambda: 1.0 if self.ready.is_set() else 0.0)
        self.metrics.gauge("cosyedge_queue_depth", lambda: self.batcher.depth() if self.batcher else 0)
        self.metrics.gauge("cosyedge_in_flight", lambda: self.batcher.in_flight() if self.batcher else 0)
        self.metrics.occupancy(lambda: self.engine.decode_occupancy() if self.engine else {})
        for gauge, key in ENGINE_GAUGES.items():
            self.metrics.gauge(gauge, lambda key=key: self.engine.stats().get(key, 0.0) if self.engine else 0.0)

    def start(self, engine: Engine, heartbeat: Callable[[], None] | None = None,
              heartbeat_interval: float | None = None) -> float:
        """Recover the journal, attach the loaded engine, start the worker, push one request through it.

        Returns the warm-up seconds. Requests a previous run accepted and never answered are dead-lettered first.
        """
        self.journal.recover()
        voices = engine.voices()
        aliases = {name: voices[0] for name in OPENAI_VOICES}
        for alias, target in self.config.voice_aliases.items():
            if target not in voices:
                raise ConfigError(f"configuration: voice alias {alias!r} names unknown voice {target!r}; "
                                  f"available: {', '.join(voices[:20])}")
            aliases[alias] = target
        self.engine, self.aliases = engine, aliases
        self.batcher = SynthesisQueue(engine, self.metrics, self.config.queue_size, self.config.batch_max,
                                      self.config.batch_timeout, heartbeat, heartbeat_interval)
        self.batcher.start()
        start = time.perf_counter()
        options = engine.options(deterministic=True)
        future = self.batcher.submit([(engine.segments("Ready."), options)], time.monotonic() + 600)[0]
        encode(to_audio_segment(self.batcher.wait(future, time.monotonic() + 600), engine.sample_rate), "wav")
        self.ready.set()
        return time.perf_counter() - start

    def enter(self) -> None:
        with self._idle:
            self._inflight += 1

    def leave(self) -> None:
        with self._idle:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.notify_all()

    def drain(self, timeout: float) -> bool:
        """Stop admitting synthesis (readyz and new requests answer 503), wait for requests under way."""
        self.ready.clear()
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

    def stop(self) -> None:
        self.ready.clear()
        if self.batcher is not None:
            self.batcher.stop()
        self.journal.close()

    def require_ready(self) -> tuple[Engine, SynthesisQueue]:
        if not self.ready.is_set() or self.engine is None or self.batcher is None:
            raise NotReady()
        return self.engine, self.batcher


def current_service() -> Service:
    """The service of the app handling the current request."""
    return current_app.extensions["cosyedge"]
