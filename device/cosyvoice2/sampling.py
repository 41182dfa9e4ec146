"""Speech-token choice for the CosyVoice2 LLM: Repetition Aware Sampling (the release's sampler) and greedy.

RAS (official `ras_sampling`): softmax the scores; nucleus-sample from the highest-probability tokens, taken in
descending order while the accumulated probability is still below `top_p` and fewer than `top_k` are taken (the
token that crosses `top_p` is included); draw from those kept probabilities. If the drawn token already occurs in
the last `win_size` generated tokens at least `win_size * tau_r` times, ban it and draw again from the full
softmax over every remaining token. The eos rule (eos banned while step < min_len) applies before either draw.

Every draw uses the caller's `numpy.random.Generator`: one per request, so concurrent requests never share state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


@dataclass(frozen=True)
class SamplingConfig:
    """RAS parameters (`manifest.config["sampling"]`, from the release yaml)."""
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "SamplingConfig":
        return cls(top_p=float(cfg["top_p"]), top_k=int(cfg["top_k"]), win_size=int(cfg["win_size"]),
                   tau_r=float(cfg["tau_r"]))


def softmax(scores: np.ndarray) -> np.ndarray:
    """float64 probabilities of a 1-D score row; -inf entries get probability 0."""
    scores = np.asarray(scores, np.float64)
    shifted = np.exp(scores - scores.max())
    return shifted / shifted.sum()


def draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """Index drawn with probability proportional to `weights` (non-negative, not necessarily normalised)."""
    cumulative = np.cumsum(weights, dtype=np.float64)
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return min(index, len(weights) - 1)


def nucleus_candidates(probs: np.ndarray, top_p: float, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, their probabilities) kept by the nucleus rule, in descending probability order (ties: lower id
    first). Only the top_k highest can be kept, so only they are sorted: those at or above the top_k-th highest
    probability, in id order, sorted stably, are the head of the full stable sort (one row per request and decode
    step: a full sort of the vocabulary was most of the sampling time)."""
    k = min(int(top_k), probs.size)
    if k <= 0:
        return np.zeros(0, np.int64), probs[:0]
    floor = probs[np.argpartition(-probs, k - 1)[k - 1]]  # the k-th highest probability
    head = np.flatnonzero(probs >= floor)
    order = head[np.argsort(-probs[head], kind="stable")][:k]
    ranked = probs[order]
    before = np.cumsum(ranked) - ranked  # probability accumulated before each candidate
    count = min(int(top_k), int(np.count_nonzero(before < top_p)))
    return order[:count], ranked[:count]


def ras_sample(scores: np.ndarray, history: Sequence[int], config: SamplingConfig,
               rng: np.random.Generator) -> int:
    """One RAS draw from a score row (logits or log-probs, eos rule already applied) given the generated tokens."""
    probs = softmax(scores)
    ids, kept = nucleus_candidates(probs, config.top_p, config.top_k)
    token = int(ids[draw(kept, rng)])
    window = history[-config.win_size:] if config.win_size > 0 else ()
    if sum(1 for t in window if t == token) >= config.win_size * config.tau_r:
        banned = np.array(scores, np.float64, copy=True)
        banned[token] = -np.inf
        token = draw(softmax(banned), rng)
    return token


def mask_eos(scores: np.ndarray, step: int, min_len: int, eos: int) -> np.ndarray:
    """The official length rule: eos cannot be chosen before `min_len` tokens exist."""
    if step < min_len:
        scores = np.array(scores, copy=True)
        scores[eos] = -np.inf
    return scores


def choose_token(scores: np.ndarray, step: int, min_len: int, eos: int, history: Sequence[int], greedy: bool,
                 config: SamplingConfig, rng: np.random.Generator) -> int:
    """The next speech token: eos rule, then argmax (greedy; first index wins ties) or RAS."""
    scores = mask_eos(scores, step, min_len, eos)
    if greedy:
        return int(np.argmax(scores))
    return ras_sample(scores, history, config, rng)


def without_stops(logits: np.ndarray, stop_ids) -> np.ndarray:
    """Logits with every stop id at -inf: a pinned length (bench) must not end early on any stop id."""
    logits = np.array(logits, copy=True)
    logits[..., sorted(stop_ids)] = -np.inf
    return logits
