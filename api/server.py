"""`cosyedge serve`: waitress (threads) in one process, systemd readiness and watchdog.

The HTTP server starts first so /healthz answers while the voice loads; READY=1 goes to systemd
only after the engine is loaded and one request has gone through the batch queue. WATCHDOG=1
pings come from the engine worker's loop, so a hung engine makes systemd restart the service.
"""
from __future__ import annotations

import ipaddress
import logging
import signal
import socket
import sys
import threading
from typing import TYPE_CHECKING, Any

from cosyedge.api.app import create_app
from cosyedge.api.config import ConfigError, ServiceConfig
from cosyedge.api.sdnotify import notify, watchdog_interval
from cosyedge.device.errors import InputError

if TYPE_CHECKING:
    from cosyedge.device.engine import Engine

log = logging.getLogger("cosyedge.serve")
DRAIN_SECONDS = 10.0  # below the units' TimeoutStopSec=20


class _Stop(Exception):
    """Raised in the main thread by SIGTERM/SIGINT."""


MAX_HEADER_BYTES = 32 << 10  # the request line and headers together; the app also bounds the header count


def make_server(app: Any, host: str, port: int, threads: int):
    """A waitress server; `channel_request_lookahead` keeps reading so a client that leaves is noticed."""
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


def serve(config: ServiceConfig) -> int:
    check_bind(config)  # before anything listens
    app = create_app(config)
    service = app.extensions["cosyedge"]
    try:
        server = make_server(app, config.host, config.effective_port, config.http_threads)
    except OSError as exc:
        raise InputError(f"cannot listen on {config.host}:{config.effective_port}: {exc.strerror or exc}") from None
    port = server.effective_port
    log.info("listening on http://%s:%s (voice loading)", config.host, port)

    def stop(signum: int, _frame: Any) -> None:
        raise _Stop(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    threading.Thread(target=server.run, name="cosyedge-http", daemon=True).start()
    try:
        notify(f"STATUS=loading voice; listening on {config.host}:{port}")
        engine = load_engine(config)
        interval = watchdog_interval()
        announced = threading.Event()  # systemd enforces the watchdog from READY=1 on; pings start then
        warm = service.start(engine, heartbeat=(lambda: announced.is_set() and notify("WATCHDOG=1"))
                             if interval else None, heartbeat_interval=interval)
        if config.wyoming_uri:  # same engine and queue as HTTP
            from cosyedge.api.wyoming import start_for_service
            start_for_service(service, config.wyoming_uri)
        notify(f"READY=1\nSTATUS=ready: {engine.bundle.manifest.name} on {config.host}:{port}")
        announced.set()
        log.info("ready: %s (%s), warm-up through the queue %.2f s", engine.bundle.manifest.name, engine.precision, warm)
        threading.Event().wait()
    except _Stop as why:
        log.info("stopping (%s)", why)
        return 0
    except Exception as exc:  # noqa: BLE001 - one readable line, then systemd restarts us
        print(f"cosyedge: error: {exc}", file=sys.stderr)
        return 1
    finally:
        notify("STOPPING=1")
        if not service.drain(DRAIN_SECONDS):
            log.warning("stopping with requests still under way after %.0f s", DRAIN_SECONDS)
        service.stop()
        server.close()
    return 0
