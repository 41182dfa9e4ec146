"""Every bad input gets its status and the one error shape; a failing synthesis is a 500 and a dead letter."""
from __future__ import annotations

import base64
import json

import pytest

from apitools import api_config, decode, run_server
from cosyedge.device.request import BATCH, SPEECH as SPEECH_DOOR, TTS
from requesttools import DEFAULTS, HOSTILE, case_id, wire

SPEECH = "/v1/audio/speech"
OK = {"model": "tts-1", "input": "Hello there.", "voice": "alloy", "response_format": "wav"}


def _error(status: int, body: bytes) -> dict:
    data = json.loads(body)
    assert set(data) == {"error"} and set(data["error"]) == {"code", "message", "type"}
    text = body.decode()
    assert "Traceback" not in text and "/work/" not in text and "/tmp/" not in text and "site-packages" not in text
    assert data["error"]["type"] == ("invalid_request_error" if status < 500 else data["error"]["type"])
    return data["error"]


@pytest.mark.parametrize("path, body, headers, status, code", [
    (SPEECH, b'{"input": "Hello",', None, 400, "invalid_json"),
    (SPEECH, b'["not", "an", "object"]', None, 400, "invalid_json"),
    (SPEECH, json.dumps(OK).encode(), {"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
    (SPEECH, b'{"input": "caf\xe9"}', None, 400, "invalid_utf8"),
    (SPEECH, {**OK, "input": ""}, None, 400, "empty_text"),
    (SPEECH, {**OK, "input": "   \n "}, None, 400, "empty_text"),
    (SPEECH, {**OK, "input": "\U0001F600\U0001F44D"}, None, 400, "empty_text"),
    (SPEECH, {**OK, "input": 42}, None, 400, "invalid_parameter"),
    (SPEECH, {**OK, "input": "a" * 2001}, None, 413, "text_too_long"),
    (SPEECH, {**OK, "voice": "nobody"}, None, 400, "unknown_voice"),
    (SPEECH, {**OK, "response_format": "midi"}, None, 400, "unknown_format"),
    (SPEECH, {**OK, "speed": 4.5}, None, 400, "speed_out_of_range"),
    (SPEECH, {**OK, "speed": 0.1}, None, 400, "speed_out_of_range"),
    (SPEECH, {**OK, "speed": "fast"}, None, 400, "invalid_parameter"),
    (SPEECH, {**OK, "model": "dall-e-3"}, None, 400, "unknown_model"),
    (SPEECH, {**OK, "stream": "yes"}, None, 400, "invalid_parameter"),
    ("/v1/tts", {"text": "Hi.", "speaker_id": -1}, None, 400, "unknown_voice"),
    ("/v1/tts", {"text": "Hi.", "voice": "joe", "speaker_id": 0}, None, 400, "invalid_parameter"),
    ("/v1/tts/batch", {"texts": []}, None, 400, "invalid_parameter"),
    ("/v1/tts/batch", {"texts": ["a"] * 65}, None, 413, "too_many_items"),
    ("/v1/nothing", {}, None, 404, "not_found"),
    (SPEECH, b'{"input": "' + b"a" * (2 << 20) + b'"}', None, 413, "body_too_large"),
])
def test_bad_input(server, path, body, headers, status, code):
    got, _, raw = server.post(path, body, headers=headers)
    assert got == status, raw[:300]
    assert _error(status, raw)["code"] == code


ROUTES = {SPEECH: (SPEECH_DOOR, {"input": "Hi."}), "/v1/tts": (TTS, {"text": "Hi."}),
          "/v1/tts/batch": (BATCH, {"texts": ["Hi."]})}


@pytest.mark.parametrize("case", HOSTILE, ids=case_id)
def test_hostile_fields_get_the_same_code_on_every_route(server, case):
    """The request declaration's table of hostile values (tests/requesttools.py): one code per value, on the three
    synthesis routes here, on the WebSocket (test_websocket.py), Wyoming (test_wyoming.py) and the CLI."""
    fields, code = case
    for path, (door, base) in ROUTES.items():
        status, _, raw = server.post(path, {**base, **wire(fields, door)})
        assert (status, _error(status, raw)["code"]) == (400, code), (path, raw[:300])


def test_empty_strings_and_nulls_are_the_defaults_on_every_route(server):
    for path, (door, base) in ROUTES.items():
        for fields in DEFAULTS:
            status, _, raw = server.post(path, {**base, **wire(fields, door), "format" if door != SPEECH_DOOR
                                                else "response_format": "pcm"})
            assert status == 200, (path, fields, raw[:300])


def test_wrong_method_is_405_json(server):
    status, _, raw = server.request("GET", SPEECH)
    assert status == 405 and _error(405, raw)["code"] == "method_not_allowed"


def test_emoji_is_normalised_not_rejected(server):
    status, headers, body = server.post(SPEECH, {**OK, "input": "Hello \U0001F44B world \U0001F30D!"})
    assert status == 200 and headers["content-type"] == "audio/wav"
    assert len(decode(body)) > 0.5 * 22050


def test_native_tts_by_speaker_id_and_pcm(server):
    status, headers, body = server.post("/v1/tts", {"text": "Number one.", "speaker_id": 0, "format": "pcm"})
    assert status == 200 and headers["x-sample-rate"] == "22050" and headers["content-type"].startswith("audio/L16")
    assert len(body) % 2 == 0 and len(body) > 0.3 * 22050 * 2


def test_failing_synthesis_is_500_with_dead_letter(fault_engine, fault_pipeline, tmp_path):
    with run_server(api_config(tmp_path), fault_engine) as srv:
        status, headers, raw = srv.post(SPEECH, {**OK, "input": "This one goes kaboom."})
        error = _error(500, raw)
        assert status == 500 and error["code"] == "synthesis_failed" and error["type"] == "server_error"
        assert headers["x-request-id"] in error["message"]
        records = [json.loads(line) for line in (tmp_path / "api_dead_letter.jsonl").read_text().splitlines()]
        assert len(records) == 1
        record = records[0]
        assert record["request"]["text"] == "This one goes kaboom." and record["route"] == SPEECH
        assert record["error"] == "RuntimeError: injected failure in render" and record["time"]
        assert record["request_id"] == headers["x-request-id"]
        assert srv.metric("cosyedge_synthesis_failures_total") == 1
        assert srv.post(SPEECH, OK)[0] == 200  # the service carries on


def test_batch_per_item_errors(fault_engine, fault_pipeline, tmp_path):
    texts = ["First good one.", "", "Then kaboom.", "x" * 2001, "Second good one \U0001F642."]
    with run_server(api_config(tmp_path), fault_engine) as srv:
        status, _, raw = srv.post("/v1/tts/batch", {"texts": texts, "format": "mp3"})
    assert status == 200
    data = json.loads(raw)
    assert data["succeeded"] == 2 and [r["index"] for r in data["results"]] == list(range(5))
    ok = [r for r in data["results"] if r["ok"]]
    assert [r["index"] for r in ok] == [0, 4]
    for item in ok:
        assert abs(len(decode(base64.b64decode(item["audio"]))) / 22050 - item["audio_seconds"]) < 0.2
    failed = {r["index"]: (r["status"], r["error"]["code"]) for r in data["results"] if not r["ok"]}
    assert failed == {1: (400, "empty_text"), 2: (500, "synthesis_failed"), 3: (413, "text_too_long")}
    record = json.loads((tmp_path / "api_dead_letter.jsonl").read_text().splitlines()[0])
    assert record["route"] == "/v1/tts/batch" and record["request"]["index"] == 2


def test_every_error_code_the_service_can_answer_is_in_the_error_table():
    """api/README.md's error table names every code an ApiError, a WebSocket session error or a device error can
    carry (it lacked worker_stopped and websocket_unavailable); the measurement package is not the service."""
    import re
    from pathlib import Path

    from cosyedge.api.errors import DEVICE_ERRORS
    api = Path(__file__).resolve().parents[2] / "api"
    raised = re.compile(r'(?:ApiError\(|super\(\).__init__\(|SessionError\()\s*(?:\d+,\s*)?"([a-z][a-z_]+)"|code="([a-z][a-z_]+)"')
    codes = {code for path in api.rglob("*.py") if "bench" not in path.parts
             for match in raised.finditer(path.read_text()) for code in match.groups() if code}
    codes |= {code for _, code in DEVICE_ERRORS.values()}
    readme = (api / "README.md").read_text()
    assert len(codes) > 30 and {code for code in codes if f"`{code}`" not in readme} == set()
