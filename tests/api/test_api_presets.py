"""The `preset` field of the HTTP bodies over the tiny CosyVoice2 bundle: a listed preset is used (its audio differs
from `official`, same length), an unknown one is a 400 with code `unknown_preset` (api/README.md)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import requests

from apitools import api_config, run_server
from cosyedge.device.engine import Engine
from cosyedge.device.sessions import SessionConfig

TEXT = "收到好友从远方寄来的生日礼物。"
T = 120  # seconds: a bound for every HTTP call, never an expectation


@pytest.fixture()
def cv2_server(cv2_tiny_bundle: Path, tmp_path: Path) -> Iterator:
    engine = Engine.load(cv2_tiny_bundle, precision="fp32", sessions=SessionConfig(providers=("cpu",), intra_op_threads=1),
                         warmup=False, state_dir=tmp_path / "state")
    with run_server(api_config(tmp_path / "state"), engine) as srv:
        yield srv


def test_preset_in_the_body(cv2_server):
    body = {"text": TEXT, "voice": "tiny_spk_zh", "format": "pcm", "sampling": "greedy", "deterministic": True}
    audio = {}
    for preset in ("official", "fast"):
        r = requests.post(cv2_server.url + "/v1/tts", json={**body, "preset": preset}, timeout=T)
        assert r.status_code == 200, r.text
        audio[preset] = r.content
    assert len(audio["fast"]) == len(audio["official"]) and audio["fast"] != audio["official"]
    default = requests.post(cv2_server.url + "/v1/tts", json=body, timeout=T)
    assert default.content == audio["official"]
    for path, payload in (("/v1/tts", {**body, "preset": "turbo"}),
                          ("/v1/audio/speech", {"input": TEXT, "voice": "tiny_spk_zh", "preset": "turbo"})):
        r = requests.post(cv2_server.url + path, json=payload, timeout=T)
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_preset", r.text
