"""CosyVoice2 flow on ONNX Runtime: speech tokens -> mel with the numpy Euler loop around the estimator graph.

Graph signatures and the exact Euler recipe: quantize/cosyvoice2/flow_export.py. The CFM noise is the bundle's fixed
tensor (the official seed-0 draw) sliced to the frame count, which is what makes streaming chunks reproduce the
mel of earlier chunks. Speed changes are a linear time interpolation of the final mel (torch `interpolate`
semantics, align_corners=False), as the official non-streaming path does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, TypeVar

import numpy as np
import onnx
import onnxruntime as ort

from cosyedge.device.cosyvoice2.presets import OFFICIAL, Preset
from cosyedge.device.cosyvoice2.prompt_cache import Int8Hidden, PromptCache, PromptState, frames_within, prompt_key
from cosyedge.device.errors import InputError

T = TypeVar("T")


class StepRunner(Protocol):
    """Runs one graph call of a stream's later chunk, given as a function of the run options to use (the flow's
    encoder call and estimator steps, the vocoder's decoder calls): `streaming.ChunkGate.later_step`."""

    def __call__(self, call: Callable[[ort.RunOptions | None], T]) -> T: ...


def run_graph(session: Any, outputs: list[str] | None, feeds: dict[str, np.ndarray],
              run_step: StepRunner | None = None) -> list[np.ndarray]:
    """`session.run(outputs, feeds)`, through `run_step` where one is given (with the run options it hands over)."""
    if run_step is None:
        return session.run(outputs, feeds)
    return run_step(lambda options: session.run(outputs, feeds, options))


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


def _state_layout(estimator: Any) -> tuple[int, int, int, int]:
    """(chunk, blocks, hidden values per block and frame-row, conv values per row) of the estimator's prompt state;
    chunk 0: it keeps none (a graph without the state inputs, or one whose attention sees only some chunks back)."""
    shapes = {i.name: i.shape for i in estimator.get_overridable_initializers()}
    meta = estimator.get_modelmeta().custom_metadata_map
    try:
        layers, _, _, width = shapes["past_hidden"]
        channels = shapes["past_conv"][1]
        if int(meta["estimator_left_chunks"]) >= 0:
            return 0, 0, 0, 0
        chunk = math.lcm(int(meta["estimator_chunk"]), int(meta["encoder_chunk"]) * int(meta["token_mel_ratio"]))
        return chunk, int(layers), int(width), 2 * int(channels)
    except (KeyError, ValueError, TypeError):
        return 0, 0, 0, 0


