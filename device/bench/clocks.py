"""What the benchmarks measure with: stage clocks, a session factory that times graph calls, peak RSS."""
from __future__ import annotations

import resource
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from cosyedge.device.sessions import SessionConfig, create_session

STAGES = ("frontend", "llm_prefill", "llm_decode", "flow", "hift")
# ORT graph -> the stage its calls count towards (flow = encoder + estimator, hift = source + decoder)
GRAPH_STAGE = {"llm_prefill": "llm_prefill", "llm_decode": "llm_decode", "flow_encoder": "flow",
               "flow_estimator": "flow", "hift_source": "hift", "hift_decoder": "hift"}

SessionFactory = Callable[[Path, SessionConfig], Any]


class StageClock:
    """Seconds per stage, summed over every thread of a process, and the largest resident set seen right after
    a graph call of each stage (ORT keeps its arena, so this is the stage's footprint, all threads together)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = dict.fromkeys(STAGES, 0.0)
        self._rss: dict[str, float] = {}

    def note_rss(self, stage: str) -> None:
        rss = current_rss_mb()
        with self._lock:
            self._rss[stage] = max(self._rss.get(stage, 0.0), rss)

    def take_rss(self) -> dict[str, float]:
        """Resident MB after each stage's calls so far (stages with calls only), and forget them."""
        with self._lock:
            rss, self._rss = self._rss, {}
        return rss

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
    """A session whose graph calls add their wall time to a stage (everything else delegates)."""

    def __init__(self, session: Any, stage: str, clock: StageClock) -> None:
        self._session = session
        self._stage = stage
        self._clock = clock

    def run(self, *args: Any, **kwargs: Any) -> Any:
        with self._clock.timed(self._stage):
            out = self._session.run(*args, **kwargs)
        self._clock.note_rss(self._stage)
        return out

    def run_with_iobinding(self, *args: Any, **kwargs: Any) -> Any:
        with self._clock.timed(self._stage):
            out = self._session.run_with_iobinding(*args, **kwargs)
        self._clock.note_rss(self._stage)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


def graph_name(path: Path) -> str:
    """`llm_decode.int8.onnx` -> `llm_decode`; trt-int8 QDQ graphs are named `trt_<graph>`."""
    return Path(path).name.split(".")[0].removeprefix("trt_")


def timing_factory(clock: StageClock, create: SessionFactory = create_session) -> SessionFactory:
    """A `SessionConfig.session_factory` that makes sessions with `create` and times the stage graphs on `clock`
    (graphs outside `GRAPH_STAGE`, e.g. CAM++, are returned as made)."""

    def factory(path: Path, config: SessionConfig) -> Any:
        session = create(path, config)
        stage = GRAPH_STAGE.get(graph_name(path))
        return TimedSession(session, stage, clock) if stage else session

    return factory


def current_rss_mb() -> float:
    """Resident set of this process now (Linux /proc/self/statm; 0 elsewhere)."""
    try:
        import os
        return round(int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return 0.0


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
