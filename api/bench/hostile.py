"""A hostile run: slowloris, floods of malformed and cross-site requests, idle WebSockets and served clients, all at
once against one `cosyedge serve`, with `/healthz` probed throughout (it must answer within 1 s, every time).

Every lane is bounded in sockets and time, and talks to loopback only (a service started here on a free port,
whose process tree is under the memory guard, or `--url` on 127.0.0.1):
- slowloris: sockets that each send one more byte of a request line every 2 s, reopened when the service closes
  them (the header deadline answers 408, the cap closes the oldest);
- flood: threads sending, as fast as answered, malformed requests (garbage request lines, oversized headers,
  broken chunked bodies) and requests a rebinding or cross-site page would send (foreign Host, foreign Origin);
- idle WebSockets: handshakes that never send `start`, each held open, reopened when the service closes it (its
  `start` deadline) or refuses it (429: past the client's stream slots);
- clients: well-behaved `POST /v1/tts` requests of a short sentence;
- probe: `GET /healthz` every 0.25 s on a new connection.

    python -m cosyedge.api.bench.hostile --seconds 300 [--slowloris 200] [--flood 8] [--websockets 8]
        [--clients 2] [--url http://127.0.0.1:PORT [--pid PID] | --bundle DIR] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from collections import Counter
from typing import Any, Callable
from urllib.parse import urlsplit

from cosyedge.api.bench.harness import (ServiceProcess, TreeMemory, add_service_arguments, http_status,
                                        write_json)
from cosyedge.api.bench.load import _percentiles
from cosyedge.api.security import is_loopback

PROBE_EVERY_S, PROBE_LIMIT_S = 0.25, 1.0
TRICKLE_EVERY_S = 2.0
_LINE = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 4096


def _chunked(body: bytes) -> bytes:
    return (b"POST /v1/tts HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + body)


def _json_post(path: str, headers: str) -> bytes:
    body = b'{"text": "Hi.", "format": "pcm"}'
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


FLOOD = (  # (name, bytes, status the service must answer)
    ("garbage request line", b"GARBAGE\r\n\r\n", 400),
    ("header line over 8 kB", b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431),
    ("80 headers", b"GET /healthz HTTP/1.1\r\n" + b"".join(b"X-N%d: 1\r\n" % i for i in range(80)) + b"\r\n", 431),
    ("bad chunk size", _chunked(b'zz\r\n{"text": "Hi."}\r\n0\r\n\r\n'), 400),
    ("negative chunk size", _chunked(b"-5\r\n{\"te\r\n0\r\n\r\n"), 400),
    ("rebinding Host", _json_post("/v1/tts", "").replace(b"Host: 127.0.0.1", b"Host: rebind.evil.example"), 400),
    ("foreign Origin", _json_post("/v1/tts", "Origin: http://evil.example\r\n"), 403),
    ("foreign Origin DELETE", b"DELETE /v1/audio/voices/someone HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                              b"Origin: http://evil.example\r\nConnection: close\r\n\r\n", 403),
)
WS_HANDSHAKE = (b"GET /v1/audio/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")


def _status(answer: bytes) -> str:
    parts = answer.split(b" ", 2)
    return parts[1].decode("ascii", "replace") if len(parts) > 1 and answer.startswith(b"HTTP/") else "no answer"


def _exchange(port: int, data: bytes, timeout: float = 10.0) -> str:
    """Send `data` on a new connection; the status of the answer, "timeout" or "dropped"."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(data)
            return _status(sock.recv(4096))
    except (socket.timeout, TimeoutError):
        return "timeout"
    except OSError:
        return "dropped"