class Flow:
    """`flow_encoder` + `flow_estimator` and the fixed CFM noise; with a `prompt_cache`, streaming calls start
    after the voice's prompt state (prompt_cache.py), its hidden states kept in int8 where `quantized_state` (an
    estimator that quantizes its activations at run time: prompt_cache.py), else in float32."""

    def __init__(self, encoder: ort.InferenceSession, estimator: ort.InferenceSession, noise: np.ndarray,
                 config: FlowConfig, prompt_cache: PromptCache | None = None, quantized_state: bool = False) -> None:
        self._encoder = encoder
        self._estimator = estimator
        self._noise = noise
        self.config = config
        self._cache = prompt_cache
        self._quantized_state = quantized_state
        chunk, blocks, width, conv = _state_layout(estimator) if prompt_cache is not None else (0, 0, 0, 0)
        self._state_chunk = chunk
        self._state_frame_bytes = blocks * (width + 4) if quantized_state else blocks * width * 4  # int8: + scales
        self._state_conv_bytes = conv * np.dtype(np.float32).itemsize
        # an estimator that reads an int8 past (flow_export.py `past_hidden_q`) is fed the cached int8 state as it
        # is: a quarter of the float feed (full size, official stream on: 5 MB, not 20 MB); older bundles: float
        self._int8_feed = quantized_state and "past_hidden_q" in {
            i.name for i in estimator.get_overridable_initializers()}

    @property
    def official(self) -> Preset:
        """The release's recipe: `n_timesteps` steps, all guided, whole history."""
        return Preset(OFFICIAL, self.config.n_timesteps, self.config.n_timesteps)

    def mel(self, prompt: FlowPrompt, tokens: np.ndarray, finalize: bool, streaming: bool,
            preset: Preset | None = None, start: int = 0, run_step: StepRunner | None = None) -> np.ndarray:
        """[1, M, ratio * (n - start)] mel of the generated tokens from `start` on (prompt frames removed).

        finalize=False: the last `pre_lookahead_len` tokens are look-ahead context only and produce no mel.
        start > 0 (a preset's bounded streaming re-solve): tokens[:start] are left out of the flow's context; the
        noise of every frame is still the one at its position in the whole utterance. `run_step` (a stream's later
        chunk: `ChunkGate.later_step`) runs the encoder call and each estimator step; it may wait, and stop a call
        and run it again.
        """
        mu, spks, cond = self._condition(prompt, tokens[start:], finalize, streaming, run_step)
        skip = self.config.token_mel_ratio * start
        past = self.prompt_state(prompt, preset) if streaming and not finalize else None
        done = past.frames if past else 0
        return self.solve(mu, spks, cond, streaming, preset=preset, skip=(prompt.mel.shape[0], skip),
                          past=[past] if past else (), run_step=run_step)[:, :, prompt.mel.shape[0] - done:]

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
        states = [self.prompt_state(prompt, preset) for prompt in prompts] if streaming else []
        past = states if states and all(states) and len({s.frames for s in states}) == 1 else []  # type: ignore[union-attr]
        done = past[0].frames if past else 0
        x = self.solve(stack(0), np.concatenate([c[1] for c in conditions]), stack(2), streaming, mask, preset,
                       past=past)  # type: ignore[arg-type]
        return [x[row:row + 1, :, prompt.mel.shape[0] - done:size - done]
                for row, (prompt, size) in enumerate(zip(prompts, frames))]

    def prompt_state(self, prompt: FlowPrompt, preset: Preset | None, build: bool = True) -> PromptState | None:
        """The estimator state of this voice's prompt prefix under `preset` (prompt_cache.py), from the cache or
        (`build`) computed now; None where the graph keeps no state or the prompt has no whole chunk to keep."""
        if not self._state_chunk or self._cache is None:
            return None
        c, preset = self.config, preset or self.official
        rows = preset.estimator_rows()
        frames = frames_within(min(prompt.mel.shape[0], c.token_mel_ratio * (prompt.tokens.size - c.pre_lookahead_len)),
                               self._state_chunk, rows * self._state_frame_bytes,
                               self._cache.cap_bytes - rows * self._state_conv_bytes)
        if frames <= 0:
            return None
        key = prompt_key(prompt.tokens, prompt.mel, prompt.embedding, (preset.steps, preset.cfg_steps, frames))
        state = self._cache.get(key)
        if state is None and build:
            tokens = np.asarray(prompt.tokens, np.int64).reshape(1, -1)
            mu, spks = self._encoder.run(None, {"token": tokens, "embedding": prompt.embedding.reshape(1, -1),
                                                "finalize": _flag(False), "streaming": _flag(True)})
            kept: list[tuple[np.ndarray, np.ndarray]] = []
            self.solve(mu[:, :, :frames], spks, prompt.mel[None, :frames].transpose(0, 2, 1).copy(), True,
                       preset=preset, keep=(frames, kept))
            state = PromptState(frames, tuple(kept))
            self._cache.put(key, state)
        return state

    def _condition(self, prompt: FlowPrompt, tokens: np.ndarray, finalize: bool, streaming: bool,
                   run_step: StepRunner | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Encoder outputs (mu [1, M, T], spks [1, M]) and the prompt-mel condition cond [1, M, T]; `run_step` as
        in `mel` (a later chunk's encoder call re-reads its whole history: 0.1-0.6 s at full size on 2 cores)."""
        c = self.config
        parts = [prompt.tokens.reshape(-1), np.asarray(tokens, np.int64).reshape(-1)]
        if finalize:
            parts.append(np.zeros(c.pre_lookahead_len, np.int64))  # placeholders: the graph zero-pads
        token = np.concatenate(parts).astype(np.int64)[None]
        feeds = {"token": token, "embedding": prompt.embedding.reshape(1, -1), "finalize": _flag(finalize),
                 "streaming": _flag(streaming)}
        mu, spks = run_graph(self._encoder, None, feeds, run_step)
        frames = mu.shape[2]
        if frames > self._noise.shape[2]:
            raise InputError(f"the utterance needs {frames} mel frames; the flow supports at most "
                             f"{self._noise.shape[2]}: use a shorter text or prompt")
        cond = np.zeros_like(mu)
        cond[0, :, :prompt.mel.shape[0]] = prompt.mel.T
        return mu, spks, cond

    def solve(self, mu: np.ndarray, spks: np.ndarray, cond: np.ndarray, streaming: bool,
              mask: np.ndarray | None = None, preset: Preset | None = None,
              skip: tuple[int, int] = (0, 0), past: Sequence[PromptState] = (),
              keep: tuple[int, list[tuple[np.ndarray, np.ndarray]]] | None = None,
              run_step: StepRunner | None = None) -> np.ndarray:
        """The official Euler solver with classifier-free guidance, float32 (t accumulated as the official loop).

        Rows [B, M, T] may be right-padded (mask [B, 1, T] zero there); every row starts from the same fixed
        noise, as each would alone. A guided step runs the estimator on 2B rows (B conditional, then B
        unconditional); the preset's steps after `cfg_steps` run the B conditional rows alone. `skip` (at, n):
        frames from `at` on take the noise n frames further on (a bounded re-solve left n frames out there).
        `past` (a prompt state per row, all of F frames): the first F frames are the states', not solved again, and
        the result starts at frame F. `keep` (n, list): each step's state after the first n frames is appended.
        `run_step`, if given, runs each estimator call with run options of its own (the caller's turn may wait
        there, or stop a call midway and run it again: the same inputs, the same result).
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
        done = past[0].frames if past else 0
        noise, mu, cond, mask = (a[:, :, done:] for a in (noise, mu, cond, mask))
        outputs = ["velocity", "present_hidden", "present_conv"] if keep else ["velocity"]
        extra = {"keep": np.array([keep[0]], np.int64)} if keep else {}
        x = np.repeat(noise.astype(np.float32), rows, axis=0)
        zeros = np.zeros_like(mu)
        guided = {"mask": np.concatenate([mask, mask]), "mu": np.concatenate([mu, zeros]),
                  "spks": np.concatenate([spks, np.zeros_like(spks)]), "cond": np.concatenate([cond, zeros]),
                  "streaming": _flag(streaming)}
        plain = {"mask": mask, "mu": mu, "spks": spks, "cond": cond, "streaming": guided["streaming"]}

        t, dt = t_span[0], t_span[1] - t_span[0]
        for step in range(1, preset.steps + 1):
            state = _past_feeds(past, step - 1, step <= preset.cfg_steps, self._int8_feed) | extra
            if step <= preset.cfg_steps:
                v, *kept = run_graph(self._estimator, outputs, guided | state | {
                    "x": np.concatenate([x, x]), "t": np.full(2 * rows, t, np.float32)}, run_step)
                x = x + dt * ((1 + rate) * v[:rows] - rate * v[rows:])
            else:
                v, *kept = run_graph(self._estimator, outputs, plain | state | {
                    "x": x, "t": np.full(rows, t, np.float32)}, run_step)
                x = x + dt * v
            if keep:
                keep[1].append((Int8Hidden.of(kept[0]) if self._quantized_state else kept[0].copy(), kept[1].copy()))
            t = t + dt
            if step < preset.steps:
                dt = t_span[step + 1] - t
        return x.astype(np.float32, copy=False)


def _past_feeds(past: Sequence[PromptState], step: int, guided: bool, int8: bool = False) -> dict[str, np.ndarray]:
    """The estimator's prompt-state inputs of one Euler step for rows with states `past` (none: no inputs). A guided
    call's rows are every row's conditional one, then every unconditional one, as each state holds them. `int8`:
    int8 states go in as `past_hidden_q` / `past_hidden_scale` (the graph dequantizes them block by block)."""
    if not past:
        return {}
    halves = (slice(0, 1), slice(1, 2)) if guided else (slice(0, 1),)
    parts = [s.steps[step][0] for s in past] if len(past) == 1 else \
        [s.steps[step][0][:, half] for half in halves for s in past]
    conv = past[0].steps[step][1] if len(past) == 1 else \
        np.concatenate([s.steps[step][1][half] for half in halves for s in past], axis=0)

    def rows(arrays: list[np.ndarray]) -> np.ndarray:
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=1)

    if int8 and all(isinstance(part, Int8Hidden) for part in parts):
        return {"past_hidden_q": rows([p.values for p in parts]),
                "past_hidden_scale": rows([p.scales for p in parts]), "past_conv": conv}
    return {"past_hidden": rows([p.astype(np.float32, copy=False) for p in parts]), "past_conv": conv}


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
