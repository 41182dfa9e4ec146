"""CosyVoice2 LLM on ONNX Runtime: lm_input assembly from the bundle's embedding tables and KV-cache decoding.

Graph signatures: quantize/cosyvoice2/llm.py. The KV cache never round-trips through numpy: the prefill's
`present_*` outputs stay ORT values (on the session's device) and are bound as the next step's `past_*` inputs;
only the logits row [1, V] is copied out for sampling. Batch 1, no padding: positions are consecutive.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import onnxruntime as ort

from device.cosyvoice2.sampling import SamplingConfig, choose_token

_GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")


@dataclass(frozen=True)
class DecodeConfig:
    """Speech vocabulary specials and the length rule (`manifest.config`)."""
    eos: int
    stop_ids: frozenset[int]
    min_token_text_ratio: float
    max_token_text_ratio: float
    sampling: SamplingConfig

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "DecodeConfig":
        return cls(eos=int(cfg["eos"]), stop_ids=frozenset(int(i) for i in cfg["stop_ids"]),
                   min_token_text_ratio=float(cfg["min_token_text_ratio"]),
                   max_token_text_ratio=float(cfg["max_token_text_ratio"]),
                   sampling=SamplingConfig.from_config(cfg["sampling"]))

    def min_max_len(self, n_text_tokens: int, pin: int | None = None) -> tuple[int, int]:
        """Official limits, counted over the target text tokens only (prompt text excluded); `pin` fixes both
        (benchmarks: random-weight models never stop sensibly)."""
        if pin is not None:
            return int(pin), int(pin)
        return int(n_text_tokens * self.min_token_text_ratio), int(n_text_tokens * self.max_token_text_ratio)

    def unstoppable(self, logits: np.ndarray) -> np.ndarray:
        """Logits with every stop id at -inf: a pinned length must not end early on a non-eos stop id."""
        logits = np.array(logits, copy=True)
        logits[..., sorted(self.stop_ids)] = -np.inf
        return logits


def _device(session: ort.InferenceSession) -> str:
    return "cuda" if session.get_providers()[0] in _GPU_PROVIDERS else "cpu"


class SpeechLM:
    """The `llm_prefill` / `llm_decode` pair with the embedding tables the runtime gathers from."""

    def __init__(self, prefill: ort.InferenceSession, decode: ort.InferenceSession, embed_tokens: Path,
                 speech_embedding: Path, llm_embedding: Path, config: DecodeConfig) -> None:
        self._prefill = prefill
        self._decode = decode
        self._embed_tokens = np.load(embed_tokens, mmap_mode="r")  # 544 MB at full size: rows read on demand
        self._speech_embedding = np.load(speech_embedding)
        self._llm_embedding = np.load(llm_embedding)
        self.config = config
        self._kv_device = _device(decode)

    @property
    def hidden_size(self) -> int:
        return int(self._llm_embedding.shape[1])

    def lm_input(self, text: Sequence[int], prompt_text: Sequence[int] = (),
                 prompt_speech: Sequence[int] = ()) -> np.ndarray:
        """[1, L, H]: sos, embed(prompt_text ++ text), task_id, speech_embedding(prompt speech tokens)."""
        ids = np.asarray([*prompt_text, *text], dtype=np.int64)
        speech = np.asarray(prompt_speech, dtype=np.int64)
        rows = [self._llm_embedding[0:1], np.asarray(self._embed_tokens[ids], np.float32),
                self._llm_embedding[1:2], self._speech_embedding[speech]]
        return np.concatenate(rows, axis=0)[None].astype(np.float32, copy=False)

    def tokens(self, lm_input: np.ndarray, n_text_tokens: int, greedy: bool,
               rng: np.random.Generator, pin: int | None = None) -> Iterator[int]:
        """Generated speech tokens, each yielded as soon as it is chosen (stop tokens are not yielded);
        `pin` = exactly that many tokens (benchmarks)."""
        cfg = self.config
        min_len, max_len = cfg.min_max_len(n_text_tokens, pin)
        length = lm_input.shape[1]
        logits, key, value = self._run(self._prefill, {"inputs_embeds": lm_input,
                                                       "attention_mask": np.ones((1, length), np.int64)})
        logits = logits[0]
        history: list[int] = []
        for step in range(max_len):
            if pin is not None:
                logits = cfg.unstoppable(logits)
            token = choose_token(logits, step, min_len, cfg.eos, history, greedy, cfg.sampling, rng)
            if token in cfg.stop_ids:
                return
            history.append(token)
            yield token
            if step + 1 == max_len:
                return
            position = length + step
            logits, key, value = self._run(self._decode, {
                "inputs_embeds": self._speech_embedding[token][None, None],
                "attention_mask": np.ones((1, position + 1), np.int64),
                "position_ids": np.array([[position]], np.int64)}, key, value)
            logits = logits[0]

    def batch_tokens(self, lm_inputs: Sequence[np.ndarray], n_text_tokens: Sequence[int], greedy: bool,
                     rng: np.random.Generator, pin: int | None = None) -> list[list[int]]:
        """Speech tokens of several prompts decoded together (left padding); each row keeps its own length
        rule and history and stops on its own; the batch runs until the last row stops. Rows draw from `rng`
        in row order at each step. `pin` = exactly that many tokens per row (benchmarks)."""
        cfg = self.config
        rows = len(lm_inputs)
        limits = [cfg.min_max_len(n, pin) for n in n_text_tokens]
        lengths = np.array([x.shape[1] for x in lm_inputs], np.int64)
        width = int(lengths.max())
        embeds = np.zeros((rows, width, self.hidden_size), np.float32)
        mask = np.zeros((rows, width), np.int64)
        for row, x in enumerate(lm_inputs):
            embeds[row, width - x.shape[1]:] = x[0]
            mask[row, width - x.shape[1]:] = 1
        logits, key, value = self._run(self._prefill, {"inputs_embeds": embeds, "attention_mask": mask})
        histories: list[list[int]] = [[] for _ in range(rows)]
        active = [max_len > 0 for _, max_len in limits]
        step = 0
        while True:
            if pin is not None:
                logits = cfg.unstoppable(logits)
            fed = np.zeros(rows, np.int64)  # finished rows feed token 0; their results are ignored
            for row in range(rows):
                if not active[row]:
                    continue
                min_len, max_len = limits[row]
                token = choose_token(logits[row], step, min_len, cfg.eos, histories[row], greedy, cfg.sampling, rng)
                if token in cfg.stop_ids:
                    active[row] = False
                    continue
                histories[row].append(token)
                fed[row] = token
                active[row] = len(histories[row]) < max_len
            if not any(active):
                return histories
            mask = np.concatenate([mask, np.ones((rows, 1), np.int64)], axis=1)
            logits, key, value = self._run(self._decode, {
                "inputs_embeds": self._speech_embedding[fed][:, None],
                "attention_mask": mask, "position_ids": (lengths + step)[:, None]}, key, value)
            step += 1

    def _run(self, session: ort.InferenceSession, feeds: dict[str, np.ndarray], past_key: ort.OrtValue | None = None,
             past_value: ort.OrtValue | None = None) -> tuple[np.ndarray, ort.OrtValue, ort.OrtValue]:
        """One graph call with IO binding: the cache stays an ORT value on the session's device; logits [B, V]."""
        binding = session.io_binding()
        arrays = {name: np.ascontiguousarray(array) for name, array in feeds.items()}  # alive until the run
        for name, array in arrays.items():
            binding.bind_cpu_input(name, array)
        if past_key is not None:
            binding.bind_ortvalue_input("past_key", past_key)
            binding.bind_ortvalue_input("past_value", past_value)
        binding.bind_output("logits", "cpu")
        binding.bind_output("present_key", self._kv_device)
        binding.bind_output("present_value", self._kv_device)
        session.run_with_iobinding(binding)
        logits, key, value = binding.get_outputs()
        return logits.numpy(), key, value
