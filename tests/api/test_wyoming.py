"""`cosyedge wyoming` end to end: a real server process on the default voice, driven by the `wyoming` client
library; its audio is compared with the HTTP API's for the same deterministic request."""
from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import requests

from apitools import api_config, run_server
from cosyedge.api.harness import ServiceProcess
from wyoming.audio import AudioChunk
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped, SynthesizeVoice

T = 120  # seconds: a bound for every wait, never an expectation
PIECES = ["Counter three is free. Please take", " your ticket now. Thank you", " for waiting."]
TEXT = "".join(PIECES)
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, alive=lambda: True) -> None:
    """Until something accepts on the port; `alive()` is True while the server process runs (else its log)."""
    deadline = time.monotonic() + T
    while True:
        assert alive() is True, alive()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, "the Wyoming server never listened"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def wyoming_port(cosyedge_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = _free_port()
    env = {**os.environ, "COSYEDGE_HOME": str(cosyedge_home), "COSYEDGE_THREADS": "1", "OMP_NUM_THREADS": "1",
           "COSYEDGE_STATE_DIR": str(tmp_path_factory.mktemp("wyoming_state"))}
    server = subprocess.Popen([sys.executable, "-m", "cosyedge.device.cli", "wyoming", "--uri",
                               f"tcp://127.0.0.1:{port}", "--deterministic", "--precision", "fp32"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_listening(port, lambda: server.poll() is None or server.stdout.read()[-2000:])
        yield port
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def http(default_engine, tmp_path_factory: pytest.TempPathFactory):
    with run_server(api_config(tmp_path_factory.mktemp("http_state"), cache_max_mb=0), default_engine) as srv:
        yield srv


def _http_pcm(srv, text: str) -> bytes:
    response = requests.post(srv.url + "/v1/tts", json={"text": text, "format": "pcm", "deterministic": True}, timeout=T)
    assert response.status_code == 200, response.text
    return response.content


async def _read(client: AsyncTcpClient) -> Event:
    event = await asyncio.wait_for(client.read_event(), T)
    assert event is not None, "the server closed the connection"
    return event


async def _audio(client: AsyncTcpClient, until: str = "audio-stop") -> tuple[bytes, list[str]]:
    """Read events up to `until`: the audio of the chunks and the event types seen."""
    audio, types = b"", []
    while True:
        event = await _read(client)
        types.append(event.type)
        if AudioChunk.is_type(event.type):
            chunk = AudioChunk.from_event(event)
            assert (chunk.rate, chunk.width, chunk.channels) == (22050, 2, 1)
            audio += chunk.audio
        if event.type == until or Error.is_type(event.type):
            return audio, types


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, T * 3))


def test_describe_lists_every_voice_with_streaming(wyoming_port, default_engine):
    async def go() -> Info:
        async with AsyncTcpClient("127.0.0.1", wyoming_port) as client:
            await client.write_event(Describe().event())
            return Info.from_event(await _read(client))
    program = _run(go()).tts[0]
    assert program.supports_synthesize_streaming is True and program.installed
    assert [v.name for v in program.voices] == default_engine.voices()
    voice = program.voices[0]
    assert voice.languages == ["en_US"] and voice.installed and voice.attribution.name.startswith("Piper")


def test_one_shot_audio_equals_the_http_api(wyoming_port, http):
    async def go() -> tuple[bytes, list[str]]:
        async with AsyncTcpClient("127.0.0.1", wyoming_port) as client:
            await client.write_event(Synthesize(text=TEXT, voice=SynthesizeVoice(name="joe")).event())
            return await _audio(client)
    audio, types = _run(go())
    assert types[0] == "audio-start"
    assert types[-1] == "audio-stop" and types.count("audio-chunk") > 3
    assert audio == _http_pcm(http, TEXT)


def test_streamed_text_is_spoken_sentence_by_sentence_as_it_arrives(wyoming_port, http):
    async def go() -> tuple[list[bytes], list[str]]:
        sentences, tail = [], []
        async with AsyncTcpClient("127.0.0.1", wyoming_port) as client:
            await client.write_event(SynthesizeStart(voice=SynthesizeVoice(name="joe")).event())
            for piece in PIECES[:2]:  # each piece completes one sentence: its audio comes before the next piece
                await client.write_event(SynthesizeChunk(text=piece).event())
                audio, types = await _audio(client)
                assert types[0] == "audio-start" and types[-1] == "audio-stop", types
                sentences.append(audio)
            await client.write_event(Synthesize(text=TEXT).event())  # the compatibility copy: ignored
            await client.write_event(SynthesizeChunk(text=PIECES[2]).event())
            await client.write_event(SynthesizeStop().event())
            audio, types = await _audio(client, until="synthesize-stopped")
            sentences.append(audio)
            tail = types
        return sentences, tail

    sentences, tail = _run(go())
    assert tail.count("audio-start") == 1 and tail.count("audio-stop") == 1, tail  # only the last sentence
    assert tail[-1] == "synthesize-stopped"
    assert all(len(s) > 10_000 for s in sentences)
    assert b"".join(sentences) == _http_pcm(http, TEXT)
    assert sentences[0] == _http_pcm(http, "Counter three is free.")


@pytest.mark.parametrize("events, code", [
    ([Synthesize(text="Hello.", voice=SynthesizeVoice(name="nobody")).event()], "unknown_voice"),
    ([Synthesize(text="   ").event()], "empty_text"),
    ([SynthesizeChunk(text="Hello.").event()], "invalid_input"),
    ([Event(type="synthesize", data={"voice": {"name": "joe"}})], "bad_request"),
    ([SynthesizeStart().event(), SynthesizeChunk(text="...").event(), SynthesizeStop().event()], "empty_text"),
    ([SynthesizeStart().event(), SynthesizeChunk(text="Hello there" + "!" * 2100).event()], "text_too_long"),
])
def test_bad_input_is_an_error_event_and_the_connection_stays_usable(wyoming_port, events, code):
    async def go() -> tuple[Error, Event]:
        async with AsyncTcpClient("127.0.0.1", wyoming_port) as client:
            for event in events:
                await client.write_event(event)
            while not Error.is_type((event := await _read(client)).type):
                pass
            error = Error.from_event(event)
            await client.write_event(Describe().event())
            return error, await _read(client)
    error, after = _run(go())
    assert error.code == code, error
    assert "/" not in error.text and "Traceback" not in error.text
    assert Info.is_type(after.type) or after.type == "synthesize-stopped"


def test_serve_with_wyoming_shares_the_engine_and_queue(cosyedge_home):
    """`cosyedge serve` with COSYEDGE_WYOMING_URI (the unit's option): Wyoming sentences go through the HTTP queue."""
    port = _free_port()
    with ServiceProcess(env={"COSYEDGE_WYOMING_URI": f"tcp://127.0.0.1:{port}", "COSYEDGE_HOME": str(cosyedge_home),
                             "COSYEDGE_THREADS": "1"}) as service:
        _wait_listening(port)  # /readyz answers 200 a moment before Wyoming listens (READY=1 waits for both)
        def batches() -> float:
            text = requests.get(service.url + "/metrics", timeout=T).text
            return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("cosyedge_batches_total"))

        before = batches()

        async def go() -> tuple[bytes, list[str]]:
            async with AsyncTcpClient("127.0.0.1", port) as client:
                await client.write_event(Synthesize(text=TEXT).event())
                return await _audio(client)
        audio, types = _run(go())
        assert types[0] == "audio-start" and types[-1] == "audio-stop" and len(audio) > 50_000
        assert batches() - before == 3  # one queue item per sentence: the service's queue rendered them


