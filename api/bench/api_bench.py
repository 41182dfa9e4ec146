"""`cosyedge bench-api`: the HTTP service measured from the outside, beside the engine alone.

For each concurrency level, that many clients each send `requests` requests one after the other (pcm, streamed
or whole-file) and the bench records per request the time to its first audio byte, the time to its last byte and
the audio seconds. Arrivals: `burst` starts all clients at once; `staggered` starts client i at i * stagger
(default: the single-client mean latency divided by the concurrency, so requests overlap at different stages).
Reported per level: first-audio p50/p95, request latency p50/p95 and audio seconds per wall second.

Engine-only numbers for the same bundle and texts come from the engine's public surface in the same process
(time to the first chunk of `Engine.stream`, and to its end), measured before the HTTP phase so that nothing
competes with them. Without --url a service is started in-process on a free port on that same engine.
"""
from __future__ import annotations

import http.client
import json
import platform
import statistics
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence
from urllib.parse import urlsplit

from cosyedge.device.errors import InputError

# The workload: short announcements of different lengths, one sentence each.
SENTENCES = (
    "Your order has been received and will be ready in ten minutes.",
    "The meeting room on the second floor is free until noon.",
    "Remember to take your umbrella, rain is expected this afternoon.",
    "The printer near the kitchen is out of paper again.",
    "Have a pleasant evening, and see you tomorrow.",
)
ARRIVALS = ("staggered", "burst")


def _post(host: str, port: int, body: dict) -> tuple[float, float, float]:
    """(seconds to the first body byte, seconds to the end, audio seconds) of one /v1/tts request (pcm)."""
    conn = http.client.HTTPConnection(host, port, timeout=600)
    try:
        start = time.perf_counter()
        conn.request("POST", "/v1/tts", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        first = response.read1(65536)
        first_audio = time.perf_counter() - start
        rest = response.read()
        total = time.perf_counter() - start
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(first + rest)[:200]!r}")
        rate = int(response.getheader("X-Sample-Rate"))
        return first_audio, total, (len(first) + len(rest)) / 2 / rate
    finally:
        conn.close()


def _address(url: str) -> tuple[str, int]:
    """(host, port) of `--url` (http://HOST[:PORT])."""
    parts = urlsplit(url)
    try:
        port = parts.port or 80
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None:
        raise InputError(f"cannot reach {url[:80]!r}: --url must look like http://127.0.0.1:8100")
    return parts.hostname, port


def _summary(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50": round(statistics.median(ordered), 4), "p95": round(ordered[round(0.95 * (len(ordered) - 1))], 4),
            "mean": round(statistics.fmean(ordered), 4)}


def _fields(voice: str | None, preset: str | None) -> dict[str, str]:
    """The request fields every request of the bench carries, beside text, format and stream."""
    return {name: value for name, value in (("voice", voice), ("preset", preset)) if value}


def engine_only(engine: Any, texts: Sequence[str], fields: dict[str, str]) -> dict[str, Any]:
    """First chunk and whole-stream seconds of `Engine.stream` for each text, one at a time."""
    first, total, audio = [], [], 0.0
    for text in texts:
        start = time.perf_counter()
        chunks = engine.stream(text, **fields)
        samples = len(next(chunks))
        first.append(time.perf_counter() - start)
        samples += sum(len(chunk) for chunk in chunks)
        total.append(time.perf_counter() - start)
        audio += samples / engine.sample_rate
    return {"requests": len(texts), "first_audio_s": _summary(first), "latency_s": _summary(total),
            "audio_s_per_s": round(audio / sum(total), 3)}


def http_level(host: str, port: int, texts: Sequence[str], concurrency: int, requests: int, stream: bool,
               arrivals: str, stagger_s: float, fields: dict[str, str]) -> dict[str, Any]:
    """`concurrency` clients of `requests` requests each; see the module docstring."""
    results: list[tuple[float, float, float]] = []
    errors: list[str] = []
    lock = threading.Lock()
    start = time.perf_counter()

    def client(index: int) -> None:
        if arrivals == "staggered":
            time.sleep(max(0.0, start + index * stagger_s - time.perf_counter()))
        for k in range(requests):
            body = {"text": texts[(index + k) % len(texts)], "format": "pcm", "stream": stream, **fields}
            try:
                result = _post(host, port, body)
            except (OSError, RuntimeError) as exc:
                with lock:
                    errors.append(str(exc)[:200])
                continue
            with lock:
                results.append(result)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if not results:
        raise RuntimeError(f"every request failed: {errors[:3]}")
    return {"concurrency": concurrency, "requests": len(results), "errors": errors, "wall_s": round(wall, 3),
            "stagger_s": round(stagger_s, 3) if arrivals == "staggered" else 0.0,
            "first_audio_s": _summary([r[0] for r in results]), "latency_s": _summary([r[1] for r in results]),
            "audio_s_per_s": round(sum(r[2] for r in results) / wall, 3)}


