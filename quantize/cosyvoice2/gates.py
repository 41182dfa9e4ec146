"""Stage-wise quality gates: a quantized stage must reproduce its fp32 original on identical inputs and noise.

Inputs are seeded and synthetic, built from the release itself (real releases carry no test vectors): LLM prompts are
sos ++ random text-token rows ++ task_id, continued by speech tokens sampled from the fp32 graphs (top-k, seeded) and
then teacher-forced through both precisions; the flow runs random speech tokens through the encoder and the 10-step
CFG Euler loop from the bundle's fixed noise; HiFT vocodes the fp32 flow mel with zero source noise. Calibration sets
for static int8 are recorded from the same fp32 runs with other seeds, so a gate never scores on calibration data.

Thresholds (`THRESHOLDS`, per precision where it differs: `PRECISION_THRESHOLDS`) are module constants; the
report of every check lands in `manifest.quality[target][stage]`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import onnxruntime as ort

from cosyedge.device.cosyvoice2.kvcache import LLMCalls
from cosyedge.device.quality import mel_cepstral_distortion, snr_db
from cosyedge.quantize.cosyvoice2.precision_targets import RUNG_PRECISION

# What "still sounds like fp32" means per stage. LLM: mean KL(fp32 || quantized) of the speech-token distribution
# and teacher-forced top-1 agreement on decisive positions (fp32 top-1 margin >= DECISIVE_NATS; near-ties flip under
# any rounding and carry no choice: random-weight models have almost only those); flow: cosine and relative L2 of the
# final mel (same noise); HiFT: waveform SNR and mel-cepstral distortion; e2e: MCD of flow + HiFT from the same
# tokens against the all-fp32 chain.
THRESHOLDS: dict[str, dict[str, float]] = {
    "llm": {"top1_agreement_decisive_min": 0.95, "mean_kl_max": 0.05},
    "flow": {"mel_cosine_min": 0.995, "mel_rel_l2_max": 0.10},
    "hift": {"snr_db_min": 15.0, "mcd_db_max": 1.0},
    "e2e": {"mcd_db_max": 2.0},
}
# Where a precision is held to other limits than THRESHOLDS. 4-bit LLM weights (cpu-int4, optional) round 18x
# coarser than 8-bit blocks (step max|w|/7 vs /127); measured KL(fp32 || int4) is 100-130x the int8 one on random
# weights (tiny preset 0.0054 vs 5.2e-5 nats, full size 0.0018 vs 1.4e-5), so int4 may shift the sampling
# distribution up to 0.10 nats (twice int8's limit), while a decisive fp32 choice must survive as under int8
# (>= 0.95; correct int4 measured 0.957 on the tiny preset and 0.95 at full size). That floor is what rejects broken
# 4-bit graphs: swapped nibbles or scales off by 20 % measured decisive <= 0.77 (tiny preset) and <= 0.45 (full size,
# where the near-flat random distributions keep even their KL at 0.02-0.14). The oversensitive golden tiny LLM (int4
# KL 0.43) falls back to int8.
PRECISION_THRESHOLDS: dict[str, dict[str, dict[str, float]]] = {
    "int4": {"llm": {"top1_agreement_decisive_min": 0.95, "mean_kl_max": 0.10}},
}
DECISIVE_NATS = 0.1
GATE_THREADS = 1                # one thread: reproducible numbers on any build host
LLM_SEQUENCES = ((8, 24), (20, 24))        # (random text tokens, sampled speech steps) per scored sequence
FLOW_TOKENS = 50                 # speech tokens of the scored flow / HiFT / e2e utterance
CALIBRATION = ((40, 0), (60, 1))           # (speech tokens, streaming flag) per calibration utterance
TOP_K = 25
LLM_CALIBRATION_STRIDE = 3       # every 3rd decode step: min/max calibration keeps every intermediate output in memory


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = GATE_THREADS
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@dataclass(frozen=True)
class GateConfig:
    """What the gates need from the release: embedding tables, flow constants, the fixed CFM noise."""
    embed_tokens: np.ndarray          # [text vocab, H]
    speech_embedding: np.ndarray      # [V, H]
    llm_embedding: np.ndarray         # [2, H]
    speech_token_size: int
    token_mel_ratio: int
    pre_lookahead_len: int
    inference_cfg_rate: float
    n_timesteps: int
    noise: np.ndarray                 # [1, M, frames]
    sample_rate: int
    hift_upsample: int
    spk_embed_dim: int = 192

    @classmethod
    def from_bundle(cls, bundle) -> "GateConfig":
        """The same configuration from a written `cosyvoice2` bundle (device.bundle.Bundle), to re-gate its graphs."""
        cfg = bundle.manifest.config
        encoder = bundle.component("flow_encoder", "fp32")
        return cls(embed_tokens=np.load(bundle.asset("embed_tokens"), mmap_mode="r"),
                   speech_embedding=np.load(bundle.asset("speech_embedding")),
                   llm_embedding=np.load(bundle.asset("llm_embedding")),
                   speech_token_size=int(cfg["speech_token_size"]), token_mel_ratio=int(cfg["token_mel_ratio"]),
                   pre_lookahead_len=int(cfg["pre_lookahead_len"]), inference_cfg_rate=float(cfg["inference_cfg_rate"]),
                   n_timesteps=int(cfg["n_timesteps"]), noise=np.load(bundle.asset("cfm_noise")),
                   sample_rate=bundle.manifest.sample_rate, hift_upsample=int(cfg["hift_upsample"]),
                   spk_embed_dim=int(next(t.shape[1] for t in encoder.inputs if t.name == "embedding")))


@dataclass
class StageReport:
    stage: str
    precision: str
    metrics: dict[str, float]
    thresholds: dict[str, float]
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict:
        return {"precision": self.precision, "passed": self.passed, "metrics": self.metrics,
                "thresholds": self.thresholds, "failures": self.failures}


def thresholds(stage: str, precision: str) -> dict[str, float]:
    """The limits `stage` is judged by at `precision` (a stage rung: that of its graphs, `RUNG_PRECISION`):
    PRECISION_THRESHOLDS where it has them, else THRESHOLDS."""
    return PRECISION_THRESHOLDS.get(RUNG_PRECISION.get(precision, precision), {}).get(stage, THRESHOLDS[stage])


def judge(stage: str, precision: str, metrics: dict[str, float]) -> StageReport:
    """Compare metrics with `thresholds(stage, precision)` (`*_min` / `*_max`); NaN always fails."""
    limits = thresholds(stage, precision)
    failures = []
    for key, limit in limits.items():
        name, bound = key.rsplit("_", 1)
        value = metrics[name]
        ok = (value >= limit) if bound == "min" else (value <= limit)
        if not ok or math.isnan(value):
            failures.append(f"{name} {value:.4g} {'<' if bound == 'min' else '>'} {limit:g}")
    return StageReport(stage, precision, {k: round(float(v), 6) for k, v in metrics.items()}, dict(limits), failures)


class Gates:
    """Reference runs of the fp32 graphs (cached) and the stage checks against candidate graphs."""

    def __init__(self, config: GateConfig, fp32: dict[str, Path]) -> None:
        self.config = config
        self._sessions: dict[Path, ort.InferenceSession] = {}
        self.fp32 = fp32
        self._reference: dict[str, object] = {}

    def run(self, path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self._session(path).run(None, feeds)

    def _session(self, path: Path) -> ort.InferenceSession:
        if path not in self._sessions:
            self._sessions[path] = session(path)
        return self._sessions[path]

    def forget(self, paths: Iterable[Path]) -> None:
        """Close the sessions of graphs that will not be scored again."""
        for path in paths:
            self._sessions.pop(path, None)

    # ------------------------------------------------------------------------------------------------- LLM
    def _lm_input(self, rng: np.random.Generator, n_text: int) -> np.ndarray:
        c = self.config
        text = c.embed_tokens[rng.integers(0, c.embed_tokens.shape[0], n_text)]
        rows = np.concatenate([c.llm_embedding[:1], text, c.llm_embedding[1:2]])
        return rows[None].astype(np.float32)

    def _llm_sequence(self, seed: int, n_text: int, steps: int) -> tuple[np.ndarray, list[int], np.ndarray]:
        """fp32 sampled continuation (top-k, seeded): the teacher sequence for both precisions, and its logits."""
        rng = np.random.default_rng(seed)
        lm_input = self._lm_input(rng, n_text)
        tokens: list[int] = []
        logits = self.llm_logits(self.fp32, lm_input, tokens, steps, sample=(rng, tokens))
        return lm_input, tokens, logits

    def llm_logits(self, graphs: dict[str, Path], lm_input: np.ndarray, tokens: list[int], steps: int,
                   sample: tuple[np.random.Generator, list[int]] | None = None,
                   record: Callable[[dict[str, np.ndarray]], None] | None = None) -> np.ndarray:
        """Logits [steps + 1, V] of the `llm` graph (either cache contract: kvcache.LLMCalls, as the runtime calls
        it): the prefill on lm_input, then decode steps fed with `tokens` (teacher forcing); with `sample`, the
        tokens are drawn from these logits as they come; `record` receives every call's inputs."""
        c = self.config
        calls = LLMCalls(self._session(graphs["llm"]), record)
        logits, cache = calls.prefill([lm_input])
        out = []
        for i in range(steps + 1):
            out.append(logits)
            if i == steps:
                break
            if sample is not None:
                rng, chosen = sample
                logp = log_softmax(logits[0, :c.speech_token_size])   # stop ids excluded: fixed-length sequences
                top = np.argsort(logp)[-TOP_K:]
                p = np.exp(logp[top] - logp[top].max())
                chosen.append(int(rng.choice(top, p=p / p.sum())))
            logits, cache = calls.decode(c.speech_embedding[tokens[i]][None, None].astype(np.float32), cache)
        return np.concatenate(out)

    def llm(self, graphs: dict[str, Path], precision: str) -> StageReport:
        if "llm" not in self._reference:
            self._reference["llm"] = [self._llm_sequence(seed, n_text, steps)
                                      for seed, (n_text, steps) in enumerate(LLM_SEQUENCES)]
        agree, decisive, kl = [], [], []
        for lm_input, tokens, ref in self._reference["llm"]:
            got = self.llm_logits(graphs, lm_input, tokens, len(tokens))
            a, b = log_softmax(ref), log_softmax(got)
            top2 = np.sort(a, axis=1)[:, -2:]
            agree.append(a.argmax(1) == b.argmax(1))
            decisive.append(top2[:, 1] - top2[:, 0] >= DECISIVE_NATS)
            kl.append((np.exp(a) * (a - b)).sum(1))
        agree_all, decisive_all = np.concatenate(agree), np.concatenate(decisive)
        return judge("llm", precision, {
            "top1_agreement": float(agree_all.mean()),
            "top1_agreement_decisive": float(agree_all[decisive_all].mean()) if decisive_all.any() else 1.0,
            "decisive_positions": float(decisive_all.sum()), "mean_kl": float(np.concatenate(kl).mean())})

    def llm_calibration(self) -> dict[str, list[dict[str, np.ndarray]]]:
        """`llm` inputs recorded from fp32 sampled runs (seeds not used by the gate): every prefill call, every
        LLM_CALIBRATION_STRIDE-th decode call."""
        recorded: list[dict[str, np.ndarray]] = []
        for seed, (n_text, steps) in enumerate(LLM_SEQUENCES, start=100):
            rng = np.random.default_rng(seed)
            tokens: list[int] = []
            calls: list[dict[str, np.ndarray]] = []
            self.llm_logits(self.fp32, self._lm_input(rng, n_text), tokens, steps, sample=(rng, tokens),
                            record=lambda feeds: calls.append(dict(feeds)))
            recorded += calls[:1] + calls[1::LLM_CALIBRATION_STRIDE]
        return {"llm": recorded}

    # ------------------------------------------------------------------------------------------------ flow
    def _utterance(self, seed: int, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        c = self.config
        rng = np.random.default_rng(seed)
        tokens = rng.integers(0, c.speech_token_size, (1, n_tokens + c.pre_lookahead_len), dtype=np.int64)
        tokens[:, -c.pre_lookahead_len:] = 0   # finalize: placeholders
        return tokens, rng.standard_normal((1, c.spk_embed_dim), dtype=np.float32)

    def mel(self, graphs: dict[str, Path], tokens: np.ndarray, embedding: np.ndarray, streaming: int = 0,
            record: list[dict[str, np.ndarray]] | None = None) -> np.ndarray:
        """Encoder + CFG Euler loop over the estimator from the fixed noise -> mel [1, M, T]."""
        c = self.config
        flag = np.array([streaming], np.int64)
        mu, spks = self.run(graphs["flow_encoder"], {"token": tokens, "embedding": embedding,
                                                      "finalize": np.ones(1, np.int64), "streaming": flag})
        frames = mu.shape[2]
        x = c.noise[:, :, :frames].astype(np.float32)
        zeros = np.zeros_like(mu)
        t_span = 1.0 - np.cos(np.linspace(0.0, 1.0, c.n_timesteps + 1, dtype=np.float32) * 0.5 * np.pi)
        t, dt = t_span[0], t_span[1] - t_span[0]
        for step in range(1, len(t_span)):
            feeds = {"x": np.concatenate([x, x]), "mask": np.ones((2, 1, frames), np.float32),
                     "mu": np.concatenate([mu, zeros]), "t": np.full(2, t, np.float32),
                     "spks": np.concatenate([spks, np.zeros_like(spks)]), "cond": np.zeros((2, mu.shape[1], frames),
                                                                                          np.float32),
                     "streaming": flag}
            if record is not None:
                record.append(feeds)
            v = self.run(graphs["flow_estimator"], feeds)[0]
            x = x + dt * ((1.0 + c.inference_cfg_rate) * v[:1] - c.inference_cfg_rate * v[1:])
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
        return x.astype(np.float32)

    def _reference_mel(self) -> np.ndarray:
        if "mel" not in self._reference:
            self._reference["mel"] = self.mel(self.fp32, *self._utterance(0, FLOW_TOKENS))
        return self._reference["mel"]

    def flow(self, graphs: dict[str, Path], precision: str) -> StageReport:
        ref = self._reference_mel()
        got = self.mel(graphs, *self._utterance(0, FLOW_TOKENS))
        a, b = ref.reshape(-1).astype(np.float64), got.reshape(-1).astype(np.float64)
        return judge("flow", precision, {
            "mel_cosine": float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30)),
            "mel_rel_l2": float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))})

    def flow_calibration(self) -> tuple[list[dict[str, np.ndarray]], list[np.ndarray]]:
        """Estimator inputs of every Euler step of fp32 runs (other seeds), and the mels those runs produced."""
        feeds: list[dict[str, np.ndarray]] = []
        mels = [self.mel(self.fp32, *self._utterance(seed, n), streaming=streaming, record=feeds)
                for seed, (n, streaming) in enumerate(CALIBRATION, start=100)]
        return feeds, mels

    # ------------------------------------------------------------------------------------------------ HiFT
    def wave(self, graphs: dict[str, Path], mel: np.ndarray) -> np.ndarray:
        noise = np.zeros((1, mel.shape[2] * self.config.hift_upsample, 9), np.float32)
        source, _ = self.run(graphs["hift_source"], {"mel": mel, "noise": noise})
        return self.run(graphs["hift_decoder"], {"mel": mel, "source": source})[0][0]

    def hift_calibration(self, mels: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
        noise = lambda m: np.zeros((1, m.shape[2] * self.config.hift_upsample, 9), np.float32)  # noqa: E731
        return [{"mel": m, "source": self.run(self.fp32["hift_source"], {"mel": m, "noise": noise(m)})[0]}
                for m in mels]

    def _reference_wave(self) -> np.ndarray:
        if "wave" not in self._reference:
            self._reference["wave"] = self.wave(self.fp32, self._reference_mel())
        return self._reference["wave"]

    def hift(self, graphs: dict[str, Path], precision: str) -> StageReport:
        ref, got = self._reference_wave(), self.wave(graphs, self._reference_mel())
        return judge("hift", precision, {"snr_db": snr_db(ref, got),
                                         "mcd_db": mel_cepstral_distortion(ref, got, self.config.sample_rate)})

    def e2e(self, graphs: dict[str, Path], precision: str) -> StageReport:
        """Flow + HiFT of the target from the same tokens against the all-fp32 chain (the LLM has its own gate)."""
        got = self.wave(graphs, self.mel(graphs, *self._utterance(0, FLOW_TOKENS)))
        return judge("e2e", precision, {"mcd_db": mel_cepstral_distortion(self._reference_wave(), got,
                                                                          self.config.sample_rate)})

    def check(self, stage: str, graphs: dict[str, Path], precision: str) -> StageReport:
        return {"llm": self.llm, "flow": self.flow, "hift": self.hift, "e2e": self.e2e}[stage](graphs, precision)
