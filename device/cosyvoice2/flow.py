"""CosyVoice2 flow on ONNX Runtime: speech tokens -> mel with the numpy Euler loop around the estimator graph.

Graph signatures and the exact Euler recipe: quantize/cosyvoice2/flow_export.py. The CFM noise is the bundle's fixed
tensor (the official seed-0 draw) sliced to the frame count, which is what makes streaming chunks reproduce the
mel of earlier chunks. Speed changes are a linear time interpolation of the final mel (torch `interpolate`
semantics, align_corners=False), as the official non-streaming path does.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx
import onnxruntime as ort

from cosyedge.device.cosyvoice2.presets import OFFICIAL, Preset
from cosyedge.device.errors import InputError


@dataclass(frozen=True)
class FlowConfig:
    """Flow constants from `manifest.config`."""
    token_mel_ratio: int
    pre_lookahead_len: int
    n_timesteps: int
    inference_cfg_rate: float

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "FlowConfig":
        return cls(token_mel_ratio=int(cfg["token_mel_ratio"]), pre_lookahead_len=int(cfg["pre_lookahead_len"]),
                   n_timesteps=int(cfg["n_timesteps"]), inference_cfg_rate=float(cfg["inference_cfg_rate"]))


@dataclass(frozen=True, eq=False)
class FlowPrompt:
    """What a voice gives the flow: prompt tokens [P], prompt mel [ratio*P, M] and the speaker embedding [E]."""
    tokens: np.ndarray
    mel: np.ndarray
    embedding: np.ndarray


def cosine_t_span(n_timesteps: int) -> np.ndarray:
    """t_k = 1 - cos(pi/2 * k/n), k = 0..n, in float32 like the official schedule."""
    return 1 - np.cos(np.linspace(0, 1, n_timesteps + 1, dtype=np.float32) * 0.5 * np.pi)


def _flag(value: bool) -> np.ndarray:
    return np.array([int(value)], dtype=np.int64)


def rows_independent(path: Path) -> bool:
    """Whether a flow graph computes each batch row as it would alone: not where activations are quantized at run
    time per tensor (`DynamicQuantizeLinear`, the cpu targets' int8 estimator: one scale for the whole call, so
    another row's values change this row's rounding: measured up to 0.025 in the mel of a full-size bundle). Static
    QDQ (TensorRT int8), fp16 and fp32 graphs keep rows apart. Reads the graph's nodes, not its external weights."""
    model = onnx.load(str(path), load_external_data=False)
    return not any(node.op_type == "DynamicQuantizeLinear" for node in model.graph.node)


