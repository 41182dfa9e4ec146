"""Input that leaves the schema (issue 10): every one is a JSON 4xx with a code, never a 500 or a dead letter.

Each case was a 500 (or, for the negative seed, a failure inside the engine worker) before the API bounded
its JSON parser and checked these fields itself.
"""
from __future__ import annotations

import http.client
import json

import pytest

from apitools import api_config, run_server

TTS = "/v1/tts"


def _code(status: int, raw: bytes) -> str:
    body = raw.decode()
    assert "Traceback" not in body and "/work/" not in body and "/tmp/" not in body
    data = json.loads(raw)
    assert set(data["error"]) == {"code", "message", "type"} and data["error"]["type"] == "invalid_request_error"
    return data["error"]["code"]


@pytest.mark.parametrize("path, raw, code", [
    (TTS, b'{"text": "Hi.", "seed": ' + b"7" * 4301 + b"}", "number_too_large"),   # int() refuses > 4300 digits
    (TTS, b'{"text": "Hi.", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "nesting_too_deep"),  # RecursionError
    (TTS, b'{"text": "Hi.", "x": ' + b'{"a": ' * 40 + b"1" + b"}" * 40 + b"}", "nesting_too_deep"),
    (TTS, b'{"text": "Hi.", "speed": 1' + b"0" * 399 + b"}", "number_too_large"),  # a 400-digit speed
    (TTS, b'{"text": "Hi.", "speed": 1' + b"0" * 29 + b"}", "speed_out_of_range"),  # large, but never a float
    (TTS, b'{"text": "Hi.", "speed": 1e999}', "speed_out_of_range"),                 # inf
    (TTS, b'{"text": "Hi.", "speed": NaN}', "invalid_json"),
    (TTS, json.dumps({"text": "Hi.", "voice": "\u00b2"}).encode(), "unknown_voice"),  # "²".isdigit() is True
    ("/v1/audio/speech", json.dumps({"input": "Hi.", "voice": "\u0663"}).encode(), "unknown_voice"),  # Arabic 3
    (TTS, json.dumps({"text": "Hi.", "seed": -1}).encode(), "invalid_parameter"),
    (TTS, json.dumps({"text": "Hi.", "seed": 2**32}).encode(), "invalid_parameter"),
    ("/v1/tts/batch", json.dumps({"texts": ["Hi."], "seed": -5}).encode(), "invalid_parameter"),
])
def test_out_of_schema_input_is_400(server, path, raw, code):
    failures = server.metric("cosyedge_synthesis_failures_total")
    status, _, body = server.post(path, raw)
    assert status == 400, body[:300]
    assert _code(status, body) == code
    assert server.metric("cosyedge_synthesis_failures_total") == failures  # refused before the queue


def test_brackets_inside_strings_do_not_count_as_nesting(server):
    status, _, body = server.post(TTS, json.dumps({"text": "[" * 100 + "{" * 100}).encode())
    assert status == 400 and _code(status, body) == "empty_text"  # parsed; nothing speakable in it


def test_ascii_digits_still_select_a_speaker_id(server):
    assert server.post(TTS, {"text": "Hi.", "voice": "0", "format": "pcm"})[0] == 200


def test_too_many_headers_is_431(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.putrequest("GET", "/healthz")
        for i in range(200):
            conn.putheader(f"X-Filler-{i}", "x")
        conn.endheaders()
        response = conn.getresponse()
        status, raw = response.status, response.read()
    finally:
        conn.close()
    assert status == 431 and _code(status, raw) == "too_many_headers"


def test_negative_seed_never_reaches_the_worker(default_engine, tmp_path):
    """The dead-letter file stays empty: a bad seed is the client's error, not a synthesis failure."""
    with run_server(api_config(tmp_path), default_engine) as srv:
        status, _, body = srv.post(TTS, {"text": "Hello.", "seed": -1})
        assert status == 400 and _code(status, body) == "invalid_parameter"
    assert not (tmp_path / "api_dead_letter.jsonl").exists()
