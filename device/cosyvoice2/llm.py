"""CosyVoice2 LLM on ONNX Runtime: lm_input assembly from the bundle's embedding tables and KV-cache decoding.

Graph signature: quantize/cosyvoice2/llm_export.py. One `llm` session serves both call kinds (one copy of the
weights): the prefill feeds empty caches (P = 0), each decode step one new position. The KV cache never
round-trips through numpy: the `present_*` outputs stay ORT values (on the session's device) and are bound as the
next call's `past_*` inputs; only the logits [B, V] are copied out for sampling.

Batched cache layout (`KVCache`): rows are right-aligned, so row r's real positions fill the last `lengths[r]`
slots of the P slots and the attention mask is derived from the lengths. A left-padded prefill produces that
layout and every decode step keeps it (one slot appended to every row); `merge_caches` rebuilds it when rows
join or leave a running batch. A single unpadded row is the plain batch-1 cache (mask all ones).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import onnxruntime as ort

from cosyedge.device.cosyvoice2.sampling import SamplingConfig, choose_token, without_stops

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
        return without_stops(logits, self.stop_ids)


@dataclass(frozen=True, eq=False)
class KVCache:
    """The LLM cache of a batch [NL, B, KV, P, D] (ORT values on the session's device) and each row's count of
    real positions; rows are right-aligned (see the module docstring)."""
    key: ort.OrtValue
    value: ort.OrtValue
    lengths: np.ndarray

    @property
    def width(self) -> int:
        return int(self.key.shape()[3])


def _device(session: ort.InferenceSession) -> str:
    return "cuda" if session.get_providers()[0] in _GPU_PROVIDERS else "cpu"


def cache_dims(session: ort.InferenceSession) -> tuple[int, int, int]:
    """(NL, KV, D): the static dimensions of the `llm` graph's `past_key` input [NL, B, KV, P, D]."""
    shape = next(i.shape for i in session.get_inputs() if i.name == "past_key")
    return int(shape[0]), int(shape[2]), int(shape[4])


def prefill_feeds(embeds: np.ndarray, mask: np.ndarray, dims: tuple[int, int, int]) -> dict[str, np.ndarray]:
    """Feeds of the `llm` graph's prefill call over embeds [B, L, H] with mask [B, L]: empty caches (P = 0) and
    positions cumsum(mask) - 1 clamped at 0 (a left-padded row starts at 0 on its first real position)."""
    layers, heads, dim = dims
    empty = np.zeros((layers, embeds.shape[0], heads, 0, dim), np.float32)
    return {"inputs_embeds": embeds, "past_key": empty, "past_value": empty, "attention_mask": mask,
            "position_ids": np.maximum(mask.cumsum(axis=1) - 1, 0)}


class SpeechLM:
    """The `llm` graph (prefill and decode) with the embedding tables the runtime gathers from."""

    def __init__(self, llm: ort.InferenceSession, embed_tokens: Path, speech_embedding: Path, llm_embedding: Path,
                 config: DecodeConfig) -> None:
        self._llm = llm
        self._cache_dims = cache_dims(llm)
        self._embed_tokens = np.load(embed_tokens, mmap_mode="r")  # 544 MB at full size: rows read on demand
        self._speech_embedding = np.load(speech_embedding)
        self._llm_embedding = np.load(llm_embedding)
        self.config = config
        self._kv_device = _device(llm)

    @property
    def provider(self) -> str:
        return self._llm.get_providers()[0]

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
        """Generated speech tokens of one prompt decoded alone, each yielded as soon as it is chosen (stop tokens
        are not yielded). The runtime decodes through `DecodeScheduler`; this is its single-row reference.
        `pin` = exactly that many tokens (benchmarks)."""
        cfg = self.config
        min_len, max_len = cfg.min_max_len(n_text_tokens, pin)
        logits, cache = self.prefill([lm_input])
        history: list[int] = []
        for step in range(max_len):
            if pin is not None:
                logits = cfg.unstoppable(logits)
            token = choose_token(logits[0], step, min_len, cfg.eos, history, greedy, cfg.sampling, rng)
            if token in cfg.stop_ids:
                return
            history.append(token)
            yield token
            if step + 1 == max_len:
                return
            logits, cache = self.decode(np.array([token], np.int64), cache)

    def batch_tokens(self, lm_inputs: Sequence[np.ndarray], n_text_tokens: Sequence[int], greedy: bool,
                     rng: np.random.Generator, pin: int | None = None) -> list[list[int]]:
        """Speech tokens of several prompts decoded together (left padding); each row keeps its own length
        rule and history and stops on its own; the batch runs until the last row stops. Rows draw from `rng`
        in row order at each step. `pin` = exactly that many tokens per row (benchmarks)."""
        cfg = self.config
        rows = len(lm_inputs)
        limits = [cfg.min_max_len(n, pin) for n in n_text_tokens]
        logits, cache = self.prefill(lm_inputs)
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
            logits, cache = self.decode(fed, cache)
            step += 1

    def prefill(self, lm_inputs: Sequence[np.ndarray]) -> tuple[np.ndarray, "KVCache"]:
        """One prefill call over prompts [1, L_r, H] of any lengths (left padding): logits [B, V] and the cache."""
        lengths = np.array([x.shape[1] for x in lm_inputs], np.int64)
        width = int(lengths.max())
        embeds = np.zeros((len(lm_inputs), width, self.hidden_size), np.float32)
        for row, x in enumerate(lm_inputs):
            embeds[row, width - x.shape[1]:] = x[0]
        mask = (np.arange(width)[None, :] >= (width - lengths)[:, None]).astype(np.int64)
        logits, key, value = self._run(prefill_feeds(embeds, mask, self._cache_dims))
        return logits, KVCache(key, value, lengths)

    def decode(self, tokens: np.ndarray, cache: "KVCache") -> tuple[np.ndarray, "KVCache"]:
        """One decode step: token r [B] goes to row r at its own next position; logits [B, V] and the longer cache."""
        width = cache.width
        mask = (np.arange(width + 1)[None, :] >= (width - cache.lengths)[:, None]).astype(np.int64)
        logits, key, value = self._run({
            "inputs_embeds": self._speech_embedding[np.asarray(tokens, np.int64)][:, None],
            "attention_mask": mask, "position_ids": cache.lengths[:, None]}, cache.key, cache.value)
        return logits, KVCache(key, value, cache.lengths + 1)

    def merge_caches(self, parts: Sequence[tuple["KVCache", Sequence[int]]]) -> "KVCache":
        """A new right-aligned cache holding the given rows of each part, in order (rows joining and leaving a
        running batch). Copies through host memory once; a running batch pays this only when its rows change."""
        lengths = np.concatenate([cache.lengths[list(rows)] for cache, rows in parts])
        width = int(lengths.max())
        merged = []
        for name in ("key", "value"):
            out = None
            start = 0
            for cache, rows in parts:
                source = getattr(cache, name).numpy()
                if out is None:
                    layers, _, heads, _, dim = source.shape
                    out = np.zeros((layers, len(lengths), heads, width, dim), source.dtype)
                span = int(cache.lengths[list(rows)].max())
                out[:, start:start + len(rows), :, width - span:] = source[:, list(rows), :, cache.width - span:]
                start += len(rows)
            merged.append(ort.OrtValue.ortvalue_from_numpy(out, self._kv_device, 0))
        return KVCache(merged[0], merged[1], lengths)

    def _run(self, feeds: dict[str, np.ndarray], past_key: ort.OrtValue | None = None,
             past_value: ort.OrtValue | None = None) -> tuple[np.ndarray, ort.OrtValue, ort.OrtValue]:
        """One graph call with IO binding: the cache stays an ORT value on the session's device (the prefill's
        empty caches come in `feeds`); logits [B, V]."""
        session = self._llm
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
