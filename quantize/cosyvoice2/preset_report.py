"""Cost and distance of every flow quality preset from `official`, measured at bundle build time.

Each preset runs the device runtime's own flow, stream loop and the family's vocoder part (device/cosyvoice2/ and
the family's `vocoder` builder: the code that will serve it, CosyVoice2 or Fun-CosyVoice3) on one graph set (fp32, or a target's graphs) against `official` on the same graphs, the same tokens, the
same prompt and the same fixed noise, rendered whole and streamed:

- distance: mel cosine and relative L2 of the rendered mel, end-to-end MCD of the rendered and of the streamed
  waveform (HiFT with zero source noise);
- cost: estimator calls and estimator row-frames (rows x mel frames, counted through the session, not timed) for
  the rendered and the streamed utterance, and their ratio to `official`; seconds are recorded for information.

A preset passes when every distance is inside `PRESET_THRESHOLDS`; only passing presets are offered by the bundle.
With random weights these numbers bound how far a preset moves the numbers, not how it sounds: re-measure on the
real release (`cosyedge quantize --model-dir <release> ...`; the report lands in `manifest.quality["presets"]`).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from cosyedge.device.cosyvoice2 import family as cosyvoice2
from cosyedge.device.cosyvoice2.flow import Flow, FlowConfig, FlowPrompt
from cosyedge.device.cosyvoice2.parts import Vocoder
from cosyedge.device.cosyvoice2.presets import OFFICIAL, Preset
from cosyedge.device.cosyvoice2.streaming import ScheduleConfig, stream_tokens
from cosyedge.device.quality import mel_cepstral_distortion

VocoderBuilder = Callable[[dict[str, Any], tuple[Any, Any], int], Vocoder]  # a family's `vocoder` function

# How far from `official` a faster preset may move the output (same tokens, noise and graphs).
PRESET_THRESHOLDS: dict[str, float] = {"mel_cosine_min": 0.97, "mel_rel_l2_max": 0.25, "mcd_db_max": 4.0,
                                       "stream_mcd_db_max": 4.0}
PRESET_TOKENS = 200            # speech tokens of the measured utterance (past the windows of the streaming presets)
PROMPT_TOKENS = 30             # synthetic prompt when the release has no zero-shot voice
SEED = 7


class CountingSession:
    """An ORT session wrapper that counts calls and rows x frames of its `x` input (the estimator's work)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0
        self.row_frames = 0

    def run(self, names: Any, feeds: dict[str, np.ndarray], *options: Any) -> list[np.ndarray]:
        self.calls += 1
        self.row_frames += int(feeds["x"].shape[0] * feeds["x"].shape[2])
        return self.inner.run(names, feeds, *options)

    def take(self) -> tuple[int, int]:
        counts = (self.calls, self.row_frames)
        self.calls = self.row_frames = 0
        return counts


def _distance(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    a, b = ref.reshape(-1).astype(np.float64), got.reshape(-1).astype(np.float64)
    cosine = float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))
    return cosine, float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))


def judge_preset(metrics: dict[str, float]) -> list[str]:
    """Failures of a preset's metrics against PRESET_THRESHOLDS (NaN always fails)."""
    failures = []
    for key, limit in PRESET_THRESHOLDS.items():
        name, bound = key.rsplit("_", 1)
        value = metrics[name]
        if np.isnan(value) or (value < limit if bound == "min" else value > limit):
            failures.append(f"{name} {value:.4g} {'<' if bound == 'min' else '>'} {limit:g}")
    return failures


