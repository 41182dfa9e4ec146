"""The native synthesis routes: POST /v1/tts (one text) and POST /v1/tts/batch (many, each on its own)."""
from __future__ import annotations

from flask import Blueprint, Response

from cosyedge.api import bodies
from cosyedge.api.service import current_service
from cosyedge.api.synthesis import speak, speak_batch

blueprint = Blueprint("native", __name__)


@blueprint.post("/v1/tts")
def tts() -> Response:
    body = bodies.json_body()
    service = current_service()
    engine, _ = service.require_ready()
    return speak("/v1/tts", bodies.tts(body, engine, service.aliases))


@blueprint.post("/v1/tts/batch")
def tts_batch() -> Response:
    body = bodies.json_body()
    service = current_service()
    engine, _ = service.require_ready()
    return speak_batch("/v1/tts/batch", bodies.batch(body, engine, service.aliases, service.config.max_batch_items))
