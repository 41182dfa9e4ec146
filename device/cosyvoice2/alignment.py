"""Speech tokens -> text tokens -> words: a monotonic alignment over the LLM's own attention (numpy only).

The attention pass (`attention.py`) gives, for each generated speech token, how much the LLM attended to each text
token of the segment while choosing it (a matrix [S, T]). Speech follows the text in order, so the alignment is a
path through that matrix: a non-decreasing map a(s) from speech token s to text token a(s), found by dynamic
programming (Viterbi) as the path of greatest summed log attention:

    Q[s, t] = log A[s, t] + max(Q[s-1, t - j] for j in 0..J)

with A each row normalised over the text tokens. A path starts on the first text token (or, continuing a stream,
on the token where the last committed word ended), and a segment's path ends on its last text token. J = 1 (stay,
or move to the next token) whenever there are at least as many speech tokens as text tokens, so every text token
gets at least one speech token (40 ms); with fewer speech tokens (a pinned length, CosyVoice3's dropped silences)
J is the smallest jump that still reaches the end, and a skipped token gets no time.

A word holds the text tokens of its characters (`frontend.word_spans`: whitespace-separated, punctuation
attached, each CJK character a word of its own), so a pause after a comma belongs to the word with the comma and
the words of a segment tile it: the first starts at 0, each ends where the next starts, the last ends at the
segment's end. Times come from token edges (seconds at which each speech token's audio begins, `token_edges`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from cosyedge.device.options import Word

FLOOR = 1e-9  # attention below this is as good as none (log of zero)


def monotonic_path(attention: np.ndarray, start: int = 0, final: bool = True) -> np.ndarray:
    """The best non-decreasing path a[s] through attention [S, T] (rows: speech tokens, columns: text tokens),
    starting at text token `start`; with `final` it ends on the last text token (where that is reachable), else
    wherever the path scores best. Rows are normalised over the columns first."""
    rows, cols = attention.shape
    if rows == 0:
        return np.zeros(0, np.int64)
    if not 0 <= start < cols:
        raise ValueError(f"start {start} is outside the {cols} text tokens")
    weights = np.asarray(attention, np.float64)
    weights = weights / np.maximum(weights.sum(axis=1, keepdims=True), FLOOR)
    scores = np.log(np.maximum(weights, FLOOR))
    remaining = cols - 1 - start
    jump = 1 if not final or rows - 1 >= remaining else math.ceil(remaining / max(rows - 1, 1))
    best = np.full(cols, -np.inf)
    best[start] = scores[0, start]
    moves = np.zeros((rows, cols), np.int64)  # how far each row's state moved from the row before
    for s in range(1, rows):
        shifted = np.full((jump + 1, cols), -np.inf)
        for j in range(jump + 1):
            shifted[j, j:] = best[:cols - j]
        moves[s] = shifted.argmax(axis=0)
        best = shifted.max(axis=0) + scores[s]
    end = cols - 1 if final and np.isfinite(best[cols - 1]) else int(np.argmax(best))
    path = np.zeros(rows, np.int64)
    path[-1] = end
    for s in range(rows - 1, 0, -1):
        path[s - 1] = path[s] - moves[s, path[s]]
    return path


def token_edges(kept: Sequence[bool], seconds_per_token: float) -> np.ndarray:
    """[S + 1] seconds at which each speech token's audio begins (and the last one ends): a token the flow does not
    voice (`kept` False: CosyVoice3's dropped silent runs) lasts no time."""
    return np.concatenate([[0.0], np.cumsum(np.asarray(kept, np.float64))]) * seconds_per_token


def word_starts(path: np.ndarray, spans: Sequence[tuple[str, int, int]]) -> list[int]:
    """The first speech token of each word: the first s whose text token is at or past the word's first token
    (len(path) for a word the path has not reached)."""
    return [int(np.searchsorted(path, first, side="left")) for _, first, _ in spans]


def segment_words(attention: np.ndarray, spans: Sequence[tuple[str, int, int]], edges: np.ndarray,
                  end_s: float) -> tuple[Word, ...]:
    """The words of a whole segment: the path over all its speech tokens, each word from its first speech token to
    the next word's, the last to `end_s` (the segment's audio length)."""
    if not spans:
        return ()
    if attention.shape[0] == 0:
        return tuple(Word(text, 0.0, end_s) if i == len(spans) - 1 else Word(text, 0.0, 0.0)
                     for i, (text, _, _) in enumerate(spans))
    starts = word_starts(monotonic_path(attention, spans[0][1], final=True), spans)
    times = [min(float(edges[s]), end_s) for s in starts] + [end_s]
    times[0] = 0.0
    return tuple(Word(text, times[i], times[i + 1]) for i, (text, _, _) in enumerate(spans))


@dataclass
class StreamWords:
    """The words of one streamed segment, committed as its audio goes out (per request, never shared).

    `update(attention, edges, emitted_s)` takes the attention rows of every speech token so far; the path is
    re-solved from the last committed word boundary (never before it: what was sent stays true), and each word
    whose end - the next word's start - is at least `settle` tokens behind the newest token and inside the audio
    emitted so far is committed. `finish(...)` commits the rest, the last word ending at the segment's end.
    """
    spans: tuple[tuple[str, int, int], ...]
    settle: int = 3
    committed: int = 0      # words handed out
    start_token: int = 0    # speech token where the next uncommitted word begins
    start_s: float = 0.0

    def update(self, attention: np.ndarray, edges: np.ndarray, emitted_s: float) -> tuple[Word, ...]:
        if self.committed >= len(self.spans) - 1 or attention.shape[0] <= self.start_token:
            return ()
        rest = self.spans[self.committed:]
        path = monotonic_path(attention[self.start_token:], rest[0][1], final=False)
        starts = [self.start_token + s for s in word_starts(path, rest)]
        newest = attention.shape[0]
        out = []
        for index in range(1, len(rest)):
            boundary = starts[index]
            if boundary > newest - self.settle or float(edges[boundary]) > emitted_s:
                break
            out.append(self._commit(rest[index - 1][0], boundary, float(edges[boundary])))
        return tuple(out)

    def finish(self, attention: np.ndarray, edges: np.ndarray, end_s: float) -> tuple[Word, ...]:
        rest = self.spans[self.committed:]
        if not rest:
            return ()
        if attention.shape[0] <= self.start_token:
            starts = [self.start_token] * len(rest)
        else:
            path = monotonic_path(attention[self.start_token:], rest[0][1], final=True)
            starts = [self.start_token + s for s in word_starts(path, rest)]
        times = [self.start_s] + [min(max(float(edges[min(s, len(edges) - 1)]), self.start_s), end_s)
                                  for s in starts[1:]] + [end_s]
        for index in range(2, len(times)):  # never before an earlier boundary
            times[index] = max(times[index], times[index - 1])
        self.committed = len(self.spans)
        return tuple(Word(text, times[i], times[i + 1]) for i, (text, _, _) in enumerate(rest))

    def _commit(self, text: str, boundary: int, boundary_s: float) -> Word:
        word = Word(text, self.start_s, max(boundary_s, self.start_s))
        self.committed += 1
        self.start_token, self.start_s = boundary, word.end_s
        return word
