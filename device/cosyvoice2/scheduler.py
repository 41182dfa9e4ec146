"""Cross-request batched LLM decoding: one worker thread runs a decode step for every active row at once.

Why: a decode step is bound by reading the LLM weights (CPU) or by kernel launches (GPU), not by the number
of rows, so N requests decoding together cost little more than one. Requests join and leave between steps.

A request thread submits a *group* (the segments of one render call, or the one segment of a stream sentence) with
its own length rules, greedy flag and `numpy.random.Generator`, then reads each row's tokens from that row's
queue as they are chosen. The worker loop:

  1. take the groups waiting (whole groups only, up to `max_rows` rows in the batch, or the group's own smaller
     bound - the engine's `batch_max`; a larger group is taken alone) and drop rows whose consumer went away or
     whose `stop` event is set (a client that disconnected: its row leaves before the next step);
  2. prefill the new groups in one left-padded call and choose their first tokens;
  3. when rows joined or left, rebuild the batch cache once (`SpeechLM.merge_caches`);
  4. one decode step for all rows, then each row chooses its next token with its own sampler state.
While some row is *urgent* (a stream's row before the tokens of its first chunk: the group's `urgent_tokens`), the
step runs the urgent rows alone and the others wait, their cache set aside whole (no copy); they rejoin, one merge,
when no row is urgent. Why: a newcomer's first audio waits for those tokens, and a step's cost grows with its rows
and their histories (full-size CosyVoice2 cpu-int4, 2 threads: one 60-position row 8-9 ms a step; beside three rows
of 400-800 positions 20-22 ms), while the other streams' listeners already have audio.
Before a step the loop waits while chunk work it yields to is in the flow or HiFT (`before_step`, the pipeline's
`ChunkGate.before_decode_step`: a first chunk's, and on a CPU any chunk's), which then has the cores to itself.

Independence from the batch: a group's rows always start together and draw from the group's Generator in row
order at each step, exactly as `SpeechLM.batch_tokens` does for that group alone; other groups never touch it.
Only float rounding of the batched graphs differs (padding, batch size), which leaves the argmax and the RAS
draws unchanged (the tests check tokens and audio against solo runs). A lone single-row group runs exactly the
calls of `SpeechLM.tokens`.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from cosyedge.device.cosyvoice2.llm import KVCache, SpeechLM
from cosyedge.device.cosyvoice2.sampling import choose_token
from cosyedge.device.errors import Cancelled

log = logging.getLogger(__name__)

_END = object()  # queue marker: the row stopped


@dataclass(eq=False)
class Prefix:
    """Where the worker leaves a row's prefill keys and values (its first `layers` layers, every prompt position but
    the last) before the row's first token: the word-timing pass starts from them instead of recomputing the
    prompt (device/cosyvoice2/attention.py)."""
    layers: int
    key: np.ndarray | None = None
    value: np.ndarray | None = None


@dataclass(eq=False)
class _Row:
    """One prompt being decoded: its length rule, generated tokens and the queue its consumer reads."""
    group: "DecodeGroup"
    lm_input: np.ndarray
    min_len: int
    max_len: int
    history: list[int] = field(default_factory=list)
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    done: bool = False
    prefix: Prefix | None = None

    @property
    def urgent(self) -> bool:
        """Until it has its group's `urgent_tokens` (the module docstring)."""
        return not self.done and len(self.history) < self.group.urgent_tokens

    def finish(self, error: BaseException | None = None) -> None:
        if not self.done:
            self.done = True
            self.out.put(_END if error is None else error)


class DecodeGroup:
    """The rows of one submission; `rows[i].tokens()` / `results()` are read by the submitting thread."""

    def __init__(self, lm_inputs: Sequence[np.ndarray], limits: Sequence[tuple[int, int]], greedy: bool,
                 rng: np.random.Generator, pinned: bool, max_rows: int | None = None,
                 stop: threading.Event | None = None, prefixes: Sequence[Prefix | None] | None = None,
                 urgent_tokens: int = 0) -> None:
        self.greedy = greedy
        self.rng = rng
        self.pinned = pinned
        self.max_rows = max_rows  # rows of the batch this group may join (None: the scheduler's bound)
        self.stop = stop  # set by the request's owner (a client went away): the rows leave, the reader gets Cancelled
        self.cancelled = False
        self.urgent_tokens = urgent_tokens  # its rows are urgent until they have this many tokens
        self.rows = [_Row(self, x, lo, hi) for x, (lo, hi) in zip(lm_inputs, limits)]
        for row, prefix in zip(self.rows, prefixes or ()):
            row.prefix = prefix

    def stopped(self) -> bool:
        return self.cancelled or (self.stop is not None and self.stop.is_set())

    def tokens(self, index: int) -> Iterator[int]:
        """Row `index`'s tokens, each as soon as the worker chose it; raises what the worker hit (Cancelled
        when the group's `stop` was set)."""
        out = self.rows[index].out
        while True:
            item = out.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def results(self) -> list[list[int]]:
        """Every row's tokens, once all rows have stopped."""
        return [list(self.tokens(i)) for i in range(len(self.rows))]


