"""From a validated body to an HTTP answer: journal, queue the work, wait, encode (or stream), dead-letter failures.

Shared by the OpenAI-compatible and the native routes; only the batch queue's worker runs the engine.
Every accepted synthesis (one per text, each item of a batch on its own) is journalled before it is queued
and closed once its answer has been sent; whatever is accepted and not delivered (a synthesis or encoding
failure, a deadline passed in the queue, a stop, a crash) ends in the dead-letter file (see `journal.py`).
"""
from __future__ import annotations

import base64
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterator, Sequence

from flask import Response, g, jsonify, request

from cosyedge.api.batcher import SynthesisError, SynthesisQueue
from cosyedge.api.bodies import Batch, Speech
from cosyedge.api.errors import ApiError, DeadlineExceeded
from cosyedge.api.journal import Journal
from cosyedge.api.service import current_service
from cosyedge.api.streaming import audio_stream, chunk_stream, start_chunks
from cosyedge.device.audio import MIME, encode, to_audio_segment
from cosyedge.device.options import Segment, SynthesisOptions


def _accept(journal: Journal, request_id: str, route: str, payload: dict[str, Any], key: str | None = None) -> str:
    """Journal the request before it is queued; a journal that cannot be written means the request is refused."""
    try:
        return journal.accepted(request_id, route, payload, key)
    except OSError:
        raise ApiError(503, "journal_unavailable", "the service cannot record requests (state directory not "
                       "writable); retry later", retry_after=5) from None


def _detail(exc: BaseException) -> str:
    """What goes to the dead-letter file about a failure (never to the client)."""
    if isinstance(exc, SynthesisError):
        return exc.detail
    if isinstance(exc, ApiError):
        return f"{exc.code}: {exc.message}"
    return f"{type(exc).__name__}: {exc}"


class _DeadlineWatch:
    """The queue as a stream sees it, noting whether a later sentence expired in the queue (the stream ends short)."""

    def __init__(self, batcher: SynthesisQueue) -> None:
        self._batcher = batcher
        self.expired = False

    def submit(self, jobs: Sequence[tuple[list[Segment], SynthesisOptions]], deadline: float,
               admitted: bool = False) -> list[Future]:
        futures = self._batcher.submit(jobs, deadline, admitted=admitted)
        for future in futures:
            future.add_done_callback(self._check)
        return futures

    def _check(self, future: Future) -> None:
        if not future.cancelled() and isinstance(future.exception(), DeadlineExceeded):
            self.expired = True


def speak(route: str, job: Speech) -> Response:
    """One text: the whole file, or (stream) its sentences as they are made."""
    service = current_service()
    engine, batcher = service.require_ready()
    journal = service.journal
    timeout = service.config.request_timeout_s
    request_id = g.request_id
    options = job.options
    payload = {"text": job.text, "voice": options.voice, "speed": options.speed, "format": job.format,
               "stream": job.stream}

    def failed(exc: BaseException) -> None:
        journal.dead_letter(route, request_id, payload, _detail(exc), key)

    started = time.monotonic()
    deadline = started + timeout
    rate = engine.sample_rate
    headers = {"X-Sample-Rate": str(rate), "Cache-Control": "no-store"}
    mimetype = f"audio/L16; rate={rate}; channels=1" if job.format == "pcm" else MIME[job.format]
    key = _accept(journal, request_id, route, payload)
    if job.stream and batcher.continuous:
        try:
            release = batcher.admit()
        except BaseException:
            journal.finished(key)  # refused at once (too many in flight): the client has its 503
            raise
        events: queue.SimpleQueue = queue.SimpleQueue()
        stop = threading.Event()
        start_chunks(engine, job.segments, options, release, events, stop)
        disconnected = request.environ.get("waitress.client_disconnected", lambda: False)
        body = chunk_stream(events, stop, service.metrics, job.format, rate, started, disconnected, failed)
        return Response(_journalled(body, journal, key, None, failed),
                        headers={**headers, "X-Accel-Buffering": "no"}, content_type=mimetype)
    first_segments = job.segments[:1] if job.stream else job.segments
    try:
        future = batcher.submit([(first_segments, options)], deadline)[0]
    except BaseException:
        journal.finished(key)  # refused at once (queue full): never queued, the client has its 503
        raise
    try:
        wave = batcher.wait(future, deadline)
    except SynthesisError as exc:
        failed(exc)
        raise ApiError(500, "synthesis_failed", f"synthesis failed; recorded as request {request_id}") from None
    except BaseException as exc:  # deadline passed in the queue, service stopping: accepted, not delivered
        failed(exc)
        raise
    service.metrics.observe("cosyedge_time_to_first_audio_seconds", time.monotonic() - started,  # VITS: 1st sentence
                            stream=str(job.stream).lower())
    if job.stream:
        disconnected = request.environ.get("waitress.client_disconnected", lambda: False)
        watch = _DeadlineWatch(batcher)
        body = audio_stream(watch, service.metrics, job.segments, options, job.format, rate, wave, timeout,  # type: ignore[arg-type]
                            disconnected, failed)
        # no direct_passthrough: werkzeug's closing wrapper runs call_on_close (metrics) after the stream
        return Response(_journalled(body, journal, key, watch, failed),
                        headers={**headers, "X-Accel-Buffering": "no"}, content_type=mimetype)
    try:
        audio = encode(to_audio_segment(wave, rate), job.format)
    except Exception as exc:  # noqa: BLE001 - ffmpeg failures are the server's, not the client's
        failed(SynthesisError(f"encode {job.format}: {type(exc).__name__}: {exc}"))
        raise ApiError(500, "encoding_failed", f"encoding to {job.format} failed; recorded as request {request_id}") from None
    except BaseException as exc:
        failed(exc)
        raise
    headers["X-Audio-Seconds"] = f"{len(wave) / rate:.3f}"
    response = Response(audio, headers=headers, content_type=mimetype)
    response.call_on_close(lambda: journal.finished(key))  # after the last byte went out
    return response


