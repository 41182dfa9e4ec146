"""Streamed HTTP responses: each chunk of the door's stream (`device/door.py`) leaves as soon as it is made.

One body for every pipeline: VITS sends a sentence per chunk, CosyVoice its hops of 25, 50, 100 speech tokens.
pcm is sent raw, wav as an unknown-length header then pcm16, the compressed formats through one ffmpeg process
per response (`audio.FfmpegEncoder`, so mp3/opus frames continue across sentences and chunks).

The body waits for the next chunk `POLL_S` at a time and between two waits asks the server whether the client
is still there (`disconnected`: waitress's `client_disconnected`, a peek at the socket under gunicorn). So a
client that leaves while no chunk is being written (a long sentence still rendering) is noticed within POLL_S,
not when the next chunk fails to go out: its job is withdrawn (VITS: no further sentence; CosyVoice: its decode
row leaves before the next step).
"""
from __future__ import annotations

import base64
import json
import logging
import queue
from typing import Callable, Iterator

from cosyedge.api.metrics import Metrics
from cosyedge.device.audio import FfmpegEncoder, Resampler, streaming_wav_header, to_pcm16
from cosyedge.device.door import Chunk, Stream
from cosyedge.device.errors import CosyedgeError, EncodingError
from cosyedge.device.options import Word, on_rate

log = logging.getLogger(__name__)

POLL_S = 0.02  # how often a stream waiting for its next chunk asks whether its client is still there


class _ClientGone(Exception):
    """The server's probe says the client left."""


class _Words(tuple):
    """A chunk's words, among the body's pieces right after the chunk's audio went to the wire or the encoder."""


def audio_body(stream: Stream, first: Chunk | None, fmt: str, resample: Resampler, sample_rate: int,
               metrics: Metrics, disconnected: Callable[[], bool],
               on_failure: Callable[[Exception], None], timed: bool = False) -> Iterator[bytes]:
    """The response body of a stream whose first chunk (`first`; None: the stream had no audio) was taken;
    `resample` takes the voice's rate to the request's `sample_rate`. `timed` (a words job): NDJSON, one line per
    chunk, `{"audio": base64 of the bytes made since the last line, "words": the words the chunk completes}`, times
    on the delivered clock (for a compressed format the encoder may hold a word's last frame for the next line)."""
    pieces = _pieces(stream, first, fmt, resample, sample_rate, metrics, disconnected, on_failure)
    return _lines(pieces, sample_rate) if timed else _audio(pieces)


def _audio(pieces: Iterator[bytes | _Words]) -> Iterator[bytes]:
    try:
        for piece in pieces:
            if not isinstance(piece, _Words):
                yield piece
    finally:
        pieces.close()  # the client left: the stream is withdrawn now


def _lines(pieces: Iterator[bytes | _Words], sample_rate: int) -> Iterator[bytes]:
    held = b""
    try:
        for piece in pieces:
            if not isinstance(piece, _Words):
                held += piece
                continue
            yield _line(held, on_rate(piece, sample_rate))
            held = b""
        if held:
            yield _line(held, [])
    finally:
        pieces.close()


def _line(audio: bytes, words: list[Word]) -> bytes:
    return json.dumps({"audio": base64.b64encode(audio).decode(), "words": [
        {"text": w.text, "start_s": w.start_s, "end_s": w.end_s} for w in words]}, ensure_ascii=False).encode() + b"\n"


def _pieces(stream: Stream, first: Chunk | None, fmt: str, resample: Resampler, sample_rate: int,
            metrics: Metrics, disconnected: Callable[[], bool],
            on_failure: Callable[[Exception], None]) -> Iterator[bytes | _Words]:
    """The body's bytes as they are made, each chunk's words after its audio."""
    encoded: queue.SimpleQueue = queue.SimpleQueue()
    encoder = FfmpegEncoder(fmt, sample_rate, encoded.put) if fmt not in ("pcm", "wav") else None
    finished = False
    try:
        if fmt == "wav":
            yield streaming_wav_header(sample_rate)
        chunk = first
        while chunk is not None:
            yield from _write(encoder, encoded, to_pcm16(resample(chunk.audio)))
            yield _Words(chunk.words)
            chunk = yield from _next(stream, encoded, disconnected)
        yield from _write(encoder, encoded, to_pcm16(resample.flush()))
        if encoder is not None:
            yield from _drain(encoder, encoded)
        finished = True
    except _ClientGone:
        pass
    except CosyedgeError as exc:  # the engine or the encoder failed: the stream ends short, the failure is recorded
        finished = True
        stream.close()  # an encoder failure leaves the job going: withdraw it (an engine failure ended it already)
        on_failure(exc)
    finally:
        if not finished:
            stream.close()
            metrics.inc("cosyedge_stream_disconnects_total")
            metrics.inc("cosyedge_stream_segments_skipped_total", stream.skipped)
            log.info("stream client left with %d of %d segments unsent; the rest is not synthesized", stream.skipped,
                     len(stream.job.segments))
        if encoder is not None:
            encoder.close()


def _write(encoder: FfmpegEncoder | None, encoded: queue.SimpleQueue, pcm: bytes) -> Iterator[bytes]:
    """pcm to the wire, or into the encoder (and its output so far to the wire)."""
    if not pcm:
        return
    if encoder is None:
        yield pcm
    else:
        encoder.write(pcm)
        yield from _encoded(encoded)


def _next(stream: Stream, encoded: queue.SimpleQueue, disconnected: Callable[[], bool]) -> Iterator[bytes]:
    """Wait for the stream's next chunk (its value: None at the end), sending encoded bytes meanwhile and asking
    the probe between waits."""
    while not stream.ready(POLL_S):
        yield from _encoded(encoded)
        if disconnected():
            raise _ClientGone()
    return next(stream, None)


def _encoded(encoded: queue.SimpleQueue) -> Iterator[bytes]:
    """The encoder's output so far."""
    while True:
        try:
            kind, payload = encoded.get_nowait()
        except queue.Empty:
            return
        if kind == "eof":
            raise EncodingError("ffmpeg: encoder exited early")
        yield payload


def _drain(encoder: FfmpegEncoder, encoded: queue.SimpleQueue) -> Iterator[bytes]:
    """The encoder's last bytes once all audio was written."""
    encoder.finish()
    while (event := encoded.get())[0] != "eof":
        yield event[1]
