"""The official `openai` SDK, pointed at the local service, gets playable audio."""
from __future__ import annotations

import pytest

from apitools import decode

openai = pytest.importorskip("openai", reason="pip install openai (the test extra) to run the SDK tests")

TEXT = "Good morning. The next train leaves from platform four."


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="not-needed-locally", max_retries=0, timeout=60)


def _seconds(audio: bytes) -> float:
    return len(decode(audio)) / 22050


@pytest.mark.parametrize("fmt", ["wav", "mp3"])
def test_sdk_speech_create(client, fmt):
    response = client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format=fmt)
    audio = response.content
    assert audio[:4] == b"RIFF" if fmt == "wav" else audio[:3] in (b"ID3", b"\xff\xfb", b"\xff\xf3")
    assert 2.0 < _seconds(audio) < 8.0


@pytest.mark.parametrize("fmt", ["wav", "mp3"])
def test_sdk_speech_streamed(client, fmt):
    chunks = []
    with client.audio.speech.with_streaming_response.create(
            model="gpt-4o-mini-tts", voice="nova", input=TEXT, response_format=fmt, speed=1.25,
            extra_body={"stream": True}) as response:
        assert response.headers["x-sample-rate"] == "22050"
        assert response.headers.get("transfer-encoding") == "chunked"
        chunks.extend(response.iter_bytes())
    audio = b"".join(chunks)
    if fmt == "wav":
        assert audio[4:8] == b"\xff\xff\xff\xff"  # unknown-length header, then pcm16
    assert 1.5 < _seconds(audio) < 7.0


def test_sdk_streaming_response_without_stream_flag(client):
    with client.audio.speech.with_streaming_response.create(model="tts-1-hd", voice="echo", input=TEXT,
                                                             response_format="mp3") as response:
        audio = response.read()
    assert 2.0 < _seconds(audio) < 8.0


def test_sdk_unknown_voice_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.speech.create(model="tts-1", voice="nobody", input=TEXT)
    assert info.value.body["code"] == "unknown_voice"
