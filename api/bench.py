"""`cosyedge bench-api`: the HTTP service measured from the outside.

Single client: latency of whole-file requests and time to first audio byte of streamed ones.
Many clients: throughput in audio seconds per wall second, latency under load, mean batch size.
Without --url, a service on the default voice is started in-process on a free port.
"""
from __future__ import annotations

import http.client
import json
import platform
import statistics
import threading
import time
from contextlib import contextmanager
from typing import Iterator
from urllib.parse import urlsplit

# The workload: short announcements, each one sentence (whole-file requests), joined for the paragraph (streaming).
SENTENCES = (
    "Your order has been received and will be ready in ten minutes.",
    "The meeting room on the second floor is free until noon.",
    "Remember to take your umbrella, rain is expected this afternoon.",
    "The printer near the kitchen is out of paper again.",
    "Have a pleasant evening, and see you tomorrow.",
)


def _post(host: str, port: int, body: dict) -> tuple[float, float, float]:
    """(seconds to first body byte, seconds to the end, audio seconds) of one /v1/tts request."""
    conn = http.client.HTTPConnection(host, port, timeout=300)
    try:
        start = time.perf_counter()
        conn.request("POST", "/v1/tts", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        first = response.read1(65536) if hasattr(response, "read1") else response.read(1)
        ttfb = time.perf_counter() - start
        rest = response.read()
        total = time.perf_counter() - start
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(first + rest)[:200]!r}")
        rate = int(response.getheader("X-Sample-Rate"))
        audio = float(response.getheader("X-Audio-Seconds") or (len(first) + len(rest)) / 2 / rate)
        return ttfb, total, audio
    finally:
        conn.close()


def _metric(host: str, port: int, name: str) -> float:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + " ", name + "{")))


@contextmanager
def _local_service(bundle: str | None) -> Iterator[str]:
    from cosyedge.api.app import create_app
    from cosyedge.api.config import load_config
    from cosyedge.api.server import load_engine, make_server

    config = load_config(port=0, bundle=bundle)
    app = create_app(config, engine=load_engine(config))
    server = make_server(app, "127.0.0.1", 0, config.http_threads)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.effective_port}"
    finally:
        app.extensions["cosyedge"].stop()
        server.close()


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50": round(statistics.median(ordered), 4), "p90": round(ordered[int(0.9 * (len(ordered) - 1))], 4),
            "mean": round(statistics.fmean(ordered), 4)}


def run_api_bench(url: str | None = None, bundle: str | None = None, clients: int = 16,
                  requests_per_client: int = 4, single_rounds: int = 10) -> dict:
    if url is None:
        with _local_service(bundle) as local:
            return run_api_bench(local, None, clients, requests_per_client, single_rounds)
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    texts = [SENTENCES[i % len(SENTENCES)] for i in range(max(single_rounds, 1))]
    _post(host, port, {"text": "Warm up.", "format": "wav"})

    whole = [_post(host, port, {"text": t, "format": "wav"}) for t in texts]
    paragraph = " ".join(SENTENCES)  # several sentences: where streaming pays
    rounds = max(1, single_rounds // 3)
    para_whole = [_post(host, port, {"text": paragraph, "format": "wav"}) for _ in range(rounds)]
    para_stream = [_post(host, port, {"text": paragraph, "format": "pcm", "stream": True}) for _ in range(rounds)]

    batches_before = _metric(host, port, "cosyedge_batch_size_count")
    items_before = _metric(host, port, "cosyedge_batch_size_sum")
    results: list[tuple[float, float, float]] = []
    lock, barrier = threading.Lock(), threading.Barrier(clients)

    def client(index: int) -> None:
        barrier.wait()
        for k in range(requests_per_client):
            result = _post(host, port, {"text": SENTENCES[(index + k) % len(SENTENCES)], "format": "wav"})
            with lock:
                results.append(result)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    batches = _metric(host, port, "cosyedge_batch_size_count") - batches_before
    items = _metric(host, port, "cosyedge_batch_size_sum") - items_before
    audio = sum(r[2] for r in results)
    return {
        "url": url, "machine": platform.machine(), "python": platform.python_version(),
        "single_client": {"requests": len(texts), "audio_s_mean": round(statistics.fmean(w[2] for w in whole), 3),
                          "latency_s": _summary([w[1] for w in whole]),
                          "rtf": round(sum(w[1] for w in whole) / sum(w[2] for w in whole), 4)},
        "paragraph": {"sentences": len(SENTENCES), "requests": rounds,
                      "audio_s": round(statistics.fmean(w[2] for w in para_whole), 3),
                      "whole_latency_s": _summary([w[1] for w in para_whole]),
                      "stream_first_byte_s": _summary([w[0] for w in para_stream]),
                      "stream_total_s": _summary([w[1] for w in para_stream])},
        "concurrent": {"clients": clients, "requests": len(results), "wall_s": round(wall, 3),
                       "audio_s": round(audio, 2), "audio_s_per_s": round(audio / wall, 2),
                       "latency_s": _summary([r[1] for r in results]),
                       "mean_batch_size": round(items / batches, 2) if batches else None},
    }


def format_report(report: dict) -> str:
    single, para, many = report["single_client"], report["paragraph"], report["concurrent"]
    return "\n".join([
        f"cosyedge API bench ({report['url']}, {report['machine']})",
        f"single client, {single['requests']} requests of ~{single['audio_s_mean']} s audio:",
        f"  whole-file latency p50 {single['latency_s']['p50']:.3f} s, p90 {single['latency_s']['p90']:.3f} s "
        f"(RTF {single['rtf']:.3f})",
        f"paragraph of {para['sentences']} sentences ({para['audio_s']} s audio), {para['requests']} requests each:",
        f"  whole-file latency p50 {para['whole_latency_s']['p50']:.3f} s; streamed (pcm) first byte p50 "
        f"{para['stream_first_byte_s']['p50']:.3f} s, last byte p50 {para['stream_total_s']['p50']:.3f} s",
        f"{many['clients']} clients, {many['requests']} requests in {many['wall_s']:.2f} s:",
        f"  throughput {many['audio_s_per_s']:.2f} audio s per s, latency p50 {many['latency_s']['p50']:.3f} s, "
        f"p90 {many['latency_s']['p90']:.3f} s, mean batch {many['mean_batch_size']}",
    ])
