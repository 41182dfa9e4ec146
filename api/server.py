"""`cosyedge serve`: gunicorn with one gthread worker process, systemd readiness, watchdog and drain.

Why gunicorn (docs/architecture.md): the WebSocket endpoint needs the raw client socket, which waitress never
hands to the app; gunicorn's gthread worker does (simple-websocket takes it from `gunicorn.socket`), with a
bounded thread pool, header limits and a graceful stop. One worker process holds the one engine; the arbiter
(this process, systemd's main PID) only binds the port and watches the worker.

Start-up: the port is bound here first (a refused bind is one line and exit 2, as before); the worker serves
/healthz at once and loads the engine in a thread; READY=1 goes to systemd only after the engine is loaded and
one request has gone through the batch queue. The arbiter never announces readiness itself (NOTIFY_SOCKET is
hidden from it and given back to the worker), so the units say NotifyAccess=all. WATCHDOG=1 pings come from
the engine worker's loop; a hung engine makes systemd restart the service. SIGTERM: the worker stops
accepting and says STOPPING=1, WebSocket sessions end with a `shutting_down` event before their next sentence,
requests under way finish (DRAIN_SECONDS), exit 0. Wyoming beside it (`--wyoming`) drains with it: its
listening socket closes at once, each connection finishes what it holds in flight (a new request:
`shutting_down`), then closes; one still busy after DRAIN_SECONDS - FINAL_DRAIN_SECONDS is cut, what it held
dead-lettered. SIGKILL of the arbiter takes the worker with it (PR_SET_PDEATHSIG), so a killed service leaves no
orphan answering requests or writing the journal.

Bundle updates: when the configured bundle path (the bundle store's `current`) comes to name another bundle, the
worker says RELOADING=1, drains (readiness off; requests under way, Wyoming's included, finish on the old engine
within `request_timeout_s`) and ends; the arbiter starts a fresh worker that loads the new bundle, warms it up
and says READY=1 (docs/deploy.md).
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from gunicorn.app.base import BaseApplication

from cosyedge.api.app import MAX_HEADERS, create_app
from cosyedge.api.cache import state_root
from cosyedge.api.config import ServiceConfig
from cosyedge.api.front import MAX_HEADER_WAITS, FrontWorker, guard_input
from cosyedge.api.sdnotify import notify, watchdog_interval
from cosyedge.api.security import check_bind
from cosyedge.api.service import load_engine
from cosyedge.device.errors import InputError
from cosyedge.device.paths import make_dir

if TYPE_CHECKING:
    from flask import Flask

    from cosyedge.api.service import Service
    from cosyedge.api.wyoming_transport import Listener

log = logging.getLogger("cosyedge.serve")
DRAIN_SECONDS = 10.0  # gunicorn's graceful timeout, below the units' TimeoutStopSec=20
FINAL_DRAIN_SECONDS = 2.0  # then, in the worker: requests still finishing their last bytes
MAX_HEADER_LINE = 8190  # `serve` (gunicorn): the request line, and each header line; 64 of them (MAX_HEADERS)
_PR_SET_PDEATHSIG = 1


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that port 0 and a refused bind are known before gunicorn starts."""
    family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def _die_with_parent() -> None:
    """The worker gets SIGKILL when the arbiter dies (Linux): a kill -9 of the service stops both at once."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: gthread still notices the new parent within a second
        pass
    if os.getppid() == 1:
        os._exit(0)


def peer_closed(sock: socket.socket) -> bool:
    """Whether the client closed its side (or reset it); a peek that never blocks and consumes nothing."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False  # nothing to read: still there
    except OSError:
        return True


def _with_disconnect_probe(wsgi_app: Any) -> Any:
    """The streaming code asks `environ["waitress.client_disconnected"]()` whether its client left (waitress's
    name for it); under gunicorn the same question is answered by peeking at the request's socket."""
    def app(environ: dict[str, Any], start_response: Any) -> Any:
        sock = environ.get("gunicorn.socket")
        if sock is not None:
            environ.setdefault("waitress.client_disconnected", lambda: peer_closed(sock))
        return wsgi_app(environ, start_response)
    return app