def test_the_wyoming_unit_passes_systemd_analyze_verify(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (apt package: systemd); unit file not verified")
    entry = shutil.which("cosyedge", path=str(Path(sys.executable).parent))
    assert entry is not None
    unit = (REPO / "systemd" / "cosyedge-wyoming.service").read_text().replace("/opt/cosyedge/venv/bin/cosyedge", entry)
    (tmp_path / "cosyedge-wyoming.service").write_text(unit)
    result = subprocess.run([tool, "verify", str(tmp_path / "cosyedge-wyoming.service")], capture_output=True,
                            text=True, timeout=60, cwd=tmp_path)
    output = result.stdout + result.stderr
    if result.returncode != 0 and "cosyedge" not in output:
        pytest.skip(f"systemd-analyze verify cannot run in this environment: {output.strip()[:200]}")
    assert result.returncode == 0 and not [line for line in output.splitlines() if "cosyedge" in line], output


@pytest.mark.parametrize("args, message", [
    (["--uri", "tcp://0.0.0.0:10200"], "refusing to listen on 0.0.0.0"),
    (["--uri", "http://127.0.0.1:10200"], "--uri must look like tcp://"),
])
def test_wyoming_refuses_non_loopback_and_bad_uris_in_one_line(args, message, cosyedge_home):
    run = subprocess.run([sys.executable, "-m", "cosyedge.device.cli", "wyoming", *args], capture_output=True, text=True,
                         timeout=T, env={**os.environ, "COSYEDGE_HOME": str(cosyedge_home)})
    assert run.returncode == 2 and message in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