class Flow:
    """`flow_encoder` + `flow_estimator` and the fixed CFM noise."""

    def __init__(self, encoder: ort.InferenceSession, estimator: ort.InferenceSession, noise: np.ndarray,
                 config: FlowConfig) -> None:
        self._encoder = encoder
        self._estimator = estimator
        self._noise = noise
        self.config = config

    @property
    def official(self) -> Preset:
        """The release's recipe: `n_timesteps` steps, all guided, whole history."""
        return Preset(OFFICIAL, self.config.n_timesteps, self.config.n_timesteps)

    def mel(self, prompt: FlowPrompt, tokens: np.ndarray, finalize: bool, streaming: bool,
            preset: Preset | None = None, start: int = 0) -> np.ndarray:
        """[1, M, ratio * (n - start)] mel of the generated tokens from `start` on (prompt frames removed).

        finalize=False: the last `pre_lookahead_len` tokens are look-ahead context only and produce no mel.
        start > 0 (a preset's bounded streaming re-solve): tokens[:start] are left out of the flow's context; the
        noise of every frame is still the one at its position in the whole utterance.
        """
        mu, spks, cond = self._condition(prompt, tokens[start:], finalize, streaming)
        skip = self.config.token_mel_ratio * start
        return self.solve(mu, spks, cond, streaming, preset=preset, skip=(prompt.mel.shape[0], skip)
                          )[:, :, prompt.mel.shape[0]:]

    def mels(self, prompts: Sequence[FlowPrompt], token_rows: Sequence[np.ndarray],
             preset: Preset | None = None, streaming: bool = False) -> list[np.ndarray]:
        """Mels of several token sequences, each with its own prompt (voice): one encoder call each, one padded
        Euler batch. streaming=False: whole utterances (finalize on); True: first chunks of streams, each as
        `mel(prompt, tokens, False, True, preset)` gives it (finalize off, streaming attention, whole history)."""
        conditions = [self._condition(prompt, tokens, finalize=not streaming, streaming=streaming)
                      for prompt, tokens in zip(prompts, token_rows)]
        frames = [mu.shape[2] for mu, _, _ in conditions]
        width = max(frames)

        def stack(index: int) -> np.ndarray:
            return np.concatenate([np.pad(c[index], [(0, 0), (0, 0), (0, width - c[index].shape[2])])
                                   for c in conditions])

        mask = (np.arange(width)[None, None, :] < np.array(frames)[:, None, None]).astype(np.float32)
        x = self.solve(stack(0), np.concatenate([c[1] for c in conditions]), stack(2), streaming, mask, preset)
        return [x[row:row + 1, :, prompt.mel.shape[0]:size] for row, (prompt, size) in enumerate(zip(prompts, frames))]

    def _condition(self, prompt: FlowPrompt, tokens: np.ndarray, finalize: bool, streaming: bool
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Encoder outputs (mu [1, M, T], spks [1, M]) and the prompt-mel condition cond [1, M, T]."""
        c = self.config
        parts = [prompt.tokens.reshape(-1), np.asarray(tokens, np.int64).reshape(-1)]
        if finalize:
            parts.append(np.zeros(c.pre_lookahead_len, np.int64))  # placeholders: the graph zero-pads
        token = np.concatenate(parts).astype(np.int64)[None]
        mu, spks = self._encoder.run(None, {"token": token, "embedding": prompt.embedding.reshape(1, -1),
                                            "finalize": _flag(finalize), "streaming": _flag(streaming)})
        frames = mu.shape[2]
        if frames > self._noise.shape[2]:
            raise InputError(f"the utterance needs {frames} mel frames; the flow supports at most "
                             f"{self._noise.shape[2]}: use a shorter text or prompt")
        cond = np.zeros_like(mu)
        cond[0, :, :prompt.mel.shape[0]] = prompt.mel.T
        return mu, spks, cond

    def solve(self, mu: np.ndarray, spks: np.ndarray, cond: np.ndarray, streaming: bool,
              mask: np.ndarray | None = None, preset: Preset | None = None,
              skip: tuple[int, int] = (0, 0)) -> np.ndarray:
        """The official Euler solver with classifier-free guidance, float32 (t accumulated as the official loop).

        Rows [B, M, T] may be right-padded (mask [B, 1, T] zero there); every row starts from the same fixed
        noise, as each would alone. A guided step runs the estimator on 2B rows (B conditional, then B
        unconditional); the preset's steps after `cfg_steps` run the B conditional rows alone. `skip` (at, n):
        frames from `at` on take the noise n frames further on (a bounded re-solve left n frames out there).
        """
        c = self.config
        preset = preset or self.official
        t_span = cosine_t_span(preset.steps)
        rate = np.float32(c.inference_cfg_rate)
        rows, _, frames = mu.shape
        if mask is None:
            mask = np.ones((rows, 1, frames), np.float32)
        at, gap = skip
        noise = self._noise[:, :, :frames] if not gap else \
            np.concatenate([self._noise[:, :, :at], self._noise[:, :, at + gap:frames + gap]], axis=2)
        if noise.shape[2] < frames:
            raise InputError(f"the utterance needs {frames + gap} mel frames; the flow supports at most "
                             f"{self._noise.shape[2]}: use a shorter text or prompt")
        x = np.repeat(noise.astype(np.float32), rows, axis=0)
        zeros = np.zeros_like(mu)
        guided = {"mask": np.concatenate([mask, mask]), "mu": np.concatenate([mu, zeros]),
                  "spks": np.concatenate([spks, np.zeros_like(spks)]), "cond": np.concatenate([cond, zeros]),
                  "streaming": _flag(streaming)}
        plain = {"mask": mask, "mu": mu, "spks": spks, "cond": cond, "streaming": guided["streaming"]}
        t, dt = t_span[0], t_span[1] - t_span[0]
        for step in range(1, preset.steps + 1):
            if step <= preset.cfg_steps:
                (v,) = self._estimator.run(None, guided | {"x": np.concatenate([x, x]),
                                                           "t": np.full(2 * rows, t, np.float32)})
                x = x + dt * ((1 + rate) * v[:rows] - rate * v[rows:])
            else:
                (v,) = self._estimator.run(None, plain | {"x": x, "t": np.full(rows, t, np.float32)})
                x = x + dt * v
            t = t + dt
            if step < preset.steps:
                dt = t_span[step + 1] - t
        return x.astype(np.float32, copy=False)


def stretch_mel(mel: np.ndarray, speed: float) -> np.ndarray:
    """Linear time interpolation to int(frames / speed) frames (torch linear, align_corners=False)."""
    frames = mel.shape[-1]
    out = max(int(frames / speed), 1)
    if out == frames or frames == 0:
        return mel
    scale = np.float32(frames / out)
    source = np.maximum((np.arange(out, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5), 0)
    left = np.minimum(source.astype(np.int64), frames - 1)
    right = np.minimum(left + 1, frames - 1)
    weight = np.clip(source - left.astype(np.float32), 0, 1)
    return (mel[..., left] * (1 - weight) + mel[..., right] * weight).astype(np.float32)
