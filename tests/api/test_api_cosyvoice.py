"""The API over a real CosyVoice2 bundle (the tiny official-layout release): voices, registration, modes, streaming."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import requests

from apitools import api_config, assert_concurrent_requests_share_decode_steps, run_server, sdk_repeats_hit_the_cache
from cosyedge.device.audio import resample
from cosyedge.device.engine import Engine
from cosyedge.device.sessions import SessionConfig

TRANSCRIPT = "希望你以后能够做的比我还好呦。"
TEXT = "收到好友从远方寄来的生日礼物。"
T = 120  # seconds: a bound for every HTTP call, never an expectation


def _engine(bundle: Path, state: Path) -> Engine:
    return Engine.load(bundle, precision="fp32", sessions=SessionConfig(providers=("cpu",), intra_op_threads=1),
                       warmup=False, state_dir=state)


@pytest.fixture()
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture()
def cv2_server(cv2_tiny_bundle: Path, state: Path) -> Iterator:
    with run_server(api_config(state), _engine(cv2_tiny_bundle, state)) as srv:
        yield srv


@pytest.fixture(scope="module")
def prompt(golden_dir: Path) -> bytes:
    return (golden_dir / "audio" / "zero_shot_prompt.wav").read_bytes()


def _pcm(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, "<i2").astype(np.float32) / 32767


def test_concurrent_requests_share_llm_decode_steps(cv2_server):
    """Four clients at once: their LLM decode steps run batched (cross-request), visible in /metrics."""
    assert_concurrent_requests_share_decode_steps(cv2_server, TEXT, ["tiny_spk_zh", "tiny_spk_en"], T)


def test_voices_list_sft_and_zero_shot_entries(cv2_server):
    voices = requests.get(cv2_server.url + "/v1/audio/voices", timeout=T).json()["voices"]
    assert [(v["name"], v["kind"], v["speaker_id"]) for v in voices] == [
        ("tiny_spk_zh", "zero_shot", 0), ("tiny_spk_en", "zero_shot", 1), ("tiny_sft_spk", "sft", 2)]


def test_registered_voice_is_listed_used_and_survives_a_restart(cv2_tiny_bundle, cv2_server, state, prompt):
    url = cv2_server.url
    created = requests.post(url + "/v1/audio/voices", data={"name": "guest", "text": TRANSCRIPT},
                            files={"audio": ("prompt.wav", prompt, "audio/wav")}, timeout=T)
    assert created.status_code == 201, created.text
    assert created.json() == {"id": "guest", "name": "guest", "speaker_id": 3, "kind": "zero_shot", "registered": True}
    body = {"text": TEXT, "voice": "guest", "format": "pcm", "sampling": "greedy", "deterministic": True}
    first = requests.post(url + "/v1/tts", json=body, timeout=T)
    assert first.status_code == 200, first.text
    assert _pcm(first.content).size > 0

    # A restarted service (new engine, same state directory) still has the voice and says the same.
    with run_server(api_config(state), _engine(cv2_tiny_bundle, state)) as again:
        listed = {v["name"]: v for v in requests.get(again.url + "/v1/audio/voices", timeout=T).json()["voices"]}
        assert listed["guest"]["registered"] is True and listed["tiny_sft_spk"]["registered"] is False
        second = requests.post(again.url + "/v1/tts", json=body, timeout=T)
        np.testing.assert_array_equal(_pcm(second.content), _pcm(first.content))
        assert requests.delete(again.url + "/v1/audio/voices/guest", timeout=T).json() == {"id": "guest", "deleted": True}
        assert requests.delete(again.url + "/v1/audio/voices/guest", timeout=T).status_code == 404
        assert requests.delete(again.url + "/v1/audio/voices/tiny_spk_zh", timeout=T).status_code == 400


@pytest.mark.parametrize("form, upload, status, code", [
    ({"name": "x", "text": TRANSCRIPT}, None, 400, "missing_audio"),
    ({"name": "../x", "text": TRANSCRIPT}, "prompt", 400, "invalid_voice"),
    ({"name": "tiny_spk_zh", "text": TRANSCRIPT}, "prompt", 409, "voice_exists"),
    ({"name": "nodesc", "text": ""}, "prompt", 400, "invalid_voice"),
    ({"name": "junk", "text": TRANSCRIPT}, "junk", 400, "invalid_voice"),
])
def test_bad_voice_uploads(cv2_server, prompt, form, upload, status, code):
    uploads = {"prompt": prompt, "junk": b"RIFF not really"}
    files = {"audio": ("a.wav", uploads[upload], "audio/wav")} if upload else {"other": ("x.txt", b"x", "text/plain")}
    response = requests.post(cv2_server.url + "/v1/audio/voices", data=form, files=files, timeout=T)
    assert response.status_code == status and response.json()["error"]["code"] == code
    assert "/tmp" not in response.text and "Traceback" not in response.text


def _clip(prompt: bytes, gain: float) -> bytes:
    import io

    import soundfile as sf
    wav, rate = sf.read(io.BytesIO(prompt), dtype="float32")
    out = io.BytesIO()
    sf.write(out, wav * gain, rate, format="WAV")
    return out.getvalue()


def test_concurrent_registrations_of_one_name_one_wins_the_others_get_409(cv2_server, state, prompt):
    """Issue 21 item 8: 8 parallel uploads of one name gave seven 201 and one 500 (a shared temporary name), and
    the stored voice could be another client's clip. Now one registration per name at a time: one 201, seven 409,
    and the stored voice is the winner's clip; nothing else is left in the voice folder."""
    from concurrent.futures import ThreadPoolExecutor

    from cosyedge.device.cosyvoice2.voices import Voice
    from cosyedge.device.voice_store import read_prompt_audio
    clips = [_clip(prompt, 0.3 + 0.08 * i) for i in range(8)]

    def upload(i: int) -> requests.Response:
        return requests.post(cv2_server.url + "/v1/audio/voices", data={"name": "contested", "text": TRANSCRIPT},
                             files={"audio": ("a.wav", clips[i], "audio/wav")}, timeout=T)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(upload, range(8)))
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [201] + [409] * 7, [(a.status_code, a.text[:120]) for a in answers]
    assert {a.json()["error"]["code"] for a in answers if a.status_code == 409} == {"voice_exists"}
    winner = next(i for i, a in enumerate(answers) if a.status_code == 201)
    folder = next((state / "voices").iterdir())
    assert [p.name for p in folder.iterdir()] == ["contested.npz"]  # no partial, no second file
    stored = Voice.load("contested", folder / "contested.npz")
    expected = cv2_server.service.engine.pipeline.make_voice("contested", *read_prompt_audio(clips[winner]), TRANSCRIPT)
    np.testing.assert_array_equal(stored.prompt_mel, expected.prompt_mel)


