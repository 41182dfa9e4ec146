"""Load: N concurrent clients for a fixed time against the default voice, and what the service did with it.

Each client sends, one after the other, OpenAI-style `/v1/audio/speech` and native `/v1/tts`
requests with short and paragraph texts. A well-behaved client waits for Retry-After on a 503.
Every request must be answered: 200, or 503 with Retry-After; anything else is counted by kind
(other statuses, timeouts, dropped connections). The service's memory is that of its whole process tree
(gunicorn arbiter, the engine's worker, its ffmpeg children: `harness.TreeMemory`), sampled throughout
when the harness started it, or when `--pid` names it (the arbiter, systemd's main PID).

    python -m cosyedge.api.bench.load --clients 64 --seconds 60 [--url URL [--pid PID] | --bundle DIR] [--json out.json]
"""
from __future__ import annotations

import argparse
import http.client
import json
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from cosyedge.api.bench.harness import (ServiceProcess, TreeMemory, add_service_arguments, http_status, kib_to_mb,
                                        write_json)

SHORT = ("Good morning.", "The kettle is on.", "Turn left at the next corner.", "Your order has shipped.")
PARAGRAPH = ("The old lighthouse stood at the end of the harbour wall. Every evening its keeper climbed the "
             "hundred steps to light the lamp. Ships far out at sea watched for its beam. On stormy nights he "
             "stayed awake until the last boat was safely home.")
# (name, path, body): the request mix every client cycles through
KINDS = (
    ("speech_short", "/v1/audio/speech", lambda i: {"model": "tts-1", "input": SHORT[i % len(SHORT)],
                                                    "voice": "alloy", "response_format": "wav"}),
    ("tts_short", "/v1/tts", lambda i: {"text": SHORT[i % len(SHORT)], "format": "wav"}),
    ("speech_paragraph", "/v1/audio/speech", lambda i: {"model": "tts-1", "input": PARAGRAPH, "voice": "alloy",
                                                        "response_format": "wav"}),
    ("tts_paragraph", "/v1/tts", lambda i: {"text": PARAGRAPH, "format": "wav"}),
)
MAX_RETRY_WAIT_S = 5.0


@dataclass
class LoadStats:
    """Outcomes of every request, shared by the client threads under one lock."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    statuses: Counter = field(default_factory=Counter)
    by_kind: dict[str, Counter] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)      # every answered request
    latencies_ok: list[float] = field(default_factory=list)   # 200s: what a served client waited
    timeouts: int = 0
    dropped: int = 0
    unanswered: int = 0            # answered, but not 200 nor 503 with Retry-After
    empty_audio: int = 0
    errors: list[str] = field(default_factory=list)

    def add(self, kind: str, outcome: str, latency: float, problem: str | None) -> None:
        with self.lock:
            self.statuses[outcome] += 1
            self.by_kind.setdefault(kind, Counter())[outcome] += 1
            if outcome[:3].isdigit():
                self.latencies.append(latency)
            if outcome == "200":
                self.latencies_ok.append(latency)
            if problem and len(self.errors) < 20:
                self.errors.append(f"{kind}: {problem}")


def _one(host: str, port: int, path: str, body: dict, timeout: float) -> tuple[str, float, str | None, float]:
    """(outcome, seconds, problem, retry_after): outcome is the status, "timeout" or "dropped"."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    start = time.perf_counter()
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        elapsed = time.perf_counter() - start
        retry = response.getheader("Retry-After", "")
        if response.status == 200:
            return "200", elapsed, None if data else "empty body", 0.0
        if response.status == 503 and retry.strip().isdigit():
            return "503", elapsed, None, float(retry)
        outcome = "503 without Retry-After" if response.status == 503 else str(response.status)
        return outcome, elapsed, f"HTTP {response.status} {data[:160]!r}", 0.0
    except (socket.timeout, TimeoutError):
        return "timeout", time.perf_counter() - start, "timed out", 0.0
    except (ConnectionError, http.client.HTTPException, OSError) as exc:
        return "dropped", time.perf_counter() - start, f"{type(exc).__name__}: {exc}", 0.0
    finally:
        conn.close()


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None, "max": None}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)
    return {"p50": pick(0.50), "p95": pick(0.95), "p99": pick(0.99), "max": round(ordered[-1], 3)}


