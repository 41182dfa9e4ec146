"""WebSocket `GET /v1/audio/stream`: text in pieces (an LLM's output) in; audio and subtitle timings out.

Protocol (issue 11, api/README.md): the client sends JSON text frames: `start` (voice, format pcm|wav|mp3|opus,
optional sample_rate, speed, model, deterministic,
seed, sampling), any number of `text`, then `end`; `cancel` stops at once.
The server sends binary audio frames as they are made, a `segment` event per sentence once its audio is complete
(start_s/end_s on the output audio's clock), then `done` with audio_s; an error is an `error` event followed by
a normal close (1000), never a dropped connection.

One session is one request thread of the gthread worker (simple-websocket takes the socket from gunicorn and
queues incoming frames in its own reader thread). The session thread alternates: between two audio chunks it
takes what the client sent, so a `cancel` or a bad message stops the audio after the chunk under way, and
closing the `engine.stream` generator frees its CosyVoice decode row. Text is cut into sentences by
`SentenceStream` (the splitter `split_sentences` uses, the first one cut early at a clause); each sentence
goes through `engine.stream`, so the family's own frontend rules apply to it as to an HTTP request's text.

Nothing accepted is lost: every `text` piece is journalled when it arrives (`PieceJournal`) and closed once the
sentences spoken cover it; a session that ends any other way than `done` or the client's own `cancel` (an error,
a client that left, a shutdown) dead-letters its open pieces, and a SIGKILL leaves them to the next start's
recovery, as for HTTP requests.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import deque
from typing import Any

from flask import Blueprint, Response, g, request
from simple_websocket import ConnectionClosed, Server

from cosyedge.api.config import OPENAI_MODELS
from cosyedge.api.errors import ApiError, ShuttingDown
from cosyedge.api.journal import Journal
from cosyedge.api.security import current_guard
from cosyedge.api.service import Service, current_service
from cosyedge.api.streaming import FfmpegEncoder
from cosyedge.device import SentenceStream
from cosyedge.device.audio import streaming_wav_header, to_pcm16
from cosyedge.device.errors import CosyedgeError

log = logging.getLogger(__name__)

blueprint = Blueprint("websocket", __name__)
WS_FORMATS = ("pcm", "wav", "mp3", "opus")
ROUTE = "/v1/audio/stream"


class PieceJournal:
    """The journal entries of one session's text pieces: a piece is closed once the non-space characters of the
    sentences spoken reach its end (the splitter keeps every non-space character of a speakable sentence)."""

    def __init__(self, journal: Journal, request_id: str) -> None:
        self.journal, self.request_id = journal, request_id
        self.open: deque[tuple[str, dict[str, Any], int]] = deque()  # key, payload, cumulative end
        self.received = self.spoken = 0

    def accept(self, piece: str, params: dict[str, Any], fmt: str) -> None:
        key = f"{self.request_id}-{self.received}-{len(self.open)}"
        payload = {"text": piece, "voice": params.get("voice"), "speed": params.get("speed"), "format": fmt,
                   "stream": True}
        try:
            self.journal.accepted(self.request_id, ROUTE, payload, key)
        except OSError:
            raise SessionError("journal_unavailable", "the service cannot record requests (state directory not "
                               "writable); retry later") from None
        self.received += _chars(piece)
        self.open.append((key, payload, self.received))

    def spoke(self, sentence: str) -> None:
        self.spoken += _chars(sentence)
        while self.open and self.open[0][2] <= self.spoken:
            self.journal.finished(self.open.popleft()[0])

    def close(self, detail: str | None) -> None:
        """All open pieces: delivered or withdrawn by the client (detail None), else dead-lettered with `detail`."""
        while self.open:
            key, payload, _ = self.open.popleft()
            if detail is None:
                self.journal.finished(key)
            else:
                self.journal.dead_letter(ROUTE, self.request_id, payload, detail, key)


def _chars(text: str) -> int:
    return sum(not c.isspace() for c in text)


class SessionError(Exception):
    """Ends the session with an `error` event carrying `code` and `message`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class _Cancelled(Exception):
    """The client sent `cancel`."""


class _Upgraded(Response):
    """What the route returns once the WebSocket is closed: the app's close hooks run (metrics, stream slot),
    then StopIteration tells gunicorn that the socket was the WebSocket's and no HTTP response follows."""

    def __call__(self, environ: Any, start_response: Any) -> Any:
        self.close()
        raise StopIteration()


@blueprint.get(ROUTE)
def plain_get() -> Response:
    """The same path without the WebSocket handshake (werkzeug routes the two apart)."""
    raise ApiError(426, "websocket_required", f"{ROUTE} speaks WebSocket: send GET with Upgrade: websocket",
                   headers={"Upgrade": "websocket"})


