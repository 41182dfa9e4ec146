"""Every door the same (issue 20): one deterministic request through HTTP whole file, HTTP stream, WebSocket and
Wyoming gives byte-identical audio; beyond queue_size each door answers with its protocol's queue-full error; a
SIGKILL while each door has a request under way dead-letters every one of them at the next start, a WebSocket
piece sent while an earlier sentence is still rendering included.

Real processes: `cosyedge serve` with Wyoming beside it (`COSYEDGE_WYOMING_URI`) and, for the deterministic
Wyoming request (the protocol carries no options: `--deterministic` is the server's), `cosyedge wyoming`.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import requests
import websocket
from wyoming.audio import AudioChunk, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.tts import Synthesize

from cosyedge.api.bench.harness import ServiceProcess, free_port
from cosyedge.api.journal import CRASHED, DEAD_LETTER, INFLIGHT, read_jsonl

T = 120  # seconds: a bound for every wait, never an expectation
TEXT = "Counter three is free. Please take your ticket now. Thank you for waiting."
PIECES = ["Counter three is free. Ple", "ase take your ticket now. Thank you ", "for waiting."]
LONG = " ".join(f"Sentence number {i} keeps the engine busy for a little while longer." for i in range(24))
# one sentence of ~390 characters and no clause boundary: a single VITS chunk that takes a while to render
ONE_LONG_SENTENCE = ("This single sentence goes on without a pause " + "and on " * 45 + "until it ends. ")
LATE = "A late piece arrives."
HOLDERS = 4  # queue_size


def _env(home: Path, state: Path, **extra: str) -> dict[str, str]:
    return {"COSYEDGE_HOME": str(home), "COSYEDGE_STATE_DIR": str(state), "COSYEDGE_PROVIDERS": "cpu",
            "COSYEDGE_THREADS": "1", "COSYEDGE_CACHE_MAX_MB": "0", **extra}


def _wait_for(condition: Callable[[], Any], what: str | Callable[[], str]) -> Any:
    end = time.monotonic() + T
    while not (result := condition()):
        assert time.monotonic() < end, what if isinstance(what, str) else what()
        time.sleep(0.02)
    return result


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _ws_url(service: ServiceProcess) -> str:
    return service.url.replace("http://", "ws://") + "/v1/audio/stream"


def _metric(service: ServiceProcess, name: str) -> float:
    text = requests.get(service.url + "/metrics", timeout=T).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def _open_entries(state: Path) -> list[dict[str, Any]]:
    """The `accepted` records of the service's journal that have no `finished` line."""
    records = read_jsonl(state / INFLIGHT)
    finished = {r.get("key") for r in records if r.get("event") == "finished"}
    return [r for r in records if r.get("event") == "accepted" and r.get("key", r["request_id"]) not in finished]


# -- one client per door ---------------------------------------------------------------------------
def _http(service: ServiceProcess, text: str, stream: bool) -> requests.Response:
    return requests.post(service.url + "/v1/tts", json={"text": text, "format": "pcm", "deterministic": True,
                                                        "stream": stream}, timeout=T)


def _ws(service: ServiceProcess, messages: list[dict[str, Any]]) -> tuple[bytes, list[dict[str, Any]]]:
    ws = websocket.create_connection(_ws_url(service), timeout=T)
    audio, events = b"", []
    try:
        for message in messages:
            ws.send(json.dumps(message))
        while True:
            opcode, data = ws.recv_data()
            if opcode == websocket.ABNF.OPCODE_BINARY:
                audio += data
            elif opcode == websocket.ABNF.OPCODE_TEXT:
                events.append(json.loads(data))
            elif opcode == websocket.ABNF.OPCODE_CLOSE:
                return audio, events
    finally:
        ws.close()


async def _wyoming(port: int, text: str, first_audio: threading.Event | None = None) -> tuple[bytes, list[str]]:
    """One `synthesize`: its audio and the event types up to audio-stop, an error, or the connection's end."""
    audio, types = b"", []
    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Synthesize(text=text).event())
        while (event := await asyncio.wait_for(client.read_event(), T)) is not None:
            types.append(event.type)
            if AudioChunk.is_type(event.type):
                audio += AudioChunk.from_event(event).audio
                if first_audio is not None:
                    first_audio.set()
            if AudioStop.is_type(event.type) or Error.is_type(event.type):
                break
    return audio, types


