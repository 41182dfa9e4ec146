"""Discovery and operations routes, and /openapi.json kept equal to the app's routes."""
from __future__ import annotations

import json
import re
import time

from cosyedge.api.openapi import spec


def test_openapi_describes_every_route_and_only_those(server):
    status, _, raw = server.request("GET", "/openapi.json")
    assert status == 200
    described = {(path, method.upper()) for path, item in json.loads(raw)["paths"].items() for method in item}
    routed = {(re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule), method) for rule in server.app.url_map.iter_rules()
              for method in rule.methods - {"HEAD", "OPTIONS"}}
    assert described == routed
    assert json.loads(raw) == json.loads(json.dumps(spec(server.service.config)))


def test_voices_models_health(server):
    voices = json.loads(server.request("GET", "/v1/audio/voices")[2])
    assert voices["voices"][0] == {"id": "joe", "name": "joe", "speaker_id": 0, "kind": "builtin", "registered": False}
    assert voices["aliases"]["alloy"] == "joe" and len(voices["aliases"]) >= 11
    models = [m["id"] for m in json.loads(server.request("GET", "/v1/models")[2])["data"]]
    assert {"tts-1", "tts-1-hd", "gpt-4o-mini-tts", "piper-en_US-joe"} <= set(models)
    assert server.request("GET", "/healthz")[0] == 200
    assert json.loads(server.request("GET", "/readyz")[2])["status"] == "ready"


def test_metrics_exposition(server):
    server.post("/v1/tts", {"text": "Count me."})
    for _ in range(100):  # bounded: a request is counted when its response closes, just after the last byte
        status, headers, raw = server.request("GET", "/metrics")
        text = raw.decode()
        if 'cosyedge_requests_total{route="/v1/tts",status="200"}' in text:
            break
        time.sleep(0.01)
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    for name in ("cosyedge_requests_total", "cosyedge_request_duration_seconds_bucket", "cosyedge_queue_depth",
                 "cosyedge_batch_size_bucket", "cosyedge_audio_seconds_total", "cosyedge_rtf"):
        assert f"\n{name}" in text, name
    assert 'cosyedge_requests_total{route="/v1/tts",status="200"}' in text
    assert server.metric("cosyedge_rtf") > 0 and server.metric("cosyedge_ready") == 1
