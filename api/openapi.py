"""The OpenAPI 3.1 description served at /openapi.json; a test keeps it equal to the app's routes.

The synthesis bodies are generated from the request declaration (`cosyedge.device.request.FIELDS`): each
route's properties are its door's fields under its door's names, and no other property is accepted."""
from __future__ import annotations

from typing import Any

from cosyedge.api.config import OPENAI_VOICES, ServiceConfig
from cosyedge.device import request as declaration

_ERROR = {"$ref": "#/components/schemas/Error"}


def _errors(*statuses: int) -> dict[str, Any]:
    text = {400: "invalid JSON (also nested too deep or a number too long), an unknown field, a parameter, voice, "
                 "format, speed, sample rate or empty text", 404: "unknown route or voice",
            413: "text longer than max_text_len, too many batch items, or body too large",
            401: "API key missing or wrong (only when the service has one; WWW-Authenticate: Bearer)",
            415: "Content-Type is not application/json",
            429: "per-client rate limit, or too many streams open for this client (Retry-After)",
            426: "not a WebSocket handshake (Upgrade: websocket missing)", 431: "too many header lines",
            501: "the server in use cannot upgrade to WebSocket (the in-process test server)",
            500: "synthesis failed (recorded in the dead-letter file)",
            503: "queue full or voice still loading (Retry-After)", 504: "deadline passed before work started"}
    return {str(s): {"description": text[s], "content": {"application/json": {"schema": _ERROR}}} for s in statuses}


_TIMED_ITEM = {"type": "object", "required": ["text", "start_s", "end_s"],
               "properties": {"text": {"type": "string"}, "start_s": {"type": "number"}, "end_s": {"type": "number"}}}
_TIMED = {"type": "object", "required": ["format", "sample_rate", "audio_seconds", "audio", "words", "segments"],
          "properties": {"format": {"type": "string"}, "sample_rate": {"type": "integer"},
                         "audio_seconds": {"type": "number"}, "audio": {"type": "string", "contentEncoding": "base64"},
                         "words": {"type": "array", "items": _TIMED_ITEM},
                         "segments": {"type": "array", "items": _TIMED_ITEM}}}
_AUDIO = {"description": "audio; X-Sample-Rate gives the rate (pcm is 16-bit mono little-endian). With stream=true "
                         "the body is chunked, sentence by sentence (wav: unknown-length header, then pcm16). With "
                         "timestamps=true: JSON, the audio (base64) with its words and segments (with stream: "
                         "NDJSON lines of audio and words); with subtitles: the WebVTT or SRT file alone",
          "headers": {"X-Sample-Rate": {"schema": {"type": "integer"}},
                      "X-Cosyedge-Cache": {"schema": {"enum": ["hit", "miss"]}, "description": "served from the phrase cache"}},
          "content": {"audio/mpeg": {}, "audio/wav": {}, "audio/ogg": {}, "audio/flac": {}, "audio/aac": {},
                      "audio/L16": {}, "application/json": {"schema": _TIMED}, "application/x-ndjson": {},
                      "text/vtt": {}, "application/x-subrip": {}}}
_SYNTH_ERRORS = (400, 401, 413, 415, 429, 431, 500, 503, 504)
PUBLIC_PATHS = ("/healthz", "/readyz", "/", "/page.js", "/page.css")  # probes and the page's static files: no key


def _property(field: declaration.Field, door: str, config: ServiceConfig) -> dict[str, Any]:
    """One field's JSON Schema on one door."""
    schema: dict[str, Any] = {"description": field.doc}
    if field.kind in ("text", "string", "voice"):
        schema["type"] = "string"
    elif field.kind == "choice":
        schema["enum"] = list(field.choices)
    else:
        schema["type"] = field.kind
    if field.bounds is not None:
        schema["minimum"], schema["maximum"] = field.bounds
    if field.kind == "text":
        schema.update(minLength=1, maxLength=config.max_text_len)
    if field.name == "model":
        schema["examples"] = list(declaration.OPENAI_MODELS)
    if field.name == "voice" and door == declaration.SPEECH:
        schema["examples"] = list(OPENAI_VOICES)
    default = field.default_for(door)
    if default is not None:
        schema["default"] = default
    return schema


