"""`cosyedge bench-graphs`: per-graph ONNX Runtime latency of a CosyVoice2 bundle for one utterance.

Synthetic inputs of the real shapes (random weights never stop sensibly, so lengths are pinned): LLM prefill over
`prompt` positions, `tokens` decode steps with a growing cache (the runtime's `LLMCalls`), the flow encoder and `n_timesteps` CFG estimator
calls over 2 * tokens mel frames, and both HiFT graphs. The median of `repeats` rounds (after one warm-up round).

The estimator's arithmetic (multiply-adds per call and per mel frame, counted from the fp32 graph: ops.py) gives its
achieved operations per second at the selected precision, printed beside a plain GEMM micro-benchmark on the same
threads (fp32 and dynamic int8: the practical ceiling of the CPU's kernels), and where the selected estimator's
time goes: kernel milliseconds per op type from an ORT profile of one call (`ms_by_op`).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from cosyedge.device.bench.clocks import peak_rss_mb
from cosyedge.device.bench.ops import gemm_ceiling, profile_call
from cosyedge.device.bundle import Bundle
from cosyedge.device.cosyvoice2.kvcache import LLMCalls
from cosyedge.device.sessions import SessionConfig


def run_graph_bench(bundle_path: Path, precision: str = "fp32", tokens: int = 250, prompt: int = 137,
                    threads: int = 2, repeats: int = 1) -> dict:
    """Milliseconds per graph call, seconds per stage, the graphs-only RTF and the graph sizes."""
    bundle = Bundle.load(bundle_path, precision=precision)
    cfg = bundle.manifest.config
    sessions = SessionConfig(providers=("cpu",), intra_op_threads=threads)
    selected = bundle.selected(precision)  # a precision or a quantize target (cpu, gpu-fp16, trt-int8)
    graph = {name: sessions.create(bundle.path(c.file)) for name, c in selected.items()
             if name not in ("campplus", "speech_tokenizer")}
    llm = LLMCalls(graph["llm"])   # the runtime's calls (either cache contract, IO binding)
    rng = np.random.default_rng(0)
    hidden = np.load(bundle.asset("llm_embedding"), mmap_mode="r").shape[1]
    frames = cfg["token_mel_ratio"] * tokens
    mel_bins = cfg["mel"]["n_mels"]
    timings: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = fn()
        timings.setdefault(name, []).append(time.perf_counter() - start)
        return result

    for round_index in range(repeats + 1):  # round 0 warms every session up and is discarded
        if round_index == 1:
            timings.clear()
        embeds = rng.standard_normal((1, prompt, hidden), dtype=np.float32) * 0.02
        _, cache = timed("llm_prefill", lambda: llm.prefill([embeds]))
        step = rng.standard_normal((1, 1, hidden), dtype=np.float32) * 0.02
        start = time.perf_counter()
        for _ in range(tokens):
            _, cache = llm.decode(step, cache)
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
    arithmetic = profile_call(bundle.path(bundle.component("flow_estimator", "fp32").file), feeds, threads)
    profile = profile_call(bundle.path(selected["flow_estimator"].file), feeds, threads)
    gop = 2 * arithmetic["macs"] / 1e9
    estimator = {"gop_per_call": round(gop, 2), "mac_per_frame": round(arithmetic["macs"] / (2 * frames)),
                 "macs_by_op": arithmetic["macs_by_op"], "ms_by_op": profile["ms_by_op"],
                 "achieved_gops": round(gop / (ms["flow_estimator_call"] / 1000), 1), "gemm_ceiling": gemm_ceiling(threads)}
    return {"bundle": bundle.manifest.name, "precision": {name: c.precision for name, c in selected.items()},
            "selection": precision, "tokens": tokens, "prompt_positions": prompt,
            "threads": threads, "graph_ms": ms, "stage_s": {k: round(v, 3) for k, v in stage_s.items()},
            "audio_s": audio_s, "rtf_graphs_only": round(sum(stage_s.values()) / audio_s, 3), "graph_mb": sizes,
            "estimator": estimator,
            "peak_rss_mb": peak_rss_mb()}