def worker_connections(threads: int) -> int:
    """The connections the one worker holds open at most (each a file descriptor): requests in progress and
    kept alive, plus those still sending their headers (`front.MAX_HEADER_WAITS`)."""
    return max(100, threads * 4) + MAX_HEADER_WAITS


def _drained(wyoming: "Future[bool] | None", timeout: float) -> bool:
    """Whether a Wyoming drain (`Listener.drain`, None: no Wyoming) ended with nothing cut, waited for a bounded
    while: the drain cuts what is left at its own timeout, then a moment for the cut connections to close."""
    try:
        return wyoming is None or wyoming.result(timeout + 5)
    except TimeoutError:
        return False


class _Worker(FrontWorker):
    """gthread with the front check (`front.py`: header deadline and cap, JSON error pages), plus: on SIGTERM readiness goes off at once,
    so /readyz says 503 and WebSocket sessions end."""

    service: "Service | None" = None  # set once the app is loaded (post_worker_init)
    wyoming: "Listener | None" = None  # Wyoming beside HTTP, once it listens

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.alive:
            notify("STOPPING=1")
        if self.service is not None:
            self.service.ready.clear()
        if self.wyoming is not None:  # stops accepting now; its syntheses under way finish before the worker exits
            self.wyoming.drain(DRAIN_SECONDS - FINAL_DRAIN_SECONDS)
        super().handle_exit(sig, frame)


class _Gunicorn(BaseApplication):
    """gunicorn configured from `ServiceConfig`; the app (and the engine, later) are made in the worker."""

    def __init__(self, config: ServiceConfig, notify_socket: str | None, interval: float | None,
                 failed_fd: int) -> None:
        self.config, self.notify_socket, self.interval, self.failed_fd = config, notify_socket, interval, failed_fd
        self.workers_started = 0  # counted in the arbiter before each fork: above 1, a worker replaces another
        super().__init__()

    def load_config(self) -> None:
        threads = self.config.http_threads
        settings = {"workers": 1, "worker_class": _Worker, "threads": threads, "worker_connections": worker_connections(threads),
                    "graceful_timeout": int(DRAIN_SECONDS), "timeout": 60, "keepalive": 5, "loglevel": "warning",
                    "accesslog": None, "errorlog": "-", "proc_name": "cosyedge", "limit_request_line": MAX_HEADER_LINE,
                    "limit_request_fields": MAX_HEADERS, "limit_request_field_size": MAX_HEADER_LINE,
                    "pre_fork": self._pre_fork, "post_fork": self._post_fork,
                    "post_worker_init": self._post_worker_init,
                    "worker_exit": self._worker_exit}
        for key, value in settings.items():
            self.cfg.set(key, value)

    def load(self) -> "Flask":
        app = create_app(self.config)
        app.wsgi_app = guard_input(_with_disconnect_probe(app.wsgi_app))  # type: ignore[method-assign]
        return app

    def _pre_fork(self, _arbiter: Any, _worker: Any) -> None:
        self.workers_started += 1

    def _post_fork(self, _arbiter: Any, _worker: Any) -> None:
        _die_with_parent()
        if self.notify_socket:
            os.environ["NOTIFY_SOCKET"] = self.notify_socket

    def _post_worker_init(self, worker: _Worker) -> None:
        worker.service = worker.wsgi.extensions["cosyedge"]
        threading.Thread(target=self._bring_up, args=(worker, worker.service), name="cosyedge-load",
                         daemon=True).start()

    def _bring_up(self, worker: _Worker, service: "Service") -> None:
        """Load the engine, warm it up through its door, then READY=1; a failure stops the whole service."""
        loaded = threading.Event()

        def alive_while_loading() -> None:  # a replacement's load may outlast WatchdogSec (READY=1 came long ago)
            while not loaded.wait(self.interval):
                notify("WATCHDOG=1")

        if self.interval and self.workers_started > 1:  # a first start pings only from READY=1 on
            threading.Thread(target=alive_while_loading, name="cosyedge-load-watchdog", daemon=True).start()
        try:
            engine = load_engine(self.config)
            announced = threading.Event()  # systemd enforces the watchdog from READY=1 on; pings start then
            warm = service.start(engine, heartbeat=(lambda: announced.is_set() and notify("WATCHDOG=1"))
                                 if self.interval else None, heartbeat_interval=self.interval)
            if self.config.wyoming_uri:  # same engine, door, admission and journal as HTTP
                from cosyedge.api.wyoming import start_for_service
                worker.wyoming = start_for_service(service, self.config.wyoming_uri)
            notify(f"READY=1\nSTATUS=ready: {engine.bundle.manifest.name} on port {self.config.effective_port}")
            announced.set()
            loaded.set()
            service.watch_bundle(lambda: self._reload(worker, service))
            log.info("ready: %s (%s), warm-up through the door %.2f s", engine.bundle.manifest.name,
                     engine.precision, warm)
        except Exception as exc:  # noqa: BLE001 - one readable line, then the service exits 1
            loaded.set()
            print(f"cosyedge: error: {exc}", file=sys.stderr, flush=True)
            os.write(self.failed_fd, b"1")
            os.kill(os.getppid(), signal.SIGTERM)

    def _reload(self, worker: _Worker, service: "Service") -> None:
        """A new bundle is current: drain (readiness off, new requests 503 + Retry-After, those under way finish on
        this engine), then this worker ends and the arbiter starts a fresh one, which loads what the pointer names,
        warms it up and says READY=1. The listening socket stays open in the arbiter meanwhile."""
        notify("RELOADING=1\nSTATUS=reloading: a new bundle is current")
        timeout = self.config.request_timeout_s
        wyoming = worker.wyoming.drain(timeout) if worker.wyoming is not None else None  # beside HTTP's, at once
        if not service.drain(timeout) or not _drained(wyoming, timeout):
            log.warning("reloading with requests still under way after %.0f s", timeout)
        worker.alive = False  # gthread's loop ends as on SIGTERM, without STOPPING=1: the service stays up

    def _worker_exit(self, _arbiter: Any, worker: _Worker) -> None:
        """After gthread's graceful wait (DRAIN_SECONDS; the arbiter kills the worker then): the last close hooks,
        then the queue and the journal are closed. A request still open is dead-lettered at the next start."""
        service = worker.service
        if service is None:
            return
        if worker.wyoming is not None and not _drained(worker.wyoming.drain(DRAIN_SECONDS), DRAIN_SECONDS):
            log.warning("stopping with Wyoming syntheses cut after %.0f s", DRAIN_SECONDS)
        if not service.drain(FINAL_DRAIN_SECONDS):
            log.warning("stopping with requests still under way after %.0f s", DRAIN_SECONDS)
        service.stop()
        if worker.booted:  # skip the C++ static destructors (ONNX Runtime aborts in them in a forked child)
            logging.shutdown()
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(0)


