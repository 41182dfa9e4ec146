"""Concurrency: 16 clients at once all get their own audio, one sentence per engine call (VITS has nothing to
gain from closed batches, so nobody waits for company); beyond queue_size a request is answered 503 at once."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from apitools import api_config, decode, run_server

WORDS = ("apples", "bridges", "candles", "dragons", "engines", "forests", "gardens", "harbours",
         "islands", "jackets", "kettles", "lanterns", "mirrors", "needles", "oceans", "pillows")


def test_sixteen_concurrent_clients_each_get_their_own_audio(server, default_engine):
    texts = [f"Client {i} would like some {word}." for i, word in enumerate(WORDS)]
    before = server.metric("cosyedge_batch_size_count")
    start = threading.Barrier(len(texts))

    def client(text: str):
        start.wait(timeout=30)
        return server.post("/v1/tts", {"text": text, "format": "wav", "deterministic": True})

    with ThreadPoolExecutor(len(texts)) as pool:
        results = list(pool.map(client, texts))
    for text, (status, headers, body) in zip(texts, results):
        assert status == 200, body[:200]
        got = decode(body).astype(np.float32) / 32767
        want = default_engine.synthesize_waveform(text, deterministic=True)
        assert len(got) == len(want), text  # each client got its own sentence, not a neighbour's
        assert np.max(np.abs(got - want)) < 0.02, text  # 16-bit rounding
    assert server.metric("cosyedge_batch_size_count") - before == len(texts)  # one engine call per sentence
    _, _, metrics = server.request("GET", "/metrics")
    one = [l for l in metrics.decode().splitlines() if l.startswith('cosyedge_batch_size_bucket{le="1.0"}')][0]
    assert float(one.split()[1]) == server.metric("cosyedge_batch_size_count")


def test_full_queue_answers_503_with_retry_after(fault_engine, fault_pipeline, tmp_path):
    """queue_size 2 bounds the requests in flight: one rendering (held), one waiting; a third is refused."""
    config = api_config(tmp_path, queue_size=2)
    with run_server(config, fault_engine) as srv, ThreadPoolExecutor(2) as pool:
        held = pool.submit(srv.post, "/v1/tts", {"text": "Please hold the line."})
        assert fault_pipeline.holding.wait(30), "the worker never started the held item"
        queued = pool.submit(srv.post, "/v1/tts", {"text": "I wait in the queue."})
        for _ in range(200):  # bounded: until the second request waits for the engine
            if srv.service.door.waiting() == 1:
                break
            time.sleep(0.01)
        assert srv.service.door.waiting() == 1 and srv.metric("cosyedge_in_flight") == 2
        started = time.monotonic()
        status, headers, body = srv.post("/v1/tts", {"text": "No room for me."}, timeout=10)
        assert time.monotonic() - started < 5  # answered at once, not after the held work
        assert status == 503 and int(headers["retry-after"]) >= 1
        assert json.loads(body)["error"]["code"] == "queue_full"
        fault_pipeline.release.set()
        assert held.result(timeout=60)[0] == 200
        assert queued.result(timeout=60)[0] == 200
        assert srv.metric("cosyedge_queue_rejected_total") == 1


def test_deadline_expired_before_work_starts_is_504(fault_engine, fault_pipeline, tmp_path):
    config = api_config(tmp_path, request_timeout_s=0.5)
    with run_server(config, fault_engine) as srv, ThreadPoolExecutor(1) as pool:
        held = pool.submit(srv.post, "/v1/tts", {"text": "Please hold the line."})
        assert fault_pipeline.holding.wait(30)
        status, _, body = srv.post("/v1/tts", {"text": "Too late for me."}, timeout=10)
        assert status == 504 and json.loads(body)["error"]["code"] == "deadline_exceeded"
        fault_pipeline.release.set()
        assert held.result(timeout=60)[0] == 200
        assert srv.metric("cosyedge_deadline_expired_total") == 1


def test_rate_limit_answers_429(default_engine, tmp_path):
    config = api_config(tmp_path, rate_limit_per_s=0.01, rate_limit_burst=2)
    with run_server(config, default_engine) as srv:
        me = {"Authorization": "Bearer client-a"}
        assert [srv.post("/v1/tts", {"text": "Hi."}, headers=me)[0] for _ in range(2)] == [200, 200]
        status, headers, body = srv.post("/v1/tts", {"text": "Hi."}, headers=me)
        assert status == 429 and int(headers["retry-after"]) >= 1
        assert json.loads(body)["error"]["type"] == "rate_limit_error"
        # no API key configured: a made-up Authorization header is no identity, the peer address is (issue 10)
        assert srv.post("/v1/tts", {"text": "Hi."}, headers={"Authorization": "Bearer client-b"})[0] == 429


def test_drain_waits_for_requests_under_way(fault_engine, fault_pipeline, tmp_path):
    with run_server(api_config(tmp_path), fault_engine) as srv, ThreadPoolExecutor(1) as pool:
        held = pool.submit(srv.post, "/v1/tts", {"text": "Please hold the line."})
        assert fault_pipeline.holding.wait(30)
        assert not srv.service.drain(0.2)  # the held request is still under way
        status, headers, body = srv.post("/v1/tts", {"text": "Too late, we are stopping."})
        assert status == 503 and json.loads(body)["error"]["code"] == "not_ready" and headers["retry-after"]
        assert srv.request("GET", "/readyz")[0] == 503
        fault_pipeline.release.set()
        assert held.result(timeout=60)[0] == 200
        assert srv.service.drain(10)
