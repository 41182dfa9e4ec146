"""The native synthesis routes: POST /v1/tts (one text) and POST /v1/tts/batch (many, each on its own)."""
from __future__ import annotations

from flask import Blueprint, Response

from cosyedge.api import bodies, cache
from cosyedge.api.security import hold_stream, note_text
from cosyedge.api.service import current_service
from cosyedge.api.synthesis import speak, speak_batch

blueprint = Blueprint("native", __name__)


@blueprint.post("/v1/tts")
def tts() -> Response:
    body = bodies.json_body()
    service = current_service()
    engine, _ = service.require_ready()
    note_text(body.get("text"))
    job = bodies.tts(body, engine, service.aliases)
    if job.stream:
        hold_stream()  # before any work is queued: over the bound is a 429 at once
    return cache.answer(engine, job, lambda: speak("/v1/tts", job))


@blueprint.post("/v1/tts/batch")
def tts_batch() -> Response:
    body = bodies.json_body()
    service = current_service()
    engine, _ = service.require_ready()
    note_text(body.get("texts"))
    return speak_batch("/v1/tts/batch", bodies.batch(body, engine, service.aliases, service.config.max_batch_items))
