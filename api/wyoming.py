"""The Wyoming protocol's TTS handler (Home Assistant's and Rhasspy's voice pipeline): what each event asks for, as
door requests, standalone (`cosyedge wyoming`) or beside `cosyedge serve`: both are a `Service` (admission,
journal, the engine's door) without or with HTTP.

Built on the maintained `wyoming` package (its events and `AsyncEventHandler`, under `wyoming_transport`'s
`Connection`). Events:
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
- while the server drains (beside `serve`: a reload, a SIGTERM) a new `synthesize` / `synthesize-start` ->
  `error` `shutting_down`; what the connection holds in flight (`in_flight`) is finished first;
- the connection's own bounds (a malformed or oversized event, the cap on connections, the idle timeout, the write
  deadline) are its transport's (`wyoming_transport`), and so are listening, the drain and the connections' loop.
A `synthesize` / `synthesize-start` event's fields are the request declaration's (`cosyedge.device.request`,
the Wyoming door): the protocol's `voice` (`name`) and `text`, and any declared field as an extension key of
the event's data (`speed`, `seed`, `deterministic`, `sampling`, `preset`, `mode`, `instruct_text`,
`sample_rate`), over the defaults of the `cosyedge wyoming` flags (the same fields); a declared field the door
does not take (`format`, `stream`) is refused with `unknown_field`.

Each connection reads its events as they arrive and speaks in order on a task of its own: a `synthesize` or a
`synthesize-chunk` is journalled on arrival (`wyoming_requests`), before anything else happens to it (routes
`wyoming:synthesize`, `wyoming:synthesize-chunk`), and closed once its audio is out; what is accepted and not
delivered (a failure, a client gone, a SIGKILL) ends in the dead-letter file. A `synthesize` and a whole
streamed request (`synthesize-start` to its last audio) each hold one place among the requests in flight. The
audio comes from the door like every protocol's: CosyVoice chunks as they are vocoded (split into events of
CHUNK_SAMPLES), VITS sentences in turn with the other requests.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator, Awaitable, Callable

from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.event import Event
from wyoming.info import Attribution, Describe, Info, TtsProgram, TtsVoice
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

from cosyedge.api.admission import Ticket
from cosyedge.api.errors import ApiError, ShuttingDown
from cosyedge.api.security import check_wyoming_bind
from cosyedge.api.service import Service
from cosyedge.api.synthesis import detail
from cosyedge.api.wyoming_requests import OneShot, RefusedStream, StreamRequest, event_request, journal_unavailable
from cosyedge.api.wyoming_transport import Connection, Listener, log, parse_uri, start_in_thread
from cosyedge.device import CosyedgeError, EmptyTextError, InputError, TextTooLongError, to_pcm16
from cosyedge.device import request as declaration
from cosyedge.device.audio import Resampler
from cosyedge.device.door import Chunk, Job, Stream
from cosyedge.device.errors import SynthesisFailed, UnknownFieldError

CHUNK_SAMPLES = 2048  # per audio-chunk event (wyoming-piper sends 1024; fewer events, same latency per sentence)
LEFT = "the client left before this text was spoken"
STREAM_UNSPOKEN_FACTOR = 4  # x max_text_len: the characters a stream may hold cut and not yet spoken


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

    def connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Handler:
        """A client's connection (what the transport's server makes of each)."""
        return Handler(self, reader, writer)


class Handler(Connection):
    """One client connection: events handled as they arrive, speech in order on the connection's speaker task."""

    def __init__(self, tts: WyomingTts, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__(tts.service.config, reader, writer)
        self.tts = tts
        self.service = tts.service
        self.stream: StreamRequest | RefusedStream | None = None
        self.work: asyncio.Queue[Callable[[], Awaitable[None]]] = asyncio.Queue()
        self.speaker: asyncio.Task | None = None
        self.open: list[OneShot | StreamRequest] = []  # accepted and not yet delivered
        self.speaking = 0  # 1 while the speaker task works (the connection is then not idle)

    def busy(self) -> bool:
        return bool(self.speaking) or not self.work.empty()

    def in_flight(self) -> bool:
        return bool(self.open) or self.busy()

    async def handle_event(self, event: Event) -> bool:
        try:
            await self._handle(event)
        except Exception as exc:  # noqa: BLE001 - every failure is an error event; the connection stays usable
            await self._failed(exc, event.type)
        return True

    async def _failed(self, exc: BaseException, what: str) -> None:
        if isinstance(exc, ConnectionError):  # the client reset the connection: nobody to answer, nothing failed
            return
        await self.send_error(_answer(exc, what))

    async def disconnect(self) -> None:
        """The client is gone: withdraw what is being spoken, dead-letter what was accepted and not delivered."""
        if self.speaker is not None:
            self.speaker.cancel()
            try:
                await self.speaker
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the client is gone either way
                pass
        why = detail(self.cut_by) if self.cut_by is not None else LEFT
        for accepted in self.open:
            accepted.settle(why)
        self.open.clear()

    # -- events, as they arrive ------------------------------------------------------------------
    async def _handle(self, event: Event) -> None:
        if Describe.is_type(event.type):
            await self.write_event(self.tts.info().event())
        elif Synthesize.is_type(event.type):
            if self.stream is None:  # while streaming this is the compatibility copy of the same text: ignored
                await self._synthesize(self.tts.request(event.data))
        elif SynthesizeStart.is_type(event.type):
            if isinstance(self.stream, StreamRequest) and not self.stream.settled:  # its text is not dropped unspoken
                raise ApiError(409, "stream_open", "synthesize-start while a stream is open; send synthesize-stop "
                               "first (the open stream goes on)")
            request = self.tts.request(event.data)
            if request.text is not None:
                raise UnknownFieldError("synthesize-start carries no text; send it in synthesize-chunk events")
            try:
                ticket = self._admit()
            except ApiError:
                self.stream = RefusedStream()
                raise
            self.stream = StreamRequest(self.service, request, ticket)
            self.open.append(self.stream)
        elif SynthesizeChunk.is_type(event.type):
            self._chunk(SynthesizeChunk.from_event(event).text)
        elif SynthesizeStop.is_type(event.type):
            stream, self.stream = self.stream, None
            if stream is None:
                raise InputError("synthesize-stop without synthesize-start")
            if isinstance(stream, StreamRequest):
                for sentence in stream.splitter.flush():
                    self._enqueue_sentence(stream, sentence)
                self._enqueue(lambda s=stream: self._stopped(s))

    async def _synthesize(self, request: declaration.Request) -> None:
        """A one-shot request: validated, admitted, journalled, then spoken in turn."""
        if request.text is None:
            raise InputError("text must be a string")
        segments = await asyncio.get_running_loop().run_in_executor(None, self.tts.engine.segments, request.text)
        ticket = self._admit()
        accepted = OneShot(self.service, {"text": request.text, **self.tts.payload(request, stream=False)}, ticket)
        self.open.append(accepted)

        async def speak() -> None:
            try:
                await self._audio(request, Job(segments, request.options, deadline=self.service.admission.deadline()))
            except Exception as exc:
                self._settle(accepted, detail(exc))
                raise
            self._settle(accepted, None)
        self._enqueue(speak)

    def _admit(self) -> Ticket:
        """A new request's place in flight; none while the server drains (`shutting_down`)."""
        if self.stopping:
            raise ShuttingDown()
        return self.service.admission.admit()[0]

    def _chunk(self, text: object) -> None:
        stream = self.stream
        if isinstance(stream, RefusedStream) or (isinstance(stream, StreamRequest) and stream.settled):
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
            raise journal_unavailable() from None
        for sentence in stream.splitter.feed(text):
            self._enqueue_sentence(stream, sentence)

    # -- speech, in order ------------------------------------------------------------------------
    def _enqueue(self, work: Callable[[], Awaitable[None]]) -> None:
        if self.speaker is None:
            self.speaker = asyncio.get_running_loop().create_task(self._speak_in_order())
        self.work.put_nowait(work)

    def _enqueue_sentence(self, stream: StreamRequest, sentence: str) -> None:
        stream.queued += len(sentence)
        self._enqueue(lambda: self._speak_sentence(stream, sentence))

    def _settle(self, accepted: OneShot | StreamRequest, why: str | None) -> None:
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
                await self._failed(exc, "synthesize")
            finally:
                self.speaking = 0
                self.changed()

    async def _speak_sentence(self, stream: StreamRequest, sentence: str) -> None:
        try:
            await self._speak_queued(stream, sentence)
        finally:
            stream.queued -= len(sentence)

    async def _speak_queued(self, stream: StreamRequest, sentence: str) -> None:
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

    async def _stopped(self, stream: StreamRequest) -> None:
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


def _answer(exc: BaseException, what: str) -> ApiError:
    """The error event a failure is answered with: the code HTTP answers the same input with."""
    if isinstance(exc, SynthesisFailed):
        return ApiError(500, "synthesis_failed", "synthesis failed")
    if isinstance(exc, CosyedgeError):
        return ApiError.from_device(exc)
    if isinstance(exc, ApiError):  # the service's: queue full, journal unavailable
        return exc
    if isinstance(exc, (KeyError, TypeError, ValueError)):  # a malformed event (missing or mistyped field)
        return ApiError(400, "bad_request", f"malformed {what} event")
    log.error("wyoming: %s failed: %s: %s", what, type(exc).__name__, exc)
    return ApiError(500, "synthesis_failed", "synthesis failed")


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


def start_for_service(service: Service, uri: str) -> Listener:
    """Wyoming beside `cosyedge serve`: the service's admission, journal and door; the listener drains with it."""
    check_wyoming_bind(uri)
    listener = start_in_thread(Listener(WyomingTts(service).connect, service.config), uri)
    log.info("wyoming: listening on tcp://%s:%d (same engine as HTTP)", parse_uri(uri)[0], listener.port)
    return listener