def _body(door: str, config: ServiceConfig, **extra: dict[str, Any]) -> dict[str, Any]:
    """A synthesis route's request body: its door's fields (`extra`: the route's own, such as batch texts)."""
    properties = {field.wire_name(door): _property(field, door, config) for field in declaration.fields(door)}
    properties.update(extra)
    required = [declaration.BY_NAME["text"].wire_name(door)] if door != declaration.BATCH else list(extra)
    return {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "required": required, "properties": properties, "additionalProperties": False}}}}


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def spec(config: ServiceConfig) -> dict[str, Any]:
    texts = {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": config.max_batch_items}
    document = {
        "openapi": "3.1.0",
        "info": {"title": "cosyedge", "version": "1", "description": "Offline text-to-speech on localhost"},
        "paths": {
            "/v1/audio/speech": {"post": {
                "summary": "OpenAI-compatible speech; the extension fields (seed, deterministic, sampling, preset, "
                           "mode, ...) as the OpenAI SDK sends them in extra_body",
                "requestBody": _body(declaration.SPEECH, config),
                "responses": {"200": _AUDIO, **_errors(*_SYNTH_ERRORS)}}},
            "/v1/tts": {"post": {
                "summary": "Speak one text",
                "requestBody": _body(declaration.TTS, config),
                "responses": {"200": _AUDIO, **_errors(*_SYNTH_ERRORS)}}},
            "/v1/tts/batch": {"post": {
                "summary": "Speak many texts; each item succeeds or fails on its own",
                "requestBody": _body(declaration.BATCH, config, texts=texts),
                "responses": {"200": _json({"type": "object", "properties": {
                    "format": {"type": "string"}, "sample_rate": {"type": "integer"}, "succeeded": {"type": "integer"},
                    "results": {"type": "array", "items": {"type": "object", "properties": {
                        "index": {"type": "integer"}, "ok": {"type": "boolean"},
                        "audio": {"type": "string", "contentEncoding": "base64"}, "audio_seconds": {"type": "number"},
                        "status": {"type": "integer"}, "error": {"$ref": "#/components/schemas/ErrorBody"}}}}}},
                    "per-item results in input order; a failed item has ok=false, status and error"),
                    **_errors(400, 401, 413, 415, 429, 431, 503)}}},
            "/v1/audio/voices": {
                "get": {"summary": "Voices of the loaded bundle and registered ones (speaker id, kind), and the aliases",
                        "responses": {"200": _json({"type": "object"}), **_errors(401, 503)}},
                "post": {"summary": "Register a zero-shot voice from a 1-30 s recording and its transcript "
                                    "(CosyVoice bundles); kept across restarts",
                         "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
                             "type": "object", "required": ["name", "text", "audio"],
                             "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"},
                                            "text": {"type": "string"},
                                            "audio": {"type": "string", "format": "binary"}}}}}},
                         "responses": {"201": _json({"type": "object"}, "registered"),
                                       "409": {"description": "a voice of that name exists",
                                               "content": {"application/json": {"schema": _ERROR}}},
                                       **_errors(400, 401, 413, 415, 503)}}},
            "/v1/audio/voices/{name}": {"delete": {
                "summary": "Delete a registered voice",
                "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": _json({"type": "object"}, "deleted"), **_errors(400, 401, 404, 503)}}},
            "/v1/audio/stream": {"get": {
                "summary": "WebSocket: text in pieces (start, text..., end, cancel) in; binary audio, segment events "
                           "with start_s/end_s, done or error out (api/README.md)",
                "responses": {"101": {"description": "switching to WebSocket"}, **_errors(401, 426, 429, 431, 501)}}},
            "/v1/models": {"get": {"summary": "Accepted model names (OpenAI names and the bundle's name)",
                                   "responses": {"200": _json({"type": "object"}), **_errors(401)}}},
            "/healthz": {"get": {"summary": "Liveness: the process and its engine worker run",
                                 "responses": {"200": _json({"type": "object"})}}},
            "/readyz": {"get": {"summary": "Readiness: the voice is loaded and warmed up",
                                "responses": {"200": _json({"type": "object"}), **_errors(503)}}},
            "/metrics": {"get": {"summary": "Prometheus metrics",
                                 "responses": {"200": {"description": "text exposition format 0.0.4",
                                                       "content": {"text/plain": {}}}, **_errors(401)}}},
            "/openapi.json": {"get": {"summary": "This document",
                                      "responses": {"200": _json({"type": "object"}), **_errors(401)}}},
            "/v1/bundle": {"get": {"summary": "The loaded bundle: name, family, sample rate, selection, quality report",
                                   "responses": {"200": _json({"type": "object"}), **_errors(401, 503)}}},
            **{path: {"get": {"summary": f"The local control page: {what} (package files, no external assets)",
                              "responses": {"200": {"description": what, "content": {kind: {}}}}}}
               for path, what, kind in (("/", "the page", "text/html"), ("/page.js", "its script", "text/javascript"),
                                        ("/page.css", "its style sheet", "text/css"))},
        },
        "components": {"schemas": {
            "ErrorBody": {"type": "object", "required": ["code", "message", "type"],
                          "properties": {"code": {"type": "string"}, "message": {"type": "string"},
                                         "type": {"type": "string"}}},
            "Error": {"type": "object", "required": ["error"],
                      "properties": {"error": {"$ref": "#/components/schemas/ErrorBody"}}},
        }, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                          "description": "the service's API key, when it has one"}}},
    }
    if config.api_key is not None:  # every route but the probes and the page's files needs the key
        document["security"] = [{"bearer": []}]
        for path in PUBLIC_PATHS:
            document["paths"][path]["get"]["security"] = []
    return document
