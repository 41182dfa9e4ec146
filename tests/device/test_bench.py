"""The bench package: sessions injected through `SessionConfig.session_factory` (never monkeypatched), the
report tables, and the chart with and without the optional matplotlib extra."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cosyedge.device.bench.clocks import (GRAPH_STAGE, LLMTimedSession, StageClock, TimedSession, graph_name,
                                          timing_factory)
from cosyedge.device.bench.engine import pass_orders
from cosyedge.device.bench.report import cosyvoice_table, engine_table
from cosyedge.device.bench.worker import playback_stall
from cosyedge.device.sessions import SessionConfig, create_session

STAGE_SUM = {"frontend": 0.0, "llm_prefill": 0.1, "llm_decode": 0.4, "flow": 0.3, "hift": 0.2}


def _run(backend: str, precision: str, concurrency: int, stream: bool, rtf: float) -> dict[str, Any]:
    return {"backend": backend, "bundle": "b", "precision": dict.fromkeys(GRAPH_STAGE, precision),
            "concurrency": concurrency, "stream": stream, "audio_s": 2.0, "wall_s": 1.0, "rtf": rtf,
            "first_chunk_s_p50": 0.2 if stream else None, "first_chunk_s_p95": 0.3 if stream else None,
            "stall_s_p95": 0.125 if stream else None,
            "llm_ms_per_token": 5.0, "stage_s": STAGE_SUM, "peak_rss_mb": 300.0, "throughput_audio_s_per_s": 2.0}


REPORT = {"machine": {}, "runs": [_run("device", "fp32", 1, True, 0.5), _run("device", "int8", 1, False, 0.25),
                                  _run("reference", "fp32", 1, True, 1.0), _run("reference", "fp32", 1, False, 1.0)]}


class CountingFactory:
    """A session factory that counts the sessions it makes and the graph calls that reach them."""

    def __init__(self, create=create_session) -> None:
        self.created: list[str] = []
        self.runs: Counter[str] = Counter()
        self._create = create

    def __call__(self, path: Path, config: SessionConfig) -> Any:
        name = graph_name(path)
        self.created.append(name)
        session = self._create(path, config)
        factory = self

        class Counted:
            def run(self, *args: Any, **kwargs: Any) -> Any:
                factory.runs[name] += 1
                return session.run(*args, **kwargs)

            def run_with_iobinding(self, *args: Any, **kwargs: Any) -> Any:  # the LLM graphs (llm.py)
                factory.runs[name] += 1
                return session.run_with_iobinding(*args, **kwargs)

            def __getattr__(self, attr: str) -> Any:
                return getattr(session, attr)

        return Counted()


class FakeSession:
    def run(self, *args: Any, **kwargs: Any) -> list:
        return []


def test_session_config_creates_through_the_injected_factory(tmp_path):
    made = []
    config = SessionConfig(providers=("cpu",), session_factory=lambda path, cfg: made.append((path.name, cfg)) or "s")
    assert config.create(tmp_path / "vits.fp32.onnx") == "s"
    assert made == [("vits.fp32.onnx", config)]


def test_timing_factory_times_stage_graphs_only():
    """The one `llm` graph is timed by call kind: an empty cache is a prefill, any other call a decode step."""
    clock = StageClock()
    counting = CountingFactory(create=lambda path, config: FakeSession())
    factory = timing_factory(clock, counting)
    llm = factory(Path("trt_llm.int8.onnx"), SessionConfig())
    estimator = factory(Path("flow_estimator.int8.onnx"), SessionConfig())
    campplus = factory(Path("campplus.fp32.onnx"), SessionConfig())
    assert isinstance(llm, LLMTimedSession) and isinstance(estimator, TimedSession)
    assert not isinstance(campplus, TimedSession)
    llm.run(None, {"past_key": np.zeros((2, 1, 2, 0, 4), np.float32)})
    seconds = clock.take()
    assert seconds["llm_prefill"] > 0 and seconds["llm_decode"] == 0
    llm.run(None, {"past_key": np.zeros((2, 1, 2, 3, 4), np.float32)})
    llm.run(None, {"past_key": np.zeros((2, 1, 2, 4, 4), np.float32)})
    estimator.run(None, {})
    assert counting.created == ["llm", "flow_estimator", "campplus"]
    assert counting.runs == {"llm": 3, "flow_estimator": 1}
    seconds = clock.take()
    assert seconds["llm_decode"] > 0 and seconds["llm_prefill"] == 0 and seconds["flow"] > 0
    assert clock.take()["llm_decode"] == 0  # take() starts again from zero


def test_device_worker_times_the_sessions_of_an_injected_factory(cv2_tiny_bundle):
    from cosyedge.device.bench.worker import TEXTS, DeviceBackend, Settings, run_batch
    counting = CountingFactory()
    backend = DeviceBackend(cv2_tiny_bundle, "fp32", threads=1, create=counting)
    # one session per stage graph, all through the factory; ONE for the LLM; the word-timing pass only once asked
    assert sorted(counting.created) == sorted([*(set(GRAPH_STAGE) - {"llm_align"}), "llm"])
    counting.runs.clear()
    reply = run_batch(backend, [TEXTS[1]], stream=False, settings=Settings(tokens=3, sampling="greedy"))
    assert counting.runs["llm"] >= 3   # the prefill and two decode steps, each timed on its own stage
    assert reply["stage_s"]["llm_prefill"] > 0 and reply["stage_s"]["llm_decode"] > 0
    assert counting.runs["flow_estimator"] >= 1 and counting.runs["hift_decoder"] >= 1
    for graph, stage in GRAPH_STAGE.items():  # every call that reached a session was timed on its stage
        assert (reply["stage_s"][stage] > 0) >= (counting.runs[graph] > 0)
    assert reply["audio_s"] > 0 and reply["decode_steps"] >= 2
    assert reply["stage_s"]["align"] == 0 and "llm_align" not in counting.created
    timed = run_batch(backend, [TEXTS[1]], stream=False, settings=Settings(tokens=3, sampling="greedy", words=True))
    assert "llm_align" in counting.created and timed["stage_s"]["align"] > 0 and timed["audio_s"] == reply["audio_s"]


def test_tables_number_the_runs_and_compare_with_the_reference():
    table = cosyvoice_table(REPORT)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["#", "backend", "precision"] and lines[1].split()[:2] == ["1", "device"]
    stall = lines[0].split().index("stall_p95")
    assert lines[1].split()[stall] == "0.125" and lines[2].split()[stall] == "-"  # streamed, then stream off
    assert "device fp32 / reference RTF, stream on: 0.500" in table
    assert "device int8 / reference RTF, stream off: 0.250" in table
    vits = {"results": {"cosyedge-fp32": {"rtf": 0.1, "sentences": [{"text": "Hello.", "rtf": 0.1}]}}}
    assert engine_table(vits).splitlines()[-1].split() == ["TOTAL", "RTF", "0.1000"]


def test_chart_is_a_real_png(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    from cosyedge.device.bench.chart import write_chart
    path = write_chart(REPORT, tmp_path / "chart.png")
    assert path == tmp_path / "chart.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        image.load()
        width, height = image.size
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert width >= 400 and height >= 200
    assert len(colours) > 10  # bars, text and axes were drawn, not an empty canvas


_NO_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None  # any `import matplotlib...` now fails\n"


def test_without_matplotlib_the_bench_writes_json_and_table_and_names_the_extra(cv2_tiny_bundle, tmp_path):
    out, chart = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["bench", "--bundle", str(cv2_tiny_bundle), "--concurrency", "1", "--stream", "off", "--tokens", "3",
            "--texts", "1", "--threads", "1", "--json", str(out), "--chart", str(chart)]
    code = _NO_MATPLOTLIB + f"from cosyedge.device.cli import main\nsys.exit(main({argv!r}))\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(out.read_text(encoding="utf-8"))["runs"] and "rtf" in result.stdout
    assert not chart.exists()
    hints = [line for line in result.stderr.splitlines() if "pip install cosyedge[chart]" in line]
    assert len(hints) == 1 and "Traceback" not in result.stderr


def test_device_worker_applies_the_preset(cv2_tiny_bundle):
    """The bench's preset reaches the flow: `fast` calls the estimator 3 times per utterance, `official` 10."""
    from cosyedge.device.bench.worker import TEXTS, DeviceBackend, Settings, run_batch
    counting = CountingFactory()
    backend = DeviceBackend(cv2_tiny_bundle, "fp32", threads=1, create=counting)
    calls = {}
    for preset in ("official", "fast"):
        counting.runs.clear()
        run_batch(backend, [TEXTS[1]], stream=False, settings=Settings(tokens=3, sampling="greedy", preset=preset))
        calls[preset] = counting.runs["flow_estimator"]
    assert calls == {"official": 10, "fast": 3}


