"""The Wyoming server's transport under `cosyedge serve --wyoming` (`api/wyoming_transport.py`), from the outside:
its drain with the worker's (a bundle reload, a SIGTERM) and its write deadline (a client that never reads).

Clients here are raw sockets with a small receive buffer, so that a client that pauses its reads holds the
server's writes (a synthesis stays in flight for as long as the test wants)."""
from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest
import requests

from cosyedge.api.bench.harness import ServiceProcess, http_status
from cosyedge.api.config import ServiceConfig
from cosyedge.api.wyoming_transport import Connection, Listener, start_in_thread
from cosyedge.api.journal import DEAD_LETTER, read_jsonl
from wyoming.audio import AudioChunk
from wyoming.error import Error
from wyoming.event import Event, async_read_event

pytestmark = pytest.mark.slow

T = 120  # seconds: a bound for every wait, never an expectation
# ~19 s of audio (0.8 MB), far beyond the 4 KiB client's socket buffers: a synthesis stays in flight until read. Its
# compute on the worker's one thread must end inside the SIGTERM drain window (api/server.py: 8 s) on a CI box with
# a second test worker beside it: 16 sentences (~50 s of audio) were cut there once.
TEXT = " ".join(f"Sentence number {i} is here to make the audio long enough." for i in range(6))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, T * 3))


def _wait_until(what, condition) -> None:
    deadline = time.monotonic() + T
    while not condition():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.05)


async def _connect(port: int, rcvbuf: int = 4096) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection whose receive buffer is `rcvbuf` bytes (set before connecting, so the window stays small)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await asyncio.open_connection(sock=sock)


async def _send_synthesize(writer: asyncio.StreamWriter, text: str) -> None:
    writer.write(json.dumps({"type": "synthesize", "data": {"text": text, "deterministic": True}}).encode() + b"\n")
    await writer.drain()


async def _read(reader: asyncio.StreamReader) -> Event | None:
    return await asyncio.wait_for(async_read_event(reader), T)


async def _audio(reader: asyncio.StreamReader) -> tuple[bytes, str | None]:
    """The audio of the chunks read up to the end of a synthesis: (audio, the event that ended it: audio-stop, an
    error's code, or None when the connection ended first)."""
    audio = b""
    while True:
        try:
            event = await _read(reader)
        except ConnectionError:
            event = None
        if event is None:
            return audio, None
        if AudioChunk.is_type(event.type):
            audio += AudioChunk.from_event(event).audio
        elif Error.is_type(event.type):
            return audio, Error.from_event(event).code
        elif event.type == "audio-stop":
            return audio, event.type


async def _one_shot(port: int, text: str = TEXT) -> tuple[bytes, str | None]:
    reader, writer = await _connect(port, rcvbuf=1 << 20)
    try:
        await _send_synthesize(writer, text)
        return await _audio(reader)
    finally:
        writer.close()


async def _new_connection(port: int, synthesize: bool = False) -> str:
    """What a new client sending `describe` (or asking for a synthesis) gets: `refused`, an error's code, or the
    first event's type."""
    try:
        reader, writer = await _connect(port)
    except ConnectionError:
        return "refused"
    try:
        if synthesize:
            await _send_synthesize(writer, "Hello there.")
        else:
            writer.write(b'{"type": "describe"}\n')
        event = await _read(reader)
    except ConnectionError:
        return "refused"  # accepted by the kernel as the listening socket closed: reset
    finally:
        writer.close()
    if event is None:
        return "closed"
    return Error.from_event(event).code if Error.is_type(event.type) else event.type