def run_load(url: str, clients: int = 64, seconds: float = 60.0, pid: int | None = None,
             timeout: float = 180.0) -> dict[str, Any]:
    """Drive `clients` concurrent clients for `seconds` (requests under way are awaited); returns the figures."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    stats = LoadStats()
    memory = TreeMemory(pid).start() if pid else None
    before = memory.peak_sum_kib if memory else None
    start_line = threading.Barrier(clients + 1)
    deadline = 0.0

    def client(index: int) -> None:
        start_line.wait()
        n = 0
        while time.monotonic() < deadline:
            kind, path, body = KINDS[(index + n) % len(KINDS)]
            outcome, elapsed, problem, retry = _one(host, port, path, body(index + n), timeout)
            n += 1
            stats.add(kind, outcome, elapsed, problem)
            with stats.lock:
                if outcome == "timeout":
                    stats.timeouts += 1
                elif outcome == "dropped":
                    stats.dropped += 1
                elif outcome not in ("200", "503"):
                    stats.unanswered += 1
                elif outcome == "200" and problem:
                    stats.empty_audio += 1
            if retry:
                time.sleep(max(0.0, min(retry, MAX_RETRY_WAIT_S, deadline - time.monotonic())))

    threads = [threading.Thread(target=client, args=(i,), name=f"load-{i}", daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + seconds
    started = time.monotonic()
    start_line.wait()
    for thread in threads:
        thread.join(seconds + timeout + 30)  # bounded: the last request may start just before the deadline
    wall = time.monotonic() - started
    after = memory.sample() if memory else None
    if memory:
        memory.stop()
    total = sum(stats.statuses.values())
    return {
        "url": url, "clients": clients, "seconds": seconds, "wall_s": round(wall, 1), "requests": total,
        "requests_per_s": round(total / wall, 2) if wall else None,
        "statuses": dict(sorted(stats.statuses.items())),
        "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(stats.by_kind.items())},
        "latency_s": _percentiles(stats.latencies),
        "latency_200_s": _percentiles(stats.latencies_ok),  # 503s are fast and would flatter the above
        "timeouts": stats.timeouts, "dropped": stats.dropped, "unanswered": stats.unanswered,
        "empty_audio": stats.empty_audio, "clients_still_running": sum(t.is_alive() for t in threads),
        "errors": stats.errors,
        "server_pid": pid,
        "rss_mb_before": kib_to_mb(before), "rss_mb_after": kib_to_mb(after),
        **(memory.figures() if memory else {"rss_mb_peak": None, "processes": None}),
        "readyz_after": http_status(url, "/readyz"),
    }


def format_report(report: dict[str, Any]) -> str:
    lat, ok = report["latency_s"], report["latency_200_s"]
    return "\n".join([
        f"cosyedge load ({report['url']}): {report['clients']} clients for {report['seconds']} s "
        f"(wall {report['wall_s']} s)",
        f"  requests {report['requests']} ({report['requests_per_s']}/s), statuses {report['statuses']}",
        f"  by kind {report['by_kind']}",
        f"  latency p50 {lat['p50']} s, p95 {lat['p95']} s, p99 {lat['p99']} s, max {lat['max']} s "
        f"(200s only: p50 {ok['p50']} s, p95 {ok['p95']} s, p99 {ok['p99']} s)",
        f"  timeouts {report['timeouts']}, dropped {report['dropped']}, other answers {report['unanswered']}, "
        f"empty audio {report['empty_audio']}",
        f"  server RSS (process tree of pid {report['server_pid']}, {report['processes']} processes) before "
        f"{report['rss_mb_before']} MB, after {report['rss_mb_after']} MB, peak {report['rss_mb_peak']} MB; "
        f"/readyz after: {report['readyz_after']}",
        *(f"  error: {line}" for line in report["errors"][:5]),
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosyedge.api.bench.load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--timeout", type=float, default=180.0, help="client timeout per request (s)")
    add_service_arguments(parser)
    args = parser.parse_args(argv)
    if not 1 <= args.clients <= 1024 or not 0 < args.seconds <= 86400 or not 0 < args.timeout <= 3600:
        parser.error("--clients must be 1-1024, --seconds and --timeout positive")
    if args.url:
        report = run_load(args.url.rstrip("/"), args.clients, args.seconds, args.pid, args.timeout)
    else:
        with ServiceProcess(bundle=args.bundle, memory_budget_mb=args.memory_budget_mb or None) as service:
            report = run_load(service.url, args.clients, args.seconds, service.pid, args.timeout)
            report["exceeded"] = service.guard.exceeded if service.guard else None
    print(format_report(report))
    print(json.dumps({k: v for k, v in report.items() if k != "errors"}))
    write_json(report, args.json)
    bad = report["timeouts"] or report["dropped"] or report["unanswered"] or report["readyz_after"] != 200
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
