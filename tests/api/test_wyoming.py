"""`cosyedge wyoming` end to end: a real server process on the default voice, driven by the `wyoming` client
library; its audio is compared with the HTTP API's for the same deterministic request."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import requests

from apitools import api_config, run_server
from cosyedge.api.bench.harness import ServiceProcess, TreeMemory
from requesttools import HOSTILE, case_id
from cosyedge.api.journal import CRASHED, DEAD_LETTER, INFLIGHT, read_jsonl
from cosyedge.api.wyoming_requests import STREAM_ROUTE
from wyoming.audio import AudioChunk, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event, async_read_event
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped, SynthesizeVoice

T = 120  # seconds: a bound for every wait, never an expectation
PIECES = ["Counter three is free. Please take", " your ticket now. Thank you", " for waiting."]
TEXT = "".join(PIECES)
REPO = Path(__file__).resolve().parents[2]
SERVERS: dict[int, int] = {}  # port -> pid of the module's `cosyedge wyoming`


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
        SERVERS[port] = server.pid
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


def test_a_sentence_completed_in_a_chunk_is_spoken_before_the_next_chunk(wyoming_port, http):
    """`segments[spoken:-1]` held a finished sentence until more text came; the incremental splitter speaks it as
    soon as the chunk that completes it (its stop and the space after it) arrives."""
    async def go() -> tuple[bytes, list[str], list[str]]:
        async with AsyncTcpClient("127.0.0.1", wyoming_port) as client:
            await client.write_event(SynthesizeStart(voice=SynthesizeVoice(name="joe")).event())
            await client.write_event(SynthesizeChunk(text="Counter three is free. ").event())
            audio, types = await _audio(client)  # nothing more is sent until this sentence's audio is out
            await client.write_event(SynthesizeStop().event())
            _, tail = await _audio(client, until="synthesize-stopped")
            return audio, types, tail
    audio, types, tail = _run(go())
    assert types[0] == "audio-start" and types[-1] == "audio-stop", types
    assert audio == _http_pcm(http, "Counter three is free.")
    assert tail == ["synthesize-stopped"]  # nothing was left to speak


def test_a_killed_standalone_server_dead_letters_what_it_accepted(cosyedge_home, tmp_path):
    """`cosyedge wyoming` journals every piece on arrival in its state directory; after a SIGKILL mid-stream its
    next start moves the pieces not yet spoken to the dead-letter file."""
    port, state = _free_port(), tmp_path / "state"
    env = {**os.environ, "COSYEDGE_HOME": str(cosyedge_home), "COSYEDGE_THREADS": "1", "COSYEDGE_STATE_DIR": str(state)}
    command = [sys.executable, "-m", "cosyedge.device.cli", "wyoming", "--uri", f"tcp://127.0.0.1:{port}",
               "--precision", "fp32"]
    pieces = [f"Piece {i} has a sentence that takes a moment to say. " for i in range(12)]

    async def kill_at_first_audio() -> None:
        """The first sentence is being spoken, eleven wait: SIGKILL while the client is still connected (a client
        that left first would have its pieces dead-lettered by the server itself)."""
        async with AsyncTcpClient("127.0.0.1", port) as client:
            await client.write_event(SynthesizeStart().event())
            for piece in pieces:
                await client.write_event(SynthesizeChunk(text=piece).event())
            while not AudioChunk.is_type((await _read(client)).type):
                pass
            server.send_signal(signal.SIGKILL)
            assert server.wait(timeout=30) == -signal.SIGKILL

    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        _wait_listening(port, lambda: server.poll() is None)
        _run(kill_at_first_audio())
    finally:
        server.kill()
        server.wait()
    journal = read_jsonl(state / INFLIGHT)
    accepted = [r for r in journal if r.get("event") == "accepted"]
    assert [r["request"]["text"] for r in accepted] == pieces and {r["route"] for r in accepted} == {STREAM_ROUTE}
    finished = {r["key"] for r in journal if r.get("event") == "finished"}
    open_texts = [r["request"]["text"] for r in accepted if r["key"] not in finished]
    assert len(open_texts) >= 9 and open_texts == pieces[-len(open_texts):], open_texts  # killed before spoken
    again = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        _wait_listening(port, lambda: again.poll() is None)  # recovery runs before it listens
        dead = read_jsonl(state / DEAD_LETTER)
        assert [d["request"]["text"] for d in dead] == open_texts and {d["error"] for d in dead} == {CRASHED}
    finally:
        again.terminate()
        again.wait(timeout=30)


def test_cosyvoice_audio_comes_chunk_by_chunk(cv2_tiny_bundle, cosyedge_home, tmp_path):
    """A CosyVoice sentence's audio-chunk events are its streamed chunks (the official streaming path, which
    differs from a whole render), not a sentence rendered whole and cut up."""
    from cosyedge.device.engine import Engine
    from cosyedge.device.sessions import SessionConfig
    text = "，".join(["收到好友从远方寄来的生日礼物"] * 3) + "。"  # long enough for more than one chunk
    port = _free_port()
    env = {**os.environ, "COSYEDGE_HOME": str(cosyedge_home), "COSYEDGE_THREADS": "1", "COSYEDGE_PROVIDERS": "cpu",
           "COSYEDGE_STATE_DIR": str(tmp_path / "state")}
    server = subprocess.Popen([sys.executable, "-m", "cosyedge.device.cli", "wyoming", "--uri", f"tcp://127.0.0.1:{port}",
                               "--bundle", str(cv2_tiny_bundle), "--precision", "fp32", "--deterministic",
                               "--sampling", "greedy"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        _wait_listening(port, lambda: server.poll() is None)

        async def go() -> bytes:
            async with AsyncTcpClient("127.0.0.1", port) as client:
                await client.write_event(Synthesize(text=text, voice=SynthesizeVoice(name="tiny_spk_zh")).event())
                audio = b""
                while not AudioStop.is_type((event := await _read(client)).type):
                    assert not Error.is_type(event.type), event
                    if AudioChunk.is_type(event.type):
                        audio += AudioChunk.from_event(event).audio
                return audio
        got = np.frombuffer(_run(go()), "<i2").astype(np.float32) / 32767
    finally:
        server.terminate()
        server.wait(timeout=30)
    engine = Engine.load(cv2_tiny_bundle, precision="fp32", warmup=False, state_dir=tmp_path / "direct",
                         sessions=SessionConfig(providers=("cpu",), intra_op_threads=1))
    options = {"voice": "tiny_spk_zh", "sampling": "greedy", "deterministic": True}
    chunks = list(engine.stream(text, **options))
    streamed, whole = np.concatenate(chunks), engine.synthesize_waveform(text, **options)
    assert len(chunks) > 1 and got.size == streamed.size
    np.testing.assert_allclose(got, np.clip(streamed, -1, 1), atol=2 / 32767)  # pcm16 clips the tiny model's peaks
    assert got.size != whole.size or np.abs(got - whole).max() > 0.1  # the streamed path, not the whole render


@pytest.mark.parametrize("events, code", [
    ([Synthesize(text="Hello.", voice=SynthesizeVoice(name="nobody")).event()], "unknown_voice"),
    ([Synthesize(text="   ").event()], "empty_text"),
    ([SynthesizeChunk(text="Hello.").event()], "invalid_parameter"),
    ([Event(type="synthesize", data={"voice": {"name": "joe"}})], "invalid_parameter"),  # no text, as HTTP
    ([Event(type="synthesize", data={"text": "Hi.", "format": "mp3"})], "unknown_field"),  # Wyoming audio is pcm
    ([Event(type="synthesize", data={"text": "Hi.", "voice": {"name": "joe", "speaker": "x"}})], "unknown_field"),
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


async def _raw(port: int, data: dict) -> Event:
    """One synthesize event written by hand (JSON escapes, so a lone surrogate can be sent) -> the first reply."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(json.dumps({"type": "synthesize", "data": data}).encode() + b"\n")
        await writer.drain()
        event = await asyncio.wait_for(async_read_event(reader), T)
        assert event is not None, "the server closed the connection"
        return event
    finally:
        writer.close()