@pytest.mark.parametrize("how", ["reload", "sigterm"])
def test_wyoming_beside_serve_is_drained_with_the_worker(how, default_bundle_path, cosyedge_home, tmp_path):
    """A bundle reload, or a SIGTERM, drained HTTP only: the worker ended (door closed, process gone) under a
    Wyoming synthesis still being written, which was cut, and a new Wyoming connection was still taken meanwhile.
    Now the Wyoming listener closes when the drain starts (a new connection is refused, or told `shutting_down`)
    and the synthesis in flight is delivered whole, up to its audio-stop, before the worker ends."""
    port = _free_port()
    env = {"COSYEDGE_WYOMING_URI": f"tcp://127.0.0.1:{port}", "COSYEDGE_HOME": str(cosyedge_home),
           "COSYEDGE_THREADS": "1", "OMP_NUM_THREADS": "1"}
    bundle = None
    if how == "reload":  # a bundle pointer, as the bundle store's `current`, with a second bundle to move it to
        for name in ("a", "b"):
            shutil.copytree(default_bundle_path, tmp_path / name)
        (tmp_path / "current").symlink_to(tmp_path / "a")
        bundle = str(tmp_path / "current")
    with ServiceProcess(bundle=bundle, env=env, ready_timeout_s=T) as service:
        _wait_until("listening on Wyoming", lambda: _run(_new_connection(port)) == "info")
        whole, end = _run(_one_shot(port))
        assert end == "audio-stop" and len(whole) > 1 << 19, end

        async def drained() -> tuple[bytes, str | None, str, Event | None]:
            reader, writer = await _connect(port)
            try:
                await _send_synthesize(writer, TEXT)
                while not AudioChunk.is_type((event := await _read(reader)).type):  # the synthesis is under way
                    pass
                first = AudioChunk.from_event(event).audio
                if how == "reload":
                    (tmp_path / "next").symlink_to(tmp_path / "b")
                    os.replace(tmp_path / "next", tmp_path / "current")
                    while http_status(service.url, "/readyz", timeout=2) == 200:  # the drain has begun
                        await asyncio.sleep(0.05)
                else:
                    service.proc.send_signal(signal.SIGTERM)
                    while http_status(service.url, "/healthz", timeout=2) is not None:  # the arbiter stopped
                        await asyncio.sleep(0.05)
                    await asyncio.sleep(0.5)  # and has passed the signal on to the worker
                newcomer = await _new_connection(port, synthesize=True)
                rest, end = await _audio(reader)  # read again: the rest of the synthesis
                after = await _read(reader) if end == "audio-stop" else None
                return first + rest, end, newcomer, after
            finally:
                writer.close()

        audio, end, newcomer, after = _run(drained())
        assert newcomer in ("refused", "shutting_down"), newcomer
        assert end == "audio-stop", (end, len(audio), len(whole), service.log_tail())
        assert audio == whole
        assert after is None or Error.from_event(after).code == "shutting_down", after  # then a close
        if how == "reload":  # the next worker, on the new bundle, speaks on the same port
            _wait_until("ready again", lambda: http_status(service.url, "/readyz", timeout=2) == 200)
            _wait_until("Wyoming again", lambda: _run(_new_connection(port)) == "info")
            assert "still under way" not in service.log_tail(), service.log_tail()  # the drain's end was heard
        else:
            assert service.proc.wait(T) == 0, service.log_tail()
        dead = read_jsonl(service.log_path.parent / "state" / DEAD_LETTER)
        assert dead == [], dead  # nothing accepted was lost


def test_the_end_of_a_drain_is_heard_by_the_thread_that_asked(tmp_path):
    """`Listener.drain` from another thread (the worker's reload or exit) hears when the drain is over, though
    the listener's loop stops right after it: before, the answer was chained from a task of a loop that stopped
    first, so a reload with Wyoming beside `serve` waited out its whole timeout (60 s) before the new worker."""
    class Quiet(Connection):  # the transport alone: takes every event, starts nothing
        async def handle_event(self, event: Event) -> bool:
            return True

    config = ServiceConfig()
    listener = start_in_thread(Listener(lambda reader, writer: Quiet(config, reader, writer), config),
                               f"tcp://127.0.0.1:{_free_port()}")
    idle = socket.create_connection(("127.0.0.1", listener.port), timeout=T)  # holds nothing in flight
    try:
        _wait_until("the connection is counted", lambda: len(listener.connections) == 1)
        assert listener.drain(T).result(timeout=10) is True  # nothing was cut
        assert listener.drain(1).result(timeout=1) is True  # asked again: the same answer, at once
        said = idle.recv(1 << 16)
        assert b'"shutting_down"' in said, said  # the idle client was told, then closed
    finally:
        idle.close()
    # the loop stops right after the answer is set, on its own thread: wait for it (asserting at once raced it)
    _wait_until("the listener's loop stopped", lambda: listener.loop is not None and not listener.loop.is_running())