def measure_presets(presets: dict[str, Preset], graphs: dict[str, Path], noise: np.ndarray, config: dict[str, Any],
                    prompt: FlowPrompt | None, open_session: Callable[[Path], Any],
                    vocoder_part: VocoderBuilder = cosyvoice2.vocoder) -> dict[str, dict]:
    """Report per preset name (see the module docstring); `official` is the reference and always passes."""
    flow_config = FlowConfig.from_config(config)
    estimator = CountingSession(open_session(graphs["flow_estimator"]))
    flow = Flow(open_session(graphs["flow_encoder"]), estimator, noise, flow_config)
    rate = int(config["mel"]["sample_rate"])
    vocoder = vocoder_part(config, (open_session(graphs["hift_source"]), open_session(graphs["hift_decoder"])), rate)
    stream = ScheduleConfig.from_config(config["stream"])
    rng = np.random.default_rng(SEED)
    tokens = rng.integers(0, int(config["speech_token_size"]), PRESET_TOKENS, dtype=np.int64)
    if prompt is None:
        prompt = FlowPrompt(np.zeros(0, np.int64), np.zeros((0, noise.shape[1]), np.float32),
                            rng.standard_normal(192, dtype=np.float32))

    def run(preset: Preset) -> dict[str, Any]:
        estimator.take()
        start = time.perf_counter()
        mel = flow.mel(prompt, tokens, True, False, preset)
        seconds = time.perf_counter() - start
        calls, row_frames = estimator.take()
        start = time.perf_counter()
        chunks = list(stream_tokens(iter(tokens.tolist()), prompt, flow, vocoder.stream(None), stream, preset=preset))
        stream_seconds = time.perf_counter() - start
        stream_calls, stream_row_frames = estimator.take()
        return {"mel": mel, "wave": vocoder.render(mel, None), "stream_wave": np.concatenate(chunks),
                "cost": {"estimator_calls": calls, "estimator_row_frames": row_frames, "seconds": round(seconds, 3),
                         "stream_estimator_calls": stream_calls, "stream_estimator_row_frames": stream_row_frames,
                         "stream_seconds": round(stream_seconds, 3)}}

    reference = run(presets[OFFICIAL])
    base = reference["cost"]
    report = {}
    for name, preset in presets.items():
        got = reference if name == OFFICIAL else run(preset)
        cosine, rel_l2 = _distance(reference["mel"], got["mel"])
        metrics = {"mel_cosine": round(cosine, 6), "mel_rel_l2": round(rel_l2, 6),
                   "mcd_db": round(mel_cepstral_distortion(reference["wave"], got["wave"], rate), 4),
                   "stream_mcd_db": round(mel_cepstral_distortion(reference["stream_wave"], got["stream_wave"],
                                                                  rate), 4)}
        cost = dict(got["cost"])
        cost["relative_row_frames"] = round(cost["estimator_row_frames"] / base["estimator_row_frames"], 4)
        cost["stream_relative_row_frames"] = round(cost["stream_estimator_row_frames"]
                                                   / base["stream_estimator_row_frames"], 4)
        failures = [] if name == OFFICIAL else judge_preset(metrics)
        report[name] = {"preset": preset.to_config(), "passed": not failures, "metrics": metrics,
                        "thresholds": dict(PRESET_THRESHOLDS), "failures": failures, "cost": cost,
                        "tokens": PRESET_TOKENS, "prompt_tokens": int(len(prompt.tokens))}
    return report


def zero_shot_prompt(voice_files: list[Path]) -> FlowPrompt | None:
    """The flow prompt of the release's first zero-shot voice (the bench's case), or None."""
    from cosyedge.device.cosyvoice2.voices import Voice
    for path in voice_files:
        voice = Voice.load(path.stem, path)
        if voice.kind == "zero_shot":
            return FlowPrompt(voice.flow_prompt_speech, voice.prompt_mel, voice.flow_embedding)
    return None


def bundle_presets(graph_sets: dict[str, dict[str, Path]], noise: np.ndarray, config: dict[str, Any],
                   prompt: FlowPrompt | None, open_session: Callable[[Path], Any],
                   log: Callable[[str], None] = lambda _: None, vocoder_part: VocoderBuilder = cosyvoice2.vocoder,
                   candidates: dict[str, Preset] | None = None) -> tuple[dict[str, dict], dict[str, dict]]:
    """(manifest.config["presets"], manifest.quality["presets"]): every candidate (default: the built-in presets)
    measured on every graph set (fp32 and each target) with the family's vocoder part; a preset is offered only if
    it passed on all of them."""
    from cosyedge.device.cosyvoice2.presets import builtin_presets
    presets = candidates or builtin_presets(int(config["n_timesteps"]))
    quality = {}
    for name, graphs in graph_sets.items():
        quality[name] = measure_presets(presets, graphs, noise, config, prompt, open_session, vocoder_part)
        for preset, entry in quality[name].items():
            log(f"preset {preset} on {name}: {entry['metrics']} row-frames x{entry['cost']['relative_row_frames']} "
                f"(stream x{entry['cost']['stream_relative_row_frames']}) "
                f"{'pass' if entry['passed'] else entry['failures']}")
    offered = {name: preset.to_config() for name, preset in presets.items()
               if all(quality[graphs][name]["passed"] for graphs in quality)}
    return offered, quality


def graph_sets(work: Path, targets: dict[str, dict] | None, fp32: dict[str, Path]) -> dict[str, dict[str, Path]]:
    """The graph files of every built target (`manifest.config["targets"]`), or the fp32 set when none was built:
    the sets the presets are measured on."""
    if not targets:
        return {"fp32": fp32}
    return {target: {g: work / f"{ref['component']}.{ref['precision']}.onnx" for g, ref in entry["graphs"].items()}
            for target, entry in targets.items()}
