"""WebSocket `GET /v1/audio/stream`: text in pieces (an LLM's output) in; audio and subtitle timings out.

Protocol (issue 11, api/README.md): the client sends JSON text frames: `start` (the request declaration's
fields of the WebSocket door: voice or speaker_id, format, sample_rate, speed, model, deterministic, seed,
sampling, preset, mode, instruct_text, timestamps; checked as HTTP checks them), any number of `text`, then
`end`; `cancel` stops at once. Every frame goes through the HTTP bodies' bounded JSON parser.
The server sends binary audio frames as they are made, with `timestamps` a `word` event once the audio holding
the word is out (`wsclock.py`), a `segment` event per sentence once its audio is complete (start_s/end_s on the
output audio's clock), then `done` with audio_s; an error is an `error` event then a normal close (1000).

One session is one request of the gthread worker, and one request in flight for admission (`queue_size`): its
place is taken at `start` (beyond the bound: a `queue_full` error event with `retry_after`) and given back when
the session ends. Two threads serve it. A reader thread takes every message as it arrives (simple-websocket
queues the frames): a `text` piece is journalled at once, before anything else happens to it, and handed on in
order; `cancel`, a bad message or a client gone withdraw the sentence under way at once. The session thread
cuts the text into sentences with `SentenceStream` (the splitter `split_sentences` uses, the first one cut
early at a clause) and speaks each through the engine's door (`device/door.py`) like any other request: the
family's own frontend rules, CosyVoice chunks as they are vocoded, VITS sentences in turn with other requests.

Bounds against idle and flooding clients (issue 21): the handshake takes one of the client's stream slots
(`max_streams_per_client`; beyond: a 429 `too_many_streams` JSON answer, no upgrade), so one client's idle
handshakes cannot hold every worker thread, and `start` must come within `websocket_start_timeout_s` (else a
`start_timeout` error event). A session holds at most `websocket_max_pending_chars` characters accepted and
not yet spoken (else a `text_too_long` error event, the piece refused before it is journalled).

Nothing accepted is lost: a piece's journal entry (`journal.PieceJournal`) is closed once the sentences spoken
cover it; a session that ends any other way than `done` or the client's own `cancel` (an error, a client that
left, a shutdown) dead-letters its open pieces, and a SIGKILL leaves them to the next start's recovery, as for
HTTP requests.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
from typing import Any, Callable, Mapping

from flask import Blueprint, Response, g, request
from simple_websocket import ConnectionClosed, Server
from wsproto.utilities import LocalProtocolError

from cosyedge.api.admission import Ticket
from cosyedge.api.bodies import loads, parse
from cosyedge.api.errors import ApiError, ShuttingDown
from cosyedge.api.journal import PieceJournal
from cosyedge.api.routes.wsclock import SessionClock
from cosyedge.api.security import current_guard
from cosyedge.api.service import Service, current_service
from cosyedge.device import SentenceStream, SynthesisOptions
from cosyedge.device.audio import FfmpegEncoder, Resampler, streaming_wav_header, to_pcm16
from cosyedge.device.door import Job, Stream
from cosyedge.device.engine import Engine
from cosyedge.device.errors import CosyedgeError
from cosyedge.device.request import BY_NAME, WEBSOCKET, Request

log = logging.getLogger(__name__)

blueprint = Blueprint("websocket", __name__)
ROUTE = "/v1/audio/stream"
# A frame's bound, in characters as simple-websocket counts a text frame: a text of max_text_len characters fits
# even as JSON escapes (an astral character is 12: "\\ud83d\\ude00"), so the text's own length decides
# (a `text_too_long` event), never the transport's close 1009.
FRAME_CHARS_PER_TEXT_CHAR, FRAME_ENVELOPE_CHARS = 12, 4096
_READ_POLL_S = 0.25  # the reader thread checks this often whether the session is over
_CLOSE_WAIT_S = 1.0  # at the end, how long simple-websocket's reader may take to send its close reply


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
    release = current_guard().streams.acquire(g.client)  # before the upgrade: beyond the allowance, a 429 answer
    try:
        try:
            ws = Server(request.environ, max_message_size=service.config.max_text_len * FRAME_CHARS_PER_TEXT_CHAR
                        + FRAME_ENVELOPE_CHARS)
        except RuntimeError:  # the in-process test server (waitress) hands out no socket
            raise ApiError(501, "websocket_unavailable",
                           "this server cannot upgrade to WebSocket; use `cosyedge serve`") from None
        Session(ws, service, g.client, release).run()  # releases the slot before its close frame
    finally:
        release()  # whatever failed before the session ran (releasing twice is a no-op)
    return _Upgraded(status=101)


def start_request(message: dict[str, Any], engine: Engine, aliases: Mapping[str, str]) -> Request:
    """The `start` message's request: every key but `type` is a field of the declaration's WebSocket door."""
    return parse({k: v for k, v in message.items() if k != "type"}, WEBSOCKET, engine, aliases)


class Session:
    """One client's stream: its options, splitter, encoder and audio clock (nothing shared between sessions).

    Two threads: the session thread (the request's) speaks, one sentence at a time through the door; the reader
    thread takes every message as it arrives, journals a `text` piece at once, hands it to the session thread in
    order (`inbox`), and withdraws the sentence under way at once on `cancel`, a bad message or a client gone.
    """

    def __init__(self, ws: Server, service: Service, client: str, release: Callable[[], None]) -> None:
        self.ws, self.service, self.client = ws, service, client
        self.idle_s = service.config.request_timeout_s
        self.start_s = service.config.websocket_start_timeout_s
        self.max_text, self.max_pending = service.config.max_text_len, service.config.max_pending_chars
        self.splitter = SentenceStream(max_chars=min(400, self.max_text))
        self.options: SynthesisOptions | None = None
        self.resample = Resampler(1, None)
        self.clock = SessionClock()  # the events' times; `word` events held until their audio is out
        self.timestamps = False  # `word` events asked for
        self.index = 0
        self.ended = False  # the reader has taken `end`
        self.encoder: FfmpegEncoder | None = None
        self.encoded = threading.Event()  # the encoder's output is all sent
        self.send_lock = threading.Lock()  # the session thread and the encoder's reader both send
        self.release = release  # the client's stream slot, taken at the handshake
        self.ticket: Ticket | None = None  # the session's place among the requests in flight
        self.format = "pcm"
        self.pieces = PieceJournal(service.journal, ROUTE, g.request_id)
        self.inbox: queue.Queue[tuple[str, str | None]] = queue.Queue()  # ("text", piece) | ("end"|"halt", None)
        self.pending = 0  # characters accepted and not yet spoken: the inbox's, the splitter's, the sentences cut
        self.pending_lock = threading.Lock()  # the reader adds, the session thread takes away
        self.halt: BaseException | None = None  # what the reader ended the session with (cancel, bad message, gone)
        self.stop = threading.Event()  # set with `halt`: the sentence under way is withdrawn
        self.closing = threading.Event()  # the session is over: the reader stops
        self.current: Stream | None = None
        self.reader: threading.Thread | None = None

    # -- the session ---------------------------------------------------------------------------
    def run(self) -> None:
        unspoken: str | None = "the session ended before this text was spoken"
        try:
            self._serve()
            unspoken = None
            self._send_json({"type": "done", "audio_s": self.clock.seconds(self.clock.samples)})
        except _Cancelled:
            unspoken = None  # the client's own say: withdrawn, not failed
            self._close_encoder()  # no encoded audio after `done`
            self._send_last({"type": "done", "audio_s": self.clock.seconds(self.clock.samples), "cancelled": True})
        except (SessionError, ApiError) as exc:
            unspoken = f"{exc.code}: {exc.message}"
            self._send_error(exc.code, exc.message, exc.retry_after if isinstance(exc, ApiError) else None)
        except CosyedgeError as exc:
            error = ApiError.from_device(exc)
            unspoken = f"{exc.code}: {exc}"
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
            self.closing.set()
            self.stop.set()
            if self.reader is not None:
                self.reader.join(timeout=5)
            self.pieces.close(unspoken)  # after the reader: a piece it journalled last is closed too
            self._close_encoder()
            if self.ticket is not None:
                self.ticket.release()
            self.release()
            try:
                self.ws.close()
            except (ConnectionClosed, LocalProtocolError):  # the client closed first, or simple-websocket (1007/1009)
                pass
            # gunicorn closes the socket once the route returns: simple-websocket's reader thread first sends the
            # close reply it owes (to the client's close, or its own 1007/1009) and takes the client's
            self.ws.thread.join(_CLOSE_WAIT_S)

    def _serve(self) -> None:
        first = self._receive(self.start_s)
        if first is None:
            raise SessionError("start_timeout", f"no start message within {self.start_s:g} s of the handshake")
        if first.get("type") != "start":
            raise SessionError("bad_message", 'the first message must be {"type": "start", ...}')
        self._start(first)
        self.reader = threading.Thread(target=self._read, name="cosyedge-ws-reader", daemon=True)
        self.reader.start()
        while True:
            kind, text = self._take()
            self._feed(text if kind == "text" else None)
            if kind == "end":
                break
        self._audio(self.resample.flush())
        if self.encoder is not None:
            self.encoder.finish()
            if not self.encoded.wait(self.idle_s):
                raise SessionError("encoding_failed", "the encoder did not finish")

    def _start(self, message: dict[str, Any]) -> None:
        engine, _ = self.service.require_ready()
        job = start_request(message, engine, self.service.aliases)
        self.options, self.format = job.options, job.format  # validated once, here: errors come before any audio
        self.timestamps = job.timestamps
        self.ticket = self.service.admission.admit()[0]  # the session is one request in flight until it ends
        out_rate = job.rate(engine.sample_rate)
        self.clock.start(engine.sample_rate, out_rate)
        self.resample = Resampler(engine.sample_rate, out_rate)
        if job.format == "wav":
            self._send(streaming_wav_header(out_rate))
        elif job.format != "pcm":
            self.encoder = FfmpegEncoder(job.format, out_rate, self._encoded)

    def _take(self) -> tuple[str, str | None]:
        """The next piece (or `end`) in arrival order; what the reader halted with is raised instead."""
        if self.halt is not None:
            raise self.halt
        try:
            kind, text = self.inbox.get(timeout=self.idle_s)
        except queue.Empty:
            raise SessionError("idle_timeout", f"nothing received for {self.idle_s:.0f} s") from None
        if self.halt is not None:
            raise self.halt
        return kind, text

    def _feed(self, text: str | None) -> None:
        """Speak the sentences `text` completes (None: the end, the unfinished tail); the pending count drops by
        what the splitter let go unspoken (spaces, unspeakable text) at once, by each sentence once it is spoken."""
        before = self.splitter.held + len(text or "")
        sentences = self.splitter.flush() if text is None else self.splitter.feed(text)
        self._spoken(before - self.splitter.held - sum(map(len, sentences)))
        for sentence in sentences:
            self._speak(sentence)

    def _spoken(self, chars: int) -> None:
        """`chars` of the pending text are spoken (or dropped unspeakable): the reader may accept that many more."""
        with self.pending_lock:
            self.pending -= chars

    def _speak(self, sentence: str) -> None:
        """One sentence through the door: its audio as it is made (with `timestamps`, each word once its audio is
        out), then its `segment` event."""
        if self.halt is not None:
            raise self.halt
        if not self.service.ready.is_set():
            raise ShuttingDown()
        engine, door = self.service.require_ready()
        assert self.options is not None
        start = self.clock.samples
        stream = door.open(Job(engine.segments(sentence, words=self.timestamps), self.options,
                               deadline=self.service.admission.deadline(), words=self.timestamps), self.stop)
        self.current = stream
        try:
            for chunk in stream:
                self.clock.hold(chunk.words, start)  # a streaming pipeline's empty last chunk may end words too
                if not chunk.audio.size:
                    continue
                self.clock.samples += len(chunk.audio)
                self._audio(self.resample(chunk.audio))
        finally:
            stream.close()  # a withdrawn CosyVoice stream leaves its decode row at once
            self.current = None
        if self.halt is not None:
            raise self.halt
        for event in self.clock.rest():
            self._send_json(event)
        self._spoken(len(sentence))  # before the event: a client that waits for it may send that much again
        self._send_json({"type": "segment", "index": self.index, "text": sentence,
                         "start_s": self.clock.seconds(start), "end_s": self.clock.seconds(self.clock.samples)})
        self.pieces.spoke(sentence)
        self.index += 1

    # -- the reader thread -----------------------------------------------------------------------
    def _read(self) -> None:
        """Every message as it arrives, until the session is over; the first problem halts the session."""
        try:
            while not self.closing.is_set():
                message = self._receive(_READ_POLL_S)
                if message is not None:
                    self._handle(message)
        except BaseException as exc:  # noqa: BLE001 - handed to the session thread, which answers it
            if not self.closing.is_set():
                self._halt(exc)

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
            self.ended = True
            self.inbox.put(("end", None))
            return
        text = BY_NAME["text"].check(message.get("text"))  # a string without lone surrogates, as HTTP's text
        if text is None:
            raise ApiError(400, "invalid_parameter", "text must be a string")
        if len(text) > self.max_text:
            raise SessionError("text_too_long", f"a text message has {len(text)} characters; the limit is {self.max_text}")
        with self.pending_lock:  # before the piece is journalled: a refused piece was never accepted
            if self.pending + len(text) > self.max_pending:
                raise SessionError("text_too_long", f"the session holds {self.pending} characters not yet spoken; "
                                   f"with this message's {len(text)} that is over its bound of {self.max_pending}: "
                                   "send text about as fast as it is spoken")
            self.pending += len(text)
        try:
            self.pieces.accept(text, {"voice": self.options.voice, "speed": self.options.speed,  # type: ignore[union-attr]
                                      "format": self.format, "stream": True})
        except OSError:
            raise SessionError("journal_unavailable", "the service cannot record requests (state directory not "
                               "writable); retry later") from None
        self.inbox.put(("text", text))

    def _halt(self, exc: BaseException) -> None:
        self.halt = exc
        self.stop.set()
        current = self.current
        if current is not None:
            current.close()
        self.inbox.put(("halt", None))

    # -- frames --------------------------------------------------------------------------------
    def _receive(self, timeout: float) -> dict[str, Any] | None:
        """The next message (None: none within `timeout`)."""
        data = self.ws.receive(timeout=timeout)
        if data is None:
            return None
        if isinstance(data, bytes):
            raise SessionError("bad_message", "binary frames are not accepted; send JSON text frames")
        return loads(data)  # the HTTP bodies' bounded parser: invalid_json, nesting_too_deep, number_too_large

    def _audio(self, chunk: Any) -> None:
        """A float chunk out as pcm16: into the encoder, or as a binary frame; then the words it completes."""
        pcm = to_pcm16(chunk)
        if self.encoder is not None:
            self.encoder.write(pcm)
        elif pcm:
            self._send(pcm)
        for event in self.clock.sent_out(len(pcm) // 2):
            self._send_json(event)

    def _send(self, data: bytes | str) -> None:
        """One frame; a client gone mid-send (a reset socket is an OSError) is ConnectionClosed, whichever thread
        sends, and so is a connection simple-websocket's reader is closing (its close 1007 or 1009 sent, `connected`
        not yet False: wsproto refuses the frame)."""
        with self.send_lock:
            try:
                self.ws.send(data)
            except (OSError, LocalProtocolError) as exc:
                raise ConnectionClosed() from exc

    def _send_json(self, event: dict[str, Any]) -> None:
        self._send(json.dumps(event))

    def _close_encoder(self) -> None:
        if self.encoder is not None:
            self.encoder.close()
            self.encoder = None

    def _send_error(self, code: str, message: str, retry_after: int | None = None) -> None:
        self._close_encoder()
        event: dict[str, Any] = {"type": "error", "code": code, "message": message}
        if retry_after is not None:
            event["retry_after"] = retry_after  # queue_full: as HTTP's Retry-After
        self._send_last(event)

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