def test_names_no_request_could_select_are_refused_at_registration(cv2_server, prompt):
    """Issue 21 item 13: "5" and "007" select speaker ids, "alloy" is an OpenAI alias: such a voice could never be
    used, yet it was registered with 201."""
    for name in ("5", "007", "alloy"):
        response = requests.post(cv2_server.url + "/v1/audio/voices", data={"name": name, "text": TRANSCRIPT},
                                 files={"audio": ("a.wav", prompt, "audio/wav")}, timeout=T)
        assert response.status_code == 400 and response.json()["error"]["code"] == "voice_name_reserved", name
    names = [v["name"] for v in requests.get(cv2_server.url + "/v1/audio/voices", timeout=T).json()["voices"]]
    assert not {"5", "007", "alloy"} & set(names)
    assert requests.post(cv2_server.url + "/v1/audio/voices", data={"name": "v5", "text": TRANSCRIPT},
                         files={"audio": ("a.wav", prompt, "audio/wav")}, timeout=T).status_code == 201


def test_voice_upload_needs_multipart(cv2_server):
    response = requests.post(cv2_server.url + "/v1/audio/voices", json={"name": "x"}, timeout=T)
    assert response.status_code == 415 and response.json()["error"]["code"] == "unsupported_media_type"


def test_modes_and_streaming(cv2_tiny_bundle, cv2_server, state):
    url = cv2_server.url
    for extra in ({"voice": "tiny_spk_zh", "mode": "cross_lingual"},
                  {"voice": "tiny_spk_zh", "instruct_text": "用四川话说这句话"}, {"voice": "tiny_sft_spk"}):
        ok = requests.post(url + "/v1/tts", json={"text": TEXT, "format": "wav", "sampling": "greedy", **extra}, timeout=T)
        assert ok.status_code == 200, (extra, ok.text)
    refused = requests.post(url + "/v1/tts", json={"text": TEXT, "voice": "tiny_sft_spk", "mode": "zero_shot"}, timeout=T)
    assert refused.status_code == 400 and "sft voice" in refused.json()["error"]["message"]

    body = {"text": TEXT, "voice": "tiny_spk_zh", "format": "pcm", "sampling": "greedy", "deterministic": True,
            "stream": True}
    with requests.post(url + "/v1/tts", json=body, timeout=T, stream=True) as response:
        assert response.status_code == 200 and response.headers["x-sample-rate"] == "24000"
        streamed = _pcm(b"".join(response.iter_content(chunk_size=None)))
    engine = _engine(cv2_tiny_bundle, state)
    direct = np.concatenate(list(engine.stream(TEXT, voice="tiny_spk_zh", sampling="greedy", deterministic=True)))
    assert streamed.size == direct.size
    np.testing.assert_allclose(streamed, direct, atol=2 / 32767)
    # sample_rate: the chunks are resampled as they go (the filter's state across chunks): the direct audio at 16 kHz
    with requests.post(url + "/v1/tts", json={**body, "sample_rate": 16000}, timeout=T, stream=True) as response:
        assert response.status_code == 200 and response.headers["x-sample-rate"] == "16000"
        resampled = _pcm(b"".join(response.iter_content(chunk_size=None)))
    expected = resample(direct, 24000, 16000)
    assert resampled.size == expected.size
    np.testing.assert_allclose(resampled, np.clip(expected, -1, 1), atol=3 / 32767)


