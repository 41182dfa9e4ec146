"""From a validated body to an HTTP answer: queue the work, wait, encode (or stream), dead-letter failures.

Shared by the OpenAI-compatible and the native routes; only the batch queue's worker runs the engine.
"""
from __future__ import annotations

import base64
import time
from typing import Any

from flask import Response, g, jsonify, request

from cosyedge.api.batcher import SynthesisError
from cosyedge.api.bodies import Batch, Speech
from cosyedge.api.errors import ApiError
from cosyedge.api.service import current_service
from cosyedge.api.streaming import audio_stream
from cosyedge.device.audio import MIME, encode, to_audio_segment


def speak(route: str, job: Speech) -> Response:
    """One text: the whole file, or (stream) its sentences as they are made."""
    service = current_service()
    engine, batcher = service.require_ready()
    timeout = service.config.request_timeout_s
    request_id = g.request_id
    options = job.options
    payload = {"text": job.text, "voice": options.voice, "speed": options.speed, "format": job.format,
               "stream": job.stream}

    def failed(exc: SynthesisError) -> None:
        service.dead_letter(route, request_id, payload, exc)

    deadline = time.monotonic() + timeout
    first_segments = job.segments[:1] if job.stream else job.segments
    future = batcher.submit([(first_segments, options)], deadline)[0]
    try:
        wave = batcher.wait(future, deadline)
    except SynthesisError as exc:
        failed(exc)
        raise ApiError(500, "synthesis_failed", f"synthesis failed; recorded as request {request_id}") from None
    rate = engine.sample_rate
    headers = {"X-Sample-Rate": str(rate), "Cache-Control": "no-store"}
    mimetype = f"audio/L16; rate={rate}; channels=1" if job.format == "pcm" else MIME[job.format]
    if job.stream:
        disconnected = request.environ.get("waitress.client_disconnected", lambda: False)
        body = audio_stream(batcher, service.metrics, job.segments, options, job.format, rate, wave, timeout,
                            disconnected, failed)
        # no direct_passthrough: werkzeug's closing wrapper runs call_on_close (metrics) after the stream
        return Response(body, headers={**headers, "X-Accel-Buffering": "no"}, content_type=mimetype)
    try:
        audio = encode(to_audio_segment(wave, rate), job.format)
    except Exception as exc:  # noqa: BLE001 - ffmpeg failures are the server's, not the client's
        failed(SynthesisError(f"encode {job.format}: {type(exc).__name__}: {exc}"))
        raise ApiError(500, "encoding_failed", f"encoding to {job.format} failed; recorded as request {request_id}") from None
    headers["X-Audio-Seconds"] = f"{len(wave) / rate:.3f}"
    return Response(audio, headers=headers, content_type=mimetype)


def speak_batch(route: str, job: Batch) -> Response:
    """Many texts, queued together; each item succeeds or fails on its own, results in input order."""
    service = current_service()
    engine, batcher = service.require_ready()
    results: list[dict[str, Any]] = [{} for _ in job.texts]
    queued = [(index, item) for index, item in enumerate(job.items) if not isinstance(item, ApiError)]
    for index, item in enumerate(job.items):
        if isinstance(item, ApiError):
            results[index] = _failure(index, item)
    deadline = time.monotonic() + service.config.request_timeout_s
    futures = batcher.submit([(segments, job.options) for _, segments in queued], deadline) if queued else []
    for (index, _), future in zip(queued, futures):
        try:
            wave = batcher.wait(future, deadline)
            audio = encode(to_audio_segment(wave, engine.sample_rate), job.format)
        except ApiError as exc:
            results[index] = _failure(index, exc)
            continue
        except Exception as exc:  # noqa: BLE001 - synthesis or encoding failed for this item only
            error = exc if isinstance(exc, SynthesisError) else SynthesisError(f"encode: {type(exc).__name__}: {exc}")
            service.dead_letter(route, g.request_id, {"index": index, "text": job.texts[index],
                                "voice": job.options.voice, "speed": job.options.speed, "format": job.format}, error)
            results[index] = _failure(index, ApiError(500, "synthesis_failed",
                                                      f"synthesis failed; recorded as request {g.request_id}"))
            continue
        results[index] = {"index": index, "ok": True, "audio": base64.b64encode(audio).decode("ascii"),
                          "audio_seconds": round(len(wave) / engine.sample_rate, 3)}
    return jsonify({"object": "list", "format": job.format, "sample_rate": engine.sample_rate,
                    "succeeded": sum(1 for r in results if r["ok"]), "results": results})


def _failure(index: int, error: ApiError) -> dict[str, Any]:
    return {"index": index, "ok": False, "status": error.status, **error.body()}
