"""Operations: liveness, readiness, Prometheus metrics and the OpenAPI document."""
from __future__ import annotations

from flask import Blueprint, Response, jsonify

from cosyedge.api.errors import ApiError
from cosyedge.api.metrics import CONTENT_TYPE
from cosyedge.api.openapi import spec
from cosyedge.api.service import current_service

blueprint = Blueprint("ops", __name__)


@blueprint.get("/healthz")
def healthz() -> Response:
    door = current_service().door
    if door is not None and not door.alive():
        raise ApiError(500, "worker_stopped", "the engine worker has stopped; restart the service")
    return jsonify({"status": "ok"})


@blueprint.get("/readyz")
def readyz() -> Response:
    engine, door = current_service().require_ready()
    return jsonify({"status": "ready", "queue_depth": door.waiting(), "bundle_sha256": engine.bundle.sha256})


@blueprint.get("/metrics")
def metrics() -> Response:
    return Response(current_service().metrics.exposition(), content_type=CONTENT_TYPE)


@blueprint.get("/openapi.json")
def openapi() -> Response:
    return jsonify(spec(current_service().config))
