"""The Flask application: OpenAI-compatible and native TTS routes in front of the batch queue.

`create_app(config, engine=None)` builds the app; with an engine it is ready at once, otherwise
`app.extensions["cosyedge"].start(engine)` makes it ready once the voice is loaded (the server
does this so /healthz answers while the voice loads). Request threads validate, queue and
encode; only the batch queue's worker thread runs the engine.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import math
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from flask import Flask, Response, g, jsonify, request
from werkzeug.exceptions import HTTPException

from cosyedge.api.batcher import SynthesisQueue, SynthesisError
from cosyedge.api.config import OPENAI_MODELS, OPENAI_VOICES, ConfigError, ServiceConfig
from cosyedge.api.errors import ApiError, NotReady
from cosyedge.api.metrics import Metrics
from cosyedge.api.openapi import spec
from cosyedge.api.ratelimit import RateLimiter
from cosyedge.api.streaming import audio_stream
from cosyedge.device.audio import FORMATS, MIME, encode, to_audio_segment
from cosyedge.device.engine import Engine
from cosyedge.device.errors import InputError, UnknownVoiceError
from cosyedge.device.options import SPEED_RANGE, Segment, SynthesisOptions

log = logging.getLogger(__name__)

DEAD_LETTER = "api_dead_letter.jsonl"
SYNTH_ENDPOINTS = {"speech", "tts", "tts_batch"}


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
        for key in engine.stats():  # CosyVoice's cross-request LLM batching: decode_steps, decode_rows_mean, ...
            self.metrics.gauge(f"cosyedge_{key}", lambda key=key: float(engine.stats()[key]))
        self.batcher = SynthesisQueue(engine, self.metrics, self.config.queue_size, self.config.batch_max,
                                  self.config.batch_timeout, heartbeat, heartbeat_interval)
        self.batcher.start()
        start = time.perf_counter()
        request_ = engine.options(deterministic=True)
        future = self.batcher.submit([(engine.segments("Ready."), request_)], time.monotonic() + 600)[0]
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
        if self.config.state_dir:
            return Path(self.config.state_dir) / DEAD_LETTER
        from cosyedge.device.paths import state_dir
        return state_dir() / DEAD_LETTER


# -- request parsing -------------------------------------------------------------------------------
def _json_body() -> dict[str, Any]:
    if request.mimetype != "application/json":
        raise ApiError(415, "unsupported_media_type", "send the request body as JSON with Content-Type: application/json")
    raw = request.get_data(cache=False)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "invalid_utf8", "the request body is not valid UTF-8") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError(400, "invalid_json", f"the request body is not valid JSON ({exc.msg} at line {exc.lineno} "
                                            f"column {exc.colno})") from None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_json", "the request body must be a JSON object")
    return body


def _text(value: Any, field: str, limit: int) -> str:
    if not isinstance(value, str):
        raise ApiError(400, "invalid_parameter", f"{field} must be a string")
    if not value.strip():
        raise ApiError(400, "empty_text", f"{field} is empty")
    if len(value) > limit:
        raise ApiError(413, "text_too_long", f"{field} has {len(value)} characters; the limit is {limit}: "
                                             "split it into several requests")
    return value


def _format(value: Any, default: str) -> str:
    if value is None:
        return default
    if not isinstance(value, str) or value.lower() not in FORMATS:
        raise ApiError(400, "unknown_format", f"unknown audio format {str(value)[:32]!r}; choose one of {', '.join(FORMATS)}")
    return value.lower()


def _speed(value: Any) -> float:
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, "invalid_parameter", "speed must be a number")
    if not (math.isfinite(value) and SPEED_RANGE[0] <= value <= SPEED_RANGE[1]):
        raise ApiError(400, "speed_out_of_range", f"speed must be between {SPEED_RANGE[0]} and {SPEED_RANGE[1]}")
    return float(value)


def _bool(value: Any, field: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, "invalid_parameter", f"{field} must be true or false")
    return value


def _optional_str(value: Any, field: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ApiError(400, "invalid_parameter", f"{field} must be a string")
    return value or None


def _engine_request(engine: Engine, voice: str | int | None, speed: float, deterministic: bool = False,
                    seed: Any = None, body: dict[str, Any] | None = None) -> SynthesisOptions:
    """Validated per-request options; `body` may add the CosyVoice fields mode, instruct_text and sampling."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, "invalid_parameter", "seed must be an integer")
    body = body or {}
    extra = {"mode": _optional_str(body.get("mode"), "mode"),
             "instruct_text": _optional_str(body.get("instruct_text"), "instruct_text"),
             "sampling": _optional_str(body.get("sampling"), "sampling") or "default"}
    try:
        return engine.options(voice=voice, speed=speed, deterministic=deterministic, seed=seed, **extra)
    except UnknownVoiceError as exc:
        raise ApiError(400, "unknown_voice", str(exc)) from None
    except InputError as exc:
        raise ApiError(400, "invalid_parameter", str(exc)) from None


