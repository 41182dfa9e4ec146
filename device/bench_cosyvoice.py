"""`cosyedge bench --bundle B` for CosyVoice2 bundles: RTF, first-chunk latency, throughput, stage times, peak RSS.

Every backend runs in its own worker process (one per device precision, one for the PyTorch reference), so the
peak RSS of each is its own (VmHWM, reset at the start of every configuration) and torch never enters the device
runtime. The parent (numpy only) sends the workers the same batches of requests in turn, ABBA-ordered, batch by
batch: on a noisy shared machine the backends are slowed alike and their ratios hold.

A configuration is (concurrency c, stream on/off): the text set is cut into batches of c requests (texts reused
round-robin to fill the last batch); the c requests of a batch start together on c threads. Per run:

* rtf: sum of request latencies / sum of audio seconds (c = 1: compute time / audio time);
* first_chunk_s_p50/p95: request start (text in) to its first audio chunk (streaming runs; null otherwise);
* throughput_audio_s_per_s: audio seconds / wall seconds of the batches;
* stage_s: seconds per stage summed over every request (frontend, llm_prefill, llm_decode, flow, hift); on the
  device they are the wall time of the stage's ORT graph calls (flow = encoder + estimator, hift = source +
  decoder), timed by wrapping the sessions in the worker only; llm_ms_per_token = llm_decode / decode steps;
* peak_rss_mb: the worker's peak resident set during the configuration (the models stay resident).

`--tokens N` pins every segment to exactly N speech tokens (`SynthesisOptions.pin_tokens`: no stop id can be chosen), because
random-weight bundles never stop sensibly; without it lengths follow the model.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from cosyedge.device.errors import CosyedgeError, InputError

# Alternating Chinese / English; each is one frontend segment (one segment) so a pinned run is N tokens per request.
TEXTS = (
    "欢迎乘坐本次列车，下一站是机场。",
    "Good morning, and welcome to the station.",
    "请保管好您的随身物品，祝您旅途愉快。",
    "The next train to the airport leaves from platform four in six minutes.",
    "今天天气晴朗，适合出门散步。",
    "Tickets can be bought at the machines near the main entrance.",
)
STAGES = ("frontend", "llm_prefill", "llm_decode", "flow", "hift")
GRAPH_STAGE = {"llm_prefill": "llm_prefill", "llm_decode": "llm_decode", "flow_encoder": "flow",
               "flow_estimator": "flow", "hift_source": "hift", "hift_decoder": "hift"}
WARMUP_TOKENS = 8


# ------------------------------------------------------------------------------------------ measuring

class StageClock:
    """Seconds per stage, summed over every thread of a worker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = dict.fromkeys(STAGES, 0.0)

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self._seconds[stage] = self._seconds.get(stage, 0.0) + seconds

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - start)

    def take(self) -> dict[str, float]:
        """The totals so far, and zero again."""
        with self._lock:
            seconds, self._seconds = self._seconds, dict.fromkeys(STAGES, 0.0)
        return seconds


class TimedSession:
    """An ORT session whose graph calls add their wall time to a stage (bench workers only; all else delegates)."""

    def __init__(self, session: Any, stage: str, clock: StageClock) -> None:
        self._session = session
        self._stage = stage
        self._clock = clock

    def run(self, *args: Any, **kwargs: Any) -> Any:
        with self._clock.timed(self._stage):
            return self._session.run(*args, **kwargs)

    def run_with_iobinding(self, *args: Any, **kwargs: Any) -> Any:
        with self._clock.timed(self._stage):
            return self._session.run_with_iobinding(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


def reset_peak_rss() -> None:
    """Start a new peak-RSS window (Linux: VmHWM is reset by writing 5 to clear_refs); no-op elsewhere."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    """Peak resident set of this process since the last reset (VmHWM), else since it started (ru_maxrss)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20, 1)


@dataclass(frozen=True)
class Settings:
    """What every request of a run asks for."""
    tokens: int | None
    sampling: str  # "greedy" (argmax, no NSF noise) or "default" (the release's sampler, seeded noise)
    seed: int = 0