def serve(config: ServiceConfig) -> int:
    from gunicorn.arbiter import Arbiter
    from gunicorn.sock import TCP6Socket, TCPSocket
    check_bind(config)  # before anything listens
    make_dir(state_root(config.state_dir), "state directory")  # the worker's journal and voices live there
    try:
        listener = _listen(config.host, config.effective_port)
    except OSError as exc:
        raise InputError(f"cannot listen on {config.host}:{config.effective_port}: {exc.strerror or exc}") from None
    port = listener.getsockname()[1]
    interval = watchdog_interval()
    notify(f"STATUS=loading voice; listening on {config.host}:{port}")
    log.info("listening on http://%s:%s (voice loading)", config.host, port)
    notify_socket = os.environ.pop("NOTIFY_SOCKET", None)  # gunicorn's arbiter would send its own READY=1
    failed_r, failed_w = os.pipe()
    arbiter = Arbiter(_Gunicorn(config, notify_socket, interval, failed_w))
    kind = TCP6Socket if listener.family == socket.AF_INET6 else TCPSocket
    arbiter.LISTENERS = [kind(listener.getsockname(), arbiter.cfg, arbiter.log, fd=os.dup(listener.fileno()))]
    listener.close()
    code: Any = 0
    try:
        arbiter.run()
    except SystemExit as exit_:
        code = exit_.code
    finally:
        if notify_socket:
            os.environ["NOTIFY_SOCKET"] = notify_socket
    os.set_blocking(failed_r, False)
    try:
        failed = bool(os.read(failed_r, 1))
    except BlockingIOError:
        failed = False
    os.close(failed_r), os.close(failed_w)
    return 1 if failed or code not in (0, None) else 0
