"""The service behind every door: lifecycle (start, readiness, drain, stop), metrics, admission, the journal, and
the engine's door (`device/door.py`).

One `Service` per app, kept in `app.extensions["cosyedge"]`; routes reach it through `current_service()`. The
standalone Wyoming server (`cosyedge wyoming`) runs one without HTTP: the same admission, journal and door.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from flask import current_app

from cosyedge.api.admission import Admission
from cosyedge.api.config import OPENAI_VOICES, ConfigError, ServiceConfig
from cosyedge.api.errors import NotReady
from cosyedge.api.journal import Journal
from cosyedge.api.metrics import Metrics
from cosyedge.api.ratelimit import RateLimiter
from cosyedge.device.audio import encode, to_audio_segment
from cosyedge.device.door import Door, Job, Observer, collect
from cosyedge.device.engine import Engine
from cosyedge.device.options import BatchLimits
from cosyedge.device.paths import state_dir

log = logging.getLogger(__name__)


def load_engine(config: ServiceConfig) -> Engine:
    """The engine the configuration names: bundle, precision or build target, batch limits, state directory.

    Start-up checks: the bundle's files are hashed against its manifest, and every registered voice must load
    (`strict_voices`): a service never becomes ready with a corrupted bundle or a voice silently missing.
    A pointer (the bundle store's `current`) is resolved here, once: the engine reads the files of the bundle it
    named at load time, whatever `cosyedge bundle install` points it at later (`Service.watch_bundle`).
    """
    limits = BatchLimits(max_text_len=config.max_text_len, batch_max=config.batch_max, timeout=config.batch_timeout)
    bundle = Path(config.bundle).resolve() if config.bundle else None
    return Engine.load(bundle, precision=config.precision, target=config.target, limits=limits,
                       state_dir=config.state_dir, strict_voices=True)


def voice_aliases(config: ServiceConfig, engine: Engine) -> dict[str, str]:
    """Alias -> voice for every door: the OpenAI voice names (the bundle's first voice) and the configured ones."""
    voices = engine.voices()
    aliases = {name: voices[0] for name in OPENAI_VOICES}
    for alias, target in config.voice_aliases.items():
        if target not in voices:
            raise ConfigError(f"configuration: voice alias {alias!r} names unknown voice {target!r}; "
                              f"available: {', '.join(voices[:20])}")
        aliases[alias] = target
    return aliases
class _DoorMetrics(Observer):
    """The door's reports as the service's metrics."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def rendered(self, jobs: int, audio_s: float, compute_s: float) -> None:
        self.metrics.observe("cosyedge_batch_size", jobs)
        self.metrics.inc("cosyedge_batches_total")
        self.metrics.inc("cosyedge_audio_seconds_total", audio_s)
        self.metrics.inc("cosyedge_compute_seconds_total", compute_s)

    def expired(self) -> None:
        self.metrics.inc("cosyedge_deadline_expired_total")

    def failed(self) -> None:
        self.metrics.inc("cosyedge_synthesis_failures_total")


class Service:
    """State shared by every request of every door: config, metrics, admission, the journal, and once ready the
    engine and its door. `cosyedge serve` makes one per app; `cosyedge wyoming` one of its own."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.engine: Engine | None = None
        self.door: Door | None = None
        self.aliases: dict[str, str] = {}
        self.ready = threading.Event()
        self.limiter = RateLimiter(config.rate_limit_per_s, config.rate_limit_burst) if config.rate_limit_per_s else None
        self.journal = Journal(Path(config.state_dir) if config.state_dir else state_dir())
        self.admission = Admission(config.queue_size, config.request_timeout_s, self.metrics)
        self._inflight = 0
        self._idle = threading.Condition()
        self.metrics.gauge("cosyedge_ready", lambda: 1.0 if self.ready.is_set() else 0.0)
        self.metrics.gauge("cosyedge_queue_depth", lambda: self.door.waiting() if self.door else 0)
        self.metrics.gauge("cosyedge_in_flight", self.admission.in_flight)
        self.metrics.occupancy(lambda: self.engine.decode_occupancy() if self.engine else {})
        self.metrics.engine_stats(lambda: self.engine.stats() if self.engine else {})

    def start(self, engine: Engine, heartbeat: Callable[[], None] | None = None,
              heartbeat_interval: float | None = None) -> float:
        """Recover the journal, attach the loaded engine, open its door, push one request through it.

        Returns the warm-up seconds. Requests a previous run accepted and never answered are dead-lettered first.
        """
        self.journal.recover()
        self.engine, self.aliases = engine, voice_aliases(self.config, engine)
        self.door = Door(engine, gather_s=self.config.batch_timeout, observer=_DoorMetrics(self.metrics),
                         heartbeat=heartbeat, heartbeat_s=heartbeat_interval or 1.0)
        start = time.perf_counter()
        job = Job(engine.segments("Ready."), engine.options(deterministic=True), chunked=False)
        encode(to_audio_segment(collect(self.door.stream(job)), engine.sample_rate), "wav")
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
        """Close the door (jobs not started end with `shutting_down`) and the journal."""
        self.ready.clear()
        if self.door is not None:
            self.door.close()
        self.journal.close()

    def watch_bundle(self, on_moved: Callable[[], None], interval: float = 1.0) -> None:
        """Call `on_moved` once when the configured bundle path comes to name another bundle than the loaded one
        (`cosyedge bundle install` or `rollback` moved the store's `current` pointer); a thread polls it."""
        if not self.config.bundle or self.engine is None:
            return
        pointer, loaded = Path(self.config.bundle), self.engine.bundle.root

        def watch() -> None:
            while self.door is not None and self.door.alive():
                time.sleep(interval)
                target = pointer.resolve()
                if target != loaded and target.is_dir():
                    log.info("bundle pointer %s moved: %s -> %s", pointer.name, loaded.name, target.name)
                    on_moved()
                    return

        threading.Thread(target=watch, name="cosyedge-bundle-watch", daemon=True).start()

    def require_ready(self) -> tuple[Engine, Door]:
        if not self.ready.is_set() or self.engine is None or self.door is None:
            raise NotReady()
        return self.engine, self.door


def current_service() -> Service:
    """The service of the app handling the current request."""
    return current_app.extensions["cosyedge"]
