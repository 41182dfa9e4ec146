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
graph: `Flow`'s `state_dtype`), the hidden states are kept in float16, half that: their rounding (2^-11 of a value)
is far below the int8 step (1/127 of the tensor's largest value) the graph applies to them next. On the full-size
(random-init) `cpu` target the default voice's `official` state is 83 MB instead of 165 MB, the resident set loaded
and warmed 950 MB instead of 1027 MB, and a first chunk's mel moves 0.012 from the float32 state's (which is 0.019
from solving the prompt again; test_cv2_quantized_load.py checks it on a tiny release). float32 graphs keep float32
states (fp32 round-off: test_cv2_prompt_cache.py). The cache keeps entries up to `cap_bytes` in all, least recently
used out first; a voice whose state exceeds the cap keeps fewer whole chunks (`frames_within`), so what a request
gets depends on the cap, never on what else is cached: an evicted state is computed again, the same.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class PromptState:
    """The estimator state after `frames` prompt frames, per Euler step: (hidden [L, rows, frames, D], conv
    [rows, S, 2]) with the step's rows (conditional, then unconditional on a guided step)."""
    frames: int
    steps: tuple[tuple[np.ndarray, np.ndarray], ...]

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
