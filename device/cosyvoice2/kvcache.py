"""The `llm` graph's calls and its key/value cache, for either cache contract of the graph.

Two contracts (the graph's inputs say which; both take embeddings, return logits [B, V] of each row's last real new
position, and serve prefill and decode with one session):

* stacked (quantize/cosyvoice2/llm_export.py: every fp32 / fp16 / TensorRT graph): `past_key` / `past_value`
  [NL, B, KV, P, D] in, the caches one call longer out (`present_*`). Rows are right-aligned: row r's real
  positions fill the last `lengths[r]` slots, a left-padded prefill makes that layout, every decode step keeps it
  (one slot appended to every row), and the attention mask is derived from the lengths. The caches never
  round-trip through numpy: the `present_*` outputs stay ORT values (on the session's device) bound as the next
  call's inputs.
* shared (quantize/cosyvoice2/llm_shared_kv.py: the cpu targets' LLM graphs): per layer one cache buffer
  [B, KV, C, D] that the graph's GroupQueryAttention writes in place (bound as both `past_*_<i>` and
  `present_*_<i>`), rows left-aligned (row r's positions in slots 0..lengths[r] - 1), a right-padded prefill.
  Nothing is copied per step; the buffers grow by doubling C when a row would pass it (one copy, rarely), and
  are numpy arrays that ORT reads and writes directly.

`LLMCalls` is the one definition of both call kinds for the runtime, the quality gates and `bench-graphs`;
`merge` rebuilds a batch cache when rows join or leave (through host memory, once per change).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import onnxruntime as ort

from cosyedge.device.errors import InputError

_GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")
_GROWTH_SLOTS = 64               # a shared cache is allocated in multiples of this many positions


@dataclass(frozen=True, eq=False)
class StackedCache:
    """[NL, B, KV, P, D] ORT values and each row's count of real positions (right-aligned rows)."""
    key: ort.OrtValue
    value: ort.OrtValue
    lengths: np.ndarray

    @property
    def width(self) -> int:
        return int(self.key.shape()[3])


@dataclass(eq=False)
class SharedCache:
    """[NL, B, KV, C, D] host buffers written in place by the graph (left-aligned rows) and the rows' lengths."""
    key: np.ndarray
    value: np.ndarray
    lengths: np.ndarray
    bound: list[tuple[str, ort.OrtValue]] | None = field(default=None, repr=False)   # per-layer views, made once

    @property
    def capacity(self) -> int:
        return int(self.key.shape[3])


KVCache = StackedCache | SharedCache


def cache_dims(session: ort.InferenceSession) -> tuple[int, int, int]:
    """(NL, KV, D) of the `llm` graph's cache, in either contract."""
    inputs = {i.name: i.shape for i in session.get_inputs()}
    if "past_key" in inputs:
        shape = inputs["past_key"]
        return int(shape[0]), int(shape[2]), int(shape[4])
    layers = sum(name.startswith("past_key_") for name in inputs)
    shape = inputs["past_key_0"]
    return layers, int(shape[1]), int(shape[3])


def prefill_feeds(embeds: np.ndarray, mask: np.ndarray, dims: tuple[int, int, int]) -> dict[str, np.ndarray]:
    """Feeds of the stacked graph's prefill over embeds [B, L, H] with mask [B, L]: empty caches (P = 0) and
    positions cumsum(mask) - 1 clamped at 0 (a left-padded row starts at 0 on its first real position)."""
    layers, heads, dim = dims
    empty = np.zeros((layers, embeds.shape[0], heads, 0, dim), np.float32)
    return {"inputs_embeds": embeds, "past_key": empty, "past_value": empty, "attention_mask": mask,
            "position_ids": np.maximum(mask.cumsum(axis=1) - 1, 0)}