def _wyoming_error(port: int, text: str) -> str:
    async def go() -> str:
        async with AsyncTcpClient("127.0.0.1", port) as client:
            await client.write_event(Synthesize(text=text).event())
            event = await asyncio.wait_for(client.read_event(), T)
            assert event is not None and Error.is_type(event.type), event
            return Error.from_event(event).code or ""
    return asyncio.run(go())


class _Background:
    """A client run on a thread of its own: its result, or the exception that ended it."""

    def __repr__(self) -> str:
        return f"<client {'running' if self.thread.is_alive() else 'ended'}: {self.error!r} {self.result!r:.100}>"

    def __init__(self, run: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(run,), daemon=True)
        self.thread.start()

    def _run(self, run: Callable[[], Any]) -> None:
        try:
            self.result = run()
        except BaseException as exc:  # noqa: BLE001 - what the client saw is the point
            self.error = exc

    def join(self) -> "_Background":
        self.thread.join(T)
        assert not self.thread.is_alive(), "a client still waits after the kill"
        return self


def _stream_until_killed(service: ServiceProcess, started: threading.Event) -> bool:
    """A streamed HTTP request read to its end (True) unless the connection breaks; `started` at its first bytes."""
    with requests.post(service.url + "/v1/tts", json={"text": LONG, "format": "pcm", "stream": True},
                       stream=True, timeout=T) as response:
        assert response.status_code == 200
        for _ in response.iter_content(chunk_size=None):
            started.set()
    return True


