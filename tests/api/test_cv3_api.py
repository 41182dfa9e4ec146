"""The API over the tiny Fun-CosyVoice3 bundle: its voices, registration from a 3-30 s recording and its limits,
OpenAI `instructions` / native `instruct_text` mapped to instruct2 (with the official frame), streaming, and
cross-request decode batching visible in /metrics."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import requests
import soundfile as sf

from apitools import api_config, assert_concurrent_requests_share_decode_steps, run_server
from cosyedge.device.engine import Engine
from cosyedge.device.sessions import SessionConfig

TRANSCRIPT = "希望你以后能够做的比我还好呦。"
TEXT = "收到好友从远方寄来的生日礼物。"
T = 120  # seconds: a bound for every HTTP call, never an expectation
FRAME = "You are a helpful assistant. {}<|endofprompt|>"


@pytest.fixture(scope="module")
def engine(cv3_tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return Engine.load(cv3_tiny_bundle, precision="fp32", sessions=SessionConfig(providers=("cpu",), intra_op_threads=1),
                       warmup=False, state_dir=tmp_path_factory.mktemp("cv3state"))


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator:
    with run_server(api_config(engine.state_dir), engine) as srv:
        yield srv


@pytest.fixture(scope="module")
def prompt(golden_dir: Path) -> tuple[np.ndarray, int]:
    wav, rate = sf.read(golden_dir / "audio" / "zero_shot_prompt.wav", dtype="float32")   # 3.48 s
    return wav, rate


def _wav_bytes(wav: np.ndarray, rate: int) -> bytes:
    out = io.BytesIO()
    sf.write(out, wav, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def _register(server, name: str, audio: bytes) -> requests.Response:
    return requests.post(server.url + "/v1/audio/voices", data={"name": name, "text": TRANSCRIPT},
                         files={"audio": ("prompt.wav", audio, "audio/wav")}, timeout=T)


def _pcm(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, "<i2").astype(np.float32) / 32767


def test_voices_are_the_bundles_saved_speakers(server) -> None:
    voices = requests.get(server.url + "/v1/audio/voices", timeout=T).json()["voices"]
    assert [(v["name"], v["kind"]) for v in voices][:2] == [("zs_full", "zero_shot"), ("zs_2s", "zero_shot")]


@pytest.mark.parametrize("seconds, message", [(2.0, "need 3-30 s"), (31.0, "at most 30 s")])
def test_registration_limits(server, prompt, seconds: float, message: str) -> None:
    wav, rate = prompt
    audio = np.tile(wav, 10)[:int(seconds * rate)]
    response = _register(server, f"bad{int(seconds)}", _wav_bytes(audio, rate))
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_voice"
    assert message in response.json()["error"]["message"] and "/tmp" not in response.text


def test_registered_voice_speaks_and_instructions_map_to_instruct2(server, engine, prompt, monkeypatch) -> None:
    wav, rate = prompt
    created = _register(server, "guest3", _wav_bytes(wav, rate))
    assert created.status_code == 201, created.text
    assert created.json()["kind"] == "zero_shot"
    # native route, greedy and deterministic: exactly the engine's instruct2 output with the official frame
    body = {"text": TEXT, "voice": "guest3", "format": "pcm", "sampling": "greedy", "deterministic": True}
    plain = requests.post(server.url + "/v1/tts", json=body, timeout=T)
    instructed = requests.post(server.url + "/v1/tts", json={**body, "instruct_text": "请用广东话表达。"}, timeout=T)
    assert plain.status_code == instructed.status_code == 200, instructed.text
    direct = engine.synthesize_waveform(TEXT, voice="guest3", instruct_text=FRAME.format("请用广东话表达。"),
                                        sampling="greedy", deterministic=True)
    np.testing.assert_allclose(_pcm(instructed.content), direct, atol=2 / 32767)
    assert _pcm(plain.content).shape != direct.shape or not np.allclose(_pcm(plain.content), direct, atol=1e-3)

    # OpenAI route: `instructions` reach the LLM as the framed instruct2 text (a spy on the real pipeline call)
    pipeline = engine.pipeline
    seen: list[tuple] = []
    original = pipeline._mode_inputs

    def spy(request):
        inputs = original(request)
        seen.append((request.voice, request.instruct_text, tuple(inputs.prompt_text)))
        return inputs

    monkeypatch.setattr(pipeline, "_mode_inputs", spy)
    for voice in ("guest3", "zs_full"):
        response = requests.post(server.url + "/v1/audio/speech", timeout=T, json={
            "model": "tts-1", "input": TEXT, "voice": voice, "response_format": "wav", "instructions": "快一点"})
        assert response.status_code == 200, response.text
    framed = tuple(pipeline._frontend.encode(FRAME.format("快一点")))
    assert ("guest3", "快一点", framed) in seen
    # a saved speaker (spk2info) reproduces the official quirk: its prompt text replaces the instruction
    saved = tuple(int(i) for i in pipeline._voices["zs_full"].prompt_text_ids)
    assert ("zs_full", "快一点", saved) in seen


def test_streaming_equals_the_engine(server, engine) -> None:
    body = {"text": TEXT, "voice": "zs_2s", "format": "pcm", "sampling": "greedy", "deterministic": True,
            "stream": True}
    with requests.post(server.url + "/v1/tts", json=body, timeout=T, stream=True) as response:
        assert response.status_code == 200 and response.headers["x-sample-rate"] == "24000"
        streamed = _pcm(b"".join(response.iter_content(chunk_size=None)))
    direct = np.concatenate(list(engine.stream(TEXT, voice="zs_2s", sampling="greedy", deterministic=True)))
    assert streamed.size == direct.size > 0
    np.testing.assert_allclose(streamed, direct, atol=2 / 32767)


def test_concurrent_requests_share_llm_decode_steps(server) -> None:
    assert_concurrent_requests_share_decode_steps(server, TEXT, ["zs_full", "zs_2s"], T)


LONG = "，".join(["收到好友从远方寄来的生日礼物", "那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐"] * 2) + "。"  # one sentence


def _long_chunks(engine: Engine, voice: str) -> list[np.ndarray]:
    chunks = list(engine.stream(LONG, voice=voice, sampling="greedy", deterministic=True))
    assert len(engine.segments(LONG)) == 1 and len(chunks) >= 4   # first hop, then 50, 100, ... tokens: many hops
    return chunks


def test_a_long_request_streams_many_chunks_over_http(server, engine) -> None:
    """One sentence longer than several hops: the HTTP body arrives piece by piece as the chunks are made (the
    first before half the request's time: an order of events, not a duration) and equals the engine's chunks."""
    import time
    chunks = _long_chunks(engine, "zs_full")
    body = {"text": LONG, "voice": "zs_full", "format": "pcm", "sampling": "greedy", "deterministic": True,
            "stream": True}
    arrivals, raw = [], b""
    started = time.monotonic()
    with requests.post(server.url + "/v1/tts", json=body, timeout=T, stream=True) as response:
        assert response.status_code == 200
        for piece in response.iter_content(chunk_size=None):
            arrivals.append(time.monotonic() - started)
            raw += piece
    assert len(arrivals) >= 4 and arrivals[0] < arrivals[-1] / 2, arrivals
    streamed, direct = _pcm(raw), np.concatenate(chunks)
    assert streamed.size == direct.size
    np.testing.assert_allclose(streamed, direct, atol=2 / 32767)


def test_a_long_request_streams_many_chunks_over_the_websocket(cv3_tiny_bundle: Path, engine, tmp_path: Path) -> None:
    """The WebSocket protocol (start / text / end; binary audio, `segment`, `done`) against a real `cosyedge serve`
    on the CosyVoice3 bundle: the long sentence comes back as several binary frames before its `segment` event,
    and the audio is the engine's."""
    import json

    import websocket

    from cosyedge.api.bench.harness import ServiceProcess
    chunks = _long_chunks(engine, "zs_full")
    env = {"COSYEDGE_HOME": str(tmp_path / "home"), "COSYEDGE_PROVIDERS": "cpu", "COSYEDGE_THREADS": "1"}
    messages = [{"type": "start", "format": "pcm", "voice": "zs_full", "sampling": "greedy", "deterministic": True},
                {"type": "text", "text": LONG}, {"type": "end"}]
    frames, audio, events, close = 0, b"", [], None
    with ServiceProcess(bundle=str(cv3_tiny_bundle), env=env) as service:
        ws = websocket.create_connection(service.url.replace("http://", "ws://") + "/v1/audio/stream", timeout=T)
        try:
            for message in messages:
                ws.send(json.dumps(message))
            while close is None:
                opcode, data = ws.recv_data()
                if opcode == websocket.ABNF.OPCODE_BINARY:
                    frames += not events
                    audio += data
                elif opcode == websocket.ABNF.OPCODE_TEXT:
                    events.append(json.loads(data))
                elif opcode == websocket.ABNF.OPCODE_CLOSE:
                    close = int.from_bytes(data[:2], "big")
        finally:
            ws.close()
    assert close == 1000 and [e["type"] for e in events] == ["segment", "done"], events
    assert frames >= 4   # audio frames before the sentence's `segment` event: chunk by chunk
    streamed, direct = _pcm(audio), np.concatenate(chunks)
    assert streamed.size == direct.size
    np.testing.assert_allclose(streamed, direct, atol=2 / 32767)
