"""The Wyoming protocol (Home Assistant's and Rhasspy's voice pipeline), standalone (`cosyedge wyoming`) or beside
`cosyedge serve`: both are a `Service` (admission, journal, the engine's door) without or with HTTP.

Built on the maintained `wyoming` package (its events and `AsyncEventHandler`); one asyncio loop reads the
clients. Events:
- `describe` -> `info`: one TTS program listing every voice of the loaded bundle, with the languages and the
  attribution the engine describes, streaming supported;
- `synthesize` -> `audio-start`, `audio-chunk`* (as the door makes the audio), `audio-stop`;
- `synthesize-start`, `synthesize-chunk`*, `synthesize-stop` -> for each sentence as soon as the text that
  arrived completes it (`SentenceStream`: a sentence ends at its stop and the space after it, or a CJK stop),
  `audio-start` / `audio-chunk`* / `audio-stop`; the unfinished tail is spoken at `synthesize-stop`, then
  `synthesize-stopped`. A `synthesize` sent while streaming is the protocol's compatibility copy of the same
  text and is ignored;
- bad input (unknown voice, nothing speakable, text too long, a chunk outside a stream) -> `error` with the
  code HTTP answers the same input with; beyond `queue_size` -> `error` `queue_full`; the connection stays usable;
  a second `synthesize-start` while a stream is open -> `error` `stream_open`, the open stream goes on;
- a malformed or oversized event (`wyoming_events`) -> `error` `bad_request` / `event_too_large`, then a normal
  close (the byte stream cannot be trusted after it); beyond `wyoming_max_connections` -> `too_many_connections`,
  nothing received for `wyoming_idle_timeout_s` while nothing is spoken -> `idle_timeout`, each then a close.
A `synthesize` / `synthesize-start` event's fields are the request declaration's (`cosyedge.device.request`,
the Wyoming door): the protocol's `voice` (`name`) and `text`, and any declared field as an extension key of
the event's data (`speed`, `seed`, `deterministic`, `sampling`, `preset`, `mode`, `instruct_text`,
`sample_rate`), over the defaults of the `cosyedge wyoming` flags (the same fields); a declared field the door
does not take (`format`, `stream`) is refused with `unknown_field`.

Each connection reads its events as they arrive and speaks in order on a task of its own: a `synthesize` or a
`synthesize-chunk` is journalled on arrival, before anything else happens to it (routes `wyoming:synthesize`,
`wyoming:synthesize-chunk`), and closed once its audio is out; what is accepted and not delivered (a failure, a
client gone, a SIGKILL) ends in the dead-letter file. A `synthesize` and a whole streamed request
(`synthesize-start` to its last audio) each hold one place among the requests in flight. The audio comes from
the door like every protocol's: CosyVoice chunks as they are vocoded (split into events of CHUNK_SAMPLES), VITS
sentences in turn with the other requests.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping
from urllib.parse import urlparse

from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Attribution, Describe, Info, TtsProgram, TtsVoice
from wyoming.server import AsyncEventHandler
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

from cosyedge.api.admission import Ticket
from cosyedge.api.errors import ApiError
from cosyedge.api.journal import PieceJournal
from cosyedge.api.security import check_wyoming_bind
from cosyedge.api.service import Service
from cosyedge.api.wyoming_events import max_event_bytes, read_event
from cosyedge.api.synthesis import detail
from cosyedge.device import (CosyedgeError, EmptyTextError, Engine, InputError, SentenceStream, TextTooLongError,
                             to_pcm16)
from cosyedge.device import request as declaration
from cosyedge.device.audio import Resampler
from cosyedge.device.door import Chunk, Job, Stream
from cosyedge.device.errors import SynthesisFailed, UnknownFieldError

log = logging.getLogger("cosyedge.wyoming")

CHUNK_SAMPLES = 2048  # per audio-chunk event (wyoming-piper sends 1024; fewer events, same latency per sentence)
ROUTE = "wyoming:synthesize"
STREAM_ROUTE = "wyoming:synthesize-chunk"
LEFT = "the client left before this text was spoken"
STREAM_UNSPOKEN_FACTOR = 4  # x max_text_len: the characters a stream may hold cut and not yet spoken
DRAIN_S, DRAIN_BYTES = 2.0, 1 << 20  # after an error event that ends a connection: what is read and dropped
# Keys of a synthesize event's data that are the protocol's own, not request fields: `voice` (read below),
# `text_format` (only plain text is spoken) and `context` (the conversation's, nothing to do with the audio).
PROTOCOL_KEYS = ("voice", "text_format", "context")


class WyomingTts:
    """What every connection shares: the service (admission, journal, door) and the default request fields."""

    def __init__(self, service: Service, defaults: dict[str, Any] | None = None) -> None:
        self.service = service
        self.engine, self.door = service.require_ready()
        self.defaults = dict(defaults or {})  # the Wyoming door's fields, from the `cosyedge wyoming` flags
        self.request({})  # refuse bad defaults before anything listens

    def info(self) -> Info:
        manifest, described = self.engine.bundle.manifest, self.engine.describe()
        attribution = Attribution(**described["attribution"])  # type: ignore[arg-type]
        languages = list(described["languages"])  # type: ignore[call-overload]
        voices = [TtsVoice(name=name, description=f"{name} ({manifest.name})", attribution=attribution, installed=True,
                           version=None, languages=languages, speakers=None) for name in self.engine.voices()]
        return Info(tts=[TtsProgram(name="cosyedge", description=f"cosyedge: {manifest.name}", attribution=attribution,
                                    installed=True, version=None, voices=voices, supports_synthesize_streaming=True)])

    def request(self, data: dict[str, Any]) -> declaration.Request:
        """A synthesize / synthesize-start event's request (its data as sent), over the server's defaults."""
        return event_request(data, self.defaults, self.engine, self.service.aliases)

    def payload(self, request: declaration.Request, stream: bool) -> dict[str, Any]:
        """What the journal keeps of a request besides its text."""
        return {"voice": request.options.voice, "speed": request.options.speed, "format": "pcm", "stream": stream}


def event_request(data: dict[str, Any], defaults: Mapping[str, Any], engine: Engine,
                  aliases: Mapping[str, str]) -> declaration.Request:
    """A synthesize / synthesize-start event's request (its data as sent) over `defaults` (the `cosyedge wyoming`
    flags), checked as every door checks it."""
    if not isinstance(data, dict):
        raise InputError("an event's data must be an object")
    voice = data.get("voice")
    if voice is not None and not isinstance(voice, dict):
        raise InputError("voice must be an object with a name")
    if (voice or {}).get("speaker") is not None:
        raise UnknownFieldError("voice.speaker: these voices have no speakers; choose a voice by its name")
    if data.get("text_format") not in (None, "text"):
        raise InputError("only text_format 'text' is spoken (no SSML)")
    fields = {key: value for key, value in data.items() if key not in PROTOCOL_KEYS}
    name = (voice or {}).get("name")  # a language alone: the bundle's default voice
    values = {**defaults, **fields, **({"voice": name} if name is not None else {})}
    return declaration.parse(values, declaration.WYOMING, engine, aliases)


class _Request:
    """A one-shot `synthesize`, admitted and journalled on arrival; `settle` closes it once: delivered (None) or
    dead-lettered with why."""

    def __init__(self, service: Service, payload: dict[str, Any], ticket: Ticket) -> None:
        self.journal, self.payload, self.ticket = service.journal, payload, ticket
        self.request_id = uuid.uuid4().hex[:16]
        self.settled = False
        try:
            self.journal.accepted(self.request_id, ROUTE, payload)
        except OSError:
            ticket.release()
            raise _journal_unavailable() from None

    def settle(self, why: str | None) -> None:
        if self.settled:
            return
        self.settled = True
        if why is None:
            self.journal.finished(self.request_id)
        else:
            self.journal.dead_letter(ROUTE, self.request_id, self.payload, why)
        self.ticket.release()


class _Stream:
    """One streaming request: its request fields, splitter, pieces journalled on arrival and place in flight; `settle`
    closes its pieces (delivered: None, else dead-lettered with why) and gives its place back."""

    def __init__(self, service: Service, request: declaration.Request, ticket: Ticket) -> None:
        self.request, self.ticket = request, ticket
        self.pieces = PieceJournal(service.journal, STREAM_ROUTE, uuid.uuid4().hex[:16])
        self.splitter = SentenceStream(max_chars=min(400, service.config.max_text_len))
        self.spoken = 0  # sentences spoken
        self.queued = 0  # characters of the sentences cut and not yet spoken (the splitter holds at most 400 more)
        self.settled = False

    def settle(self, why: str | None) -> None:
        if self.settled:
            return
        self.settled = True
        self.pieces.close(why)
        self.ticket.release()


class _Refused:
    """A streaming request refused at `synthesize-start` (queue full): its chunks and stop are dropped."""


def _journal_unavailable() -> ApiError:
    return ApiError(503, "journal_unavailable", "the service cannot record requests (state directory not "
                    "writable); retry later")


class Handler(AsyncEventHandler):
    """One client connection: events handled as they arrive, speech in order on the connection's speaker task."""

    def __init__(self, tts: WyomingTts, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__(reader, writer)
        self.tts = tts
        self.service = tts.service
        self.stream: _Stream | _Refused | None = None
        self.work: asyncio.Queue[Callable[[], Awaitable[None]]] = asyncio.Queue()
        self.speaker: asyncio.Task | None = None
        self.open: list[_Request | _Stream] = []  # accepted and not yet delivered
        self.speaking = 0  # 1 while the speaker task works (the connection is then not idle)

    async def run(self) -> None:
        """Events as they arrive, each read bounded and checked (`wyoming_events`); a malformed one is answered
        with an `error` event, then the connection closes normally."""
        config = self.service.config
        limit, idle = max_event_bytes(config.max_text_len), config.wyoming_idle_timeout_s
        read: asyncio.Future | None = None
        try:
            while True:
                read = read or asyncio.ensure_future(read_event(self.reader, limit))
                if not (await asyncio.wait({read}, timeout=idle))[0]:
                    if self.speaking or not self.work.empty():  # the client waits for its audio: not idle
                        continue
                    read.cancel()
                    await self.end(ApiError(408, "idle_timeout", f"nothing received for {idle:.0f} s"))
                    break
                try:
                    event, read = read.result(), None
                except ApiError as exc:
                    await self.end(exc)
                    break
                except ConnectionError:  # the client reset the connection: it left, as at EOF
                    break
                if event is None:
                    break
                await self.handle_event(event)
        finally:
            await self.disconnect()
            self.writer.close()

    async def end(self, why: ApiError) -> None:
        """The connection ends on an error: its event, then a normal close."""
        await self._error(why, "an")
        await self._drain()

    async def _drain(self) -> None:
        """Before closing after an error event: say we are done, then read (and drop) what the client is still
        sending, a bounded while, so the close is a FIN after the error event, not a reset that could lose it."""
        try:
            self.writer.write_eof()
            deadline, dropped = asyncio.get_running_loop().time() + DRAIN_S, 0
            while dropped < DRAIN_BYTES and (left := deadline - asyncio.get_running_loop().time()) > 0:
                piece = await asyncio.wait_for(self.reader.read(65536), left)
                if not piece:
                    return
                dropped += len(piece)
        except (OSError, RuntimeError, asyncio.TimeoutError):  # the client is gone or keeps talking: close anyway
            pass

    async def handle_event(self, event: Event) -> bool:
        try:
            await self._handle(event)
        except Exception as exc:  # noqa: BLE001 - every failure is an error event; the connection stays usable
            await self._error(exc, event.type)
        return True

    async def disconnect(self) -> None:
        """The client is gone: withdraw what is being spoken, dead-letter what was accepted and not delivered."""
        if self.speaker is not None:
            self.speaker.cancel()
            try:
                await self.speaker
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the client is gone either way
                pass
        for accepted in self.open:
            accepted.settle(LEFT)
        self.open.clear()

    async def _error(self, exc: BaseException, what: str) -> None:
        if isinstance(exc, ConnectionError):  # the client reset the connection: nobody to answer, nothing failed
            return
        if isinstance(exc, SynthesisFailed):
            error = Error(text="synthesis failed", code="synthesis_failed")
        elif isinstance(exc, CosyedgeError):  # the code HTTP answers the same input with
            answer = ApiError.from_device(exc)
            error = Error(text=answer.message, code=answer.code)
        elif isinstance(exc, ApiError):  # the service's: queue full, journal unavailable
            error = Error(text=exc.message, code=exc.code)
        elif isinstance(exc, (KeyError, TypeError, ValueError)):  # a malformed event (missing or mistyped field)
            error = Error(text=f"malformed {what} event", code="bad_request")
        else:
            log.error("wyoming: %s failed: %s: %s", what, type(exc).__name__, exc)
            error = Error(text="synthesis failed", code="synthesis_failed")
        try:
            await self.write_event(error.event())
        except (ConnectionError, RuntimeError):  # the client is gone
            pass

    # -- events, as they arrive ------------------------------------------------------------------
    async def _handle(self, event: Event) -> None:
        if Describe.is_type(event.type):
            await self.write_event(self.tts.info().event())
        elif Synthesize.is_type(event.type):
            if self.stream is None:  # while streaming this is the compatibility copy of the same text: ignored
                await self._synthesize(self.tts.request(event.data))
        elif SynthesizeStart.is_type(event.type):
            if isinstance(self.stream, _Stream) and not self.stream.settled:  # its text is not dropped unspoken
                raise ApiError(409, "stream_open", "synthesize-start while a stream is open; send synthesize-stop "
                               "first (the open stream goes on)")
            request = self.tts.request(event.data)
            if request.text is not None:
                raise UnknownFieldError("synthesize-start carries no text; send it in synthesize-chunk events")
            try:
                ticket = self.service.admission.admit()[0]
            except ApiError:
                self.stream = _Refused()
                raise
            self.stream = _Stream(self.service, request, ticket)
            self.open.append(self.stream)
        elif SynthesizeChunk.is_type(event.type):
            self._chunk(SynthesizeChunk.from_event(event).text)
        elif SynthesizeStop.is_type(event.type):
            stream, self.stream = self.stream, None
            if stream is None:
                raise InputError("synthesize-stop without synthesize-start")
            if isinstance(stream, _Stream):
                for sentence in stream.splitter.flush():
                    self._enqueue_sentence(stream, sentence)
                self._enqueue(lambda s=stream: self._stopped(s))

    async def _synthesize(self, request: declaration.Request) -> None:
        """A one-shot request: validated, admitted, journalled, then spoken in turn."""
        if request.text is None:
            raise InputError("text must be a string")
        segments = await asyncio.get_running_loop().run_in_executor(None, self.tts.engine.segments, request.text)
        ticket = self.service.admission.admit()[0]
        accepted = _Request(self.service, {"text": request.text, **self.tts.payload(request, stream=False)}, ticket)
        self.open.append(accepted)

        async def speak() -> None:
            try:
                await self._audio(request, Job(segments, request.options, deadline=self.service.admission.deadline()))
            except Exception as exc:
                self._settle(accepted, detail(exc))
                raise
            self._settle(accepted, None)
        self._enqueue(speak)

    def _chunk(self, text: object) -> None:
        stream = self.stream
        if isinstance(stream, _Refused) or (isinstance(stream, _Stream) and stream.settled):
            return  # refused at its start, or failed on an earlier sentence: the client has its error event
        if stream is None:
            raise InputError("synthesize-chunk without synthesize-start")
        text = declaration.BY_NAME["text"].check(text)  # a string without lone surrogates, as HTTP's text
        if text is None:
            raise InputError("text must be a string")
        limit = self.service.config.max_text_len
        if len(text) > limit:
            raise TextTooLongError(f"a synthesize-chunk has {len(text)} characters; the limit is {limit}")
        bound = STREAM_UNSPOKEN_FACTOR * limit  # what a stream holds unspoken, whatever the client sends
        if stream.queued + len(text) > bound:
            raise TextTooLongError(f"the stream holds {stream.queued} characters not yet spoken; with this chunk's "
                                   f"{len(text)} that is over its bound of {bound}: wait for its audio")
        try:
            stream.pieces.accept(text, self.tts.payload(stream.request, stream=True))
        except OSError:
            raise _journal_unavailable() from None
        for sentence in stream.splitter.feed(text):
            self._enqueue_sentence(stream, sentence)

    # -- speech, in order ------------------------------------------------------------------------
    def _enqueue(self, work: Callable[[], Awaitable[None]]) -> None:
        if self.speaker is None:
            self.speaker = asyncio.get_running_loop().create_task(self._speak_in_order())
        self.work.put_nowait(work)

    def _enqueue_sentence(self, stream: _Stream, sentence: str) -> None:
        stream.queued += len(sentence)
        self._enqueue(lambda: self._speak_sentence(stream, sentence))

    def _settle(self, accepted: _Request | _Stream, why: str | None) -> None:
        accepted.settle(why)
        if accepted in self.open:
            self.open.remove(accepted)

    async def _speak_in_order(self) -> None:
        while True:
            work = await self.work.get()
            self.speaking = 1
            try:
                await work()
            except Exception as exc:  # noqa: BLE001 - an error event; the connection goes on
                await self._error(exc, "synthesize")
            finally:
                self.speaking = 0

    async def _speak_sentence(self, stream: _Stream, sentence: str) -> None:
        try:
            await self._speak_queued(stream, sentence)
        finally:
            stream.queued -= len(sentence)

    async def _speak_queued(self, stream: _Stream, sentence: str) -> None:
        if stream.settled:  # failed on an earlier sentence: the error event was sent
            return
        try:
            segments = await asyncio.get_running_loop().run_in_executor(None, self.tts.engine.segments, sentence)
            await self._audio(stream.request, Job(segments, stream.request.options,
                                                  deadline=self.service.admission.deadline()))
        except Exception as exc:
            self._settle(stream, detail(exc))
            raise
        stream.spoken += 1
        stream.pieces.spoke(sentence)

    async def _stopped(self, stream: _Stream) -> None:
        """The stream's last sentence is out: close its entries and its place, say `synthesize-stopped`."""
        if stream.settled:
            return
        if stream.spoken == 0:
            empty = EmptyTextError("text contains nothing speakable for this voice")
            self._settle(stream, detail(empty))
            raise empty
        self._settle(stream, None)
        await self.write_event(SynthesizeStopped().event())

    async def _audio(self, request: declaration.Request, job: Job) -> None:
        """audio-start, the job's audio as the door makes it (at the request's rate), audio-stop."""
        voice_rate = self.tts.engine.sample_rate
        rate = request.rate(voice_rate)
        resample = Resampler(voice_rate, rate)
        await self.write_event(AudioStart(rate=rate, width=2, channels=1).event())
        async for chunk in _chunks(self.tts.door.open(job)):
            await self._pcm(rate, to_pcm16(resample(chunk.audio)))
        await self._pcm(rate, to_pcm16(resample.flush()))
        await self.write_event(AudioStop().event())

    async def _pcm(self, rate: int, pcm: bytes) -> None:
        for start in range(0, len(pcm), CHUNK_SAMPLES * 2):
            await self.write_event(AudioChunk(rate=rate, width=2, channels=1,
                                              audio=pcm[start:start + CHUNK_SAMPLES * 2]).event())


async def _chunks(stream: Stream) -> AsyncIterator[Chunk]:
    """A door stream's chunks on the event loop: a thread of its own waits for them (never the loop, nor the
    default executor, whose few threads many waiting clients would fill)."""
    loop = asyncio.get_running_loop()
    arrived: asyncio.Queue = asyncio.Queue()
    end = object()

    def hand_over(item: object) -> None:
        try:
            loop.call_soon_threadsafe(arrived.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody waits any more
            stream.close()

    def pump() -> None:
        try:
            for chunk in stream:
                hand_over(chunk)
            hand_over(end)
        except BaseException as exc:  # noqa: BLE001 - raised on the loop's side
            hand_over(exc)

    threading.Thread(target=pump, name="cosyedge-wyoming-stream", daemon=True).start()
    try:
        while (item := await arrived.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stream.close()


def parse_uri(uri: str) -> tuple[str, int]:
    """tcp://HOST:PORT (port 0: a free one)."""
    parsed = urlparse(uri)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme != "tcp" or not parsed.hostname or port is None:
        raise InputError(f"--uri must look like tcp://127.0.0.1:10200, not {uri[:64]!r}")
    return parsed.hostname, port


async def serve_async(tts: WyomingTts, uri: str, started: Callable[[int], None] = lambda port: None,
                      zeroconf: str | None = None) -> None:
    """Listen on `uri` until cancelled; `started(port)` once bound."""
    host, port = parse_uri(uri)

    open_now = [0]  # connections of this server (one loop: no lock)

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = Handler(tts, reader, writer)
        if open_now[0] >= tts.service.config.wyoming_max_connections:
            await handler.end(ApiError(503, "too_many_connections", "too many Wyoming connections; retry later"))
            writer.close()
            return
        open_now[0] += 1
        try:
            await handler.run()
        finally:
            open_now[0] -= 1

    server = await asyncio.start_server(client, host, port, limit=max_event_bytes(tts.service.config.max_text_len))
    bound = server.sockets[0].getsockname()[1]
    if zeroconf is not None:
        try:
            from wyoming.zeroconf import HomeAssistantZeroconf  # needs the `zeroconf` package: only with the flag
        except ImportError:
            raise InputError("--zeroconf needs the zeroconf package (pip install zeroconf)") from None
        await HomeAssistantZeroconf(port=bound, name=zeroconf or None).register_server()
    started(bound)
    async with server:
        await server.serve_forever()


def start_in_thread(tts: WyomingTts, uri: str) -> tuple[int, Callable[[], None]]:
    """The server on its own loop in a daemon thread (beside the HTTP service): (port, stop)."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    port: list[int] = []
    task: list[asyncio.Task] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        task.append(loop.create_task(serve_async(tts, uri, lambda p: (port.append(p), ready.set()))))
        try:
            loop.run_until_complete(task[0])
        except (asyncio.CancelledError, OSError) as exc:
            if isinstance(exc, OSError):
                log.error("wyoming: cannot listen on %s: %s", uri, exc.strerror or exc)
        finally:
            ready.set()

    threading.Thread(target=run, name="cosyedge-wyoming", daemon=True).start()
    ready.wait()
    if not port:
        raise InputError(f"cannot listen on {uri}")
    return port[0], lambda: loop.call_soon_threadsafe(task[0].cancel)


def start_for_service(service: Service, uri: str) -> int:
    """Wyoming beside `cosyedge serve`: the service's admission, journal and door; returns the port."""
    check_wyoming_bind(uri)
    port, _ = start_in_thread(WyomingTts(service), uri)
    log.info("wyoming: listening on tcp://%s:%d (same engine as HTTP)", parse_uri(uri)[0], port)
    return port
