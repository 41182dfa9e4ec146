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

# Stages are timed by call kind: the one `llm` graph's calls count as llm_prefill when they start from an empty
# cache, as llm_decode otherwise (LLMTimedSession), so the decode time per token stays measurable.
STAGES = ("frontend", "llm_prefill", "llm_decode", "flow", "hift", "align")
# ORT graph -> the stage its calls count towards (flow = encoder + estimator, hift = source + decoder, align = the
# word-timing pass of runs with word times)
GRAPH_STAGE = {"flow_encoder": "flow", "flow_estimator": "flow", "hift_source": "hift", "hift_decoder": "hift",
               "llm_align": "align"}

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
        return self._timed(self._stage, self._session.run, *args, **kwargs)

    def run_with_iobinding(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(self._stage, self._session.run_with_iobinding, *args, **kwargs)

    def _timed(self, stage: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self._clock.timed(stage):
            out = call(*args, **kwargs)
        self._clock.note_rss(stage)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


class _CacheBinding:
    """An IOBinding that remembers whether its call is a prefill: stacked caches, the cached length P of the
    `past_key` bound to it is 0; shared caches (kvcache.py), the new positions are the whole total length."""

    def __init__(self, binding: Any) -> None:
        self.binding = binding
        self.past = 0
        self.total: int | None = None
        self.length = 0

    @property
    def prefill(self) -> bool:
        return self.past == 0 if self.total is None else self.total == self.length

    def bind_cpu_input(self, name: str, array: Any) -> None:
        if name == "past_key":
            self.past = int(array.shape[3])
        elif name == "total_sequence_length":
            self.total = int(array)
        elif name == "inputs_embeds":
            self.length = int(array.shape[1])
        self.binding.bind_cpu_input(name, array)

    def bind_ortvalue_input(self, name: str, value: Any) -> None:
        if name == "past_key":
            self.past = int(value.shape()[3])
        self.binding.bind_ortvalue_input(name, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.binding, name)


class LLMTimedSession(TimedSession):
    """The `llm` graph: a call with an empty cache counts towards llm_prefill, any other towards llm_decode."""

    def __init__(self, session: Any, clock: StageClock) -> None:
        super().__init__(session, "llm_decode", clock)

    def run(self, output_names: Any, feeds: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        prefill = int(feeds["past_key"].shape[3]) == 0 if "past_key" in feeds else \
            int(feeds["total_sequence_length"]) == int(feeds["inputs_embeds"].shape[1])
        return self._timed("llm_prefill" if prefill else "llm_decode", self._session.run, output_names, feeds,
                           *args, **kwargs)

    def io_binding(self) -> _CacheBinding:
        return _CacheBinding(self._session.io_binding())

    def run_with_iobinding(self, binding: _CacheBinding, *args: Any, **kwargs: Any) -> Any:
        return self._timed("llm_prefill" if binding.prefill else "llm_decode", self._session.run_with_iobinding,
                           binding.binding, *args, **kwargs)


def graph_name(path: Path) -> str:
    """`flow_estimator.int8.onnx` -> `flow_estimator`; trt-int8 QDQ graphs are named `trt_<graph>`."""
    return Path(path).name.split(".")[0].removeprefix("trt_")


def timing_factory(clock: StageClock, create: SessionFactory = create_session) -> SessionFactory:
    """A `SessionConfig.session_factory` that makes sessions with `create` and times the stage graphs on `clock`
    (the `llm` graph by call kind; graphs outside `GRAPH_STAGE`, e.g. CAM++, are returned as made)."""

    def factory(path: Path, config: SessionConfig) -> Any:
        session = create(path, config)
        name = graph_name(path)
        if name == "llm":
            return LLMTimedSession(session, clock)
        stage = GRAPH_STAGE.get(name)
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
