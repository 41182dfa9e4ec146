"""CosyVoice2 flow quality presets (device/cosyvoice2/presets.py) on the tiny bundle.

`official` is the default bit for bit, so the golden parity tests (which run the default) hold it to the official
output within their tolerances; each faster preset does less estimator work, counted through a counting session
(calls and rows x frames), not timed; the streaming window keeps a long stream's flow work linear; an unknown preset
is an InputError with its own code (HTTP 400, CLI exit 2); the bundle carries each preset's measured cost and
distance (`manifest.quality["presets"]`).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cosyedge.device.bundle import Bundle
from cosyedge.device.cosyvoice2 import family as cosyvoice2
from cosyedge.device.cosyvoice2.presets import OFFICIAL, Preset
from cosyedge.device.cosyvoice2.streaming import stream_tokens
from cosyedge.device.engine import Engine
from cosyedge.device.errors import BundleError, UnknownPresetError
from cosyedge.device.sessions import SessionConfig, create_session
from presettools import assert_a_failing_preset_is_not_offered

VOICE = "tiny_spk_zh"
TEXT = "今天天气晴朗，适合出门散步。"


class Counter:
    """Estimator calls and rows x frames seen by the counting session factory."""

    def __init__(self) -> None:
        self.calls = 0
        self.row_frames = 0

    def take(self) -> tuple[int, int]:
        out = (self.calls, self.row_frames)
        self.calls = self.row_frames = 0
        return out


class CountingSession:
    def __init__(self, inner: Any, counter: Counter) -> None:
        self.inner, self.counter = inner, counter

    def run(self, names: Any, feeds: dict[str, np.ndarray], *options: Any) -> list[np.ndarray]:
        self.counter.calls += 1
        self.counter.row_frames += int(feeds["x"].shape[0] * feeds["x"].shape[2])
        return self.inner.run(names, feeds, *options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def counter() -> Counter:
    return Counter()


@pytest.fixture(scope="module")
def engine(cv2_tiny_bundle: Path, counter: Counter) -> Engine:
    def factory(path: Path, config: SessionConfig) -> Any:
        session = create_session(path, config)
        return CountingSession(session, counter) if path.name.startswith("flow_estimator") else session

    sessions = SessionConfig(providers=("cpu",), intra_op_threads=1, session_factory=factory)
    return Engine.load(cv2_tiny_bundle, precision="fp32", sessions=sessions, warmup=False)


def _render(engine: Engine, counter: Counter, preset: str | None) -> tuple[np.ndarray, tuple[int, int]]:
    counter.take()
    wave = engine.synthesize_waveform(TEXT, voice=VOICE, deterministic=True, sampling="greedy", preset=preset)
    return wave, counter.take()


def test_bundle_offers_measured_presets(cv2_tiny_bundle: Path, engine: Engine) -> None:
    manifest = Bundle.load(cv2_tiny_bundle).manifest
    offered = manifest.config["presets"]
    assert manifest.config["default_preset"] == OFFICIAL and OFFICIAL in offered
    assert len(offered) >= 2, manifest.quality["presets"]  # at least one faster preset passed its gate on tiny
    report = manifest.quality["presets"]["fp32"]  # an fp32-only bundle: measured on its fp32 graphs
    for name, entry in report.items():
        assert entry["passed"] == (not entry["failures"]) and entry["thresholds"]
        assert (name in offered) == entry["passed"]
        assert set(entry["metrics"]) == {"mel_cosine", "mel_rel_l2", "mcd_db", "stream_mcd_db"}
        assert entry["cost"]["estimator_row_frames"] > 0
    assert report[OFFICIAL]["metrics"]["mel_rel_l2"] == 0 and report[OFFICIAL]["cost"]["relative_row_frames"] == 1
    for name in offered:
        if name != OFFICIAL:  # counted estimator work, streamed and rendered, below official's
            assert report[name]["cost"]["relative_row_frames"] <= 0.5
            assert report[name]["cost"]["stream_relative_row_frames"] < 0.5
    described = engine.describe()
    assert described["presets_measured"] and set(described["presets"]) == set(offered)
    assert engine.pipeline.presets() == list(offered)


def test_a_preset_that_misses_its_gate_is_not_offered(cv2_tiny_bundle: Path) -> None:
    """The gate's failure path (presettools): a crude candidate measured on the tiny graphs fails and is not offered.
    Mutation checked: `judge_preset` returning [] makes this fail."""
    assert_a_failing_preset_is_not_offered(cv2_tiny_bundle, cosyvoice2.vocoder)


def test_official_is_the_default_bit_for_bit(engine: Engine, counter: Counter) -> None:
    default, (calls, row_frames) = _render(engine, counter, None)
    official, cost = _render(engine, counter, OFFICIAL)
    assert np.array_equal(default, official) and cost == (calls, row_frames)
    assert calls == 10  # 10 Euler steps, each one call on the guided pair of rows


@pytest.mark.parametrize("name", ["balanced", "fast", "fastest"])
def test_faster_presets_do_less_estimator_work(engine: Engine, counter: Counter, name: str) -> None:
    official, (_, official_work) = _render(engine, counter, OFFICIAL)
    wave, (calls, work) = _render(engine, counter, name)
    preset = engine.pipeline._presets[name]
    assert calls == preset.steps
    frames = official_work // 20  # official: 10 steps x 2 rows over the same frames
    assert work == preset.estimator_rows() * frames <= official_work // 2
    assert wave.shape == official.shape and not np.array_equal(wave, official)


def test_stream_window_bounds_the_resolve(engine: Engine, counter: Counter) -> None:
    """A 300-token stream: the official path re-solves the whole history for every chunk, the windowed one the
    prompt and at most window + hop + look-ahead tokens; chunk sizes are the same."""
    pipeline = engine.pipeline
    prompt = pipeline._mode_inputs(engine.options(voice=VOICE, deterministic=True)).flow
    tokens = np.random.default_rng(0).integers(0, 6561, 300).tolist()
    # both runs start after the same prompt state (same steps), built here, not counted
    kept = pipeline._flow.prompt_state(prompt, pipeline._flow.official).frames
    runs = {}
    for preset in (pipeline._flow.official, Preset("window", 10, 10, 50)):
        counter.take()
        chunks = list(stream_tokens(iter(tokens), prompt, pipeline._flow, pipeline._vocoder.stream(None),
                                    pipeline._schedule, preset=preset))
        runs[preset.name] = (chunks, counter.take())
    (official, (calls, work)), (windowed, (wcalls, wwork)) = runs["official"], runs["window"]
    assert [c.shape for c in official] == [c.shape for c in windowed] and calls == wcalls
    ratio = pipeline._flow.config.token_mel_ratio
    widest = 2 * (ratio * (len(prompt.tokens) + 50 + 25 + 100 + pipeline._schedule.lookahead) - kept)
    assert wwork <= calls * widest < work
    assert np.array_equal(official[0], windowed[0]) and np.array_equal(official[1], windowed[1])  # no window yet


def test_an_unpadded_first_hop_gives_first_audio_after_the_first_hop_alone(engine: Engine) -> None:
    """`first_hop_pad` off (the built-in `fastest`): the first chunk leaves after hops[0] + look-ahead tokens, not
    after the pad that brings prompt + first hop to a chunk boundary; later chunks keep the hops, and the utterance
    is voiced whole. The voice's pad is not 0, so the padded schedule waits longer. Mutation checked: ChunkSchedule
    ignoring `pad_first` fails here."""
    pipeline = engine.pipeline
    prompt = pipeline._mode_inputs(engine.options(voice=VOICE, deterministic=True)).flow
    hops, lookahead = pipeline._schedule.hops, pipeline._schedule.lookahead
    pad = -len(prompt.tokens) % hops[0]
    assert pad > 0, len(prompt.tokens)
    tokens = np.random.default_rng(1).integers(0, 6561, 160).tolist()
    per_token = pipeline._flow.config.token_mel_ratio * pipeline._vocoder.samples_per_frame
    consumed = {}
    for preset in (Preset("padded", 2, 1, 50), Preset("unpadded", 2, 1, 50, first_hop_pad=False)):
        seen: list[int] = []
        firsts, total = [], 0
        taken = (seen.append(t) or t for t in tokens)
        for chunk in stream_tokens(taken, prompt, pipeline._flow, pipeline._vocoder.stream(None), pipeline._schedule,
                                   preset=preset):
            firsts.append(len(seen))  # tokens taken when the chunk left
            total += chunk.size
        consumed[preset.name] = firsts
        assert total == len(tokens) * per_token, (preset, total)  # all voiced
    assert consumed["padded"][:2] == [hops[0] + pad + lookahead, hops[0] + pad + hops[1] + lookahead]
    assert consumed["unpadded"][:2] == [hops[0] + lookahead, hops[0] + hops[1] + lookahead]
    assert engine.pipeline._presets["fastest"].first_hop_pad is False  # the built bundle offers it so
    assert Preset.from_config("x", Preset("x", 2, 1, 50, False).to_config()) == Preset("x", 2, 1, 50, False)
    assert Preset.from_config("x", {"steps": 2, "cfg_steps": 1}).first_hop_pad  # bundles written before it
    with pytest.raises(BundleError):
        Preset.from_config("x", {"steps": 2, "cfg_steps": 1, "first_hop_pad": "no"})


def test_unknown_preset_is_an_input_error_with_a_code(engine: Engine) -> None:
    with pytest.raises(UnknownPresetError) as caught:
        engine.options(voice=VOICE, preset="turbo")
    assert caught.value.code == "unknown_preset" and "official" in str(caught.value)
    assert engine.options(voice=VOICE, preset="fast").preset == "fast"


def test_default_voice_has_no_presets(default_engine: Engine) -> None:
    with pytest.raises(UnknownPresetError):
        default_engine.options(preset=OFFICIAL)


def test_cli_preset(cv2_tiny_bundle: Path, tmp_path: Path) -> None:
    base = [sys.executable, "-m", "cosyedge.device.cli", "synth", TEXT, "--bundle", str(cv2_tiny_bundle),
            "--precision", "fp32", "--voice", VOICE, "--deterministic", "--sampling", "greedy"]
    bad = subprocess.run([*base, "-o", str(tmp_path / "bad.wav"), "--preset", "turbo"], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "turbo" in bad.stderr
    ok = subprocess.run([*base, "-o", str(tmp_path / "fast.wav"), "--preset", "fast"], capture_output=True, text=True,
                        timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (tmp_path / "fast.wav").stat().st_size > 1000
