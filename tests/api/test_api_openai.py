"""The official `openai` SDK, pointed at the local service, gets playable audio."""
from __future__ import annotations

import pytest

from apitools import api_config, decode, run_server, sdk_repeats_hit_the_cache
from cosyedge.api.bench.harness import ServiceProcess

openai = pytest.importorskip("openai", reason="pip install openai (the test extra) to run the SDK tests")

TEXT = "Good morning. The next train leaves from platform four."


API_KEY = "sk-local-" + "7" * 32


@pytest.fixture(scope="module")
def keyed_server(default_engine, tmp_path_factory):
    """The same service with an API key configured: the SDK sends it as `Authorization: Bearer`."""
    with run_server(api_config(tmp_path_factory.mktemp("keyed"), api_key=API_KEY), default_engine) as srv:
        yield srv


@pytest.fixture(scope="module", params=["no key", "api key"])
def client(request):
    if request.param == "no key":
        return openai.OpenAI(base_url=request.getfixturevalue("server").url + "/v1", api_key="not-needed-locally",
                             max_retries=0, timeout=60)
    return openai.OpenAI(base_url=request.getfixturevalue("keyed_server").url + "/v1", api_key=API_KEY,
                         max_retries=0, timeout=60)


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


@pytest.mark.parametrize("extra_body", [{"deterministic": True}, {"seed": 7}])
def test_sdk_extra_body_deterministic_is_honoured(server, extra_body):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="not-needed-locally", max_retries=0, timeout=60)
    sdk_repeats_hit_the_cache(client, extra_body, "alloy", TEXT)


@pytest.mark.parametrize("bundle, voice, text", [("default_bundle_path", "alloy", TEXT),
                                               ("cv2_tiny_bundle", "tiny_spk_zh", "收到好友从远方寄来的生日礼物。")])
def test_sdk_extension_fields_through_cosyedge_serve(request, cosyedge_home, bundle, voice, text):
    """Issue 20's acceptance on the service a kiosk runs (`cosyedge serve`: gunicorn and its front worker, the
    phrase cache on disk), for the default voice and the tiny CosyVoice2 bundle: `extra_body` deterministic and
    seed each give the same bytes twice, the repeat from the cache."""
    env = {"COSYEDGE_HOME": str(cosyedge_home), "COSYEDGE_PROVIDERS": "cpu", "COSYEDGE_THREADS": "1"}
    with ServiceProcess(bundle=str(request.getfixturevalue(bundle)), env=env) as service:
        client = openai.OpenAI(base_url=service.url + "/v1", api_key="not-needed-locally", max_retries=0,
                               timeout=120)
        for extra_body in ({"deterministic": True}, {"seed": 7}):
            sdk_repeats_hit_the_cache(client, extra_body, voice, text)


def test_sdk_unknown_voice_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.speech.create(model="tts-1", voice="nobody", input=TEXT)
    assert info.value.body["code"] == "unknown_voice"


def test_sdk_with_a_wrong_key_raises_authentication_error(keyed_server):
    wrong = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="sk-local-" + "0" * 32, max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.audio.speech.create(model="tts-1", voice="alloy", input=TEXT)
    assert info.value.status_code == 401 and info.value.body["code"] == "unauthorized"
    assert API_KEY not in str(info.value.body) and "0" * 32 not in str(info.value.body)
