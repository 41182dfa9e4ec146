"""Who the client is, whether it may come in, how many streams it holds, and which requests are worth a log line.

- `authenticate`: with an API key configured, every route but /healthz and /readyz needs
  `Authorization: Bearer <key>`, compared in constant time; the answer is the client's identity for the
  rate limiter and the stream bound: one identity for the (single) valid key, else the peer address. A raw
  header the service did not accept never becomes an identity, so rotating it gains nothing.
- `StreamSlots`: at most `max_streams_per_client` simultaneous streamed responses per identity.
- `SlowRequests`: one log line per request slower than the running p95 of its route (a bounded window of
  recent durations); the request text only when `log_request_text` is set.
- `HostRules`: which `Host` a request may name and which `Origin` may change state (DNS rebinding and cross-site
  requests: with the default no-key loopback setup, any web page could otherwise reach the box). A Host must be
  a loopback name (`localhost`, `*.localhost`, a loopback address), an IP address literal (a rebinding attack
  needs a name), the bind host, this machine's name (`<hostname>`, `<hostname>.local`) or one of `allowed_hosts`;
  else 400 `host_not_allowed` (the probes /healthz and /readyz answer any Host). A state-changing request (any
  method but GET, HEAD, OPTIONS) and the WebSocket handshake that sends an `Origin` must come from the service's
  own origin (the control page): a foreign or `null` Origin is 403 `origin_not_allowed`. Clients that are not
  browsers send no Origin and are not concerned.

The key itself is never logged, echoed in an error, or exported as a metric.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import math
import socket
import threading
from collections import deque
from typing import Callable
from urllib.parse import urlsplit

from cosyedge.api.config import ConfigError, ServiceConfig
from cosyedge.api.errors import ApiError

log = logging.getLogger("cosyedge.api.slow")

# no key: the probes of systemd/orchestrators, and the control page's static files (no data in them; the page asks
# for the key and sends it with every API call, as any client does)
PUBLIC_ENDPOINTS = frozenset({"ops.healthz", "ops.readyz", "page.index", "page.script", "page.style"})
REALM = 'Bearer realm="cosyedge"'


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
    """The bind rules, before anything listens or loads: beyond loopback only with an API key (then every route but
    the probes needs it); Wyoming beside the service on loopback only."""
    if config.api_key is None and not is_loopback(config.host):
        raise ConfigError(f"refusing to listen on {config.host}: it is reachable from other machines; configure "
                          f"an API key (api_key, COSYEDGE_API_KEY or COSYEDGE_API_KEY_FILE) or bind 127.0.0.1")
    if config.wyoming_uri is not None:
        check_wyoming_bind(config.wyoming_uri)


def check_wyoming_bind(uri: str) -> None:
    """The Wyoming protocol has no authentication: beside the service, it listens on loopback only."""
    if not is_loopback(urlsplit(uri).hostname or ""):
        raise ConfigError(f"wyoming_uri {uri[:64]!r}: the Wyoming protocol has no authentication, so beside the "
                          "service it listens on loopback only (use `cosyedge wyoming --allow-remote` on a trusted "
                          "network)")


PROBES = frozenset({"ops.healthz", "ops.readyz"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def _host_name(host: str) -> str:
    """`name:port`, `[v6]:port`, `name` -> the name, lower case, without a final dot."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return False
    return True


class HostRules:
    """The Host allow-list and the same-origin rule for state changes (module docstring)."""

    def __init__(self, bind_host: str, allowed_hosts: tuple[str, ...]) -> None:
        machine = socket.gethostname().lower().rstrip(".")
        self.names = frozenset({*LOOPBACK_NAMES, _host_name(bind_host), machine, f"{machine}.local",
                                *allowed_hosts})

    def host_allowed(self, host: str | None) -> bool:
        if not host:  # HTTP/1.0 without Host: not a browser
            return True
        name = _host_name(host)
        return name in self.names or name.endswith(".localhost") or _is_address(name)

    @staticmethod
    def origin_allowed(origin: str | None, host: str | None) -> bool:
        """No Origin (not a browser), or this service's own: scheme http(s) and exactly the request's Host."""
        if origin is None:
            return True
        scheme, _, netloc = origin.strip().partition("://")
        return scheme.lower() in ("http", "https") and bool(host) and netloc.lower() == str(host).strip().lower()

    def check(self, endpoint: str | None, method: str, host: str | None, origin: str | None,
              upgrade: str | None) -> None:
        """Raise the 400 / 403 ApiError a request gets, or return."""
        if endpoint in PROBES:
            return
        if not self.host_allowed(host):
            raise ApiError(400, "host_not_allowed", "this service is not reached under that host name; use "
                                                    "127.0.0.1 or localhost, or add the name to allowed_hosts")
        changes = method.upper() not in SAFE_METHODS or (upgrade or "").lower() == "websocket"
        if changes and not self.origin_allowed(origin, host):
            raise ApiError(403, "origin_not_allowed", "requests from another web site's page are refused; "
                                                      "call the API from this service's own page or a program")


