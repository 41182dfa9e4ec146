"""From a validated body to an HTTP answer, through the one door: a place in flight (`admission.py`), the journal,
the engine's door (`device/door.py`), then the whole file encoded or the stream sent as it is made.

Shared by the OpenAI-compatible and the native routes. Every accepted synthesis (one per text, each item of a
batch on its own) is admitted, then journalled, then handed to the door, and its journal entry is closed once its
answer has been sent; whatever is accepted and not delivered (a synthesis or encoding failure, a deadline passed
before work started, a stop, a crash) ends in the dead-letter file (`journal.py`).
"""
from __future__ import annotations

import base64
import time
from typing import Any, Iterator

import numpy as np
from flask import Response, g, jsonify, request

from cosyedge.api.admission import Ticket
from cosyedge.api.bodies import Batch, Speech
from cosyedge.api.errors import ApiError
from cosyedge.api.journal import Journal
from cosyedge.api.service import current_service
from cosyedge.api.streaming import audio_body
from cosyedge.api.timed import NDJSON, timed_answer
from cosyedge.device.audio import MIME, Resampler, encode_wave
from cosyedge.device.door import Job, collect
from cosyedge.device.errors import CosyedgeError, EncodingError, SynthesisFailed


def accept(journal: Journal, request_id: str, route: str, payload: dict[str, Any], key: str | None = None) -> str:
    """Journal an admitted request before the door sees it; a journal that cannot be written refuses it."""
    try:
        return journal.accepted(request_id, route, payload, key)
    except OSError:
        raise ApiError(503, "journal_unavailable", "the service cannot record requests (state directory not "
                       "writable); retry later", retry_after=5) from None


def detail(exc: BaseException) -> str:
    """What goes to the dead-letter file about a failure (never to the client)."""
    if isinstance(exc, ApiError):
        return f"{exc.code}: {exc.message}"
    if isinstance(exc, SynthesisFailed):
        return str(exc)  # the engine's own error type and message
    if isinstance(exc, CosyedgeError):
        return f"{exc.code}: {exc}"
    return f"{type(exc).__name__}: {exc}"


def answer_to(exc: CosyedgeError, request_id: str) -> ApiError:
    """The HTTP answer to a request the door could not deliver (the detail stays in the dead-letter file)."""
    if isinstance(exc, SynthesisFailed):
        return ApiError(500, "synthesis_failed", f"synthesis failed; recorded as request {request_id}")
    if isinstance(exc, EncodingError):
        return ApiError(500, "encoding_failed", f"encoding failed; recorded as request {request_id}")
    return ApiError.from_device(exc)


def _encode(wave: np.ndarray, rate: int, fmt: str, out_rate: int | None) -> bytes:
    """The whole file at `out_rate` (None: the voice's); an ffmpeg failure is the service's (EncodingError), never
    the client's."""
    try:
        return encode_wave(wave, rate, fmt, out_rate)
    except CosyedgeError:
        raise
    except Exception as exc:  # noqa: BLE001 - pydub / ffmpeg failures of any kind
        raise EncodingError(f"encode {fmt}: {type(exc).__name__}: {exc}") from None


def _mimetype(fmt: str, rate: int) -> str:
    return f"audio/L16; rate={rate}; channels=1" if fmt == "pcm" else MIME[fmt]


