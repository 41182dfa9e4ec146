"""Helpers of the API tests: real services on 127.0.0.1, free ports, the real default voice.

`fault_engine` is the real engine with the real VITS pipeline wrapped so that one special word
fails inside render and another holds render until the test releases it: the failure happens
where a real one would, behind the batch queue, without mocking the engine.
"""
from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from cosyedge.api.app import create_app
from cosyedge.api.config import ServiceConfig
from cosyedge.api.bench.harness import make_server
from cosyedge.device.audio import ffmpeg_binary
from cosyedge.device.engine import Engine
from cosyedge.device.options import Segment
from cosyedge.device.pipeline import Pipeline

FAIL_WORD = "kaboom"
HOLD_WORD = "hold"
_FAIL, _HOLD = "\x00fail\x00", "\x00hold\x00"


class FaultPipeline(Pipeline):
    """The real pipeline; segments of text with FAIL_WORD raise in render, with HOLD_WORD wait for `release`
    (the first `free` of them pass without waiting)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sample_rate = inner.sample_rate
        self.holding = threading.Event()
        self.release = threading.Event()
        self.free = 0
        self._lock = threading.Lock()

    def voices(self) -> list[str]:
        return self.inner.voices()

    def segments(self, text: str) -> list[Segment]:
        tag = _FAIL if FAIL_WORD in text.lower() else _HOLD if HOLD_WORD in text.lower() else ""
        return [Segment(text=tag + u.text, ids=u.ids) for u in self.inner.segments(text)]

    def synthesize(self, segments, request) -> list[np.ndarray]:
        if any(u.text.startswith(_FAIL) for u in segments):
            raise RuntimeError("injected failure in render")
        if any(u.text.startswith(_HOLD) for u in segments):
            with self._lock:
                free, self.free = self.free > 0, max(0, self.free - 1)
            if not free:
                self.holding.set()
                if not self.release.wait(60):
                    raise RuntimeError("test never released the held render")
        return self.inner.synthesize(segments, request)

    def stream(self, segment, request):
        yield self.synthesize([segment], request)[0]

    def describe(self) -> dict:
        return self.inner.describe()


@dataclass
class Server:
    url: str
    port: int
    app: Any

    @property
    def service(self):
        return self.app.extensions["cosyedge"]

    def request(self, method: str, path: str, body: Any = None, headers: dict | None = None,
                timeout: float = 60) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            hdrs = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, path, body=data, headers={**hdrs, **(headers or {})})
            response = conn.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            conn.close()

    def post(self, path: str, body: Any, **kwargs) -> tuple[int, dict[str, str], bytes]:
        return self.request("POST", path, body, **kwargs)

    def metric(self, name: str) -> float:
        """Sum of a metric's samples named exactly `name` (any labels)."""
        _, _, text = self.request("GET", "/metrics")
        total = 0.0
        for line in text.decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total



def assert_concurrent_requests_share_decode_steps(server: Server, text: str, voices: list[str],
                                                  timeout: float) -> None:
    """Four clients at once (two voices, four seeds): all answered, and their LLM decode steps ran batched across
    requests (more than one row per step on average, from /metrics)."""
    before = server.metric("cosyedge_decode_steps")
    statuses: list[int] = []

    def client(voice: str, seed: int) -> None:
        body = {"text": text, "voice": voice, "seed": seed, "format": "pcm"}
        statuses.append(server.post("/v1/tts", body, timeout=timeout)[0])

    threads = [threading.Thread(target=client, args=(v, s)) for s, v in enumerate(voices * 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert statuses == [200] * 4
    assert server.metric("cosyedge_decode_steps") > before
    assert server.metric("cosyedge_decode_rows_mean") > 1.0


@contextmanager
def run_server(config: ServiceConfig, engine: Engine) -> Iterator[Server]:
    """The app served by waitress in a thread on a free port; closed (socket and loop) on exit."""
    app = create_app(config, engine=engine)
    server = make_server(app, "127.0.0.1", 0, config.http_threads)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        yield Server(f"http://127.0.0.1:{server.effective_port}", server.effective_port, app)
    finally:
        app.extensions["cosyedge"].stop()
        server.close()
        server.task_dispatcher.shutdown(timeout=5)
        thread.join(timeout=5)


# A real client process: sends a streaming POST /v1/tts, reads the first audio, prints "streaming", then waits to
# be killed (it exits with the response head when the status is not 200).
_STREAM_CLIENT = r"""
import socket, sys
port, body = int(sys.argv[1]), sys.argv[2].encode()
s = socket.create_connection(("127.0.0.1", port))
s.sendall(b"POST /v1/tts HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
          b"Content-Length: %d\r\n\r\n" % len(body) + body)
data = b""
while b"\r\n\r\n" not in data or len(data) < 2000:
    chunk = s.recv(65536)
    if not chunk:
        sys.exit("server closed early")
    data += chunk
    if not data.startswith(b"HTTP/1.1 200"):
        sys.exit(data[:300].decode(errors="replace"))
print("streaming", flush=True)
sys.stdin.read()
"""


@contextmanager
def streaming_client(port: int, body: dict[str, Any]) -> Iterator[subprocess.Popen[str]]:
    """The streaming client process (text pipes) for the JSON `body`; SIGKILLed and reaped on exit."""
    client = subprocess.Popen([sys.executable, "-c", _STREAM_CLIENT, str(port), json.dumps(body)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield client
    finally:
        client.send_signal(signal.SIGKILL)
        client.wait(timeout=10)


def api_config(tmp: Path, **changes: Any) -> ServiceConfig:
    values = dict(port=0, batch_timeout_ms=100, state_dir=str(tmp), http_threads=40)
    values.update(changes)
    return ServiceConfig(**values)


def decode(audio: bytes, sample_rate: int = 22050) -> np.ndarray:
    """Any container ffmpeg can read -> mono int16 samples at `sample_rate` (proves it plays)."""
    result = subprocess.run([ffmpeg_binary(), "-hide_banner", "-loglevel", "error", "-i", "pipe:0", "-f", "s16le",
                             "-ac", "1", "-ar", str(sample_rate), "pipe:1"], input=audio, capture_output=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-500:]
    return np.frombuffer(result.stdout, dtype="<i2")


def sdk_repeats_hit_the_cache(client, extra_body: dict, voice: str, text: str) -> None:
    """The OpenAI SDK's extension fields (`extra_body`, sent as top-level JSON keys): the same request twice gives
    the same bytes, the second from the phrase cache. (The route dropped them: a miss and new audio each time.)"""
    answers = []
    for _ in range(2):
        raw = client.audio.speech.with_raw_response.create(model="tts-1", voice=voice, input=text,
                                                           response_format="wav", extra_body=extra_body)
        answers.append((raw.headers["x-cosyedge-cache"], raw.content))
    assert [hit for hit, _ in answers] == ["miss", "hit"], extra_body
    assert answers[0][1] == answers[1][1] and len(answers[0][1]) > 10_000