def _slots(need: int) -> int:
    return -(-need // _GROWTH_SLOTS) * _GROWTH_SLOTS


class LLMCalls:
    """Prefill and decode calls of one `llm` session, in the graph's cache contract. `record` (build host: the
    calibration of static int8) receives each call's inputs as numpy arrays."""

    def __init__(self, session: ort.InferenceSession, record: Callable[[dict[str, np.ndarray]], None] | None = None
                 ) -> None:
        self._session = session
        self._record = record
        inputs = {i.name for i in session.get_inputs()}
        self.shared = "seqlens_k" in inputs
        self.dims = cache_dims(session)
        self._device = "cuda" if session.get_providers()[0] in _GPU_PROVIDERS else "cpu"
        meta = session.get_modelmeta().custom_metadata_map
        self._max_positions = int(meta.get("max_positions", 0)) if self.shared else 0
        # decode steps run with options of their own: a session that hands its arena back after a call
        # (sessions.ShrinkingSession) then does so after prefills only, whose activations are the largest the LLM
        # allocates, and steps (small, every few ms) keep the regions they reuse
        self._step_options = ort.RunOptions()

    # ----------------------------------------------------------------------------------------------- calls
    def prefill(self, rows: Sequence[np.ndarray]) -> tuple[np.ndarray, KVCache]:
        """One call over prompts [1, L_r, H] of any lengths: logits [B, V] and the batch cache."""
        lengths = np.array([x.shape[1] for x in rows], np.int64)
        width = int(lengths.max())
        embeds = np.zeros((len(rows), width, rows[0].shape[2]), np.float32)
        if not self.shared:
            for row, x in enumerate(rows):                                  # left padding
                embeds[row, width - x.shape[1]:] = x[0]
            mask = (np.arange(width)[None, :] >= (width - lengths)[:, None]).astype(np.int64)
            logits, key, value = self._stacked(prefill_feeds(embeds, mask, self.dims))
            return logits, StackedCache(key, value, lengths)
        for row, x in enumerate(rows):                                      # right padding
            embeds[row, :x.shape[1]] = x[0]
        self._check_positions(width)
        layers, heads, dim = self.dims
        shape = (layers, len(rows), heads, _slots(width + _GROWTH_SLOTS), dim)
        cache = SharedCache(np.zeros(shape, np.float32), np.zeros(shape, np.float32), lengths)
        positions = np.minimum(np.arange(width)[None, :], (lengths - 1)[:, None])
        logits = self._shared(embeds, positions, lengths, width, lengths - 1, cache, None)
        return logits, cache

    def decode(self, embeds: np.ndarray, cache: KVCache) -> tuple[np.ndarray, KVCache]:
        """One step: embeds [B, 1, H] (row r's next input) at each row's next position; logits [B, V] and the cache
        one position longer (the same buffers in the shared contract)."""
        if isinstance(cache, StackedCache):
            width = cache.width
            mask = (np.arange(width + 1)[None, :] >= (width - cache.lengths)[:, None]).astype(np.int64)
            logits, key, value = self._stacked({"inputs_embeds": embeds, "attention_mask": mask,
                                                "position_ids": cache.lengths[:, None]}, cache.key, cache.value)
            return logits, StackedCache(key, value, cache.lengths + 1)
        total = cache.lengths + 1
        self._check_positions(int(total.max()))
        if int(total.max()) > cache.capacity:
            cache = self._resized(cache, _slots(2 * cache.capacity))
        logits = self._shared(embeds, cache.lengths[:, None], total, int(total.max()), np.zeros(len(total), np.int64),
                              cache, self._step_options)
        cache.lengths = total
        return logits, cache

    def merge(self, parts: Sequence[tuple[KVCache, Sequence[int]]]) -> KVCache:
        """A new batch cache holding the given rows of each part, in order (rows joining and leaving)."""
        lengths = np.concatenate([cache.lengths[list(rows)] for cache, rows in parts])
        width = int(lengths.max())
        layers, heads, dim = self.dims
        if isinstance(parts[0][0], SharedCache):
            shape = (layers, len(lengths), heads, _slots(width + _GROWTH_SLOTS), dim)
            out = SharedCache(np.zeros(shape, np.float32), np.zeros(shape, np.float32), lengths)
            start = 0
            for cache, rows in parts:
                span = int(cache.lengths[list(rows)].max())
                for name in ("key", "value"):
                    getattr(out, name)[:, start:start + len(rows), :, :span] = getattr(cache, name)[:, list(rows), :, :span]
                start += len(rows)
            return out
        merged = []
        for name in ("key", "value"):
            stacked = np.zeros((layers, len(lengths), heads, width, dim), np.float32)
            start = 0
            for cache, rows in parts:
                source = getattr(cache, name).numpy()
                span = int(cache.lengths[list(rows)].max())
                stacked[:, start:start + len(rows), :, width - span:] = source[:, list(rows), :, cache.width - span:]
                start += len(rows)
            merged.append(ort.OrtValue.ortvalue_from_numpy(stacked, self._device, 0))
        return StackedCache(merged[0], merged[1], lengths)

    def row_prefix(self, cache: KVCache, row: int, layers: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of row `row`'s keys and values at its first `positions` positions in the first `layers` layers,
        [layers, 1, KV, positions, D] float32: the word-timing pass's cache over the same prompt."""
        if isinstance(cache, SharedCache):
            span, key, value = slice(0, positions), cache.key, cache.value                      # left-aligned
        else:
            start = cache.width - int(cache.lengths[row])                                        # right-aligned
            span, key, value = slice(start, start + positions), cache.key.numpy(), cache.value.numpy()
        return (np.ascontiguousarray(key[:layers, row:row + 1, :, span], np.float32),
                np.ascontiguousarray(value[:layers, row:row + 1, :, span], np.float32))

    # ------------------------------------------------------------------------------------------- internals
    def _check_positions(self, positions: int) -> None:
        if self._max_positions and positions > self._max_positions:
            raise InputError(f"the speech LM's rotary tables hold {self._max_positions} positions; this segment "
                             f"needs {positions}: split the text into shorter sentences")

    @staticmethod
    def _resized(cache: SharedCache, capacity: int) -> SharedCache:
        layers, rows, heads, old, dim = cache.key.shape
        grown = SharedCache(np.zeros((layers, rows, heads, capacity, dim), np.float32),
                            np.zeros((layers, rows, heads, capacity, dim), np.float32), cache.lengths)
        grown.key[:, :, :, :old] = cache.key
        grown.value[:, :, :, :old] = cache.value
        return grown

    def _stacked(self, feeds: dict[str, np.ndarray], past_key: ort.OrtValue | None = None,
                 past_value: ort.OrtValue | None = None) -> tuple[np.ndarray, ort.OrtValue, ort.OrtValue]:
        binding = self._session.io_binding()
        arrays = {name: np.ascontiguousarray(array) for name, array in feeds.items()}  # alive until the run
        for name, array in arrays.items():
            binding.bind_cpu_input(name, array)
        if past_key is not None:
            binding.bind_ortvalue_input("past_key", past_key)
            binding.bind_ortvalue_input("past_value", past_value)
        binding.bind_output("logits", "cpu")
        binding.bind_output("present_key", self._device)
        binding.bind_output("present_value", self._device)
        if self._record is not None:
            self._record(arrays if past_key is None else arrays | {"past_key": past_key.numpy(),
                                                                    "past_value": past_value.numpy()})
        self._session.run_with_iobinding(binding, None if past_key is None else self._step_options)
        logits, key, value = binding.get_outputs()
        return logits.numpy(), key, value

    def _shared(self, embeds: np.ndarray, positions: np.ndarray, total: np.ndarray, longest: int,
                last: np.ndarray, cache: SharedCache, options: ort.RunOptions | None) -> np.ndarray:
        feeds = {"inputs_embeds": np.ascontiguousarray(embeds, np.float32),
                 "position_ids": np.ascontiguousarray(positions, np.int64),
                 "seqlens_k": (total - 1).astype(np.int32), "total_sequence_length": np.array(longest, np.int32),
                 "last_index": np.ascontiguousarray(last, np.int64)}
        if self._record is not None:
            self._record(dict(feeds))
        binding = self._session.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        binding.bind_output("logits", "cpu")
        if cache.bound is None:
            cache.bound = [(f"{name}_{i}", ort.OrtValue.ortvalue_from_numpy(getattr(cache, name)[i]))
                           for i in range(self.dims[0]) for name in ("key", "value")]
        for name, buffer in cache.bound:
            binding.bind_ortvalue_input(f"past_{name}", buffer)
            binding.bind_ortvalue_output(f"present_{name}", buffer)
        self._session.run_with_iobinding(binding, options)
        return binding.get_outputs()[0].numpy()
