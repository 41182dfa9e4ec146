"""Streaming responses: audio leaves as soon as it is made.

Two sources, one wire format. Closed-batch engines (VITS, `audio_stream`): sentences go through the batch queue
one at a time. Continuous-batching engines (CosyVoice, `chunk_stream`): a producer thread runs
`Engine.stream_segments` and every chunk (hops of 25, 50, 100 speech tokens) is sent as soon as it is vocoded.

pcm is sent raw, wav as an unknown-length header then pcm16, the compressed formats through one
ffmpeg process per stream (so mp3/opus frames continue across sentences and chunks). The generator waits on
one event queue fed by the producer (batch futures or chunks) and the ffmpeg reader. When the client
goes away, waitress closes the generator (or `disconnected()` says so): VITS: the pending sentence is
withdrawn and no further sentence is submitted; CosyVoice: the request's stop event is set and its decode row
leaves the scheduler before the next decode step.
"""
from __future__ import annotations

import logging
import queue
import subprocess
import threading
import time
from concurrent.futures import Future
from typing import Callable, Iterator, Sequence

import numpy as np

from cosyedge.api.batcher import SynthesisQueue, SynthesisError
from cosyedge.api.errors import DeadlineExceeded
from cosyedge.api.metrics import Metrics
from cosyedge.device.audio import streaming_wav_header, to_pcm16
from cosyedge.device.engine import Engine
from cosyedge.device.options import Segment, SynthesisOptions

log = logging.getLogger(__name__)

POLL_S = 0.02  # how often a CosyVoice stream waiting for its next chunk asks whether its client is still there
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


def _ffmpeg_output(fmt: str, sample_rate: int) -> list[str]:
    if fmt == "mp3":
        return ["-c:a", "libmp3lame", "-b:a", "96k", "-write_xing", "0", "-f", "mp3"]
    if fmt == "opus":
        rate = sample_rate if sample_rate in OPUS_RATES else (48000 if sample_rate > 24000 else 24000)
        return ["-ar", str(rate), "-c:a", "libopus", "-b:a", "48k", "-page_duration", "100000", "-f", "ogg"]
    if fmt == "aac":
        return ["-c:a", "aac", "-b:a", "96k", "-f", "adts"]
    if fmt == "flac":
        return ["-c:a", "flac", "-f", "flac"]
    raise ValueError(f"no streaming encoder for {fmt!r}")