def _in_flight(service: ServiceProcess) -> float:
    text = requests.get(service.url + "/metrics", timeout=T).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("cosyedge_in_flight "))


def _never_reading(port: int, service: ServiceProcess, text: str) -> socket.socket:
    """A socket with a 4 KiB receive buffer that sent two `synthesize` events of `text`, once both are admitted.
    With a cap of one connection, the probe's connection may still be counted when this one arrives (the server
    notices its close a moment later): that refusal (`too_many_connections`, then a close) is met by connecting
    again."""
    deadline = time.monotonic() + T
    while True:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        for _ in range(2):
            sock.sendall(json.dumps({"type": "synthesize", "data": {"text": text}}).encode() + b"\n")
        while time.monotonic() < deadline:
            if _in_flight(service) > 0:
                return sock  # both, soon (the dead letters show it)
            if select.select([sock], [], [], 0.05)[0]:  # the refusal, or already its audio (admitted)
                if b"too_many_connections" not in sock.recv(1 << 16, socket.MSG_PEEK):
                    return sock
                sock.close()
                break
        else:
            sock.close()
            raise AssertionError("never admitted")


def test_a_client_that_never_reads_is_cut_at_the_write_deadline(cosyedge_home):
    """A client that sent two long `synthesize` events and never read its socket held both places in flight and
    its connection for ever: once the socket's buffers were full the server's write waited without a deadline
    (and, the client waiting for audio, the idle timeout never fired). Now an event not taken within
    `wyoming_write_timeout_s` (3 s here) cuts the connection (a reset): both requests are dead-lettered `write_timeout`, their
    places come back (/metrics), and so does the connection (with a cap of one, a new client is served)."""
    port = _free_port()
    env = {"COSYEDGE_WYOMING_URI": f"tcp://127.0.0.1:{port}", "COSYEDGE_HOME": str(cosyedge_home),
           "COSYEDGE_THREADS": "1", "OMP_NUM_THREADS": "1", "COSYEDGE_WYOMING_WRITE_TIMEOUT_S": "3",
           "COSYEDGE_WYOMING_MAX_CONNECTIONS": "1"}
    long_text = " ".join(f"Sentence number {i} is here to make the audio long enough for this test."
                         for i in range(26))  # 1,835 characters: 100 s of audio, 4.4 MB, beyond the socket buffers
    with ServiceProcess(env=env, ready_timeout_s=T) as service:
        _wait_until("listening on Wyoming", lambda: _run(_new_connection(port)) == "info")
        sock = _never_reading(port, service, long_text)
        try:
            started = time.monotonic()
            _wait_until("given back", lambda: _in_flight(service) == 0)  # the socket is still open, unread
            given_back = time.monotonic() - started
            assert _run(_new_connection(port)) == "info"  # the one connection the cap allows is free again
            sock.settimeout(T)
            received = 0
            try:
                while piece := sock.recv(1 << 16):  # what the kernel held for it, then the end: a reset
                    received += len(piece)
            except ConnectionResetError:
                pass
        finally:
            sock.close()
        letters = service.log_path.parent / "state" / DEAD_LETTER
        # the places come back before the cut requests' records are written: under CI's load the read came first
        _wait_until("dead-lettered", lambda: len(read_jsonl(letters)) >= 2)
        dead = read_jsonl(letters)
    assert given_back < 60, given_back
    assert received < 4_000_000, received  # cut well before its audio was out
    assert [d["request"]["text"] for d in dead] == [long_text] * 2, dead
    assert all(d["error"].startswith("write_timeout") for d in dead), dead
