"""Issue 14's latency figures, measured from the outside of one real `cosyedge serve --wyoming` process:

- phrase-cache hits over HTTP: p50/p95 of whole-request time (keep-alive connection, body read) for a repeated
  deterministic phrase, per format, beside the miss that filled the cache;
- first audio of the same streamed two-sentence request over HTTP (`stream: true`, pcm: time to the first body
  byte) and over Wyoming (one-shot `synthesize`, and `synthesize-start`/`-chunk`/`-stop` with the whole text in one
  chunk: time to the first `audio-chunk`), taken in alternation so that both see the same load.

    python -m cosyedge.api.bench.latency [--bundle DIR] [--rounds 20] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import socket
import statistics
import time
from typing import Any

from wyoming.client import AsyncTcpClient
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop

from cosyedge.api.bench.harness import ServiceProcess, free_port

PHRASE = ("Please take your ticket and wait until your number is called. "
          "Counter three is now free for the next customer.")
TWO_SENTENCES = "Counter three is free. Please take your ticket and wait for your number."


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50_ms": round(1000 * statistics.median(ordered), 2),
            "p95_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 2), "n": len(ordered)}


def _post(conn: http.client.HTTPConnection, body: dict[str, Any]) -> tuple[float, float, http.client.HTTPResponse, bytes]:
    """(first body byte s, whole body s, response, body) of one POST /v1/tts on a kept-alive connection."""
    start = time.perf_counter()
    conn.request("POST", "/v1/tts", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    first = response.read(1)
    first_s = time.perf_counter() - start
    data = first + response.read()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {data[:200]!r}")
    return first_s, time.perf_counter() - start, response, data


def cache_hits(port: int, extra: dict[str, Any], rounds: int) -> dict[str, Any]:
    report = {}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    for fmt in ("wav", "mp3"):
        body = {"text": PHRASE, "format": fmt, **extra}
        _, miss_s, response, _ = _post(conn, body)
        assert response.getheader("X-Cosyedge-Cache") == "miss", "the phrase was cached before the bench"
        times, audio_s = [], float(response.getheader("X-Audio-Seconds"))
        for _ in range(rounds):
            _, total, response, _ = _post(conn, body)
            assert response.getheader("X-Cosyedge-Cache") == "hit"
            times.append(total)
        report[fmt] = {"audio_s": audio_s, "miss_ms": round(1000 * miss_s, 1), "hit": _percentiles(times)}
    conn.close()
    return report


async def _wyoming_first_chunk(port: int, streaming: bool) -> float:
    async with AsyncTcpClient("127.0.0.1", port) as client:
        start = time.perf_counter()
        if streaming:
            for event in (SynthesizeStart(), SynthesizeChunk(text=TWO_SENTENCES), SynthesizeStop()):
                await client.write_event(event.event())
        else:
            await client.write_event(Synthesize(text=TWO_SENTENCES).event())
        first = None
        while True:
            event = await client.read_event()
            if event is None:
                raise RuntimeError("the Wyoming server closed the connection")
            if event.type == "audio-chunk" and first is None:
                first = time.perf_counter() - start
            if event.type == "error":
                raise RuntimeError(f"Wyoming error: {event.data}")
            if event.type == ("synthesize-stopped" if streaming else "audio-stop"):
                assert first is not None
                return first


def first_audio(http_port: int, wyoming_port: int, extra: dict[str, Any], rounds: int) -> dict[str, Any]:
    series: dict[str, list[float]] = {"http_first_byte": [], "wyoming_first_chunk": [], "wyoming_streaming_first_chunk": []}
    for _ in range(rounds):
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=600)
        series["http_first_byte"].append(_post(conn, {"text": TWO_SENTENCES, "format": "pcm", "stream": True, **extra})[0])
        conn.close()
        series["wyoming_first_chunk"].append(asyncio.run(_wyoming_first_chunk(wyoming_port, False)))
        series["wyoming_streaming_first_chunk"].append(asyncio.run(_wyoming_first_chunk(wyoming_port, True)))
    report: dict[str, Any] = {name: _percentiles(values) for name, values in series.items()}
    pairs = zip(series["wyoming_first_chunk"], series["http_first_byte"])
    report["wyoming_minus_http_p50_ms"] = round(1000 * statistics.median(w - h for w, h in pairs), 2)
    return report


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def run(bundle: str | None, rounds: int, stream_rounds: int) -> dict[str, Any]:
    wyoming_port = free_port()
    env = {"COSYEDGE_WYOMING_URI": f"tcp://127.0.0.1:{wyoming_port}", "COSYEDGE_REQUEST_TIMEOUT_S": "3600"}
    with ServiceProcess(bundle=bundle, env=env, ready_timeout_s=1800) as service:
        while not _listening(wyoming_port):  # Wyoming listens just after /readyz
            time.sleep(0.05)
        conn = http.client.HTTPConnection("127.0.0.1", service.port, timeout=60)
        conn.request("GET", "/v1/bundle")
        family = json.loads(conn.getresponse().read())["family"]
        conn.close()
        extra = {"deterministic": True} if family == "vits" else {"seed": 1}  # reproducible, so cacheable
        return {"bundle": bundle or "default voice", "family": family, "request_options": extra,
                "cache": cache_hits(service.port, extra, rounds),
                "first_audio": first_audio(service.port, wyoming_port, {}, stream_rounds)}


def format_latency(report: dict[str, Any]) -> str:
    """The report as a short table (milliseconds): cache hits per format, then first audio per path."""
    lines = [f"cosyedge bench-api --cache-wyoming: {report['bundle']} ({report['family']}), milliseconds",
             f"{'':32}{'p50':>9}{'p95':>9}"]
    for fmt, entry in report["cache"].items():
        lines.append(f"{'cache hit ' + fmt:32}{entry['hit']['p50_ms']:9.1f}{entry['hit']['p95_ms']:9.1f}"
                     f"   (miss {entry['miss_ms']:.0f} ms, {entry['audio_s']:.2f} s of audio)")
    first = report["first_audio"]
    for name in ("http_first_byte", "wyoming_first_chunk", "wyoming_streaming_first_chunk"):
        lines.append(f"{'first audio ' + name:32}{first[name]['p50_ms']:9.1f}{first[name]['p95_ms']:9.1f}")
    lines.append(f"Wyoming - HTTP first audio, paired median: {first['wyoming_minus_http_p50_ms']:.1f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosyedge.api.bench.latency", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", help="bundle directory (default: the embedded default voice)")
    parser.add_argument("--rounds", type=int, default=20, help="cache hits per format")
    parser.add_argument("--stream-rounds", type=int, default=10, help="HTTP / Wyoming first-audio pairs")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    report = run(args.bundle, args.rounds, args.stream_rounds)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
