"""The Flask application factory: request hooks, error handlers and the route blueprints.

`create_app(config, engine=None)` builds the app; with an engine it is ready at once, otherwise
`app.extensions["cosyedge"].start(engine)` makes it ready once the voice is loaded (the server
does this so /healthz answers while the voice loads). Request threads validate, admit, journal and
encode; only the threads of the engine's door (`device/door.py`) run the engine.
"""
from __future__ import annotations

import logging
import time
import uuid

from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from cosyedge.api import cache
from cosyedge.api.config import ServiceConfig
from cosyedge.api.errors import ApiError
from cosyedge.api.routes import BLUEPRINTS, SYNTHESIS_ENDPOINTS
from cosyedge.api.security import Guard, HostRules
from cosyedge.api.service import Service
from cosyedge.device.engine import Engine
from cosyedge.device.errors import CosyedgeError, InputError

log = logging.getLogger(__name__)

MAX_HEADERS = 64  # header lines per request; real clients send about ten
_HTTP_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
_HTTP_MESSAGES = {404: "no such route; see /openapi.json", 405: "method not allowed on this route",
                  413: "the request body is too large"}


def create_app(config: ServiceConfig, engine: Engine | None = None) -> Flask:
    app = Flask(__name__, static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = max(1 << 20, config.max_batch_items * config.max_text_len * 4 + (64 << 10))
    service = Service(config)
    app.extensions["cosyedge"] = service
    guard = Guard(config.api_key, config.max_streams_per_client, config.log_request_text,
                  HostRules(config.host, config.allowed_hosts))
    app.extensions["cosyedge_guard"] = guard
    app.url_map.merge_slashes = False  # "//etc/x" is a 404, not a redirect to another path
    metrics = service.metrics
    cache.install(app, config.state_dir, config.cache_max_mb, metrics.registry)

    @app.before_request
    def _begin() -> None:
        service.enter()
        g.started = time.perf_counter()
        g.request_id = uuid.uuid4().hex[:16]
        if len(request.headers) > MAX_HEADERS:
            raise ApiError(431, "too_many_headers", f"the request has more than {MAX_HEADERS} header lines")
        # DNS rebinding and cross-site requests, before the key: the WebSocket handshake is a request here too
        guard.hosts.check(request.endpoint, request.method, request.headers.get("Host"),
                          request.headers.get("Origin"), request.headers.get("Upgrade"))
        # the identity is the valid key's (one client) or the peer address, never a header the client made up
        g.client = guard.auth.client(request.endpoint, request.headers.get("Authorization"), request.remote_addr)
        if service.limiter is not None and request.endpoint in SYNTHESIS_ENDPOINTS:
            wait = service.limiter.take(g.client)
            if wait is not None:
                metrics.inc("cosyedge_rate_limited_total")
                raise ApiError(429, "rate_limited", "too many requests from this client; slow down", retry_after=wait)

    @app.after_request
    def _finish(response: Response) -> Response:
        route = request.url_rule.rule if request.url_rule is not None else "unmatched"
        status, started = str(response.status_code), g.get("started", time.perf_counter())
        request_id = g.get("request_id", "")
        response.headers["X-Request-Id"] = request_id
        release_stream = g.pop("stream_release", None)
        text, text_chars = g.get("text"), g.get("text_chars", 0)

        def record() -> None:
            if release_stream is not None:  # the stream ended, or its client left (waitress closed the body)
                release_stream()
            service.leave()
            seconds = time.perf_counter() - started
            metrics.inc("cosyedge_requests_total", route=route, status=status)
            metrics.observe("cosyedge_request_duration_seconds", seconds, route=route)
            guard.slow.observe(route, int(status), seconds, request_id, text, text_chars)
        response.call_on_close(record)  # after the last byte, so streams count their whole length
        return response

    @app.errorhandler(ApiError)
    def _api_error(exc: ApiError) -> Response:
        return exc.response()

    @app.errorhandler(CosyedgeError)
    def _device_error(exc: CosyedgeError) -> Response:
        if not isinstance(exc, InputError):  # the box's fault (bundle, provider), not the client's
            log.error("request %s: %s: %s", g.get("request_id", "?"), type(exc).__name__, exc)
        return ApiError.from_device(exc).response()

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        return ApiError(status, _HTTP_CODES.get(status, "http_error"), _HTTP_MESSAGES.get(status, exc.name)).response()

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Response:
        log.exception("unhandled error in request %s", g.get("request_id", "?"))
        return ApiError(500, "internal_error", f"internal error (request {g.get('request_id', '?')})").response()

    for blueprint in BLUEPRINTS:
        app.register_blueprint(blueprint)
    if engine is not None:
        service.start(engine)
    return app
