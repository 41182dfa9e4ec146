"""The local control page at `/` (static files shipped in the package: no CDN, no web fonts) and the one route
it needs beyond the public API's others: `GET /v1/bundle`, the loaded bundle and its quality report."""
from __future__ import annotations

from importlib.resources import files

from flask import Blueprint, Response, jsonify

from cosyedge.api.service import current_service

blueprint = Blueprint("page", __name__)

# Everything the page loads comes from this origin; blob: is the audio the page itself made.
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "media-src 'self' blob:; form-action 'none'; base-uri 'none'; frame-ancestors 'none'")
_FILES = {"index.html": "text/html; charset=utf-8", "page.js": "text/javascript; charset=utf-8",
          "page.css": "text/css; charset=utf-8"}


def _file(name: str) -> Response:
    body = files("cosyedge.api").joinpath("page", name).read_bytes()
    return Response(body, content_type=_FILES[name], headers={"Content-Security-Policy": _CSP,
                                                              "X-Content-Type-Options": "nosniff",
                                                              "Cache-Control": "no-cache"})


@blueprint.get("/")
def index() -> Response:
    return _file("index.html")


@blueprint.get("/page.js")
def script() -> Response:
    return _file("page.js")


@blueprint.get("/page.css")
def style() -> Response:
    return _file("page.css")


@blueprint.get("/v1/bundle")
def bundle() -> Response:
    """What is loaded: name, family, rate, graph selection, voices, and the quality report written at build time."""
    engine, _ = current_service().require_ready()
    manifest = engine.bundle.manifest
    return jsonify({"name": manifest.name, "family": manifest.family, "sample_rate": manifest.sample_rate,
                    "selection": engine.precision, "precisions": list(manifest.precisions),
                    "voices": len(engine.voices()), "quality": manifest.quality})