def test_openai_instructions_map_to_instruct2(cv2_server):
    response = requests.post(cv2_server.url + "/v1/audio/speech", timeout=T, json={
        "model": "tts-1", "input": TEXT, "voice": "tiny_spk_zh", "response_format": "wav",
        "instructions": "用四川话说这句话"})
    assert response.status_code == 200, response.text
    refused = requests.post(cv2_server.url + "/v1/audio/speech", timeout=T, json={
        "model": "tts-1", "input": TEXT, "voice": "tiny_sft_spk", "instructions": "快一点"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_parameter"


@pytest.mark.parametrize("extra_body", [{"seed": 7}, {"deterministic": True}])
def test_openai_sdk_extension_fields_are_honoured(cv2_server, extra_body):
    import openai
    client = openai.OpenAI(base_url=cv2_server.url + "/v1", api_key="local", max_retries=0, timeout=T)
    sdk_repeats_hit_the_cache(client, extra_body, "tiny_spk_zh", TEXT)


def test_negative_seed_is_refused_before_the_queue(cv2_server, state):
    """Issue 10: a negative seed failed inside the worker (numpy refuses it) and was dead-lettered as a 500."""
    response = requests.post(cv2_server.url + "/v1/tts", json={"text": TEXT, "voice": "tiny_spk_zh", "seed": -1},
                             timeout=T)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_parameter"
    assert not (state / "api_dead_letter.jsonl").exists()


@pytest.mark.parametrize("route, field", [("/v1/tts", "text"), ("/v1/audio/speech", "input")])
@pytest.mark.parametrize("text", ["Hello \\ud800 world.", "\\u4f60\\u597d\\udfff\\u3002"])
def test_lone_surrogates_are_a_400_not_a_500(cv2_server, state, route, field, text):
    """Issue 10 (found by the property tests): JSON can carry a lone surrogate; the CosyVoice2 frontend crashed."""
    body = ('{"%s": "%s", "voice": "tiny_spk_zh", "model": "tts-1"}' % (field, text)).encode()
    status, _, raw = cv2_server.request("POST", route, body)
    assert status == 400, raw[:300]
    assert "lone surrogate" in json.loads(raw)["error"]["message"]
    assert not (state / "api_dead_letter.jsonl").exists()
