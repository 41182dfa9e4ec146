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
    batcher = current_service().batcher
    if batcher is not None and not batcher.alive():
        raise ApiError(500, "worker_stopped", "the engine worker has stopped; restart the service")
    return jsonify({"status": "ok"})


@blueprint.get("/readyz")
def readyz() -> Response:
    _, batcher = current_service().require_ready()
    return jsonify({"status": "ready", "queue_depth": batcher.depth()})


@blueprint.get("/metrics")
def metrics() -> Response:
    return Response(current_service().metrics.exposition(), content_type=CONTENT_TYPE)


@blueprint.get("/openapi.json")
def openapi() -> Response:
    return jsonify(spec(current_service().config))