@pytest.mark.parametrize("case", HOSTILE, ids=case_id)
def test_hostile_fields_get_the_codes_http_gives(wyoming_port, case):
    """The request declaration's table of hostile values (tests/requesttools.py) as extension keys of a
    synthesize event (the protocol's voice name for `voice`): the code HTTP answers each one with."""
    fields, code = case
    data = {"text": "Hi.", **{k: v for k, v in fields.items() if k != "voice"}}
    if "voice" in fields:
        data["voice"] = {"name": fields["voice"]}
    event = _run(_raw(wyoming_port, data))
    assert Error.is_type(event.type) and Error.from_event(event).code == code, event


def test_extension_fields_are_honoured(wyoming_port):
    """speed and sample_rate as extension keys of the event's data: the audio is resampled and faster."""
    async def go(data: dict) -> tuple[int, int]:
        reader, writer = await asyncio.open_connection("127.0.0.1", wyoming_port)
        try:
            writer.write(json.dumps({"type": "synthesize", "data": {"text": "Counter three is free.", **data}}).encode()
                         + b"\n")
            await writer.drain()
            rate, size = 0, 0
            while (event := await asyncio.wait_for(async_read_event(reader), T)).type != "audio-stop":
                if AudioChunk.is_type(event.type):
                    chunk = AudioChunk.from_event(event)
                    rate, size = chunk.rate, size + len(chunk.audio)
            return rate, size
        finally:
            writer.close()
    rate, size = _run(go({}))
    fast_rate, fast_size = _run(go({"speed": 2.0, "sample_rate": 16000}))
    assert (rate, fast_rate) == (22050, 16000)
    assert fast_size / 16000 < 0.7 * size / 22050  # seconds of audio: twice as fast, give or take the pauses


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


