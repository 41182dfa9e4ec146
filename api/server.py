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
requests under way finish (DRAIN_SECONDS), exit 0. SIGKILL of the arbiter takes the worker with it (PR_SET_PDEATHSIG), so a killed service
leaves no orphan answering requests or writing the journal.
"""
from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
from typing import TYPE_CHECKING, Any

from gunicorn.app.base import BaseApplication
from gunicorn.workers.gthread import ThreadWorker

from cosyedge.api.app import MAX_HEADERS, create_app
from cosyedge.api.config import ConfigError, ServiceConfig
from cosyedge.api.sdnotify import notify, watchdog_interval
from cosyedge.device.errors import InputError

if TYPE_CHECKING:
    from flask import Flask

    from cosyedge.api.service import Service
    from cosyedge.device.engine import Engine

log = logging.getLogger("cosyedge.serve")
DRAIN_SECONDS = 10.0  # gunicorn's graceful timeout, below the units' TimeoutStopSec=20
FINAL_DRAIN_SECONDS = 2.0  # then, in the worker: requests still finishing their last bytes
MAX_HEADER_BYTES = 32 << 10  # the in-process server: the request line and headers together
MAX_HEADER_LINE = 8190  # `serve` (gunicorn): the request line, and each header line; 64 of them (MAX_HEADERS)
_PR_SET_PDEATHSIG = 1


def make_server(app: Any, host: str, port: int, threads: int):
    """An in-process waitress server in a thread, for the tests and `bench-api`'s in-process service.

    gunicorn's arbiter forks and owns the process's signals, so it cannot run inside a test process; the
    HTTP routes behave the same on both. WebSocket needs `cosyedge serve` (gunicorn).
    """
    from waitress import create_server
    return create_server(app, host=host, port=port, threads=threads, channel_request_lookahead=1,
                         ident="cosyedge", asyncore_use_poll=True, connection_limit=max(100, threads * 4),
                         max_request_header_size=MAX_HEADER_BYTES)


def load_engine(config: ServiceConfig) -> "Engine":
    """The engine the configuration names: bundle, precision or build target, batch limits, state directory.

    Start-up checks: the bundle's files are hashed against its manifest, and every registered voice must load
    (`strict_voices`): a service never becomes ready with a corrupted bundle or a voice silently missing.
    """
    from cosyedge.device import BatchLimits, Engine
    limits = BatchLimits(max_text_len=config.max_text_len, batch_max=config.batch_max, timeout=config.batch_timeout)
    return Engine.load(config.bundle, precision=config.precision, target=config.target, limits=limits,
                       state_dir=config.state_dir, strict_voices=True)


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback address (a name that does not resolve: no)."""
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0]).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%", 1)[0]).is_loopback for info in infos)


def check_bind(config: ServiceConfig) -> None:
    """The bind rule: beyond loopback only with an API key (then every route but the probes needs it)."""
    if config.api_key is None and not is_loopback(config.host):
        raise ConfigError(f"refusing to listen on {config.host}: it is reachable from other machines; configure "
                          f"an API key (api_key, COSYEDGE_API_KEY or COSYEDGE_API_KEY_FILE) or bind 127.0.0.1")


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


class _Worker(ThreadWorker):
    """gthread, plus: on SIGTERM readiness goes off at once, so /readyz says 503 and WebSocket sessions end."""

    service: "Service | None" = None  # set once the app is loaded (post_worker_init)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.alive:
            notify("STOPPING=1")
        if self.service is not None:
            self.service.ready.clear()
        super().handle_exit(sig, frame)


class _Gunicorn(BaseApplication):
    """gunicorn configured from `ServiceConfig`; the app (and the engine, later) are made in the worker."""

    def __init__(self, config: ServiceConfig, notify_socket: str | None, interval: float | None,
                 failed_fd: int) -> None:
        self.config, self.notify_socket, self.interval, self.failed_fd = config, notify_socket, interval, failed_fd
        super().__init__()

    def load_config(self) -> None:
        threads = self.config.http_threads
        settings = {"workers": 1, "worker_class": _Worker, "threads": threads, "worker_connections": max(100, threads * 4),
                    "graceful_timeout": int(DRAIN_SECONDS), "timeout": 60, "keepalive": 5, "loglevel": "warning",
                    "accesslog": None, "errorlog": "-", "proc_name": "cosyedge", "limit_request_line": MAX_HEADER_LINE,
                    "limit_request_fields": MAX_HEADERS, "limit_request_field_size": MAX_HEADER_LINE,
                    "post_fork": self._post_fork, "post_worker_init": self._post_worker_init,
                    "worker_exit": self._worker_exit}
        for key, value in settings.items():
            self.cfg.set(key, value)

    def load(self) -> "Flask":
        app = create_app(self.config)
        app.wsgi_app = _with_disconnect_probe(app.wsgi_app)  # type: ignore[method-assign]
        return app

    def _post_fork(self, _arbiter: Any, _worker: Any) -> None:
        _die_with_parent()
        if self.notify_socket:
            os.environ["NOTIFY_SOCKET"] = self.notify_socket

    def _post_worker_init(self, worker: _Worker) -> None:
        worker.service = worker.wsgi.extensions["cosyedge"]
        threading.Thread(target=self._bring_up, args=(worker.service,), name="cosyedge-load", daemon=True).start()

    def _bring_up(self, service: "Service") -> None:
        """Load the engine, warm it up through the queue, then READY=1; a failure stops the whole service."""
        try:
            engine = load_engine(self.config)
            announced = threading.Event()  # systemd enforces the watchdog from READY=1 on; pings start then
            warm = service.start(engine, heartbeat=(lambda: announced.is_set() and notify("WATCHDOG=1"))
                                 if self.interval else None, heartbeat_interval=self.interval)
            if self.config.wyoming_uri:  # same engine and queue as HTTP
                from cosyedge.api.wyoming import start_for_service
                start_for_service(service, self.config.wyoming_uri)
            notify(f"READY=1\nSTATUS=ready: {engine.bundle.manifest.name} on port {self.config.effective_port}")
            announced.set()
            log.info("ready: %s (%s), warm-up through the queue %.2f s", engine.bundle.manifest.name,
                     engine.precision, warm)
        except Exception as exc:  # noqa: BLE001 - one readable line, then the service exits 1
            print(f"cosyedge: error: {exc}", file=sys.stderr, flush=True)
            os.write(self.failed_fd, b"1")
            os.kill(os.getppid(), signal.SIGTERM)

    def _worker_exit(self, _arbiter: Any, worker: _Worker) -> None:
        """After gthread's graceful wait (DRAIN_SECONDS; the arbiter kills the worker then): the last close hooks,
        then the queue and the journal are closed. A request still open is dead-lettered at the next start."""
        service = worker.service
        if service is None:
            return
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