def test_playback_stall_counts_the_gaps_a_listener_hears_after_the_first_chunk():
    """Playback starts at the first chunk; a chunk plays from its arrival or the previous one's end, whichever is
    later, so a chunk that arrives early adds no gap and a late one adds its lateness."""
    assert playback_stall([], []) == 0.0
    assert playback_stall([2.0], [1.0]) == 0.0                                  # the wait for first audio is not a stall
    assert playback_stall([1.0, 1.5, 4.0], [1.0, 2.0, 1.0]) == 0.0               # each came before the previous ended
    assert playback_stall([1.0, 3.0, 3.5], [1.0, 0.25, 1.0]) == pytest.approx(1.25)  # 1 s, then 0.25 s


def test_multiply_adds_of_products_from_their_shapes():
    from cosyedge.device.bench.ops import node_macs
    assert node_macs("MatMul", [[2, 10, 64], [64, 32]], [[2, 10, 32]]) == 2 * 10 * 32 * 64
    assert node_macs("Conv", [[1, 16, 50], [32, 16, 3], [32]], [[1, 32, 50]]) == 32 * 50 * 16 * 3
    assert node_macs("Conv", [[1, 16, 50], [16, 1, 3]], [[1, 16, 50]]) == 16 * 50 * 3  # depthwise
    assert node_macs("Add", [[4, 4], [4, 4]], [[4, 4]]) == 0


def test_pass_orders_give_every_runner_each_neighbour_alike():
    """A runner is faster right after its own engine (engine.py): over the passes each runner comes after a given
    runner (the pass before's last included) as often as before it, and first as often as last, so no runner is
    favoured by its place. A fixed order fails this."""
    names = ["ours", "ours+words", "other", "peer"]
    sequence = [name for order in pass_orders(names, 8) for name in order]
    follows = Counter(zip(sequence, sequence[1:]))
    for a in names:
        for b in names:
            if a != b:
                assert follows[(a, b)] == follows[(b, a)], (a, b)
    orders = pass_orders(names, 8)
    assert Counter(order[0] for order in orders) == Counter(order[-1] for order in orders)
