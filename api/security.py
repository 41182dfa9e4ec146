"""Who the client is, whether it may come in, how many streams it holds, and which requests are worth a log line.

- `authenticate`: with an API key configured, every route but /healthz and /readyz needs
  `Authorization: Bearer <key>`, compared in constant time; the answer is the client's identity for the
  rate limiter and the stream bound: one identity for the (single) valid key, else the peer address. A raw
  header the service did not accept never becomes an identity, so rotating it gains nothing.
- `StreamSlots`: at most `max_streams_per_client` simultaneous streamed responses per identity.
- `SlowRequests`: one log line per request slower than the running p95 of its route (a bounded window of
  recent durations); the request text only when `log_request_text` is set.

The key itself is never logged, echoed in an error, or exported as a metric.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import math
import threading
from collections import deque
from typing import Callable

from cosyedge.api.errors import ApiError

log = logging.getLogger("cosyedge.api.slow")

# no key: the probes of systemd/orchestrators, and the control page's static files (no data in them; the page asks
# for the key and sends it with every API call, as any client does)
PUBLIC_ENDPOINTS = frozenset({"ops.healthz", "ops.readyz", "page.index", "page.script", "page.style"})
REALM = 'Bearer realm="cosyedge"'


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

    def __init__(self, api_key: str | None, max_streams_per_client: int, log_request_text: bool) -> None:
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
