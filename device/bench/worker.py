"""The worker side of the CosyVoice bench's subprocess protocol, and the device worker itself.

A worker loads one backend, answers `{"ready": true, ...describe()}`, then reads one JSON command per line on stdin
(`{"cmd": "batch", "texts": [...], "stream": bool, "reset_peak": bool, "settings": {...}}` or `{"cmd": "quit"}`) and
writes one JSON reply per line (a batch's measurements, or `{"error": "..."}`). The PyTorch reference
(`cosyedge.quantize.cosyvoice2.reference`) serves the same protocol with its own `Backend`.

`python -m cosyedge.device.bench.worker --worker BUNDLE --precision fp32 --threads 2` (started by the bench).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from cosyedge.device.bench.clocks import SessionFactory, StageClock, peak_rss_mb, reset_peak_rss, timing_factory
from cosyedge.device.sessions import create_session

# Alternating Chinese / English; each is one frontend segment so a pinned run is N tokens per request.
TEXTS = (
    "欢迎乘坐本次列车，下一站是机场。",
    "Good morning, and welcome to the station.",
    "请保管好您的随身物品，祝您旅途愉快。",
    "The next train to the airport leaves from platform four in six minutes.",
    "今天天气晴朗，适合出门散步。",
    "Tickets can be bought at the machines near the main entrance.",
)
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Settings:
    """What every request of a run asks for."""
    tokens: int | None
    sampling: str  # "greedy" (argmax, no NSF noise) or "default" (the release's sampler, seeded noise)
    seed: int = 0
    preset: str | None = None  # CosyVoice2 flow quality preset (None: the bundle default; the reference ignores it)
    words: bool = False  # with word times (the device's alignment pass after each segment; the reference ignores it)


class Backend:
    """What a worker serves: `describe()` once, then `synthesize` for every request (any number of threads)."""

    clock: StageClock
    sample_rate: int
    samples_per_token: int
    words = False  # warm up the word-timing path too (a device worker started for runs with --words)

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError

    def synthesize(self, text: str, stream: bool, settings: Settings, index: int) -> tuple[int, Iterator[np.ndarray]]:
        """(segments, waveform chunks); request `index` within the batch seeds its generator."""
        raise NotImplementedError

    def prepare(self, texts: Sequence[str], settings: Settings) -> bool:
        """Untimed work before a batch (a peer reopens its engine for another pinned length); True when it did
        some, so the batch's peak-RSS window starts after it."""
        return False

    def warm_up(self) -> None:
        """Run both paths once (lazy ORT initialisation, first allocations) before anything is timed."""
        for stream in (False, True):
            _, chunks = self.synthesize(TEXTS[1], stream, Settings(WARMUP_TOKENS, "greedy", words=self.words), 0)
            for _ in chunks:
                pass


def playback_stall(arrivals: Sequence[float], seconds: Sequence[float]) -> float:
    """Seconds a listener who starts playing at the first chunk waits for later ones: chunk i arrives at
    `arrivals[i]` and plays for `seconds[i]`, from its arrival or the end of the one before, whichever is later."""
    stall, end = 0.0, None
    for arrived, length in zip(arrivals, seconds):
        if end is not None and arrived > end:
            stall += arrived - end
        end = max(arrived, end if end is not None else arrived) + length
    return stall