class Backend:
    """What a worker serves: `describe()` once, then `synthesize` for every request (any number of threads)."""

    clock: StageClock
    sample_rate: int
    samples_per_token: int

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError

    def synthesize(self, text: str, stream: bool, settings: Settings, index: int) -> tuple[int, Iterator[np.ndarray]]:
        """(segments, waveform chunks); request `index` within the batch seeds its generator."""
        raise NotImplementedError


def run_batch(backend: Backend, texts: Sequence[str], stream: bool, settings: Settings) -> dict[str, Any]:
    """len(texts) requests started together on their own threads; latencies, first chunks, audio, stage times."""
    results: list[dict[str, Any] | None] = [None] * len(texts)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(texts))

    def one(index: int) -> None:
        try:
            barrier.wait()
            start = time.perf_counter()
            first = None
            samples = 0
            segments, chunks = backend.synthesize(texts[index], stream, settings, index)
            for chunk in chunks:
                if first is None and chunk.size:
                    first = time.perf_counter() - start
                samples += int(chunk.size)
            results[index] = {"latency_s": time.perf_counter() - start, "first_chunk_s": first,
                              "samples": samples, "segments": segments}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which stops the bench
            errors.append(exc)

    backend.clock.take()
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(texts))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    rows = [r for r in results if r is not None]
    tokens = sum(r["samples"] for r in rows) // backend.samples_per_token
    return {"wall_s": wall, "latency_s": [r["latency_s"] for r in rows],
            "first_chunk_s": [r["first_chunk_s"] for r in rows if r["first_chunk_s"] is not None],
            "audio_s": sum(r["samples"] for r in rows) / backend.sample_rate,
            "decode_steps": max(tokens - sum(r["segments"] for r in rows), 0),
            "stage_s": backend.clock.take(), "peak_rss_mb": peak_rss_mb()}