class _PieceWhileRendering:
    """A WebSocket session that sends one long sentence and, once that is journalled and rendering, a late piece;
    it notes whether any audio came before the late piece was in the journal. Its frames are read until the end."""

    def __init__(self, service: ServiceProcess, state: Path) -> None:
        self.ws = websocket.create_connection(_ws_url(service), timeout=T)
        self.frames = 0
        self.events: list[dict[str, Any]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.ws.send(json.dumps({"type": "start", "format": "pcm"}))
        self.ws.send(json.dumps({"type": "text", "text": ONE_LONG_SENTENCE}))
        _wait_for(lambda: any(r["request"]["text"] == ONE_LONG_SENTENCE for r in _open_entries(state)),
                  "the first piece was never journalled")
        self.ws.send(json.dumps({"type": "text", "text": LATE}))
        _wait_for(lambda: any(r["request"]["text"] == LATE for r in _open_entries(state)),
                  "the late piece was never journalled")
        self.audio_before_late_piece_journalled = self.frames

    def _read(self) -> None:
        try:
            while True:
                opcode, data = self.ws.recv_data()
                if opcode == websocket.ABNF.OPCODE_BINARY:
                    self.frames += 1
                elif opcode == websocket.ABNF.OPCODE_TEXT:
                    self.events.append(json.loads(data))
                elif opcode == websocket.ABNF.OPCODE_CLOSE:
                    return
        except (OSError, websocket.WebSocketException):
            return

    def join(self) -> None:
        self.reader.join(T)
        assert not self.reader.is_alive(), "the WebSocket client still waits after the kill"


def _key(record: dict[str, Any]) -> tuple[str, str, bool]:
    return record["route"], record["request"]["text"], record["request"]["stream"]


# -- the test --------------------------------------------------------------------------------------
def test_every_door_speaks_alike_refuses_alike_and_loses_nothing(cosyedge_home, default_bundle_path, tmp_path):
    state = tmp_path / "state"
    wyoming_port, standalone_port = free_port(), free_port()
    env = _env(cosyedge_home, state, COSYEDGE_QUEUE_SIZE=str(HOLDERS), COSYEDGE_MAX_STREAMS_PER_CLIENT="16",
               COSYEDGE_WYOMING_URI=f"tcp://127.0.0.1:{wyoming_port}")
    standalone = subprocess.Popen(
        [sys.executable, "-m", "cosyedge.device.cli", "wyoming", "--uri", f"tcp://127.0.0.1:{standalone_port}",
         "--deterministic", "--precision", "fp32"], env={**os.environ, **_env(cosyedge_home, tmp_path / "wyoming")},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with ServiceProcess(env=env) as service:
            _wait_for(lambda: _listening(wyoming_port) and _listening(standalone_port), "Wyoming never listened")

            # 1. The same deterministic request through every door: byte-identical pcm.
            whole, streamed = _http(service, TEXT, stream=False), _http(service, TEXT, stream=True)
            assert whole.status_code == streamed.status_code == 200
            ws_audio, ws_events = _ws(service, [{"type": "start", "format": "pcm", "deterministic": True},
                                                *({"type": "text", "text": p} for p in PIECES), {"type": "end"}])
            assert ws_events[-1]["type"] == "done" and len([e for e in ws_events if e["type"] == "segment"]) == 3
            wyoming_audio, types = asyncio.run(_wyoming(standalone_port, TEXT))
            assert types[-1] == "audio-stop", types
            assert len(whole.content) > 100_000
            assert whole.content == streamed.content == ws_audio == wyoming_audio

            # 2. Beyond queue_size: WebSocket sessions hold every place (a session is a request from `start` on).
            holders = [websocket.create_connection(_ws_url(service), timeout=T) for _ in range(HOLDERS)]
            try:
                for holder in holders:
                    holder.send(json.dumps({"type": "start", "format": "pcm"}))
                _wait_for(lambda: _metric(service, "cosyedge_in_flight") == HOLDERS, "the sessions hold no places")
                for stream in (False, True):
                    refused = _http(service, "Hello.", stream)
                    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
                    assert refused.json()["error"]["code"] == "queue_full"
                _, events = _ws(service, [{"type": "start", "format": "pcm"}])
                assert events[-1]["type"] == "error" and events[-1]["code"] == "queue_full", events
                assert events[-1]["retry_after"] >= 1
                assert _wyoming_error(wyoming_port, "Hello.") == "queue_full"
            finally:
                for holder in holders:
                    holder.close()
            _wait_for(lambda: _metric(service, "cosyedge_in_flight") == 0, "the places never came back")
            assert _metric(service, "cosyedge_queue_rejected_total") == 4

            # 3. SIGKILL while every door has a request under way (the long ones first, then the WebSocket's).
            stream_started, wyoming_started = threading.Event(), threading.Event()
            clients = {
                "file": _Background(lambda: _http(service, LONG, stream=False)),
                "stream": _Background(lambda: _stream_until_killed(service, stream_started)),
                "wyoming": _Background(lambda: asyncio.run(_wyoming(wyoming_port, LONG, wyoming_started))),
            }
            for door, started in (("stream", stream_started), ("wyoming", wyoming_started)):
                assert started.wait(T), f"{door} never started: {clients[door].error!r}"
            session = _PieceWhileRendering(service, state)
            assert len(_open_entries(state)) == 5, f"open: {[_key(r)[::2] for r in _open_entries(state)]}; {clients}"
            assert service.kill() == -signal.SIGKILL
        for client in clients.values():
            client.join()
        session.join()
        # the kill came before any of them completed
        assert clients["file"].error is not None and clients["stream"].error is not None
        assert not [e for e in session.events if e["type"] in ("segment", "done")], session.events
        assert clients["wyoming"].error is not None or "audio-stop" not in clients["wyoming"].result[1]
        # the late WebSocket piece was journalled on arrival, while the sentence before it was still rendering
        assert session.audio_before_late_piece_journalled == 0
        open_at_kill = sorted(_key(r) for r in _open_entries(state))  # the dead process's journal
        assert open_at_kill == sorted([("/v1/tts", LONG, False), ("/v1/tts", LONG, True),
                                       ("/v1/audio/stream", ONE_LONG_SENTENCE, True), ("/v1/audio/stream", LATE, True),
                                       ("wyoming:synthesize", LONG, False)])

        with ServiceProcess(env=env):  # the next start dead-letters exactly what was open
            dead = read_jsonl(state / DEAD_LETTER)
        assert sorted(_key(d) for d in dead if d["error"] == CRASHED) == open_at_kill
    finally:
        standalone.terminate()
        standalone.wait(timeout=30)