def run_batch(backend: Backend, texts: Sequence[str], stream: bool, settings: Settings) -> dict[str, Any]:
    """len(texts) requests started together on their own threads; latencies, first chunks, audio, stage times."""
    results: list[dict[str, Any] | None] = [None] * len(texts)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(texts))

    def one(index: int) -> None:
        try:
            barrier.wait()
            start = time.perf_counter()
            arrivals: list[float] = []
            sizes: list[int] = []
            segments, chunks = backend.synthesize(texts[index], stream, settings, index)
            for chunk in chunks:
                if chunk.size:
                    arrivals.append(time.perf_counter() - start)
                    sizes.append(int(chunk.size))
            results[index] = {"latency_s": time.perf_counter() - start,
                              "first_chunk_s": arrivals[0] if arrivals else None,
                              "stall_s": playback_stall(arrivals, [size / backend.sample_rate for size in sizes]),
                              "samples": sum(sizes), "segments": segments}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which stops the bench
            errors.append(exc)

    backend.clock.take()
    backend.clock.take_rss()
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
    stage_rss = backend.clock.take_rss()
    tokens = sum(r["samples"] for r in rows) // backend.samples_per_token
    return {"wall_s": wall, "latency_s": [r["latency_s"] for r in rows],
            "first_chunk_s": [r["first_chunk_s"] for r in rows if r["first_chunk_s"] is not None],
            "stall_s": [r["stall_s"] for r in rows if r["first_chunk_s"] is not None],
            "audio_s": sum(r["samples"] for r in rows) / backend.sample_rate,
            "decode_steps": max(tokens - sum(r["segments"] for r in rows), 0),
            "stage_s": backend.clock.take(), "stage_rss_mb": stage_rss,
            # VmHWM misses pages returned with madvise (glibc free) before the kernel updates it: never below a
            # resident set seen after a stage
            "peak_rss_mb": max([peak_rss_mb(), *stage_rss.values()])}


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
            settings = Settings(**command["settings"])
            # a configuration's peak is the largest of its batches' (the parent keeps the max): a window may restart
            if backend.prepare(command["texts"], settings) or command.get("reset_peak"):
                reset_peak_rss()
            send(run_batch(backend, command["texts"], bool(command["stream"]), settings))
        except Exception as exc:  # noqa: BLE001
            send({"error": f"{type(exc).__name__}: {exc}"})
    return 0


class DeviceBackend(Backend):
    """The runtime engine on one precision; its stage graphs are timed by the session factory it injects.

    `create` makes the underlying sessions (default: ONNX Runtime); tests pass a counting one."""

    def __init__(self, bundle: Path, precision: str, threads: int,
                 create: SessionFactory = create_session, words: bool = False) -> None:
        from cosyedge.device.engine import Engine, selection
        from cosyedge.device.sessions import SessionConfig

        self.clock = StageClock()
        sessions = SessionConfig(providers=("cpu",), intra_op_threads=threads,
                                 session_factory=timing_factory(self.clock, create))
        self.engine = Engine.load(bundle, **selection(precision), sessions=sessions, warmup=False)
        cfg = self.engine.bundle.manifest.config
        self.sample_rate = self.engine.sample_rate
        self.samples_per_token = int(cfg["hift_upsample"]) * int(cfg["token_mel_ratio"])
        self._bundle = Path(bundle)
        self.words = words
        self.warm_up()

    def describe(self) -> dict[str, Any]:
        return {"backend": "device", "bundle": self._bundle.name,
                "precision": self.engine.pipeline.describe()["precision"], "sample_rate": self.sample_rate}

    def prepare(self, texts: Sequence[str], settings: Settings) -> bool:
        """The work a warmed service has done before requests (`Engine.warmup`: CosyVoice2's streaming prompt
        state of the default voice, the bench's voice, for the run's preset, then a short synthesis that hands the
        state's arena regions back), so a run measures requests, not it."""
        return self.engine.warmup(settings.preset)

    def synthesize(self, text: str, stream: bool, settings: Settings, index: int) -> tuple[int, Iterator[np.ndarray]]:
        from cosyedge.device.cosyvoice2.pipeline import pinned  # the bench's own options: pinned lengths
        greedy = settings.sampling == "greedy"
        options = pinned(self.engine.options(deterministic=greedy, seed=settings.seed + index,
                                             sampling=settings.sampling, preset=settings.preset), settings.tokens)
        with self.clock.timed("frontend"):
            segments = self.engine.segments(text, words=settings.words)
        pipeline, rows = self.engine.pipeline, self.engine.limits.batch_max
        if settings.words and stream:
            chunks: Iterator[np.ndarray] = (chunk for segment in segments
                                            for chunk, _ in pipeline.stream_words(segment, options, None, rows))
        elif settings.words:
            chunks = (wave for wave, _ in pipeline.synthesize_words(segments, options, rows))
        elif stream:
            chunks = (chunk for segment in segments for chunk in pipeline.stream(segment, options))
        else:
            chunks = iter(pipeline.synthesize(segments, options))
        return len(segments), chunks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosyedge.device.bench.worker", description="bench worker (internal)")
    parser.add_argument("--worker", required=True, metavar="BUNDLE")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--words", action="store_true", help="warm up the word-timing path too")
    args = parser.parse_args(argv)
    return serve(lambda: DeviceBackend(Path(args.worker), args.precision, args.threads, words=args.words))


if __name__ == "__main__":
    sys.exit(main())
