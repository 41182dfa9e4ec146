"""OpenAI-compatible routes: POST /v1/audio/speech and GET /v1/models."""
from __future__ import annotations

from flask import Blueprint, Response, jsonify

from cosyedge.api import bodies, cache
from cosyedge.api.security import hold_stream, note_text
from cosyedge.api.service import current_service
from cosyedge.api.synthesis import speak
from cosyedge.device.request import OPENAI_MODELS

blueprint = Blueprint("openai", __name__)


@blueprint.post("/v1/audio/speech")
def speech() -> Response:
    body = bodies.json_body()
    service = current_service()
    engine, _ = service.require_ready()
    note_text(body.get("input"))
    job = bodies.speech(body, engine, service.aliases)
    if job.stream:
        hold_stream()  # before any work is queued: over the bound is a 429 at once
    return cache.answer(engine, job, lambda: speak("/v1/audio/speech", job))


@blueprint.get("/v1/models")
def models() -> Response:
    engine = current_service().engine
    ids = [*OPENAI_MODELS, *([engine.bundle.manifest.name] if engine is not None else [])]
    return jsonify({"object": "list", "data": [{"id": i, "object": "model", "created": 0, "owned_by": "cosyedge"}
                                               for i in ids]})