def _journalled(body: Iterator[bytes], journal: Journal, key: str, watch: _DeadlineWatch | None,
                failed: Callable[[BaseException], None]) -> Iterator[bytes]:
    """The stream's body; closes its journal entry: delivered, cut short by the server (dead letter), or left."""
    complete = False
    try:
        yield from body
        complete = True
    finally:
        if complete and watch is not None and watch.expired and journal.is_open(key):
            failed(DeadlineExceeded())  # the stream ended short: the rest was never synthesised
        else:
            journal.finished(key)  # delivered, or the client left (its choice); a SynthesisError closed it already


def speak_batch(route: str, job: Batch) -> Response:
    """Many texts, queued together; each item succeeds or fails on its own, results in input order."""
    service = current_service()
    engine, batcher = service.require_ready()
    journal = service.journal
    request_id = g.request_id
    results: list[dict[str, Any]] = [{} for _ in job.texts]
    queued = [(index, item) for index, item in enumerate(job.items) if not isinstance(item, ApiError)]
    for index, item in enumerate(job.items):
        if isinstance(item, ApiError):
            results[index] = _failure(index, item)

    def payload(index: int) -> dict[str, Any]:
        return {"index": index, "text": job.texts[index], "voice": job.options.voice, "speed": job.options.speed,
                "format": job.format}

    keys: dict[int, str] = {}
    try:
        for index, _ in queued:
            keys[index] = _accept(journal, request_id, route, payload(index), f"{request_id}/{index}")
        deadline = time.monotonic() + service.config.request_timeout_s
        futures = batcher.submit([(segments, job.options) for _, segments in queued], deadline) if queued else []
    except BaseException:
        for key in keys.values():
            journal.finished(key)  # refused at once (queue full): never queued
        raise
    delivered: list[str] = []
    for (index, _), future in zip(queued, futures):
        try:
            wave = batcher.wait(future, deadline)
            audio = encode(to_audio_segment(wave, engine.sample_rate), job.format)
        except ApiError as exc:  # the deadline passed in the queue, or the service is stopping
            journal.dead_letter(route, request_id, payload(index), _detail(exc), keys[index])
            results[index] = _failure(index, exc)
            continue
        except Exception as exc:  # noqa: BLE001 - synthesis or encoding failed for this item only
            error = exc if isinstance(exc, SynthesisError) else SynthesisError(f"encode: {type(exc).__name__}: {exc}")
            journal.dead_letter(route, request_id, payload(index), error.detail, keys[index])
            results[index] = _failure(index, ApiError(500, "synthesis_failed",
                                                      f"synthesis failed; recorded as request {request_id}"))
            continue
        delivered.append(keys[index])
        results[index] = {"index": index, "ok": True, "audio": base64.b64encode(audio).decode("ascii"),
                          "audio_seconds": round(len(wave) / engine.sample_rate, 3)}
    response = jsonify({"object": "list", "format": job.format, "sample_rate": engine.sample_rate,
                        "succeeded": sum(1 for r in results if r["ok"]), "results": results})
    response.call_on_close(lambda: [journal.finished(key) for key in delivered])
    return response


def _failure(index: int, error: ApiError) -> dict[str, Any]:
    return {"index": index, "ok": False, "status": error.status, **error.body()}
