"""The service's Prometheus metrics through `prometheus-client`, in a registry of their own per app.

A private registry (not the client's global default) lets several apps live in one process (tests, the
bench) without their metrics colliding. Callers name metrics by their exposed names, as /metrics shows them.
"""
from __future__ import annotations

from typing import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from cosyedge.device.options import Stat

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # the text format 0.0.4 that every Prometheus scrapes

_COUNTERS = {  # name -> (help, label names)
    "cosyedge_requests_total": ("HTTP requests by route and status", ("route", "status")),
    "cosyedge_queue_rejected_total": ("items refused because the queue was full (503)", ()),
    "cosyedge_deadline_expired_total": ("items dropped because their deadline passed before work started (504)", ()),
    "cosyedge_rate_limited_total": ("requests refused by the per-client rate limit (429)", ()),
    "cosyedge_batches_total": ("engine calls", ()),
    "cosyedge_audio_seconds_total": ("seconds of audio produced", ()),
    "cosyedge_compute_seconds_total": ("seconds the engine spent producing it", ()),
    "cosyedge_synthesis_failures_total": ("items whose synthesis failed (500, dead-lettered)", ()),
    "cosyedge_stream_disconnects_total": ("streaming responses whose client went away before the end", ()),
    "cosyedge_stream_segments_skipped_total": ("sentences not synthesized because their stream's client left", ()),
}
_HISTOGRAMS = {  # name -> (help, label names, buckets)
    "cosyedge_request_duration_seconds": ("time from request to last byte, by route", ("route",), LATENCY_BUCKETS),
    "cosyedge_batch_size": ("items per engine call", (), BATCH_BUCKETS),
    "cosyedge_time_to_first_audio_seconds": ("time from request to its first audio being ready to send "
                                             "(stream: the first chunk; else the whole file)", ("stream",),
                                             LATENCY_BUCKETS),
}
GAUGES = {  # name -> help; read at scrape time from what `Metrics.gauge` registers (0 until then)
    "cosyedge_queue_depth": "jobs handed to the engine's door whose work has not started",
    "cosyedge_ready": "1 once the voice is loaded and warmed up",
    "cosyedge_rtf": "real-time factor so far: compute seconds / audio seconds",
    "cosyedge_in_flight": "requests admitted and not yet delivered, every door together (queue_size bounds it)",
}
OCCUPANCY = ("cosyedge_decode_rows_per_step", "CosyVoice: rows decoded together per LLM decode step (occupancy)")


class Metrics:
    """All of the service's metrics; `exposition()` is the body of GET /metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._counters = {name: Counter(name, text, labels, registry=self.registry)
                          for name, (text, labels) in _COUNTERS.items()}
        self._histograms = {name: Histogram(name, text, labels, buckets=buckets, registry=self.registry)
                            for name, (text, labels, buckets) in _HISTOGRAMS.items()}
        self._gauges = {name: Gauge(name, text, registry=self.registry) for name, text in GAUGES.items()}
        self.gauge("cosyedge_rtf", self._rtf)
        self._occupancy = _CountHistogram(*OCCUPANCY, BATCH_BUCKETS)
        self.registry.register(self._occupancy)

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        counter = self._counters[name]
        (counter.labels(**labels) if labels else counter).inc(value)

    def observe(self, name: str, value: float, **labels: str) -> None:
        histogram = self._histograms[name]
        (histogram.labels(**labels) if labels else histogram).observe(value)

    def gauge(self, name: str, read: Callable[[], float]) -> None:
        """A gauge read at scrape time (queue depth, readiness, the engine's counters)."""
        self._gauges[name].set_function(read)

    def occupancy(self, read: Callable[[], dict[int, int]]) -> None:
        """Where the decode-row occupancy histogram comes from: steps by rows (`Engine.decode_occupancy`)."""
        self._occupancy.read = read

    def engine_stats(self, read: Callable[[], Mapping[str, Stat]]) -> None:
        """The engine's own gauges (`Engine.stats()`), each exposed as `cosyedge_<name>` with the engine's help
        text: the service names none of them."""
        self.registry.register(_EngineGauges(read))

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (0 if it has none yet): for tests and the bench."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def _rtf(self) -> float:
        audio = self.value("cosyedge_audio_seconds_total")
        return self.value("cosyedge_compute_seconds_total") / audio if audio else 0.0



class _EngineGauges:
    """Whatever gauges the engine reports, read at scrape time."""

    def __init__(self, read: Callable[[], Mapping[str, Stat]]) -> None:
        self.read = read

    def describe(self) -> list:
        return []  # names known only once an engine is loaded

    def collect(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(f"cosyedge_{name}", stat.help, value=stat.value)
                for name, stat in sorted(self.read().items())]


class _CountHistogram:
    """A Prometheus histogram of exact counts (value -> occurrences) kept elsewhere, read at scrape time."""

    def __init__(self, name: str, text: str, buckets: tuple[int, ...]) -> None:
        self.name, self.text, self.buckets = name, text, buckets
        self.read: Callable[[], dict[int, int]] = dict

    def collect(self) -> list[HistogramMetricFamily]:
        counts = self.read()
        cumulative = [(str(float(le)), sum(n for v, n in counts.items() if v <= le)) for le in self.buckets]
        cumulative.append(("+Inf", sum(counts.values())))
        return [HistogramMetricFamily(self.name, self.text, buckets=cumulative,
                                      sum_value=sum(v * n for v, n in counts.items()))]
