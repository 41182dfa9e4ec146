"""The flow's prompt work done once per voice and preset (CosyVoice2 streaming chunks).

Every streaming chunk of a request solves the flow over the voice's prompt frames again before the frames it needs,
and the first chunk is mostly prompt (a 3.5 s prompt is 174 of a first chunk's 250 frames). In a streaming call
the estimator's attention is chunk-causal and its convolutions causal, so its first whole chunks never see later
frames; the encoder's output there is fixed by the prompt's tokens once they reach `pre_lookahead_len` tokens past
those frames. For such a prefix of `frames` prompt frames (whole `estimator_chunk`s, at most token_mel_ratio x
(prompt tokens - look-ahead)) each Euler step's estimator state (quantize/cosyvoice2/flow_export.py: each
transformer block's normalised hidden states and each causal convolution's last input frames) is the same in every
streaming call of that voice and preset. `Flow` computes it once from the prompt alone (`Flow.prompt_state`) and
each later streaming call starts after it: the same arithmetic as solving those frames again (fp32 round-off;
tests/device/test_cv2_prompt_cache.py), on a dynamic-int8 estimator the rounding of fewer frames per call.

Memory: per kept frame, the estimator rows of the preset's solve (2 per guided step, 1 per other) x blocks x
channels x 4 bytes; CosyVoice2-0.5B: 57 KB per frame-row, a 3.5 s prompt 26 MB for `fastest` (3 rows) and 172 MB for
`official` (20 rows). Where the estimator quantizes its activations at run time (the cpu targets' dynamic int8
graph: `Flow`'s `quantized_state`), the hidden states are kept in int8 with one float32 scale per block, row and
frame (`Int8Hidden`), a little over a quarter of that: the graph quantizes these values to int8 itself next, with
one scale per call (its largest value / 127), never finer than a frame's own. On the full-size (random-init) `cpu`
target the default voice's `official` state is 43 MB (float32: 165 MB; float16, kept before: 83 MB), the engine
loaded and warmed 856 MB (float16: 897 MB), and streaming chunks' mel is as near solving the prompt again as with
float16 states (`official` first / later chunk 0.019 / 0.025, float16 0.019 / 0.022; `fastest` 0.023 / 0.023,
float16 0.025 / 0.024; mel range -4.2 to 4.3) at the same first-chunk time; test_cv2_quantized_load.py checks it on
a tiny release. An estimator with the `past_hidden_q` input (bundles built since it) is fed the int8 state as it
is, not its float32 values: the call's past input is a quarter of the size (full size, `official` stream on: the
estimator call's peak 13 MB lower). float32 graphs keep float32 states (fp32 round-off: test_cv2_prompt_cache.py).
The cache keeps entries up to `cap_bytes` in all, least recently used out first; a voice whose state exceeds the
cap keeps fewer whole chunks (`frames_within`), so what a request gets depends on the cap, never on what else is
cached: an evicted state is computed again, the same.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class Int8Hidden:
    """Hidden states [L, rows, frames, D] as int8 values and one float32 scale per block, row and frame (the frame's
    largest magnitude / 127). Read like the float array it replaces: `state[:, rows]` and `astype`."""
    values: np.ndarray
    scales: np.ndarray

    @classmethod
    def of(cls, hidden: np.ndarray) -> Int8Hidden:
        scales = (np.abs(hidden).max(axis=-1, keepdims=True) / 127).astype(np.float32)
        scales[scales == 0] = 1  # an all-zero frame: any scale gives zeros
        return cls(np.rint(hidden / scales).astype(np.int8), scales)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    def __getitem__(self, key: tuple[slice, ...]) -> Int8Hidden:
        return Int8Hidden(self.values[key], self.scales[key])

    def astype(self, dtype: type[np.floating], copy: bool = True) -> np.ndarray:
        return (self.values.astype(np.float32) * self.scales).astype(dtype, copy=False)


@dataclass(frozen=True, eq=False)
class PromptState:
    """The estimator state after `frames` prompt frames, per Euler step: (hidden [L, rows, frames, D], float32 or
    `Int8Hidden`; conv [rows, S, 2]) with the step's rows (conditional, then unconditional on a guided step)."""
    frames: int
    steps: tuple[tuple[np.ndarray | Int8Hidden, np.ndarray], ...]

    @property
    def nbytes(self) -> int:
        return sum(hidden.nbytes + conv.nbytes for hidden, conv in self.steps)


def prompt_key(tokens: np.ndarray, mel: np.ndarray, embedding: np.ndarray, preset: object) -> str:
    """What a state depends on: the voice's flow prompt (by content: requests build their prompt objects afresh)
    and the preset (steps and guidance)."""
    digest = hashlib.blake2b(digest_size=16)
    for part in (tokens, mel, embedding):
        array = np.ascontiguousarray(part)
        digest.update(str(array.dtype).encode() + str(array.shape).encode() + array.tobytes())
    digest.update(repr(preset).encode())
    return digest.hexdigest()


def frames_within(frames: int, chunk: int, bytes_per_frame: int, cap_bytes: int) -> int:
    """The most whole chunks of `frames` whose state fits `cap_bytes`."""
    fitting = cap_bytes // bytes_per_frame if bytes_per_frame else frames
    return min(frames, fitting) // chunk * chunk


class PromptCache:
    """Prompt states by key, least recently used out first past `cap_bytes` (thread-safe; a state is immutable)."""

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self._states: OrderedDict[str, PromptState] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> PromptState | None:
        with self._lock:
            state = self._states.get(key)
            if state is not None:
                self._states.move_to_end(key)
            return state

    def put(self, key: str, state: PromptState) -> None:
        """Keep `state` (never over the cap: older states leave first; one larger than the cap is not kept)."""
        if state.nbytes > self.cap_bytes:
            return
        with self._lock:
            self._states[key] = state
            self._states.move_to_end(key)
            while self.nbytes > self.cap_bytes:
                self._states.popitem(last=False)

    @property
    def nbytes(self) -> int:
        return sum(state.nbytes for state in self._states.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._states)
