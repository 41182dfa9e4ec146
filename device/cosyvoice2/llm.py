"""CosyVoice2 LLM on ONNX Runtime: lm_input assembly from the bundle's embedding tables and KV-cache decoding.

Graph signature: quantize/cosyvoice2/llm_export.py (and llm_shared_kv.py for the cpu targets' graphs). One `llm`
session serves both call kinds (one copy of the weights): the prefill over the prompts, then one new position per
decode step. The calls and the cache of either graph contract are `kvcache.LLMCalls`: only the logits [B, V] are
copied out for sampling.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import onnxruntime as ort

from cosyedge.device.cosyvoice2.kvcache import KVCache, LLMCalls, cache_dims, prefill_feeds
from cosyedge.device.cosyvoice2.sampling import SamplingConfig, choose_token, without_stops
from cosyedge.device.cosyvoice2.table_rows import TableRows

__all__ = ["DecodeConfig", "KVCache", "SpeechLM", "cache_dims", "prefill_feeds"]


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


class SpeechLM:
    """The `llm` graph (prefill and decode) with the embedding tables the runtime gathers from."""

    def __init__(self, llm: ort.InferenceSession, embed_tokens: Path, speech_embedding: Path, llm_embedding: Path,
                 config: DecodeConfig) -> None:
        self._llm = llm
        self._calls = LLMCalls(llm)
        # rows read on demand (table_rows.py), never held: 544 MB and 23.5 MB at full size
        self._embed_tokens = TableRows(embed_tokens)
        self._speech_embedding = TableRows(speech_embedding)  # shared with the word-timing pass
        self._llm_embedding = np.load(llm_embedding)
        self.config = config

    @property
    def provider(self) -> str:
        return self._llm.get_providers()[0]

    @property
    def speech_embedding(self) -> TableRows:
        """[V, H] speech-token embeddings (the word-timing pass embeds with the same table)."""
        return self._speech_embedding

    @property
    def hidden_size(self) -> int:
        return int(self._llm_embedding.shape[1])

    def lm_input(self, text: Sequence[int], prompt_text: Sequence[int] = (),
                 prompt_speech: Sequence[int] = ()) -> np.ndarray:
        """[1, L, H]: sos, embed(prompt_text ++ text), task_id, speech_embedding(prompt speech tokens)."""
        ids = np.asarray([*prompt_text, *text], dtype=np.int64)
        speech = np.asarray(prompt_speech, dtype=np.int64)
        rows = [self._llm_embedding[0:1], self._embed_tokens.rows(ids).astype(np.float32, copy=False),
                self._llm_embedding[1:2], self._speech_embedding.rows(speech).astype(np.float32, copy=False)]
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

    def prefill(self, lm_inputs: Sequence[np.ndarray]) -> tuple[np.ndarray, KVCache]:
        """One prefill call over prompts [1, L_r, H] of any lengths (padded): logits [B, V] and the cache."""
        return self._calls.prefill(lm_inputs)

    def decode(self, tokens: np.ndarray, cache: KVCache) -> tuple[np.ndarray, KVCache]:
        """One decode step: token r [B] goes to row r at its own next position; logits [B, V] and the longer cache."""
        return self._calls.decode(self._speech_embedding.rows(tokens).astype(np.float32, copy=False)[:, None], cache)

    def row_prefix(self, cache: KVCache, row: int, layers: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
        """Row `row`'s keys and values of its first `positions` positions in the first `layers` layers (copies)."""
        return self._calls.row_prefix(cache, row, layers, positions)

    def merge_caches(self, parts: Sequence[tuple[KVCache, Sequence[int]]]) -> KVCache:
        """A new cache holding the given rows of each part, in order (rows joining and leaving a running batch).
        Copies through host memory once; a running batch pays this only when its rows change."""
        return self._calls.merge(parts)