class Lanes:
    """The lanes' threads and their counts, stopped together at the deadline."""

    def __init__(self, port: int, seconds: float) -> None:
        self.port, self.deadline = port, time.monotonic() + seconds
        self.lock = threading.Lock()
        self.counts: dict[str, Counter] = {}
        self.probes: list[float] = []
        self.threads: list[threading.Thread] = []

    def count(self, lane: str, outcome: str) -> None:
        with self.lock:
            self.counts.setdefault(lane, Counter())[outcome] += 1

    def running(self) -> bool:
        return time.monotonic() < self.deadline

    def spawn(self, name: str, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self.threads.append(thread)
        thread.start()

    def probe(self) -> None:
        while self.running():
            began = time.perf_counter()
            answer = _exchange(self.port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
                               timeout=5.0)
            elapsed = time.perf_counter() - began
            with self.lock:
                self.probes.append(elapsed if answer == "200" else float("inf"))
            time.sleep(max(0.0, PROBE_EVERY_S - elapsed))

    def slowloris(self, count: int) -> None:
        sockets: dict[socket.socket, int] = {}  # socket -> bytes sent
        try:
            while self.running():
                while len(sockets) < count and self.running():
                    try:
                        sockets[socket.create_connection(("127.0.0.1", self.port), timeout=5.0)] = 0
                        self.count("slowloris", "opened")
                    except OSError:
                        self.count("slowloris", "refused")
                        break
                for sock, sent in list(sockets.items()):
                    try:
                        sock.setblocking(False)
                        try:
                            answer = sock.recv(4096)
                        except BlockingIOError:
                            sock.setblocking(True)
                            sock.send(_LINE[sent % len(_LINE):sent % len(_LINE) + 1])
                            sockets[sock] = sent + 1
                            continue
                        self.count("slowloris", f"closed by the service ({_status(answer) if answer else 'no answer'})")
                    except OSError:
                        self.count("slowloris", "closed by the service (reset)")
                    sock.close()
                    del sockets[sock]
                time.sleep(TRICKLE_EVERY_S)
        finally:
            for sock in sockets:
                sock.close()

    def flood(self, index: int) -> None:
        n = index
        while self.running():
            name, data, expected = FLOOD[n % len(FLOOD)]
            outcome = _exchange(self.port, data)
            self.count("flood", "as documented" if outcome == str(expected) else f"{name}: {outcome}")
            n += 1

    def idle_websocket(self) -> None:
        while self.running():  # renewed, as an attacker would: each close by the service is answered with a new one
            try:
                self._hold_idle_websocket()
            except OSError as exc:
                self.count("websocket", type(exc).__name__)
                time.sleep(1.0)

    def _hold_idle_websocket(self) -> None:
        """One handshake that never sends `start`, held until the service closes it (its start deadline) or the
        run ends; a refused one (429: past the client's stream slots) is retried a second later."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=10.0) as sock:
            sock.sendall(WS_HANDSHAKE)
            status = _status(sock.recv(4096))
            self.count("websocket", status)
            if status != "101":
                time.sleep(1.0)
                return
            while self.running():
                sock.settimeout(max(0.1, min(5.0, self.deadline - time.monotonic())))
                try:
                    if not sock.recv(4096):
                        self.count("websocket", "closed by the service")
                        return
                except (socket.timeout, TimeoutError):
                    continue

    def client(self) -> None:
        while self.running():
            outcome = _exchange(self.port, _json_post("/v1/tts", ""), timeout=120.0)
            self.count("clients", outcome)


def run_hostile(url: str, seconds: float, slowloris: int = 200, flood: int = 8, websockets: int = 8,
                clients: int = 2, pid: int | None = None) -> dict[str, Any]:
    """All lanes at once for `seconds`; the figures (probe latencies, each lane's outcomes, the tree's memory)."""
    parts = urlsplit(url)
    if not is_loopback(parts.hostname or ""):
        raise ValueError("the hostile run talks to loopback only")
    lanes = Lanes(parts.port or 80, seconds)
    memory = TreeMemory(pid).start() if pid else None
    lanes.spawn("probe", lanes.probe)
    lanes.spawn("slowloris", lanes.slowloris, slowloris)
    for i in range(flood):
        lanes.spawn(f"flood-{i}", lanes.flood, i)
    for i in range(websockets):
        lanes.spawn(f"ws-{i}", lanes.idle_websocket)
    for i in range(clients):
        lanes.spawn(f"client-{i}", lanes.client)
    for thread in lanes.threads:
        thread.join(seconds + 180)
    if memory:
        memory.stop()
    late = [p for p in lanes.probes if p > PROBE_LIMIT_S]
    return {
        "url": url, "seconds": seconds, "slowloris": slowloris, "flood": flood, "websockets": websockets,
        "clients": clients, "probes": len(lanes.probes), "probes_over_1s": len(late),
        "probes_failed": sum(p == float("inf") for p in late),
        "probe_s": _percentiles([p for p in lanes.probes if p != float("inf")]),
        "lanes": {lane: dict(sorted(c.items())) for lane, c in sorted(lanes.counts.items())},
        "threads_still_running": sum(t.is_alive() for t in lanes.threads),
        "server_pid": pid, **(memory.figures() if memory else {"rss_mb_peak": None, "processes": None}),
        "readyz_after": http_status(url, "/readyz"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosyedge.api.bench.hostile",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--slowloris", type=int, default=200, help="sockets trickling a request line")
    parser.add_argument("--flood", type=int, default=8, help="threads sending malformed and cross-site requests")
    parser.add_argument("--websockets", type=int, default=8, help="idle WebSocket handshakes held open")
    parser.add_argument("--clients", type=int, default=2, help="well-behaved synthesis clients")
    add_service_arguments(parser)  # --url: on loopback only
    args = parser.parse_args(argv)
    if not (0 < args.seconds <= 3600 and 0 <= args.slowloris <= 2000 and 0 <= args.flood <= 64
            and 0 <= args.websockets <= 256 and 0 <= args.clients <= 64):
        parser.error("--seconds 0-3600, --slowloris 0-2000, --flood 0-64, --websockets 0-256, --clients 0-64")
    lanes = (args.seconds, args.slowloris, args.flood, args.websockets, args.clients)
    if args.url:
        report = run_hostile(args.url.rstrip("/"), *lanes, pid=args.pid)
    else:
        with ServiceProcess(bundle=args.bundle, memory_budget_mb=args.memory_budget_mb or None) as service:
            report = run_hostile(service.url, *lanes)
            report.update(server_pid=service.pid, **service.memory())  # the guard's own figures
    print(json.dumps(report, indent=2))
    write_json(report, args.json)
    return 1 if report["probes_over_1s"] or report["readyz_after"] != 200 else 0


if __name__ == "__main__":
    sys.exit(main())
