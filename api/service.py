"""The service behind the routes: lifecycle (start, readiness, drain, stop), metrics and the dead-letter file.

One `Service` per app, kept in `app.extensions["cosyedge"]`; routes reach it through `current_service()`.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from flask import current_app

from cosyedge.api.batcher import SynthesisError, SynthesisQueue
from cosyedge.api.config import OPENAI_VOICES, ConfigError, ServiceConfig
from cosyedge.api.errors import NotReady
from cosyedge.api.metrics import Metrics
from cosyedge.api.ratelimit import RateLimiter
from cosyedge.device.audio import encode, to_audio_segment
from cosyedge.device.engine import Engine
from cosyedge.device.paths import state_dir

log = logging.getLogger(__name__)

DEAD_LETTER = "api_dead_letter.jsonl"
ENGINE_GAUGES = {"cosyedge_decode_steps": "decode_steps", "cosyedge_decode_rows_mean": "decode_rows_mean",
                 "cosyedge_decode_active_rows": "decode_active_rows"}  # gauge -> key of Engine.stats()


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
        self._dead_lock = threading.Lock()
        self._inflight = 0
        self._idle = threading.Condition()
        self.metrics.gauge("cosyedge_ready", lambda: 1.0 if self.ready.is_set() else 0.0)
        self.metrics.gauge("cosyedge_queue_depth", lambda: self.batcher.depth() if self.batcher else 0)
        for gauge, key in ENGINE_GAUGES.items():
            self.metrics.gauge(gauge, lambda key=key: self.engine.stats().get(key, 0.0) if self.engine else 0.0)

    def start(self, engine: Engine, heartbeat: Callable[[], None] | None = None,
              heartbeat_interval: float | None = None) -> float:
        """Attach the loaded engine, start the worker, push one request through it; returns warm-up seconds."""
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

    def require_ready(self) -> tuple[Engine, SynthesisQueue]:
        if not self.ready.is_set() or self.engine is None or self.batcher is None:
            raise NotReady()
        return self.engine, self.batcher

    def dead_letter(self, route: str, request_id: str, payload: dict[str, Any], error: SynthesisError) -> None:
        """One JSONL record per failed synthesis, in the state directory, for later inspection or replay."""
        path = self.dead_letter_path()
        record = {"time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"), "route": route,
                  "request_id": request_id, "request": payload, "error": error.detail}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with self._dead_lock, path.open("a", encoding="utf-8") as out:
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
        except OSError as exc:
            log.error("cannot write the dead-letter record: %s", exc)

    def dead_letter_path(self) -> Path:
        return (Path(self.config.state_dir) if self.config.state_dir else state_dir()) / DEAD_LETTER


def current_service() -> Service:
    """The service of the app handling the current request."""
    return current_app.extensions["cosyedge"]