async def _bytes_then_replies(port: int, sent: bytes) -> tuple[list[Event], bool]:
    """`sent` written as is -> the events answered and whether the server then closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(sent)
        await writer.drain()
        replies = []
        while (event := await asyncio.wait_for(async_read_event(reader), T)) is not None:
            replies.append(event)
        return replies, reader.at_eof()
    finally:
        writer.close()


MALFORMED = {  # issue 21 item 12: each dropped the connection without an answer, most with a traceback
    "a header that is a list": b'["synthesize"]\n',
    "no type": b'{"data": {"text": "Hi."}}\n',
    "a string data_length": b'{"type": "synthesize", "data_length": "12"}\n{"text": "Hi."}',
    "data that is not JSON": b'{"type": "synthesize", "data_length": 5}\nHi. }',
    "a 70 kB line": b'{"type": "synthesize", "data": {"text": "' + b"a" * 70_000 + b'"}}\n',
    "data that is a string": b'{"type": "synthesize", "data": "text"}\n',
    "a header that is not UTF-8": b'{"type": "describe\xff"}\n',
    "5,000 nested brackets": b"[" * 5000 + b"\n",
}


@pytest.mark.parametrize("sent", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_event_is_answered_with_an_error_event_then_a_normal_close(wyoming_port, sent):
    replies, closed = _run(_bytes_then_replies(wyoming_port, sent))
    assert [e.type for e in replies] == ["error"] and closed, replies
    error = Error.from_event(replies[0])
    assert error.code in ("bad_request", "event_too_large") and "Traceback" not in error.text, error
    assert _run(_first_reply(wyoming_port, Describe().event())).type == "info"  # the server goes on


async def _first_reply(port: int, event: Event) -> Event:
    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(event)
        return await _read(client)


def test_a_second_synthesize_start_is_refused_and_the_open_stream_is_spoken(wyoming_port, http):
    """A second synthesize-start discarded the first stream's unspoken text without a word: it is refused
    (`stream_open`) and the open stream goes on to its end."""
    async def go() -> tuple[list[str], str | None, bytes]:
        async with AsyncTcpClient("127.0.0.1", wyoming_port) as client:
            await client.write_event(SynthesizeStart(voice=SynthesizeVoice(name="joe")).event())
            await client.write_event(SynthesizeChunk(text="Counter three is free").event())
            await client.write_event(SynthesizeStart(voice=SynthesizeVoice(name="joe")).event())
            error = await _read(client)
            await client.write_event(SynthesizeStop().event())
            audio, types = await _audio(client, until="synthesize-stopped")
            return types, Error.from_event(error).code if Error.is_type(error.type) else error.type, audio
    types, code, audio = _run(go())
    assert code == "stream_open" and types[-1] == "synthesize-stopped", (code, types)
    assert audio == _http_pcm(http, "Counter three is free")


def test_an_announced_payload_is_not_read_past_its_bound(wyoming_port):
    """issue 21 item 6: a `describe` announcing payload_length 256 MiB was read whole (RSS +256 MB until the
    connection closed); it gets event_too_large and a close after at most the drain's 1 MiB, and the server's
    process tree does not grow by what the client goes on sending (64 MiB offered)."""
    memory = TreeMemory(SERVERS[wyoming_port])
    before = memory.sample()

    async def go() -> tuple[list[Event], int]:
        reader, writer = await asyncio.open_connection("127.0.0.1", wyoming_port)
        sent, block = 0, b"\0" * (1 << 20)
        try:
            writer.write(json.dumps({"type": "describe", "payload_length": 256 << 20}).encode() + b"\n" + block)
            await writer.drain()
            replies = []
            while (event := await asyncio.wait_for(async_read_event(reader), 20)) is not None:
                replies.append(event)
            while sent < 64 << 20:  # the server has closed: the writes fail soon
                writer.write(block)
                await asyncio.wait_for(writer.drain(), 20)
                sent += len(block)
                memory.sample()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
        return replies, sent
    replies, sent = _run(go())
    assert [e.type for e in replies] == ["error"] and Error.from_event(replies[0]).code == "event_too_large", replies
    assert sent < 32 << 20, sent
    assert memory.peak_sum_kib - before < 32 * 1024, (before, memory.peak_sum_kib)


def test_a_streams_unspoken_text_is_bounded(wyoming_port):
    """issue 21 item 6: chunks sent faster than they are spoken piled up without bound (200 of them: every one
    accepted); past 4 x max_text_len characters cut and not yet spoken a chunk gets text_too_long and is not
    accepted, and the stream goes on."""
    chunk = "Word " * 400  # 2,000 characters, max_text_len: each one is within the per-chunk bound

    async def go() -> list[str]:
        async with AsyncTcpClient("127.0.0.1", wyoming_port) as client:
            await client.write_event(SynthesizeStart(voice=SynthesizeVoice(name="joe")).event())
            for _ in range(12):
                await client.write_event(SynthesizeChunk(text=chunk).event())
            codes = []
            while len(codes) < 12 - 5:  # at most 4 x 2,000 cut and queued (+ the splitter's tail): 5 accepted
                event = await asyncio.wait_for(client.read_event(), 60)
                assert event is not None
                if Error.is_type(event.type):
                    codes.append(Error.from_event(event).code)
            return codes
    assert set(_run(go())) == {"text_too_long"}


def _bounded_server(cosyedge_home: Path, state: Path, port: int, connections: int) -> subprocess.Popen:
    """`cosyedge wyoming` with a 2 s idle timeout, `connections` at most, under 128 open files (so that idle
    connections beyond it would exhaust them: EMFILE at accept)."""
    import resource
    env = {**os.environ, "COSYEDGE_HOME": str(cosyedge_home), "COSYEDGE_THREADS": "1", "OMP_NUM_THREADS": "1",
           "COSYEDGE_STATE_DIR": str(state), "COSYEDGE_WYOMING_IDLE_TIMEOUT_S": "2",
           "COSYEDGE_WYOMING_MAX_CONNECTIONS": str(connections)}
    return subprocess.Popen([sys.executable, "-m", "cosyedge.device.cli", "wyoming", "--uri", f"tcp://127.0.0.1:{port}"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128)))


def test_connections_are_capped_idle_ones_closed_and_accept_survives_emfile(cosyedge_home, tmp_path):
    """issue 21 item 5: Wyoming had no connection cap and no idle timeout, so idle connections held their files
    until the process ran out (EMFILE at accept, and beside `serve` the HTTP worker's accept failed too). Beyond
    the cap a connection gets `too_many_connections` and a close; an idle one `idle_timeout` and a close; with a
    cap above the open-files limit, 200 idle connections exhaust it, and once the idle ones are closed the server
    accepts and answers again."""
    capped, flooded = _free_port(), _free_port()
    servers = [_bounded_server(cosyedge_home, tmp_path / "a", capped, 4),
               _bounded_server(cosyedge_home, tmp_path / "b", flooded, 1000)]
    try:
        for port, server in zip((capped, flooded), servers):
            _wait_listening(port, lambda s=server: s.poll() is None)

        async def held_idle() -> list:
            """4 idle connections the server holds. `_wait_listening`'s probe may still be counted when they arrive
            (the server notices its close a moment later): a refused one is met by connecting all four again."""
            for _ in range(10):
                idle = [await asyncio.open_connection("127.0.0.1", capped) for _ in range(4)]
                await asyncio.sleep(0.5)
                if not any(r.at_eof() or len(r._buffer) for r, _ in idle):  # nothing said to any: all held
                    return idle
                for _, w in idle:
                    w.close()
                await asyncio.sleep(0.5)
            raise AssertionError("4 idle connections were never all held")

        async def capped_run() -> tuple[list[str], list[str]]:
            idle = await held_idle()
            refused, _ = await _bytes_then_replies(capped, b"")
            timed_out = [(await asyncio.wait_for(async_read_event(r), 20)) for r, _ in idle]
            for _, w in idle:
                w.close()
            return [e.data.get("code") for e in refused], [e.data.get("code") if e else None for e in timed_out]
        refused, timed_out = _run(capped_run())
        assert refused == ["too_many_connections"] and timed_out == ["idle_timeout"] * 4, (refused, timed_out)

        held = []
        for _ in range(200):  # beyond 128 open files: the server's accepts fail with EMFILE meanwhile
            try:
                held.append(socket.create_connection(("127.0.0.1", flooded), timeout=2))
            except OSError:
                break
        try:
            assert len(held) > 128
            assert _run(_first_reply(flooded, Describe().event())).type == "info"  # the idle ones were closed
            assert servers[1].poll() is None
        finally:
            for s in held:
                s.close()
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=30)
