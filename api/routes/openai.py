"""OpenAI-compatible routes: POST /v1/audio/speech and GET /v1/models."""
from __future__ import annotations

from flask import Blueprint, Response, jsonify

from cosyedge.api import bodies
from cosyedge.api.config import OPENAI_MODELS
from cosyedge.api.service import current_service
from cosyedge.api.synthesis import speak

blueprint = Blueprint("openai", __name__)


@blueprint.post("/v1/audio/speech")
def speech() -> Response:
    body = bodies.json_body()
    service = current_service()
    engine, _ = service.require_ready()
    return speak("/v1/audio/speech", bodies.speech(body, engine, service.aliases))


@blueprint.get("/v1/models")
def models() -> Response:
    engine = current_service().engine
    ids = [*OPENAI_MODELS, *([engine.bundle.manifest.name] if engine is not None else [])]
    return jsonify({"object": "list", "data": [{"id": i, "object": "model", "created": 0, "owned_by": "cosyedge"}
                                               for i in ids]})
