"""Fun-CosyVoice3 flow quality presets, as for CosyVoice2 (tests/device/test_cv2_presets.py): measured and gated when
the bundle is built (cost and distance from `official` in the manifest, only passing presets offered) and honoured
per request in whole and streamed synthesis, where a preset's bounded re-solve makes each chunk's flow work
bounded. Work is counted through a counting estimator session (rows x frames), never timed."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cosyedge.device.bundle import Bundle
from cosyedge.device.cosyvoice2.pipeline import pinned
from cosyedge.device.cosyvoice2.presets import OFFICIAL, Preset, builtin_presets
from cosyedge.device.cosyvoice2.streaming import stream_tokens
from cosyedge.device.cosyvoice3 import family as cosyvoice3
from cosyedge.device.engine import Engine
from cosyedge.device.sessions import SessionConfig, create_session
from cosyedge.quantize.cosyvoice2 import preset_report
from presettools import assert_a_failing_preset_is_not_offered

VOICE = "zs_full"
TEXT = "收到好友从远方寄来的生日礼物。"
STREAM_TOKENS = 200   # past the first hops and the 50-token window of the streaming presets


class CountingSession:
    """The estimator's calls and rows x frames, counted (the preset report's own counter reads the same feeds)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.row_frames = inner, 0

    def run(self, names: Any, feeds: dict[str, np.ndarray], *options: Any) -> list[np.ndarray]:
        self.row_frames += int(feeds["x"].shape[0] * feeds["x"].shape[2])
        return self.inner.run(names, feeds, *options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def counted(cv3_tiny_bundle: Path) -> tuple[Engine, list[CountingSession]]:
    estimators: list[CountingSession] = []

    def factory(path: Path, config: SessionConfig) -> Any:
        inner = create_session(path, config)
        if path.name.startswith("flow_estimator"):
            estimators.append(CountingSession(inner))
            return estimators[-1]
        return inner

    sessions = SessionConfig(providers=("cpu",), intra_op_threads=1, session_factory=factory)
    return Engine.load(cv3_tiny_bundle, precision="fp32", sessions=sessions, warmup=False), estimators


def test_presets_are_measured_into_the_manifest_with_their_gate_reports(cv3_tiny_bundle: Path, counted) -> None:
    manifest = Bundle.load(cv3_tiny_bundle).manifest
    offered, report = manifest.config["presets"], manifest.quality["presets"]["fp32"]
    assert manifest.config["default_preset"] == OFFICIAL and set(report) == set(builtin_presets(10))
    for name, entry in report.items():
        assert entry["passed"] == (name in offered) and entry["thresholds"] == preset_report.PRESET_THRESHOLDS
        assert set(entry["metrics"]) == {"mel_cosine", "mel_rel_l2", "mcd_db", "stream_mcd_db"}
        assert entry["cost"]["estimator_row_frames"] > 0 and entry["cost"]["stream_estimator_row_frames"] > 0
    assert report["fastest"]["cost"]["relative_row_frames"] < 0.2 and "fastest" in offered, report["fastest"]
    engine, _ = counted
    described = engine.describe()
    assert described["presets_measured"] and engine.pipeline.presets() == list(offered)


def test_a_preset_that_misses_its_gate_is_not_offered(cv3_tiny_bundle: Path) -> None:
    """A one-step, unguided, zero-window candidate is far from `official`: measured, reported failed, not offered."""
    assert_a_failing_preset_is_not_offered(cv3_tiny_bundle, cosyvoice3.vocoder)


def _stream(engine: Engine, preset: str) -> list[np.ndarray]:
    options = pinned(engine.options(voice=VOICE, sampling="greedy", deterministic=True, preset=preset), STREAM_TOKENS)
    return list(engine.stream_segments(engine.segments(TEXT), options))


def test_streamed_fastest_differs_from_official_and_costs_fewer_row_frames(counted) -> None:
    engine, estimators = counted
    runs = {}
    for preset in (OFFICIAL, "fastest"):
        before = sum(e.row_frames for e in estimators)
        chunks = _stream(engine, preset)
        runs[preset] = (chunks, sum(e.row_frames for e in estimators) - before)
    (official, official_work), (fastest, fastest_work) = runs[OFFICIAL], runs["fastest"]
    assert len(official) >= 4 and sum(c.size for c in official) == sum(c.size for c in fastest)
    assert fastest[0].size < official[0].size  # its first chunk is unpadded (first_hop_pad false): fewer tokens
    assert not np.array_equal(np.concatenate(official), np.concatenate(fastest))
    assert 0 < fastest_work < official_work * 0.25   # 3 of 20 rows per step and the bounded re-solve


def test_the_bounded_resolve_keeps_a_long_streams_chunks_bounded(counted) -> None:
    """Windowed (official steps, 50-token window) against the whole-history re-solve of `official`: the same chunk
    sizes, and every chunk's estimator frames at most prompt + window + hop + look-ahead tokens' worth."""
    engine, estimators = counted
    pipeline = engine.pipeline
    prompt = pipeline._mode_inputs(engine.options(voice=VOICE, deterministic=True)).flow
    tokens = np.random.default_rng(0).integers(0, 6561, 300).tolist()
    runs = {}
    for preset in (pipeline._flow.official, Preset("window", 10, 10, 50)):
        before = sum(e.row_frames for e in estimators)
        chunks = list(stream_tokens(iter(tokens), prompt, pipeline._flow, pipeline._vocoder.stream(None),
                                    pipeline._schedule, pipeline._parts.token_filter(), preset=preset))
        runs[preset.name] = (chunks, sum(e.row_frames for e in estimators) - before)
    (official, work), (bounded, bounded_work) = runs[OFFICIAL], runs["window"]
    assert [c.shape for c in official] == [c.shape for c in bounded]
    ratio = pipeline._flow.config.token_mel_ratio
    widest = 2 * ratio * (len(prompt.tokens) + 50 + 25 + 100 + pipeline._schedule.lookahead)
    calls = 10 * len(official)
    assert bounded_work <= calls * widest < work