class DecodeScheduler:
    """The shared decode loop of one `SpeechLM`; its worker thread starts on the first submission."""

    def __init__(self, lm: SpeechLM, max_rows: int = 16, before_step: Callable[[], None] = lambda: None) -> None:
        """`before_step` may block the loop before each step (the pipeline's `ChunkGate.before_decode_step`)."""
        self._lm = lm
        self.max_rows = max_rows
        self._before_step = before_step
        self._cond = threading.Condition()
        self._waiting: deque[DecodeGroup] = deque()
        self._thread: threading.Thread | None = None
        self._rows: list[_Row] = []  # the running batch, in cache row order (worker thread only)
        self._cache: KVCache | None = None
        self._parked: list[_Row] = []  # rows set aside while others are urgent, in their cache's row order
        self._parked_cache: KVCache | None = None
        self._parked_steps = 0
        self._steps = 0
        self._prefills = 0
        self._tokens = 0
        self._joined_running = 0
        self._rebuilds = 0
        self._cancelled_rows = 0
        self._rows_per_step: Counter[int] = Counter()
        self._seconds = {"prefill": 0.0, "decode": 0.0, "rebuild": 0.0}

    # -- request threads ---------------------------------------------------------------------
    def submit(self, lm_inputs: Sequence[np.ndarray], n_text_tokens: Sequence[int], greedy: bool,
               rng: np.random.Generator, pin: int | None = None, max_rows: int | None = None,
               stop: threading.Event | None = None, prefixes: Sequence[Prefix | None] | None = None,
               urgent_tokens: int = 0) -> DecodeGroup:
        """Queue prompts [1, L, H] that decode together under one Generator; returns at once. `pin` = exactly
        that many tokens per row (benchmarks); `max_rows` bounds the batch the group joins; `stop` withdraws it;
        `prefixes[i]` receives row i's prefill cache; its rows are urgent until they have `urgent_tokens`."""
        group = self.group(lm_inputs, n_text_tokens, greedy, rng, pin, max_rows, stop, prefixes, urgent_tokens)
        self.enqueue([group])
        return group

    def group(self, lm_inputs: Sequence[np.ndarray], n_text_tokens: Sequence[int], greedy: bool,
              rng: np.random.Generator, pin: int | None = None, max_rows: int | None = None,
              stop: threading.Event | None = None, prefixes: Sequence[Prefix | None] | None = None,
              urgent_tokens: int = 0) -> DecodeGroup:
        """A group for `enqueue` (the arguments of `submit`), not yet queued."""
        limits = [self._lm.config.min_max_len(n, pin) for n in n_text_tokens]
        return DecodeGroup(lm_inputs, limits, greedy, rng, pin is not None, max_rows, stop, prefixes, urgent_tokens)

    def enqueue(self, groups: Sequence[DecodeGroup]) -> None:
        """Queue groups at once, so that requests that arrived together are prefilled together."""
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cosyedge-decode", daemon=True)
                self._thread.start()
            self._waiting.extend(groups)
            self._cond.notify()

    def stream(self, lm_input: np.ndarray, n_text_tokens: int, greedy: bool, rng: np.random.Generator,
               pin: int | None = None, max_rows: int | None = None,
               stop: threading.Event | None = None, prefix: Prefix | None = None,
               urgent_tokens: int = 0) -> Iterator[int]:
        """One prompt's tokens as they are chosen; closing the iterator early, or setting `stop`, withdraws the
        row before the next decode step. `urgent_tokens`: a stream's tokens before its first chunk."""
        group = self.submit([lm_input], [n_text_tokens], greedy, rng, pin, max_rows, stop, [prefix], urgent_tokens)
        try:
            yield from group.tokens(0)
        finally:
            self.cancel(group)

    def cancel(self, group: DecodeGroup) -> None:
        """Stop decoding a group whose consumer went away (no effect once it has finished)."""
        with self._cond:
            group.cancelled = True
            self._cond.notify()

    def stats(self) -> dict[str, object]:
        """Counters for the bench and the metrics: decode steps, rows per step, prefills, rebuilds, and the
        seconds spent in each kind of call (decode includes sampling)."""
        with self._cond:
            hist = dict(sorted(self._rows_per_step.items()))
            steps = self._steps
            return {"decode_steps": steps, "prefill_calls": self._prefills, "tokens": self._tokens,
                    "rows_per_step": hist, "mean_rows": (sum(k * v for k, v in hist.items()) / steps) if steps else 0.0,
                    "joined_running": self._joined_running, "cache_rebuilds": self._rebuilds,
                    "cancelled_rows": self._cancelled_rows, "parked_steps": self._parked_steps,
                    "seconds": {k: round(v, 6) for k, v in self._seconds.items()},
                    "active_rows": sum(not row.done for row in self._rows + self._parked),
                    "waiting_groups": len(self._waiting),
                    "max_rows": self.max_rows}

    # -- worker ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            joining = self._admit()
            self._before_step()
            try:
                self._step(joining)
            except Exception as exc:  # noqa: BLE001 - fail the rows in flight, keep serving others
                log.exception("LLM decode step failed")
                for row in self._rows + self._parked + [r for g in joining for r in g.rows]:
                    row.finish(exc)
                self._rows, self._cache, self._parked, self._parked_cache = [], None, [], None

    def _admit(self) -> list[DecodeGroup]:
        """Groups that join now (blocks while nothing runs); cancelled rows of the batch are stopped."""
        with self._cond:
            while not self._waiting and not self._rows and not self._parked:
                self._cond.wait()
            for row in self._rows + self._parked:
                if not row.done and row.group.stopped():
                    self._withdraw(row)
            for group in [g for g in self._waiting if g.stopped()]:
                self._waiting.remove(group)
                for row in group.rows:
                    self._withdraw(row)
            used = sum(not row.done for row in self._rows + self._parked)
            joining: list[DecodeGroup] = []
            while self._waiting:
                group = self._waiting[0]
                bound = min(self.max_rows, group.max_rows or self.max_rows)
                if used + len(group.rows) > bound and (used or joining):  # too big alone: it runs alone
                    break
                self._waiting.popleft()
                used += len(group.rows)
                joining.append(group)
            return joining

    def _withdraw(self, row: _Row) -> None:
        """Stop a row whose consumer left (caller holds the lock); a reader still waiting gets Cancelled."""
        if not row.done:
            self._cancelled_rows += 1
            row.finish(Cancelled("the request was withdrawn") if row.group.stop is not None else None)

    def _step(self, joining: list[DecodeGroup]) -> None:
        parts: list[tuple[KVCache, list[_Row]]] = []  # every cache and the row at each of its positions
        if self._cache is not None:
            parts.append((self._cache, self._rows))
        if self._parked_cache is not None:
            parts.append((self._parked_cache, self._parked))
        new_rows = [row for group in joining for row in group.rows]
        if new_rows:
            began = time.perf_counter()
            logits, cache = self._lm.prefill([row.lm_input for row in new_rows])
            for index, row in enumerate(new_rows):  # before the first token, so a reader of tokens sees it
                if row.prefix is not None:
                    row.prefix.key, row.prefix.value = self._lm.row_prefix(cache, index, row.prefix.layers,
                                                                           row.lm_input.shape[1] - 1)
            self._choose(new_rows, logits)
            with self._cond:
                self._prefills += 1
                self._joined_running += len(new_rows) if any(not r.done for _, rows in parts for r in rows) else 0
                self._seconds["prefill"] += time.perf_counter() - began
            parts.append((cache, new_rows))
        live = [row for _, rows in parts for row in rows if not row.done]
        urgent = [row for row in live if row.urgent]
        rows = urgent or live
        parked = [row for row in live if not row.urgent] if urgent else []
        if not rows:
            self._rows, self._cache, self._parked, self._parked_cache = [], None, [], None
            return
        cache = self._assemble(parts, rows)
        parked_cache = self._assemble(parts, parked) if parked else None
        began = time.perf_counter()
        fed = np.array([row.history[-1] for row in rows], np.int64)
        logits, cache = self._lm.decode(fed, cache)
        self._choose(rows, logits)
        with self._cond:
            self._rows, self._cache, self._parked, self._parked_cache = rows, cache, parked, parked_cache
            self._steps += 1
            self._parked_steps += bool(parked)
            self._rows_per_step[len(rows)] += 1
            self._seconds["decode"] += time.perf_counter() - began

    def _assemble(self, parts: list[tuple[KVCache, list[_Row]]], rows: list[_Row]) -> KVCache:
        """One cache of `rows` in their order (taken from `parts` in order): a part's own cache where it holds
        exactly them (nobody joined, left, or was set aside: the graph's output is the next input), else merged."""
        for cache, held in parts:
            if len(held) == len(rows) and all(a is b for a, b in zip(held, rows)):
                return cache
        began = time.perf_counter()
        wanted = {id(row) for row in rows}
        cache = self._lm.merge_caches([(cache, [i for i, row in enumerate(held) if id(row) in wanted])
                                       for cache, held in parts if any(id(row) in wanted for row in held)])
        with self._cond:
            self._rebuilds += 1
            self._seconds["rebuild"] += time.perf_counter() - began
        return cache

    def _choose(self, rows: list[_Row], logits: np.ndarray) -> None:
        """Each row's next token (step index = tokens so far) from its logits row, in batch order: a group's rows
        are contiguous and in order, so each Generator sees the draws of the group decoded alone."""
        cfg = self._lm.config
        chosen = 0
        for row, scores in zip(rows, logits):
            if row.group.stopped():
                with self._cond:
                    self._withdraw(row)
                continue
            if row.max_len <= 0:
                row.finish()
                continue
            if row.group.pinned:
                scores = cfg.unstoppable(scores)
            token = choose_token(scores, len(row.history), row.min_len, cfg.eos, row.history, row.group.greedy,
                                 cfg.sampling, row.group.rng)
            if token in cfg.stop_ids:
                row.finish()
                continue
            row.history.append(token)
            row.out.put(token)
            chosen += 1
            if len(row.history) >= row.max_len:
                row.finish()
        with self._cond:
            self._tokens += chosen
