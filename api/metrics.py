"""Prometheus text exposition, written by hand: counters, gauges and histograms behind one lock."""
from __future__ import annotations

import threading
from bisect import bisect_left
from typing import Callable, Iterable

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)

Labels = tuple[tuple[str, str], ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Labels, extra: tuple[tuple[str, str], ...] = ()) -> str:
    items = labels + extra
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}" if items else ""


def _number(value: float) -> str:
    return repr(float(value)) if value != int(value) else str(int(value))


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1


class Metrics:
    """All of the service's metrics; `render()` is the body of GET /metrics."""

    _HELP = {
        "cosyedge_requests_total": ("counter", "HTTP requests by route and status"),
        "cosyedge_request_duration_seconds": ("histogram", "time from request to last byte, by route"),
        "cosyedge_queue_depth": ("gauge", "synthesis items waiting for the engine"),
        "cosyedge_queue_rejected_total": ("counter", "items refused because the queue was full (503)"),
        "cosyedge_deadline_expired_total": ("counter", "items dropped because their deadline passed before work started (504)"),
        "cosyedge_rate_limited_total": ("counter", "requests refused by the per-client rate limit (429)"),
        "cosyedge_batch_size": ("histogram", "items per engine call"),
        "cosyedge_batches_total": ("counter", "engine calls"),
        "cosyedge_audio_seconds_total": ("counter", "seconds of audio produced"),
        "cosyedge_compute_seconds_total": ("counter", "seconds the engine spent producing it"),
        "cosyedge_rtf": ("gauge", "real-time factor so far: compute seconds / audio seconds"),
        "cosyedge_synthesis_failures_total": ("counter", "items whose synthesis failed (500, dead-lettered)"),
        "cosyedge_stream_disconnects_total": ("counter", "streaming responses whose client went away before the end"),
        "cosyedge_stream_segments_skipped_total": ("counter", "sentences not synthesized because their stream's client left"),
        "cosyedge_ready": ("gauge", "1 once the voice is loaded and warmed up"),
        "cosyedge_decode_steps": ("gauge", "CosyVoice: batched LLM decode steps run so far"),
        "cosyedge_decode_rows_mean": ("gauge", "CosyVoice: mean requests' rows per LLM decode step (cross-request batching)"),
        "cosyedge_decode_active_rows": ("gauge", "CosyVoice: rows decoding right now"),
    }

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, dict[Labels, float]] = {}
        self._histograms: dict[str, dict[Labels, _Histogram]] = {}
        self._gauges: dict[str, Callable[[], float]] = {}

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._counters.setdefault(name, {})
            series[key] = series.get(key, 0.0) + value

    def observe(self, name: str, value: float, buckets: tuple[float, ...] = LATENCY_BUCKETS, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._histograms.setdefault(name, {}).setdefault(key, _Histogram(buckets)).observe(value)

    def gauge(self, name: str, read: Callable[[], float]) -> None:
        """A gauge read at scrape time (queue depth, readiness)."""
        self._gauges[name] = read

    def value(self, name: str, **labels: str) -> float:
        """A counter's current value (tests, bench)."""
        with self._lock:
            return self._counters.get(name, {}).get(tuple(sorted(labels.items())), 0.0)

    def synthesize(self) -> str:
        lines: list[str] = []
        with self._lock:
            counters = {n: dict(s) for n, s in self._counters.items()}
            histograms = {n: {k: (h.buckets, list(h.counts), h.total, h.count) for k, h in s.items()}
                          for n, s in self._histograms.items()}
        audio = sum(counters.get("cosyedge_audio_seconds_total", {}).values())
        compute = sum(counters.get("cosyedge_compute_seconds_total", {}).values())
        gauges = {name: read() for name, read in self._gauges.items()}
        gauges["cosyedge_rtf"] = compute / audio if audio else 0.0
        for name, (kind, text) in self._HELP.items():
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            if kind == "counter":
                lines += [f"{name}{_labels(k)} {_number(v)}" for k, v in sorted(counters.get(name, {}).items())]
                if not counters.get(name):
                    lines.append(f"{name} 0")
            elif kind == "gauge":
                lines.append(f"{name} {_number(gauges.get(name, 0.0))}")
            else:
                for key, (buckets, counts, total, count) in sorted(histograms.get(name, {}).items()):
                    lines += list(self._histogram_lines(name, key, buckets, counts, total, count))
        return "\n".join(lines) + "\n"

    @staticmethod
    def _histogram_lines(name: str, key: Labels, buckets: tuple[float, ...], counts: list[int],
                         total: float, count: int) -> Iterable[str]:
        running = 0
        for bound, n in zip(buckets, counts):
            running += n
            yield f"{name}_bucket{_labels(key, (('le', _number(bound)),))} {running}"
        yield f"{name}_bucket{_labels(key, (('le', '+Inf'),))} {count}"
        yield f"{name}_sum{_labels(key)} {_number(total)}"
        yield f"{name}_count{_labels(key)} {count}"