def speak(route: str, job: Speech) -> Response:
    """One text: the whole file (the door's stream collected), or its chunks as they are made."""
    service = current_service()
    engine, door = service.require_ready()
    journal, request_id, rate = service.journal, g.request_id, engine.sample_rate
    payload = {"text": job.text, "voice": job.options.voice, "speed": job.options.speed, "format": job.format,
               "stream": job.stream}
    ticket = service.admission.admit()[0]  # beyond queue_size: 503 queue_full + Retry-After, nothing journalled
    try:
        key = accept(journal, request_id, route, payload)
    except BaseException:
        ticket.release()
        raise

    def failed(exc: BaseException) -> None:
        journal.dead_letter(route, request_id, payload, detail(exc), key)

    started = time.monotonic()
    out_rate = job.rate(rate)
    headers = {"X-Sample-Rate": str(out_rate), "Cache-Control": "no-store"}
    try:
        stream = door.open(Job(job.segments, job.options, chunked=job.stream, deadline=ticket.deadline,
                               words=job.words))
        if job.stream:
            first = next(stream, None)  # a failure before any audio is an HTTP error, not a short stream
        else:
            chunks = list(stream)
            wave = collect(chunks)
            audio = None if job.subtitles else _encode(wave, rate, job.format, job.sample_rate)
    except CosyedgeError as exc:
        ticket.release()
        failed(exc)
        raise answer_to(exc, request_id) from None
    except BaseException as exc:
        ticket.release()
        failed(exc)
        raise
    service.metrics.observe("cosyedge_time_to_first_audio_seconds", time.monotonic() - started,
                            stream=str(job.stream).lower())
    if job.stream:
        disconnected = request.environ.get("waitress.client_disconnected", lambda: False)
        body = audio_body(stream, first, job.format, Resampler(rate, out_rate), out_rate, service.metrics,
                          disconnected, failed, timed=job.timestamps)
        # no direct_passthrough: werkzeug's closing wrapper runs call_on_close (metrics) after the stream
        return Response(_delivered(body, journal, key, ticket), headers={**headers, "X-Accel-Buffering": "no"},
                        content_type=NDJSON if job.timestamps else _mimetype(job.format, out_rate))
    headers["X-Audio-Seconds"] = f"{len(wave) / rate:.3f}"
    content_type = _mimetype(job.format, out_rate)
    if job.words:
        audio, content_type = timed_answer(job, chunks, audio, rate, out_rate)
    response = Response(audio, headers=headers, content_type=content_type)
    response.call_on_close(lambda: (journal.finished(key), ticket.release()))  # after the last byte went out
    return response


def _delivered(body: Iterator[bytes], journal: Journal, key: str, ticket: Ticket) -> Iterator[bytes]:
    """The stream's body; then its journal entry is closed (delivered, or the client left: its choice; a failure
    was dead-lettered already) and its place in flight given back."""
    try:
        yield from body
    finally:
        journal.finished(key)
        ticket.release()


def speak_batch(route: str, job: Batch) -> Response:
    """Many texts, each a job of its own through the door at once; each item succeeds or fails on its own, results
    in input order."""
    service = current_service()
    engine, door = service.require_ready()
    journal, request_id, rate = service.journal, g.request_id, engine.sample_rate
    results: list[dict[str, Any]] = [{} for _ in job.texts]
    queued = [(index, item) for index, item in enumerate(job.items) if not isinstance(item, ApiError)]
    for index, item in enumerate(job.items):
        if isinstance(item, ApiError):
            results[index] = _failure(index, item)

    def payload(index: int) -> dict[str, Any]:
        return {"index": index, "text": job.texts[index], "voice": job.options.voice, "speed": job.options.speed,
                "format": job.format}

    tickets = service.admission.admit(len(queued)) if queued else []  # all or none
    keys: dict[int, str] = {}
    try:
        for index, _ in queued:
            keys[index] = accept(journal, request_id, route, payload(index), f"{request_id}/{index}")
        streams = [door.open(Job(segments, job.options, chunked=False, deadline=ticket.deadline))
                   for (_, segments), ticket in zip(queued, tickets)]
    except BaseException as exc:
        for index, key in keys.items():
            journal.dead_letter(route, request_id, payload(index), detail(exc), key)
        for ticket in tickets:
            ticket.release()
        raise answer_to(exc, request_id) if isinstance(exc, CosyedgeError) else exc from None
    delivered: list[str] = []
    for (index, _), stream in zip(queued, streams):
        try:
            wave = collect(stream)
            audio = _encode(wave, rate, job.format, job.sample_rate)
        except CosyedgeError as exc:  # this item only: synthesis or encoding failed, its deadline passed, a stop
            journal.dead_letter(route, request_id, payload(index), detail(exc), keys[index])
            results[index] = _failure(index, answer_to(exc, request_id))
            continue
        delivered.append(keys[index])
        results[index] = {"index": index, "ok": True, "audio": base64.b64encode(audio).decode("ascii"),
                          "audio_seconds": round(len(wave) / rate, 3)}
    response = jsonify({"object": "list", "format": job.format, "sample_rate": job.rate(rate),
                        "succeeded": sum(1 for r in results if r["ok"]), "results": results})

    def close() -> None:
        for key in delivered:
            journal.finished(key)
        for ticket in tickets:
            ticket.release()
    response.call_on_close(close)
    return response


def _failure(index: int, error: ApiError) -> dict[str, Any]:
    return {"index": index, "ok": False, "status": error.status, **error.body()}