def _segments(engine: Engine, text: str) -> list[Segment]:
    try:
        return engine.segments(text)
    except InputError as exc:
        raise ApiError(400, "empty_text", str(exc)) from None


def _client_key() -> str:
    """Bearer token (hashed) when given, else the peer address: on localhost every peer is 127.0.0.1."""
    auth = request.headers.get("Authorization")
    if auth:
        return "key:" + hashlib.sha256(auth.encode("utf-8", "replace")).hexdigest()[:16]
    return "addr:" + (request.remote_addr or "?")


MAX_VOICE_UPLOAD = 16 << 20  # bytes: 30 s of 48 kHz stereo 16-bit WAV is 11 MB


# -- the application -------------------------------------------------------------------------------
def create_app(config: ServiceConfig, engine: Engine | None = None) -> Flask:
    app = Flask(__name__, static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = max(1 << 20, config.max_batch_items * config.max_text_len * 4 + (64 << 10))
    service = Service(config)
    app.extensions["cosyedge"] = service
    metrics = service.metrics

    # -- cross-cutting: request id, metrics, rate limit, errors ----------------------------------
    @app.before_request
    def _begin() -> None:
        service.enter()
        g.started = time.perf_counter()
        g.request_id = uuid.uuid4().hex[:16]
        if service.limiter is not None and request.endpoint in SYNTH_ENDPOINTS:
            wait = service.limiter.take(_client_key())
            if wait is not None:
                metrics.inc("cosyedge_rate_limited_total")
                raise ApiError(429, "rate_limited", "too many requests from this client; slow down", retry_after=wait)

    @app.after_request
    def _finish(response: Response) -> Response:
        route = request.url_rule.rule if request.url_rule is not None else "unmatched"
        status, started = str(response.status_code), g.get("started", time.perf_counter())
        response.headers["X-Request-Id"] = g.get("request_id", "")

        def record() -> None:
            service.leave()
            metrics.inc("cosyedge_requests_total", route=route, status=status)
            metrics.observe("cosyedge_request_duration_seconds", time.perf_counter() - started, route=route)
        response.call_on_close(record)  # after the last byte, so streams count their whole length
        return response

    @app.errorhandler(ApiError)
    def _api_error(exc: ApiError) -> Response:
        return exc.response()

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Response:
        codes = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
        messages = {404: "no such route; see /openapi.json", 405: "method not allowed on this route",
                    413: "the request body is too large"}
        status = exc.code or 500
        return ApiError(status, codes.get(status, "http_error"), messages.get(status, exc.name)).response()

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Response:
        log.exception("unhandled error in request %s", g.get("request_id", "?"))
        return ApiError(500, "internal_error", f"internal error (request {g.get('request_id', '?')})").response()

    # -- synthesis -------------------------------------------------------------------------------
    def synthesize(route: str, text: str, req: SynthesisOptions, fmt: str, stream: bool) -> Response:
        engine, batcher = service.require_ready()
        segments = _segments(engine, text)
        request_id = g.request_id
        payload = {"text": text, "voice": req.voice, "speed": req.speed, "format": fmt, "stream": stream}

        def failed(exc: SynthesisError) -> None:
            service.dead_letter(route, request_id, payload, exc)

        deadline = time.monotonic() + config.request_timeout_s
        first_segments = segments[:1] if stream else segments
        future = batcher.submit([(first_segments, req)], deadline)[0]
        try:
            wave = batcher.wait(future, deadline)
        except SynthesisError as exc:
            failed(exc)
            raise ApiError(500, "synthesis_failed", f"synthesis failed; recorded as request {request_id}") from None
        rate = engine.sample_rate
        headers = {"X-Sample-Rate": str(rate), "Cache-Control": "no-store"}
        mimetype = f"audio/L16; rate={rate}; channels=1" if fmt == "pcm" else MIME[fmt]
        if stream:
            disconnected = request.environ.get("waitress.client_disconnected", lambda: False)
            body = audio_stream(batcher, metrics, segments, req, fmt, rate, wave, config.request_timeout_s,
                                disconnected, failed)
            # no direct_passthrough: werkzeug's closing wrapper runs call_on_close (metrics) after the stream
            return Response(body, headers={**headers, "X-Accel-Buffering": "no"}, content_type=mimetype)
        try:
            audio = encode(to_audio_segment(wave, rate), fmt)
        except Exception as exc:  # noqa: BLE001 - ffmpeg failures are the server's, not the client's
            failed(SynthesisError(f"encode {fmt}: {type(exc).__name__}: {exc}"))
            raise ApiError(500, "encoding_failed", f"encoding to {fmt} failed; recorded as request {request_id}") from None
        headers["X-Audio-Seconds"] = f"{len(wave) / rate:.3f}"
        return Response(audio, headers=headers, content_type=mimetype)

    @app.post("/v1/audio/speech", endpoint="speech")
    def speech() -> Response:
        body = _json_body()
        engine, _ = service.require_ready()
        model = body.get("model", "tts-1")
        if not isinstance(model, str) or model not in (*OPENAI_MODELS, engine.bundle.manifest.name):
            raise ApiError(400, "unknown_model", f"unknown model {str(model)[:64]!r}; see /v1/models")
        voice = body.get("voice")
        if isinstance(voice, dict):  # newer SDKs may send {"id": "..."}
            voice = voice.get("id")
        if voice is not None and not isinstance(voice, str):
            raise ApiError(400, "unknown_voice", "voice must be a name")
        if body.get("stream_format") not in (None, "audio"):
            raise ApiError(400, "invalid_parameter", "only stream_format 'audio' is supported")
        if body.get("instructions") is not None and not isinstance(body["instructions"], str):
            raise ApiError(400, "invalid_parameter", "instructions must be a string")
        text = _text(body.get("input"), "input", config.max_text_len)
        fmt = _format(body.get("response_format"), "mp3")
        # OpenAI's `instructions` ("speak cheerfully") is CosyVoice's instruct2 text; Piper voices ignore it.
        instructions = body.get("instructions") if engine.bundle.manifest.family != "vits" else None
        req = _engine_request(engine, service.aliases.get(voice, voice) if voice else None, _speed(body.get("speed")),
                              body={"instruct_text": instructions})
        return synthesize("/v1/audio/speech", text, req, fmt, _bool(body.get("stream"), "stream"))

    def native_voice(body: dict[str, Any]) -> str | int | None:
        voice, speaker = body.get("voice"), body.get("speaker_id")
        if voice is not None and speaker is not None:
            raise ApiError(400, "invalid_parameter", "give voice or speaker_id, not both")
        if speaker is not None:
            if isinstance(speaker, bool) or not isinstance(speaker, int) or speaker < 0:
                raise ApiError(400, "unknown_voice", "speaker_id must be a non-negative integer")
            return speaker
        if voice is not None and not isinstance(voice, str):
            raise ApiError(400, "unknown_voice", "voice must be a name")
        return service.aliases.get(voice, voice) if voice else None

    @app.post("/v1/tts", endpoint="tts")
    def tts() -> Response:
        body = _json_body()
        engine, _ = service.require_ready()
        text = _text(body.get("text"), "text", config.max_text_len)
        fmt = _format(body.get("format"), "wav")
        req = _engine_request(engine, native_voice(body), _speed(body.get("speed")),
                              _bool(body.get("deterministic"), "deterministic"), body.get("seed"), body)
        return synthesize("/v1/tts", text, req, fmt, _bool(body.get("stream"), "stream"))

    @app.post("/v1/tts/batch", endpoint="tts_batch")
    def tts_batch() -> Response:
        body = _json_body()
        engine, batcher = service.require_ready()
        texts = body.get("texts")
        if not isinstance(texts, list) or not texts:
            raise ApiError(400, "invalid_parameter", "texts must be a non-empty list of strings")
        if len(texts) > config.max_batch_items:
            raise ApiError(413, "too_many_items", f"{len(texts)} texts; the limit is {config.max_batch_items} per request")
        fmt = _format(body.get("format"), "wav")
        req = _engine_request(engine, native_voice(body), _speed(body.get("speed")),
                              _bool(body.get("deterministic"), "deterministic"), body.get("seed"), body)
        results: list[dict[str, Any]] = [{} for _ in texts]
        jobs: list[tuple[int, list[Segment]]] = []
        for index, text in enumerate(texts):
            try:
                jobs.append((index, _segments(engine, _text(text, f"texts[{index}]", config.max_text_len))))
            except ApiError as exc:
                results[index] = {"index": index, "ok": False, "status": exc.status, **exc.body()}
        deadline = time.monotonic() + config.request_timeout_s
        futures = batcher.submit([(segments, req) for _, segments in jobs], deadline) if jobs else []
        for (index, _), future in zip(jobs, futures):
            try:
                wave = batcher.wait(future, deadline)
                audio = encode(to_audio_segment(wave, engine.sample_rate), fmt)
            except ApiError as exc:
                results[index] = {"index": index, "ok": False, "status": exc.status, **exc.body()}
                continue
            except Exception as exc:  # noqa: BLE001 - synthesis or encoding failed for this item only
                error = exc if isinstance(exc, SynthesisError) else SynthesisError(f"encode: {type(exc).__name__}: {exc}")
                service.dead_letter("/v1/tts/batch", g.request_id, {"index": index, "text": texts[index],
                                    "voice": req.voice, "speed": req.speed, "format": fmt}, error)
                failure = ApiError(500, "synthesis_failed", f"synthesis failed; recorded as request {g.request_id}")
                results[index] = {"index": index, "ok": False, "status": 500, **failure.body()}
                continue
            results[index] = {"index": index, "ok": True, "audio": base64.b64encode(audio).decode("ascii"),
                              "audio_seconds": round(len(wave) / engine.sample_rate, 3)}
        return jsonify({"object": "list", "format": fmt, "sample_rate": engine.sample_rate,
                        "succeeded": sum(1 for r in results if r["ok"]), "results": results})

    # -- discovery and operations ------------------------------------------------------------------
    @app.get("/v1/audio/voices")
    def voices() -> Response:
        engine, _ = service.require_ready()
        catalog = engine.voice_catalog()
        return jsonify({"object": "list", "default": catalog[0]["name"], "aliases": service.aliases,
                        "voices": [{"id": v["name"], **v} for v in catalog]})

    @app.post("/v1/audio/voices")
    def add_voice() -> Response:
        """Register a zero-shot voice: multipart form with `name`, `text` (the transcript) and file `audio`."""
        engine, _ = service.require_ready()
        request.max_content_length = MAX_VOICE_UPLOAD  # a 30 s prompt is larger than any JSON body
        if request.mimetype != "multipart/form-data":
            raise ApiError(415, "unsupported_media_type", "send multipart/form-data with fields name, text and file audio")
        upload = request.files.get("audio")
        if upload is None:
            raise ApiError(400, "missing_audio", "the form needs a file field 'audio' (1-30 s of the speaker)")
        name = request.form.get("name", "")
        try:
            engine.add_voice(name, upload.read(), request.form.get("text", ""))
        except InputError as exc:
            status, code = (409, "voice_exists") if "already exists" in str(exc) else (400, "invalid_voice")
            raise ApiError(status, code, str(exc)) from None
        entry = next(v for v in engine.voice_catalog() if v["name"] == name)
        return jsonify({"id": name, **entry}), 201

    @app.delete("/v1/audio/voices/<name>")
    def remove_voice(name: str) -> Response:
        engine, _ = service.require_ready()
        try:
            engine.remove_voice(name)
        except InputError as exc:
            status = 404 if "not a registered voice" in str(exc) else 400
            raise ApiError(status, "not_found" if status == 404 else "invalid_voice", str(exc)) from None
        return jsonify({"id": name, "deleted": True})

    @app.get("/v1/models")
    def models() -> Response:
        ids = list(OPENAI_MODELS)
        if service.engine is not None:
            ids.append(service.engine.bundle.manifest.name)
        return jsonify({"object": "list", "data": [{"id": i, "object": "model", "created": 0, "owned_by": "cosyedge"}
                                                   for i in ids]})

    @app.get("/healthz")
    def healthz() -> Response:
        if service.batcher is not None and not service.batcher.alive():
            raise ApiError(500, "worker_stopped", "the engine worker has stopped; restart the service")
        return jsonify({"status": "ok"})

    @app.get("/readyz")
    def readyz() -> Response:
        service.require_ready()
        return jsonify({"status": "ready", "queue_depth": service.batcher.depth() if service.batcher else 0})

    @app.get("/metrics")
    def metrics_route() -> Response:
        return Response(metrics.synthesize(), content_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/openapi.json")
    def openapi() -> Response:
        return jsonify(spec(config))

    if engine is not None:
        service.start(engine)
    return app