class FfmpegEncoder:
    """One ffmpeg process: pcm16 in on stdin, encoded bytes out through `sink(("data", bytes))`."""

    def __init__(self, fmt: str, sample_rate: int, sink: Callable[[tuple], None]) -> None:
        args = ["ffmpeg", "-hide_banner", "-loglevel", "error", "-f", "s16le", "-ar", str(sample_rate), "-ac", "1",
                "-i", "pipe:0", *_ffmpeg_output(fmt, sample_rate), "-flush_packets", "1", "pipe:1"]
        self._proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._sink = sink
        self._reader = threading.Thread(target=self._pump, name="cosyedge-ffmpeg-reader", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        while chunk := self._proc.stdout.read1(65536):
            self._sink(("data", chunk))
        self._sink(("eof", None))

    def write(self, pcm: bytes) -> None:
        try:
            self._proc.stdin.write(pcm)
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise SynthesisError("ffmpeg: encoder stopped accepting audio") from None

    def finish(self) -> None:
        self._proc.stdin.close()

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._reader.join(timeout=5)
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe and not pipe.closed:
                try:
                    pipe.close()
                except OSError:
                    pass


def audio_stream(batcher: SynthesisQueue, metrics: Metrics, segments: list[Segment], request: SynthesisOptions, fmt: str,
                 sample_rate: int, first: np.ndarray, timeout: float, disconnected: Callable[[], bool],
                 on_failure: Callable[[SynthesisError], None]) -> Iterator[bytes]:
    """The response body of a stream whose first sentence (`first`) is already rendered."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    encoder = FfmpegEncoder(fmt, sample_rate, events.put) if fmt not in ("pcm", "wav") else None
    pending: Future | None = None
    sent = 0
    finished = False

    def submit(index: int) -> Future:
        future = batcher.submit([([segments[index]], request)], time.monotonic() + timeout, admitted=True)[0]
        future.add_done_callback(lambda f: events.put(("wave", f)))
        return future

    def until_wave() -> Iterator[bytes]:
        """Forward encoder output until the pending sentence is done."""
        while True:
            kind, payload = events.get()
            if kind == "data":
                yield payload
            elif kind == "wave" and payload is pending:
                return
            elif kind == "eof":
                raise SynthesisError("ffmpeg: encoder exited early")

    try:
        if fmt == "wav":
            yield streaming_wav_header(sample_rate)
        wave = first
        while True:
            if sent + 1 < len(segments):
                if disconnected():
                    break
                pending = submit(sent + 1)  # the next sentence renders while this one is sent
            pcm = to_pcm16(wave)
            sent += 1
            if encoder is None:
                yield pcm
            else:
                encoder.write(pcm)
            if pending is None:
                break
            yield from until_wave()
            wave, pending = pending.result(), None
        if sent == len(segments):
            if encoder is not None:
                yield from _drain(encoder, events)
            finished = True
    except SynthesisError as exc:
        finished = True  # not a disconnect: the stream ends short, the failure is recorded
        on_failure(exc)
    except DeadlineExceeded:
        finished = True
        log.warning("stream ended short: a sentence waited past its deadline")
    finally:
        if not finished:
            if pending is not None:
                pending.cancel()
            metrics.inc("cosyedge_stream_disconnects_total")
            metrics.inc("cosyedge_stream_segments_skipped_total", len(segments) - sent)
            log.info("stream client left after %d of %d sentences; the rest is not synthesized", sent, len(segments))
        if encoder is not None:
            encoder.close()


def _drain(encoder: FfmpegEncoder, events: queue.SimpleQueue) -> Iterator[bytes]:
    """The encoder's last bytes once all audio was written."""
    encoder.finish()
    while (event := events.get())[0] != "eof":
        if event[0] == "data":
            yield event[1]


def start_chunks(engine: Engine, segments: Sequence[Segment], request: SynthesisOptions, release: Callable[[], None],
                 events: queue.SimpleQueue, stop: threading.Event) -> None:
    """The producer of `chunk_stream`, started before the response: every chunk of `Engine.stream_segments` goes
    to `events` as soon as it exists; `release` (the request's place in flight) runs once the engine is done."""

    def produce() -> None:
        try:
            for chunk in engine.stream_segments(segments, request, stop):
                events.put(("chunk", chunk))
            events.put(("end", None))
        except Exception as exc:  # noqa: BLE001 - reported on the stream, dead-lettered by the caller
            log.exception("streamed synthesis failed")
            events.put(("error", SynthesisError(f"{type(exc).__name__}: {exc}")))
        finally:
            release()

    threading.Thread(target=produce, name="cosyedge-stream", daemon=True).start()


def chunk_stream(events: queue.SimpleQueue, stop: threading.Event, metrics: Metrics, fmt: str, sample_rate: int,
                 started: float, disconnected: Callable[[], bool],
                 on_failure: Callable[[SynthesisError], None]) -> Iterator[bytes]:
    """The response body of a CosyVoice stream fed by `start_chunks`: each chunk leaves as soon as it is vocoded
    (through the stream's one encoder for compressed formats); time to first audio goes to the metrics."""
    encoder = FfmpegEncoder(fmt, sample_rate, events.put) if fmt not in ("pcm", "wav") else None
    finished, chunks = False, 0
    try:
        if fmt == "wav":
            yield streaming_wav_header(sample_rate)
        while True:
            try:
                kind, payload = events.get(timeout=POLL_S)
            except queue.Empty:
                if disconnected():
                    break
                continue
            if kind == "chunk":
                if chunks == 0:
                    metrics.observe("cosyedge_time_to_first_audio_seconds", time.monotonic() - started, stream="true")
                chunks += 1
                if encoder is None:
                    yield to_pcm16(payload)
                else:
                    encoder.write(to_pcm16(payload))
            elif kind == "data":
                yield payload
            elif kind == "error":
                raise payload
            elif kind == "eof":
                raise SynthesisError("ffmpeg: encoder exited early")
            elif kind == "end":
                if encoder is not None:
                    yield from _drain(encoder, events)
                finished = True
                return
    except SynthesisError as exc:
        finished = True  # not a disconnect: the stream ends short, the failure is recorded
        on_failure(exc)
    finally:
        if not finished:
            stop.set()  # the decode row leaves before the next step
            metrics.inc("cosyedge_stream_disconnects_total")
            log.info("stream client left after %d chunks; the rest is not synthesized", chunks)
        if encoder is not None:
            encoder.close()
