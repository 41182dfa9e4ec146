"""CosyVoice over HTTP with continuous batching (issue 11): no request waits behind another's batch, streams send
each chunk as soon as it is vocoded, and a client that leaves frees its decode row (tiny CosyVoice2 bundle)."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest
import requests

from apitools import api_config, decode, run_server, streaming_client
from cosyedge.api.admission import Admission
from cosyedge.api.metrics import Metrics
from cosyedge.device.engine import Engine
from cosyedge.device.sessions import SessionConfig

# One sentence of 180 text tokens: the LLM must make >= 360 speech tokens (6+ chunks, seconds of work even tiny);
# LONGER keeps the LLM itself busy for seconds, so a client that leaves after its first chunk leaves a decoding row.
LONG = "，".join(["收到好友从远方寄来的生日礼物"] * 20) + "。"
LONGER = "，".join(["收到好友从远方寄来的生日礼物"] * 100) + "。"  # 900 text tokens: >= 1800 speech tokens
SHORT = "你好。"
T = 120  # seconds: a bound for every HTTP call, never an expectation


@pytest.fixture(scope="module")
def cv2_server(cv2_tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    state = tmp_path_factory.mktemp("continuous")
    engine = Engine.load(cv2_tiny_bundle, precision="fp32", warmup=False, state_dir=state,
                         sessions=SessionConfig(providers=("cpu",), intra_op_threads=1))
    with run_server(api_config(state), engine) as srv:
        yield srv


def _wait_for(condition, what: str, bound: float = 60) -> None:
    end = time.monotonic() + bound
    while not condition():
        assert time.monotonic() < end, what
        time.sleep(0.01)


def test_short_request_finishes_before_a_long_one_already_running(cv2_server):
    finished: list[str] = []
    lock = threading.Lock()

    def post(name: str, text: str) -> int:
        response = requests.post(cv2_server.url + "/v1/tts", json={"text": text, "voice": "tiny_spk_zh", "seed": 1,
                                                                   "format": "wav"}, timeout=T)
        with lock:
            finished.append(name)
        return response.status_code

    steps = cv2_server.metric("cosyedge_decode_steps")
    joined = cv2_server.metric("cosyedge_decode_rows_joined")
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(post, "long", LONG)
        _wait_for(lambda: cv2_server.metric("cosyedge_decode_steps") > steps + 20, "the long request never decoded")
        short = pool.submit(post, "short", SHORT)
        assert (short.result(T), long.result(T)) == (200, 200)
    assert finished == ["short", "long"]
    # the short request's row joined the long one's running decode batch (it did not wait for its end)
    assert cv2_server.metric("cosyedge_decode_rows_joined") == joined + 1
    assert cv2_server.metric("cosyedge_decode_rows_per_step_bucket") > 0  # occupancy histogram is exposed


@pytest.mark.parametrize("fmt", ["pcm", "mp3"])
def test_long_sentence_streams_chunks_spread_over_the_request(cv2_server, fmt):
    """The first audio reaches the client while the LLM is still decoding the sentence: chunk by chunk, not the
    sentence rendered and then sent. Progress is read from the decode-step counter, not a wall-clock ratio, which a
    shared box skews (only this request runs on the module's server)."""
    pieces = 0
    body = b""
    ttfa = cv2_server.metric("cosyedge_time_to_first_audio_seconds_count")
    steps = cv2_server.metric("cosyedge_decode_steps")
    steps_at_first_audio = None
    with requests.post(cv2_server.url + "/v1/audio/speech", stream=True, timeout=T, json={
            "model": "tts-1", "input": LONG, "voice": "tiny_spk_zh", "stream": True, "response_format": fmt}) as r:
        assert r.status_code == 200
        for piece in r.iter_content(chunk_size=None):
            if steps_at_first_audio is None:
                steps_at_first_audio = cv2_server.metric("cosyedge_decode_steps") - steps
            pieces += 1
            body += piece
    steps_total = cv2_server.metric("cosyedge_decode_steps") - steps
    assert cv2_server.metric("cosyedge_time_to_first_audio_seconds_count") > ttfa
    assert pieces >= 4
    # >= 360 speech tokens; the first chunk needs ~30, and the decoder goes on while the flow and vocoder work
    assert steps_total >= 360 and steps_at_first_audio < steps_total * 0.8, (steps_at_first_audio, steps_total)
    assert len(decode(body, 24000) if fmt == "mp3" else body) > 0


def test_client_that_leaves_mid_stream_frees_its_decode_row(cv2_server):
    disconnects = cv2_server.metric("cosyedge_stream_disconnects_total")
    cancelled = cv2_server.metric("cosyedge_decode_rows_cancelled")
    with streaming_client(cv2_server.port, {"text": LONGER, "voice": "tiny_spk_zh", "stream": True,
                                            "format": "pcm"}) as client:
        assert client.stdout.readline().strip() == "streaming", client.stderr.read()
        assert cv2_server.metric("cosyedge_decode_active_rows") == 1
    _wait_for(lambda: cv2_server.metric("cosyedge_decode_rows_cancelled") > cancelled, "the row was never withdrawn")
    assert cv2_server.metric("cosyedge_stream_disconnects_total") == disconnects + 1
    _wait_for(lambda: cv2_server.metric("cosyedge_decode_active_rows") == 0, "a row still decodes")
    _wait_for(lambda: cv2_server.metric("cosyedge_in_flight") == 0, "the stream still holds its place")


def test_requests_beyond_the_in_flight_bound_get_503_with_retry_after(cv2_tiny_bundle, tmp_path):
    """queue_size bounds the requests in flight (waiting + decoding + streaming): one stream holds the only place."""
    engine = Engine.load(cv2_tiny_bundle, precision="fp32", warmup=False, state_dir=tmp_path,
                         sessions=SessionConfig(providers=("cpu",), intra_op_threads=1))
    with run_server(api_config(tmp_path, queue_size=1), engine) as srv:
        with streaming_client(srv.port, {"text": LONGER, "voice": "tiny_spk_zh", "stream": True,
                                         "format": "pcm"}) as client:
            assert client.stdout.readline().strip() == "streaming", client.stderr.read()
            assert srv.metric("cosyedge_in_flight") == 1
            for stream in (False, True):
                status, headers, body = srv.post("/v1/tts", {"text": SHORT, "voice": "tiny_spk_zh", "stream": stream})
                assert status == 503 and int(headers["retry-after"]) >= 1, body[:200]
                assert json.loads(body)["error"]["code"] == "queue_full"
        _wait_for(lambda: srv.metric("cosyedge_in_flight") == 0, "the stream still holds its place")
        assert srv.post("/v1/tts", {"text": SHORT, "voice": "tiny_spk_zh"})[0] == 200
        assert srv.metric("cosyedge_queue_rejected_total") == 2


def test_retry_after_comes_from_the_measured_completions():
    admission = Admission(capacity=4, timeout_s=60, metrics=Metrics())
    assert admission.retry_after(1) == 1  # nothing measured yet
    admission._finished.extend([100.0, 110.0, 120.0])  # two completions in 20 s: 0.1 per second
    assert admission.retry_after(1) == 10 and admission.retry_after(3) == 30


def test_first_arrival_waits_batch_timeout_for_company(cv2_tiny_bundle, tmp_path):
    """Idle engine, batch_timeout 3 s: a request sent 0.3 s after the first joins its prefill (one prefill call for
    both); once both are there (batch_max 2) nobody waits longer."""
    engine = Engine.load(cv2_tiny_bundle, precision="fp32", warmup=False, state_dir=tmp_path,
                         sessions=SessionConfig(providers=("cpu",), intra_op_threads=1))
    with run_server(api_config(tmp_path, batch_max=2, batch_timeout_ms=3000), engine) as srv, \
            ThreadPoolExecutor(2) as pool:
        prefills = engine.describe()["decode"]["prefill_calls"]
        body = {"text": SHORT, "voice": "tiny_spk_zh", "format": "pcm"}
        first = pool.submit(srv.post, "/v1/tts", body)
        _wait_for(lambda: srv.service.door.waiting() == 1, "the first request never queued")
        time.sleep(0.3)  # well inside the 3 s wait: the first request is still waiting for company
        second = pool.submit(srv.post, "/v1/tts", body)
        assert (first.result(T)[0], second.result(T)[0]) == (200, 200)
        assert engine.describe()["decode"]["prefill_calls"] == prefills + 1