@contextmanager
def _local_service(bundle: str | None, target: str | None) -> Iterator[tuple[str, Any]]:
    """A service on a free port and its engine (one load, shared with the engine-only measurement)."""
    from cosyedge.api.app import create_app
    from cosyedge.api.config import load_config
    from cosyedge.api.bench.harness import make_server
    from cosyedge.api.service import load_engine

    config = load_config(port=0, bundle=bundle, target=target)
    engine = load_engine(config)
    app = create_app(config, engine=engine)
    server = make_server(app, "127.0.0.1", 0, config.http_threads)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.effective_port}", engine
    finally:
        app.extensions["cosyedge"].stop()
        server.task_dispatcher.shutdown(timeout=5)  # first: a task ending after close() pulls a closed trigger
        server.close()
        thread.join(timeout=5)


def run_api_bench(url: str | None = None, bundle: str | None = None, target: str | None = None,
                  concurrency: Sequence[int] = (1, 4), stream: bool = True, arrivals: str = "staggered",
                  requests: int = 4, texts: Sequence[str] | None = None, stagger_s: float | None = None,
                  voice: str | None = None, preset: str | None = None, _engine: Any = None) -> dict[str, Any]:
    """The bench-api report (see the module docstring); `url` measures a running service (no engine-only part).
    `voice` and `preset` go into every request (HTTP body and engine-only call alike)."""
    texts = texts or SENTENCES
    if arrivals not in ARRIVALS:
        raise ValueError(f"arrivals must be one of {', '.join(ARRIVALS)}")
    if url is None:
        with _local_service(bundle, target) as (local, engine):
            return run_api_bench(local, bundle, target, concurrency, stream, arrivals, requests, texts, stagger_s,
                                 voice, preset, engine)
    host, port = _address(url)
    fields = _fields(voice, preset)
    if _engine is None:  # a running service may be cold; an in-process one is warm (engine load + readiness)
        try:
            _post(host, port, {"text": texts[0], "format": "pcm", **fields})
        except (OSError, http.client.HTTPException, RuntimeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
            raise InputError(f"cannot reach a cosyedge service at {url[:80]}: {reason[:200]}") from None
    report: dict[str, Any] = {"url": url, "bundle": bundle or "default voice", "target": target,
                              "machine": platform.machine(), "python": platform.python_version(), "stream": stream,
                              "arrivals": arrivals, "texts": len(texts), "requests_per_client": requests, **fields}
    if _engine is not None:
        report["engine"] = engine_only(_engine, texts, fields)
    levels = []
    single_latency = None
    for level in concurrency:
        gap = stagger_s if stagger_s is not None else (single_latency or 0.0) / max(level, 1)
        result = http_level(host, port, texts, level, requests, stream, arrivals, gap, fields)
        if level == 1:
            single_latency = result["latency_s"]["mean"]
        levels.append(result)
    report["http"] = levels
    return report


def format_report(report: dict[str, Any]) -> str:
    """The report as a table: one row for the engine alone, one per concurrency level."""
    def row(name: str, part: dict[str, Any]) -> str:
        fa, lat = part["first_audio_s"], part["latency_s"]
        return (f"{name:<22} {fa['p50']:>8.3f} {fa['p95']:>8.3f} {lat['p50']:>9.3f} {lat['p95']:>9.3f} "
                f"{part['audio_s_per_s']:>9.3f}")

    preset = f", preset {report['preset']}" if "preset" in report else ""
    lines = [f"cosyedge bench-api: {report['bundle']}{preset} ({report['url']}, {report['machine']}), stream "
             f"{'on' if report['stream'] else 'off'}, arrivals {report['arrivals']}, {report['texts']} texts, "
             f"{report['requests_per_client']} requests per client",
             f"{'':<22} {'first audio s':>17} {'latency s':>19} {'audio s':>9}",
             f"{'':<22} {'p50':>8} {'p95':>8} {'p50':>9} {'p95':>9} {'per s':>9}"]
    if "engine" in report:
        lines.append(row("engine.stream alone", report["engine"]))
    for level in report["http"]:
        note = f" ({len(level['errors'])} failed)" if level["errors"] else ""
        lines.append(row(f"HTTP x{level['concurrency']}", level) + note)
    return "\n".join(lines)