def serve(load: Callable[[], Backend]) -> int:
    """Worker loop: one JSON line per command on stdin, one JSON reply per line on the original stdout
    (anything the libraries print goes to stderr instead)."""
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    replies = os.fdopen(reply_fd, "w", buffering=1, encoding="utf-8")

    def send(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")

    try:
        backend = load()
        send({"ready": True, **backend.describe(), "peak_rss_mb": peak_rss_mb()})
    except Exception as exc:  # noqa: BLE001
        send({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "quit":
            break
        try:
            if command.get("reset_peak"):
                reset_peak_rss()
            settings = Settings(**command["settings"])
            send(run_batch(backend, command["texts"], bool(command["stream"]), settings))
        except Exception as exc:  # noqa: BLE001
            send({"error": f"{type(exc).__name__}: {exc}"})
    return 0


# ------------------------------------------------------------------------------------------ device worker

class DeviceBackend(Backend):
    """The runtime engine on one precision, its ORT sessions wrapped in stage timers."""

    def __init__(self, bundle: Path, precision: str, threads: int) -> None:
        import cosyedge.device.cosyvoice2.pipeline as cv2_pipeline
        from cosyedge.device.engine import Engine, selection
        from cosyedge.device.sessions import SessionConfig

        self.clock = StageClock()
        create = cv2_pipeline.create_session

        def timed_session(path: Path, config: SessionConfig) -> Any:
            graph = Path(path).name.split(".")[0].removeprefix("trt_")  # trt-int8 QDQ graphs: trt_<graph>
            session = create(path, config)
            return TimedSession(session, GRAPH_STAGE[graph], self.clock) if graph in GRAPH_STAGE else session

        cv2_pipeline.create_session = timed_session  # this worker process only
        try:
            self.engine = Engine.load(bundle, **selection(precision),
                                      sessions=SessionConfig(providers=("cpu",), intra_op_threads=threads),
                                      warmup=False)
        finally:
            cv2_pipeline.create_session = create
        cfg = self.engine.bundle.manifest.config
        self.sample_rate = self.engine.sample_rate
        self.samples_per_token = int(cfg["hift_upsample"]) * int(cfg["token_mel_ratio"])
        self._bundle = Path(bundle)
        for stream in (False, True):  # warm both paths (lazy ORT initialisation, first allocations)
            _, chunks = self.synthesize(TEXTS[1], stream, Settings(WARMUP_TOKENS, "greedy"), 0)
            for _ in chunks:
                pass

    def describe(self) -> dict[str, Any]:
        return {"backend": "device", "bundle": self._bundle.name,
                "precision": self.engine.pipeline.describe()["precision"], "sample_rate": self.sample_rate}

    def synthesize(self, text: str, stream: bool, settings: Settings, index: int) -> tuple[int, Iterator[np.ndarray]]:
        greedy = settings.sampling == "greedy"
        request = replace(self.engine.options(deterministic=greedy, seed=settings.seed + index,
                                              sampling=settings.sampling), pin_tokens=settings.tokens)
        with self.clock.timed("frontend"):
            segments = self.engine.segments(text)
        pipeline = self.engine.pipeline
        if stream:
            chunks: Iterator[np.ndarray] = (chunk for segment in segments for chunk in pipeline.stream(segment, request))
        else:
            chunks = iter(pipeline.synthesize(segments, request))
        return len(segments), chunks


# ------------------------------------------------------------------------------------------ parent side

class Worker:
    """One backend process and its line protocol."""

    def __init__(self, name: str, argv: list[str]) -> None:
        self.name = name
        self._log = tempfile.TemporaryFile(mode="w+", encoding="utf-8")
        self._process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                         text=True, encoding="utf-8", bufsize=1)
        self.info: dict[str, Any] = {}

    def wait_ready(self) -> dict[str, Any]:
        self.info = self._receive()
        return self.info

    def batch(self, texts: Sequence[str], stream: bool, settings: Settings, reset_peak: bool) -> dict[str, Any]:
        self._send({"cmd": "batch", "texts": list(texts), "stream": stream, "reset_peak": reset_peak,
                    "settings": {"tokens": settings.tokens, "sampling": settings.sampling, "seed": settings.seed}})
        return self._receive()

    def close(self) -> None:
        try:
            if self._process.poll() is None:
                self._send({"cmd": "quit"})
                self._process.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self._process.kill()
            self._process.wait()
        self._log.close()

    def _send(self, message: dict[str, Any]) -> None:
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(message) + "\n")
        self._process.stdin.flush()

    def _receive(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        message = json.loads(line) if line.strip() else {"error": "the worker exited"}
        if "error" in message:
            self._log.seek(0)
            tail = self._log.read()[-1500:].strip()
            raise CosyedgeError(f"bench worker {self.name}: {message['error']}" + (f"\n{tail}" if tail else ""))
        return message


@dataclass
class _Run:
    """The batches of one backend in one configuration, summed."""
    wall_s: float = 0.0
    audio_s: float = 0.0
    latency_s: list[float] = field(default_factory=list)
    first_chunk_s: list[float] = field(default_factory=list)
    decode_steps: int = 0
    stage_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    peak_rss_mb: float = 0.0

    def add(self, reply: dict[str, Any]) -> None:
        self.wall_s += reply["wall_s"]
        self.audio_s += reply["audio_s"]
        self.latency_s += reply["latency_s"]
        self.first_chunk_s += reply["first_chunk_s"]
        self.decode_steps += reply["decode_steps"]
        for stage in STAGES:
            self.stage_s[stage] += reply["stage_s"].get(stage, 0.0)
        self.peak_rss_mb = max(self.peak_rss_mb, reply["peak_rss_mb"])

    def row(self, info: dict[str, Any], concurrency: int, stream: bool) -> dict[str, Any]:
        audio = self.audio_s or float("nan")
        first = np.asarray(self.first_chunk_s, np.float64)
        streamed = stream and first.size > 0
        return {"backend": info["backend"], "bundle": info["bundle"], "precision": info["precision"],
                "concurrency": concurrency, "stream": stream, "audio_s": round(self.audio_s, 3),
                "wall_s": round(self.wall_s, 3), "rtf": round(sum(self.latency_s) / audio, 4),
                "first_chunk_s_p50": round(float(np.percentile(first, 50)), 4) if streamed else None,
                "first_chunk_s_p95": round(float(np.percentile(first, 95)), 4) if streamed else None,
                "llm_ms_per_token": round(1000 * self.stage_s["llm_decode"] / self.decode_steps, 2)
                if self.decode_steps else None,
                "stage_s": {k: round(v, 4) for k, v in self.stage_s.items()},
                "peak_rss_mb": self.peak_rss_mb,
                "throughput_audio_s_per_s": round(self.audio_s / self.wall_s, 4) if self.wall_s else None}


def batches(texts: Sequence[str], concurrency: int) -> list[list[str]]:
    """The text set as batches of `concurrency` requests, texts reused round-robin to fill the last batch."""
    count = math.ceil(len(texts) / concurrency)
    return [[texts[(b * concurrency + j) % len(texts)] for j in range(concurrency)] for b in range(count)]


def machine_info(threads: int, settings: Settings, rounds: int, texts: int) -> dict[str, Any]:
    import onnxruntime
    return {"platform": platform.platform(), "processor": platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "onnxruntime": onnxruntime.__version__, "numpy": np.__version__,
            "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
            "threads": threads, "tokens": settings.tokens, "sampling": settings.sampling, "rounds": rounds,
            "texts": texts}


def run_cosyvoice_bench(bundle: Path, precisions: Sequence[str], concurrency: Sequence[int] = (1, 4, 8),
                        streams: Sequence[bool] = (True, False), tokens: int | None = None,
                        reference: Path | None = None, threads: int = 2, texts: Sequence[str] = TEXTS,
                        rounds: int = 1, sampling: str = "greedy",
                        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The report `{"machine": ..., "runs": [...]}`; the reference (PyTorch, fp32, same release) runs at
    concurrency 1 only, interleaved batch by batch with the device precisions. `progress` gets a line per batch."""
    say = progress or (lambda line: None)
    from cosyedge.device.bundle import Bundle
    manifest = Bundle.load(bundle, verify=False).manifest
    if manifest.family != "cosyvoice2":
        raise InputError(f"bundle {Path(bundle).name!r} is a {manifest.family} bundle, not cosyvoice2")
    available = [*manifest.precisions, *manifest.config.get("targets", {})]  # precisions and quantize targets
    chosen = [p for p in dict.fromkeys(precisions) if p in available]
    if not chosen:
        raise InputError(f"bundle {Path(bundle).name!r} has none of the precisions {', '.join(precisions)}; "
                         f"it has {', '.join(available)}")
    if tokens is not None and tokens < 1:
        raise InputError("--tokens must be at least 1")
    if not texts or any(c < 1 for c in concurrency) or rounds < 1 or sampling not in ("greedy", "default"):
        raise InputError("texts, concurrency >= 1, rounds >= 1 and sampling greedy|default are required")
    settings = Settings(tokens, sampling)
    python = sys.executable
    workers = {f"device-{p}": Worker(f"device-{p}", [python, "-m", "cosyedge.device.bench_cosyvoice", "--worker",
                                                     str(bundle), "--precision", p, "--threads", str(threads)])
               for p in chosen}
    if reference is not None:
        workers["reference"] = Worker("reference", [python, "-m", "cosyedge.quantize.cosyvoice2.reference", "--worker",
                                                    str(reference), "--threads", str(threads)])
    runs = []
    turn = 0  # ABBA over every batch of the whole bench, so single-batch configurations alternate too
    try:
        for name, worker in workers.items():
            info = worker.wait_ready()
            say(f"{name}: ready, peak RSS {info['peak_rss_mb']:.0f} MB")
        for c in concurrency:
            for stream in streams:
                names = [n for n in workers if c == 1 or n != "reference"]
                acc = {name: _Run() for name in names}
                for _ in range(rounds):
                    for index, batch in enumerate(batches(texts, c)):
                        for name in (names if turn % 2 == 0 else names[::-1]):
                            first = not acc[name].latency_s
                            reply = workers[name].batch(batch, stream, settings, reset_peak=first)
                            acc[name].add(reply)
                            say(f"{name}: concurrency {c}, stream {'on' if stream else 'off'}, batch {index + 1}: "
                                f"{reply['audio_s']:.2f} s of audio in {reply['wall_s']:.2f} s")
                        turn += 1
                runs += [acc[name].row(workers[name].info, c, stream) for name in names]
    finally:
        for worker in workers.values():
            worker.close()
    return {"machine": machine_info(threads, settings, rounds, len(texts)), "runs": runs}


def format_table(report: dict[str, Any]) -> str:
    def num(value: Any, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    header = ("#", "backend", "precision", "conc", "stream", "audio_s", "wall_s", "rtf", "fc_p50", "fc_p95", "ms/tok",
              "front_s", "prefill_s", "decode_s", "flow_s", "hift_s", "rss_mb", "audio_s/s")
    rows = []
    for index, run in enumerate(report["runs"], 1):
        precision = "+".join(dict.fromkeys(run["precision"].values()))
        s = run["stage_s"]
        rows.append((str(index), run["backend"], precision, str(run["concurrency"]), "on" if run["stream"] else "off",
                     num(run["audio_s"], 2), num(run["wall_s"], 2), num(run["rtf"]), num(run["first_chunk_s_p50"]),
                     num(run["first_chunk_s_p95"]), num(run["llm_ms_per_token"], 1), num(s["frontend"]),
                     num(s["llm_prefill"]), num(s["llm_decode"]), num(s["flow"]), num(s["hift"]),
                     num(run["peak_rss_mb"], 0), num(run["throughput_audio_s_per_s"])))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)] if rows else [len(h) for h in header]
    lines = ["  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in (header, *rows)]
    references = {r["stream"]: r for r in report["runs"] if r["backend"] == "reference"}
    for run in report["runs"]:
        ref = references.get(run["stream"])
        if run["backend"] == "device" and run["concurrency"] == 1 and ref and ref["rtf"]:
            precision = "+".join(dict.fromkeys(run["precision"].values()))
            lines.append(f"device {precision} / reference RTF, stream {'on' if run['stream'] else 'off'}: "
                         f"{run['rtf'] / ref['rtf']:.3f}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ chart

def _png(pixels: np.ndarray) -> bytes:
    """RGB uint8 [H, W, 3] -> PNG bytes (no filtering, zlib)."""
    height, width, _ = pixels.shape
    raw = b"".join(b"\x00" + pixels[y].tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


COLORS = {("device", "fp32"): (52, 101, 164), ("device", "int8"): (78, 154, 6), ("device", "fp16"): (117, 80, 123),
          ("reference", "fp32"): (206, 92, 0)}
OTHER_COLOR = (90, 90, 90)
# A 3x5 pixel font (rows top to bottom, "#" = ink) for the chart's titles, numbers and legend: no font library needed.
FONT = {
    "A": ".#./#.#/###/#.#/#.#", "B": "##./#.#/##./#.#/##.", "C": ".##/#../#../#../.##", "D": "##./#.#/#.#/#.#/##.",
    "E": "###/#../##./#../###", "F": "###/#../##./#../#..", "G": ".##/#../#.#/#.#/.##", "H": "#.#/#.#/###/#.#/#.#",
    "I": "###/.#./.#./.#./###", "J": "..#/..#/..#/#.#/.#.", "K": "#.#/#.#/##./#.#/#.#", "L": "#../#../#../#../###",
    "M": "#.#/###/###/#.#/#.#", "N": "##./#.#/#.#/#.#/#.#", "O": ".#./#.#/#.#/#.#/.#.", "P": "##./#.#/##./#../#..",
    "Q": ".#./#.#/#.#/##./.##", "R": "##./#.#/##./#.#/#.#", "S": ".##/#../.#./..#/##.", "T": "###/.#./.#./.#./.#.",
    "U": "#.#/#.#/#.#/#.#/###", "V": "#.#/#.#/#.#/#.#/.#.", "W": "#.#/#.#/###/###/#.#", "X": "#.#/#.#/.#./#.#/#.#",
    "Y": "#.#/#.#/.#./.#./.#.", "Z": "###/..#/.#./#../###", "0": "###/#.#/#.#/#.#/###", "1": ".#./##./.#./.#./###",
    "2": "##./..#/.#./#../###", "3": "##./..#/.#./..#/##.", "4": "#.#/#.#/###/..#/..#", "5": "###/#../##./..#/##.",
    "6": ".##/#../###/#.#/###", "7": "###/..#/.#./.#./.#.", "8": "###/#.#/###/#.#/###", "9": "###/#.#/###/..#/##.",
    ".": ".../.../.../.../.#.", "-": ".../.../###/.../...", "/": "..#/..#/.#./#../#..", ":": ".../.#./.../.#./...",
    "=": ".../###/.../###/...", " ": ".../.../.../.../...", "(": ".#./#../#../#../.#.", ")": ".#./..#/..#/..#/.#.",
}
SCALE = 2  # screen pixels per font pixel


def _text(image: np.ndarray, x: int, y: int, text: str, color: tuple[int, int, int] = (0, 0, 0)) -> int:
    """Draw `text` (upper-cased; unknown characters as blanks) with its top-left corner at (x, y); returns the end x."""
    for char in text.upper():
        for row, bits in enumerate(FONT.get(char, FONT[" "]).split("/")):
            for col, bit in enumerate(bits):
                if bit == "#":
                    y0, x0 = y + row * SCALE, x + col * SCALE
                    image[y0:y0 + SCALE, x0:x0 + SCALE] = color
        x += 4 * SCALE
    return x


def _text_width(text: str) -> int:
    return 4 * SCALE * len(text)


def _bar_color(run: dict[str, Any]) -> tuple[int, int, int]:
    lowest = [p for p in ("int8", "fp16", "fp32") if p in run["precision"].values()]
    return COLORS.get((run["backend"], lowest[0] if lowest else ""), OTHER_COLOR)


def write_chart(report: dict[str, Any], path: Path) -> Path:
    """A PNG bar chart drawn with numpy (matplotlib is not a dependency): three panels, RTF, first-chunk p50 (s)
    and throughput (audio s per s), one bar per run numbered in table order. Colour = backend and lowest
    precision (legend below); non-streaming runs have a lighter top half; the RTF panel marks 1.0 (real time)."""
    runs = report["runs"]
    metrics = (("rtf", "RTF"), ("first_chunk_s_p50", "FIRST CHUNK P50 S"), ("throughput_audio_s_per_s", "AUDIO S/S"))
    bar, gap, margin, height, line = 22, 8, 24, 240, 7 * SCALE
    panel = max(len(runs) * (bar + gap) + gap, max(_text_width(t) for _, t in metrics) + gap)
    legend = sorted({(r["backend"], _bar_color(r)) for r in runs}, key=lambda item: item[0] == "reference")
    note = "light top half = stream off   bars numbered as table rows"
    width = max(len(metrics) * (panel + margin) + margin, _text_width(note) + 2 * margin)
    image = np.full((height + 2 * margin + 5 * line + len(legend) * line + line, width, 3), 255, np.uint8)
    top = margin + 3 * line
    bottom = top + height
    for m, (metric, title) in enumerate(metrics):
        left = margin + m * (panel + margin)
        _text(image, left, margin, title)
        image[top:bottom + 1, left] = image[bottom, left:left + panel] = (0, 0, 0)
        values = [run[metric] or 0.0 for run in runs]
        scale = max(max(values, default=0.0), 1.0 if metric == "rtf" else 1e-9)
        _text(image, left, margin + 3 * line // 2, f"max {scale:.3g}")
        image[top, left - 4:left] = (0, 0, 0)
        if metric == "rtf":
            y = bottom - int(height / scale)
            image[y, left + 1:left + panel] = (200, 200, 200)
        for i, (run, value) in enumerate(zip(runs, values)):
            x = left + gap + i * (bar + gap)
            color = np.array(_bar_color(run), np.uint8)
            size = int(round(height * value / scale))
            image[bottom - size:bottom, x:x + bar] = color
            if not run["stream"]:
                image[bottom - size:bottom - size + size // 2, x:x + bar] = (color.astype(np.int32) + 255) // 2
            _text(image, x + (bar - _text_width(str(i + 1))) // 2 + SCALE, bottom + 4, str(i + 1))
    y = bottom + 4 + 2 * line
    for backend, color in legend:
        image[y:y + 5 * SCALE, margin:margin + 5 * SCALE] = color
        names = {v: k for k, v in COLORS.items() if k[0] == backend}
        _text(image, margin + 8 * SCALE, y, f"{backend} {names.get(color, ('', 'mixed'))[1]}")
        y += line
    _text(image, margin, y, note)
    path = Path(path)
    path.write_bytes(_png(image))
    return path


# ------------------------------------------------------------------------------------------ worker entry

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosyedge.device.bench_cosyvoice", description="bench worker (internal)")
    parser.add_argument("--worker", required=True, metavar="BUNDLE")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    return serve(lambda: DeviceBackend(Path(args.worker), args.precision, args.threads))


if __name__ == "__main__":
    sys.exit(main())
