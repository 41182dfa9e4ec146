"""`cosyedge wyoming`: the engine behind the Wyoming protocol (Home Assistant's and Rhasspy's voice pipeline).

Built on the maintained `wyoming` package (its events and `AsyncEventHandler`); one asyncio loop reads the
clients, the engine runs in worker threads. Events:
- `describe` -> `info`: one TTS program listing every voice of the loaded bundle, streaming supported;
- `synthesize` -> `audio-start`, `audio-chunk`* (as each sentence is rendered), `audio-stop`;
- `synthesize-start`, `synthesize-chunk`*, `synthesize-stop` -> for each sentence as soon as the text that
  arrived completes it, `audio-start` / `audio-chunk`* / `audio-stop`; the unfinished tail is spoken at
  `synthesize-stop`, then `synthesize-stopped`. A `synthesize` sent while streaming is the protocol's
  compatibility copy of the same text and is ignored;
- bad input (unknown voice, nothing speakable, text too long, a chunk outside a stream) -> `error` with the
  device error's code; the connection stays usable.
Sentences are cut by `engine.segments` (the same rules as HTTP): the text received so far is segmented again
as each chunk arrives, and every segment but the last (which may still grow) is spoken.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlparse

import numpy as np
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Attribution, Describe, Info, TtsProgram, TtsVoice
from wyoming.server import AsyncEventHandler
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped, SynthesizeVoice

from cosyedge.api.errors import ApiError
from cosyedge.device import CosyedgeError, EmptyTextError, Engine, InputError, Segment, SynthesisOptions, to_pcm16

log = logging.getLogger("cosyedge.wyoming")

CHUNK_SAMPLES = 2048  # per audio-chunk event (wyoming-piper sends 1024; fewer events, same latency per sentence)
_FAMILIES = {  # family -> (languages, who made the model, where it is from)
    "vits": (None, "Piper (rhasspy / OHF-Voice)", "https://github.com/OHF-Voice/piper1-gpl"),
    "cosyvoice2": (["zh", "en", "ja", "ko", "yue"], "FunAudioLLM CosyVoice2", "https://github.com/FunAudioLLM/CosyVoice"),
    "cosyvoice3": (["zh", "en", "ja", "ko", "yue", "de", "es", "fr", "it", "ru"], "FunAudioLLM Fun-CosyVoice3",
                   "https://github.com/FunAudioLLM/CosyVoice"),
}


@dataclass(frozen=True)
class Defaults:
    """The synthesis options every Wyoming request gets (the protocol carries only text and a voice)."""
    speed: float = 1.0
    deterministic: bool = False
    seed: int | None = None
    sampling: str = "default"


class WyomingTts:
    """What every connection shares: the engine, the default options and how a sentence is rendered."""

    def __init__(self, engine: Engine, defaults: Defaults = Defaults(),
                 render: Callable[[list[Segment], SynthesisOptions], np.ndarray] | None = None) -> None:
        self.engine = engine
        self.defaults = defaults
        self.render = render or (lambda segments, options: engine.synthesize_many([(segments, options)])[0])
        engine.options(speed=defaults.speed, deterministic=defaults.deterministic, seed=defaults.seed,
                       sampling=defaults.sampling)  # refuse bad defaults before anything listens

    def info(self) -> Info:
        manifest = self.engine.bundle.manifest
        languages, maker, url = _FAMILIES.get(manifest.family, (None, manifest.family, ""))
        if languages is None:  # Piper: the voice's espeak language, en-us -> en_US
            code = str(manifest.config.get("espeak_voice", "en")).split("-")
            languages = ["_".join([code[0], *[c.upper() for c in code[1:]]])]
        attribution = Attribution(name=maker, url=url)
        voices = [TtsVoice(name=name, description=f"{name} ({manifest.name})", attribution=attribution, installed=True,
                           version=None, languages=list(languages), speakers=None) for name in self.engine.voices()]
        return Info(tts=[TtsProgram(name="cosyedge", description=f"cosyedge: {manifest.name}", attribution=attribution,
                                    installed=True, version=None, voices=voices, supports_synthesize_streaming=True)])

    def options(self, voice: SynthesizeVoice | None) -> SynthesisOptions:
        name = voice.name if voice is not None else None  # a language alone: the bundle's default voice
        d = self.defaults
        return self.engine.options(voice=name or None, speed=d.speed, deterministic=d.deterministic, seed=d.seed,
                                   sampling=d.sampling)


class _Stream:
    """One streaming request: its options, the text so far, how many of its segments were spoken."""

    def __init__(self, options: SynthesisOptions) -> None:
        self.options = options
        self.text = ""
        self.spoken = 0


class Handler(AsyncEventHandler):
    """One client connection."""

    def __init__(self, tts: WyomingTts, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__(reader, writer)
        self.tts = tts
        self.stream: _Stream | None = None

    async def handle_event(self, event: Event) -> bool:
        try:
            await self._handle(event)
        except CosyedgeError as exc:
            await self.write_event(Error(text=str(exc), code=exc.code).event())
        except ApiError as exc:  # beside the HTTP service: its queue is full, or the deadline passed in it
            await self.write_event(Error(text=exc.message, code=exc.code).event())
        except (KeyError, TypeError, ValueError):  # a malformed event (missing or mistyped field)
            await self.write_event(Error(text=f"malformed {event.type} event", code="bad_request").event())
        except Exception:  # noqa: BLE001 - a synthesis failure: the client gets an error event, the log the detail
            log.exception("wyoming: %s failed", event.type)
            self.stream = None
            await self.write_event(Error(text="synthesis failed", code="synthesis_failed").event())
        return True

    async def _handle(self, event: Event) -> None:
        if Describe.is_type(event.type):
            await self.write_event(self.tts.info().event())
        elif Synthesize.is_type(event.type):
            if self.stream is None:  # while streaming this is the compatibility copy of the same text: ignored
                request = Synthesize.from_event(event)
                options = self.tts.options(request.voice)
                await self._speak(await self._segments(request.text), options)
        elif SynthesizeStart.is_type(event.type):
            self.stream = _Stream(self.tts.options(SynthesizeStart.from_event(event).voice))
        elif SynthesizeChunk.is_type(event.type):
            if self.stream is None:
                raise InputError("synthesize-chunk without synthesize-start")
            chunk = SynthesizeChunk.from_event(event).text
            if not isinstance(chunk, str):
                raise TypeError("text")
            self.stream.text += chunk
            await self._speak_ready(final=False)
        elif SynthesizeStop.is_type(event.type):
            if self.stream is None:
                raise InputError("synthesize-stop without synthesize-start")
            try:
                await self._speak_ready(final=True)
            finally:
                self.stream = None
            await self.write_event(SynthesizeStopped().event())

    async def _segments(self, text: Any) -> list[Segment]:
        return await asyncio.get_running_loop().run_in_executor(None, self.tts.engine.segments, text)

    async def _speak_ready(self, final: bool) -> None:
        """Speak each segment of the stream that is complete (all of them at the end), one audio stream each."""
        stream = self.stream
        assert stream is not None
        if not stream.text.strip():
            return
        try:
            segments = await self._segments(stream.text)
        except EmptyTextError:
            if final and stream.spoken == 0:
                raise
            return  # nothing speakable yet (a chunk of spaces or punctuation)
        ready = segments[stream.spoken:] if final else segments[stream.spoken:-1]
        for segment in ready:
            await self._speak([segment], stream.options)
            stream.spoken += 1

    async def _speak(self, segments: list[Segment], options: SynthesisOptions) -> None:
        """audio-start, the sentences' audio as each is rendered, audio-stop."""
        rate = self.tts.engine.sample_rate
        loop = asyncio.get_running_loop()
        await self.write_event(AudioStart(rate=rate, width=2, channels=1).event())
        for segment in segments:
            wave = await loop.run_in_executor(None, self.tts.render, [segment], options)
            pcm = to_pcm16(wave)
            for start in range(0, len(pcm), CHUNK_SAMPLES * 2):
                await self.write_event(AudioChunk(rate=rate, width=2, channels=1,
                                                  audio=pcm[start:start + CHUNK_SAMPLES * 2]).event())
        await self.write_event(AudioStop().event())


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

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await Handler(tts, reader, writer).run()

    server = await asyncio.start_server(client, host, port)
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


def start_for_service(service: Any, uri: str) -> int:
    """Wyoming beside `cosyedge serve`: the service's engine, sentences through its queue; returns the port."""
    from cosyedge.api.server import is_loopback
    if not is_loopback(parse_uri(uri)[0]):
        raise InputError(f"wyoming_uri {uri[:64]!r}: the Wyoming protocol has no authentication, so beside the "
                         "service it listens on loopback only (use `cosyedge wyoming --allow-remote` on a trusted network)")
    engine, batcher = service.require_ready()

    def render(segments: list[Segment], options: SynthesisOptions) -> np.ndarray:
        deadline = time.monotonic() + service.config.request_timeout_s
        return batcher.wait(batcher.submit([(segments, options)], deadline)[0], deadline)

    port, _ = start_in_thread(WyomingTts(engine, render=render), uri)
    log.info("wyoming: listening on tcp://%s:%d (same engine as HTTP)", parse_uri(uri)[0], port)
    return port