@blueprint.route(ROUTE, methods=["GET"], websocket=True)
def audio_stream() -> Response:
    service = current_service()
    try:
        ws = Server(request.environ, max_message_size=service.config.max_text_len * 4 + 4096)
    except RuntimeError:  # the in-process test server (waitress) hands out no socket
        raise ApiError(501, "websocket_unavailable", "this server cannot upgrade to WebSocket; use `cosyedge serve`") from None
    Session(ws, service, g.client).run()
    return _Upgraded(status=101)


class Session:
    """One client's stream: its options, splitter, encoder and audio clock (nothing shared between sessions)."""

    def __init__(self, ws: Server, service: Service, client: str) -> None:
        self.ws, self.service, self.client = ws, service, client
        self.idle_s = service.config.request_timeout_s
        self.max_text = service.config.max_text_len
        self.splitter = SentenceStream(max_chars=min(400, self.max_text))
        self.pending: deque[str] = deque()
        self.params: dict[str, Any] = {}
        self.rate = 0
        self.samples = 0
        self.index = 0
        self.ended = False
        self.encoder: FfmpegEncoder | None = None
        self.encoded = threading.Event()  # the encoder's output is all sent
        self.send_lock = threading.Lock()  # the session thread and the encoder's reader both send
        self.release = lambda: None
        self.format = "pcm"
        self.pieces = PieceJournal(service.journal, g.request_id)

    # -- the session ---------------------------------------------------------------------------
    def run(self) -> None:
        unspoken: str | None = "the session ended before this text was spoken"
        try:
            self._serve()
            unspoken = None
            self._send_json({"type": "done", "audio_s": self._clock(self.samples)})
        except _Cancelled:
            unspoken = None  # the client's own say: withdrawn, not failed
            self._close_encoder()  # no encoded audio after `done`
            self._send_last({"type": "done", "audio_s": self._clock(self.samples), "cancelled": True})
        except (SessionError, ApiError) as exc:
            unspoken = f"{exc.code}: {exc.message}"
            self._send_error(exc.code, exc.message)
        except CosyedgeError as exc:
            error = ApiError.from_device(exc)
            unspoken = f"{error.code}: {exc}"
            if error.status >= 500:
                log.error("websocket session: %s: %s", type(exc).__name__, exc)
            self._send_error(error.code, error.message)
        except ConnectionClosed:
            unspoken = "the client left before this text was spoken"
            log.info("websocket client left after %d segments", self.index)
        except Exception as exc:  # noqa: BLE001 - the client gets an error event, the log the traceback
            unspoken = f"{type(exc).__name__}: {exc}"
            log.exception("websocket session failed")
            self._send_error("internal_error", "internal error")
        finally:
            self.pieces.close(unspoken)
            self._close_encoder()
            self.release()
            try:
                self.ws.close()
            except ConnectionClosed:  # the client closed first
                pass

    def _serve(self) -> None:
        first = self._receive(block=True)
        if first.get("type") != "start":
            raise SessionError("bad_message", 'the first message must be {"type": "start", ...}')
        self._start(first)
        while True:
            if self.pending:
                self._speak(self.pending.popleft())
            elif self.ended:
                break
            else:
                self._handle(self._receive(block=True))
        if self.encoder is not None:
            self.encoder.finish()
            if not self.encoded.wait(self.idle_s):
                raise SessionError("encoding_failed", "the encoder did not finish")

    def _start(self, message: dict[str, Any]) -> None:
        engine, _ = self.service.require_ready()
        fmt = message.get("format", "pcm")
        if fmt not in WS_FORMATS:
            raise SessionError("unknown_format", f"unknown format {str(fmt)[:32]!r}; choose one of {', '.join(WS_FORMATS)}")
        self.format = fmt
        rate = message.get("sample_rate")
        if rate is not None and rate != engine.sample_rate:
            raise SessionError("unsupported_sample_rate", f"this voice speaks at {engine.sample_rate} Hz; "
                                                          "omit sample_rate or give that rate")
        model = message.get("model")
        if model is not None and model not in (*OPENAI_MODELS, engine.bundle.manifest.name):
            raise SessionError("unknown_model", f"unknown model {str(model)[:64]!r}; see /v1/models")
        voice = message.get("voice")
        if voice is not None and not isinstance(voice, (str, int)):
            raise SessionError("unknown_voice", "voice must be a name or a numeric speaker id")
        deterministic = message.get("deterministic", False)
        if not isinstance(deterministic, bool):
            raise SessionError("invalid_parameter", "deterministic must be true or false")
        sampling = message.get("sampling", "default")
        if not isinstance(sampling, str):
            raise SessionError("invalid_parameter", "sampling must be default or greedy")
        self.params = {"voice": self.service.aliases.get(voice, voice) if isinstance(voice, str) else voice,
                       "speed": message.get("speed", 1.0), "deterministic": deterministic, "seed": message.get("seed"),
                       "sampling": sampling, "preset": message.get("preset")}
        engine.options(**self.params)  # validated once, here: the errors come before any audio
        self.release = current_guard().streams.acquire(self.client)
        self.rate = engine.sample_rate
        if fmt == "wav":
            self._send(streaming_wav_header(self.rate))
        elif fmt in ("mp3", "opus"):
            self.encoder = FfmpegEncoder(fmt, self.rate, self._encoded)

    def _handle(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == "cancel":
            raise _Cancelled()
        if kind == "start":
            raise SessionError("bad_message", "the stream has already started")
        if kind not in ("text", "end"):
            raise SessionError("bad_message", f"unknown message type {str(kind)[:32]!r}; send start, text, end or cancel")
        if self.ended:
            raise SessionError("bad_message", f"{kind!r} after end")
        if kind == "end":
            self.pending.extend(self.splitter.flush())
            self.ended = True
            return
        text = message.get("text")
        if not isinstance(text, str):
            raise SessionError("bad_message", "text must be a string")
        if len(text) > self.max_text:
            raise SessionError("text_too_long", f"a text message has {len(text)} characters; the limit is {self.max_text}")
        self.pieces.accept(text, self.params, self.format)
        self.pending.extend(self.splitter.feed(text))

    def _speak(self, sentence: str) -> None:
        """One sentence: its audio as it is made, then its `segment` event; messages are taken between chunks."""
        if not self.service.ready.is_set():
            raise ShuttingDown()
        engine, batcher = self.service.require_ready()
        # CosyVoice: the sentence counts among the requests in flight (QueueFull -> a `queue_full` error event)
        release = batcher.admit() if batcher.continuous else None
        start = self.samples
        stream = engine.stream(sentence, **self.params)
        try:
            for chunk in stream:
                self.samples += len(chunk)
                pcm = to_pcm16(chunk)
                if self.encoder is not None:
                    self.encoder.write(pcm)
                else:
                    self._send(pcm)
                while (message := self._receive(block=False)) is not None:
                    self._handle(message)
        finally:
            stream.close()  # a cancelled CosyVoice stream leaves its decode row at once
            if release is not None:
                release()
        self._send_json({"type": "segment", "index": self.index, "text": sentence,
                         "start_s": self._clock(start), "end_s": self._clock(self.samples)})
        self.pieces.spoke(sentence)
        self.index += 1

    # -- frames --------------------------------------------------------------------------------
    def _receive(self, block: bool) -> dict[str, Any] | None:
        data = self.ws.receive(timeout=self.idle_s if block else 0)
        if data is None:
            if block:
                raise SessionError("idle_timeout", f"nothing received for {self.idle_s:.0f} s")
            return None
        if isinstance(data, bytes):
            raise SessionError("bad_message", "binary frames are not accepted; send JSON text frames")
        try:
            message = json.loads(data)
        except ValueError:
            raise SessionError("bad_message", "a message is not valid JSON") from None
        if not isinstance(message, dict):
            raise SessionError("bad_message", 'a message must be a JSON object with a "type"')
        return message

    def _clock(self, samples: int) -> float:
        return round(samples / self.rate, 6) if self.rate else 0.0

    def _send(self, data: bytes | str) -> None:
        """One frame; a client gone mid-send (a reset socket is an OSError) is ConnectionClosed, whichever thread
        sends."""
        with self.send_lock:
            try:
                self.ws.send(data)
            except OSError as exc:
                raise ConnectionClosed() from exc

    def _send_json(self, event: dict[str, Any]) -> None:
        self._send(json.dumps(event))

    def _close_encoder(self) -> None:
        if self.encoder is not None:
            self.encoder.close()
            self.encoder = None

    def _send_error(self, code: str, message: str) -> None:
        self._close_encoder()
        self._send_last({"type": "error", "code": code, "message": message})

    def _send_last(self, event: dict[str, Any]) -> None:
        """The session's last event; a client already gone is no error."""
        try:
            self._send_json(event)
        except ConnectionClosed:
            pass

    def _encoded(self, event: tuple) -> None:
        """The encoder's reader thread: encoded bytes go out as they come."""
        kind, payload = event
        if kind == "eof":
            self.encoded.set()
            return
        try:
            self._send(payload)
        except ConnectionClosed:
            pass  # the session thread finds out at its next send or receive