class Unauthorized(ApiError):
    def __init__(self, message: str, invalid: bool = False) -> None:
        challenge = REALM + (', error="invalid_token"' if invalid else "")
        super().__init__(401, "unauthorized", message, headers={"WWW-Authenticate": challenge})


class Authenticator:
    """The configured key (as bytes) and the identity it stands for; without a key, clients are peer addresses."""

    def __init__(self, api_key: str | None) -> None:
        self._key = api_key.encode("ascii") if api_key else None
        # the identity of the one valid key: a short hash, so the key never appears in the limiter's table
        self._identity = "key:" + hashlib.sha256(self._key).hexdigest()[:16] if self._key else None

    @property
    def required(self) -> bool:
        return self._key is not None

    def client(self, endpoint: str | None, authorization: str | None, peer: str | None) -> str:
        """The client's identity; raises `Unauthorized` when a key is configured and not presented."""
        if self._key is None or endpoint in PUBLIC_ENDPOINTS:
            return "addr:" + (peer or "?")
        if not authorization:
            raise Unauthorized("this service needs an API key: send 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.strip().partition(" ")
        # WSGI headers are latin-1 decoded text: encoding back gives the bytes the client sent
        presented = token.strip().encode("latin-1", "replace")
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented, self._key):
            raise Unauthorized("the API key is not valid", invalid=True)
        return self._identity


class TooManyStreams(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(429, "too_many_streams", f"this client already has {limit} streams open; "
                                                  "finish one first", retry_after=1)


class StreamSlots:
    """Open streamed responses per client; the table holds only clients with a stream open, so it stays small."""

    def __init__(self, per_client: int) -> None:
        self.per_client = per_client
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, client: str) -> Callable[[], None]:
        """A slot for `client` (or `TooManyStreams`); the returned function frees it, once, however often called."""
        with self._lock:
            held = self._open.get(client, 0)
            if held >= self.per_client:
                raise TooManyStreams(self.per_client)
            self._open[client] = held + 1
        released = threading.Event()

        def release() -> None:
            if released.is_set():
                return
            released.set()
            with self._lock:
                left = self._open.get(client, 0) - 1
                if left > 0:
                    self._open[client] = left
                else:
                    self._open.pop(client, None)
        return release

    def open(self, client: str | None = None) -> int:
        """Streams open for `client` (all clients when None)."""
        with self._lock:
            return self._open.get(client, 0) if client is not None else sum(self._open.values())


class SlowRequests:
    """Per route, the last `window` durations; a request slower than their p95 gets one log line.

    Until a route has `min_samples` durations there is no p95 to compare with and nothing is logged.
    """

    def __init__(self, window: int = 256, min_samples: int = 20, max_routes: int = 64) -> None:
        self.window, self.min_samples, self.max_routes = window, min_samples, max_routes
        self._durations: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def is_slow(self, route: str, seconds: float) -> bool:
        """Whether `seconds` is above the route's running p95; then records it in the window."""
        with self._lock:
            recent = self._durations.get(route)
            if recent is None:
                if len(self._durations) >= self.max_routes:  # routes come from the app's url map: a fixed set
                    route = "other"
                recent = self._durations.setdefault(route, deque(maxlen=self.window))
            slow = len(recent) >= self.min_samples and seconds > _p95(recent)
            recent.append(seconds)
            return slow

    def observe(self, route: str, status: int, seconds: float, request_id: str, text: str | None,
                text_chars: int) -> None:
        if not self.is_slow(route, seconds):
            return
        if text is None:
            log.info("slow request %s: %s -> %d in %.3f s, %d characters of text", request_id, route, status,
                     seconds, text_chars)
        else:
            log.info("slow request %s: %s -> %d in %.3f s, %d characters of text: %r", request_id, route, status,
                     seconds, text_chars, text)


def _p95(values: deque[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


class Guard:
    """The app's gatekeeping state: the key check, the stream slots, the slow-request log."""

    def __init__(self, api_key: str | None, max_streams_per_client: int, log_request_text: bool,
                 hosts: HostRules | None = None) -> None:
        self.hosts = hosts or HostRules("127.0.0.1", ())
        self.auth = Authenticator(api_key)
        self.streams = StreamSlots(max_streams_per_client)
        self.slow = SlowRequests()
        self.log_request_text = log_request_text


def current_guard() -> Guard:
    from flask import current_app
    return current_app.extensions["cosyedge_guard"]


def hold_stream() -> None:
    """Take one of this client's stream slots for the current request; the app frees it when the response closes."""
    from flask import g
    g.stream_release = current_guard().streams.acquire(g.client)


def note_text(text: object) -> None:
    """Remember the request's text (for the slow-request line: its length, and itself only if configured)."""
    from flask import g
    texts = text if isinstance(text, list) else [text]
    strings = [t for t in texts if isinstance(t, str)]
    g.text_chars = sum(len(t) for t in strings)
    g.text = "\n".join(strings) if current_guard().log_request_text else None
