"""Voices: list them, register a zero-shot voice (CosyVoice bundles), delete a registered one."""
from __future__ import annotations

from flask import Blueprint, Response, jsonify

from cosyedge.api import bodies
from cosyedge.api.security import note_text
from cosyedge.api.service import current_service

blueprint = Blueprint("voices", __name__)


@blueprint.get("/v1/audio/voices")
def list_voices() -> Response:
    service = current_service()
    engine, _ = service.require_ready()
    catalog = engine.voice_catalog()
    return jsonify({"object": "list", "default": catalog[0]["name"], "aliases": service.aliases,
                    "voices": [{"id": v["name"], **v} for v in catalog]})


@blueprint.post("/v1/audio/voices")
def add_voice() -> tuple[Response, int]:
    """Register a zero-shot voice: multipart form with `name`, `text` (the transcript) and file `audio`."""
    service = current_service()
    engine, _ = service.require_ready()
    name, audio, transcript = bodies.voice_upload(service.config.max_text_len)
    note_text(transcript)
    # device errors -> statuses by code (app error handler); an alias would select another voice than this one
    engine.add_voice(name, audio, transcript, reserved=service.aliases)
    entry = next(v for v in engine.voice_catalog() if v["name"] == name)
    return jsonify({"id": name, **entry}), 201


@blueprint.delete("/v1/audio/voices/<name>")
def remove_voice(name: str) -> Response:
    engine, _ = current_service().require_ready()
    engine.remove_voice(name)
    return jsonify({"id": name, "deleted": True})
