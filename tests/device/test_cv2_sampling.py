"""The numpy Repetition Aware Sampling of the CosyVoice2 runtime (device/cosyvoice2/sampling.py).

The rules come from the fact sheet (A4 section 6): nucleus = highest probabilities taken while the mass before them is
< top_p and fewer than top_k are taken; a drawn token seen >= win_size * tau_r times in the last win_size tokens is
banned and redrawn from the full softmax; eos is banned while step < min_len. Statistical checks use fixed seeds and
wide bounds (5 sigma), so they are deterministic.
"""
from __future__ import annotations

import numpy as np
import pytest

from cosyedge.device.cosyvoice2.sampling import (SamplingConfig, choose_token, draw, nucleus_candidates, ras_sample,
                                        softmax)

CONFIG = SamplingConfig(top_p=0.8, top_k=25, win_size=10, tau_r=0.1)


def test_nucleus_includes_the_token_that_crosses_top_p() -> None:
    probs = np.array([0.05, 0.5, 0.1, 0.2, 0.15])
    ids, kept = nucleus_candidates(probs, top_p=0.8, top_k=25)
    assert ids.tolist() == [1, 3, 4]          # 0.5 + 0.2 = 0.7 < 0.8, so 0.15 is taken and crosses it
    np.testing.assert_allclose(kept, [0.5, 0.2, 0.15])
    ids, _ = nucleus_candidates(probs, top_p=0.8, top_k=2)
    assert ids.tolist() == [1, 3]             # top_k caps the set first


@pytest.mark.parametrize("seed", range(5))
def test_nucleus_mass_and_size_on_random_rows(seed: int) -> None:
    rng = np.random.default_rng(seed)
    probs = softmax(rng.normal(0, 3, 6564))
    ids, kept = nucleus_candidates(probs, CONFIG.top_p, CONFIG.top_k)
    assert 1 <= len(ids) <= CONFIG.top_k
    assert np.array_equal(np.sort(probs)[::-1][:len(ids)], kept)           # the most probable tokens
    assert kept[:-1].sum() < CONFIG.top_p                                   # needed every one of them
    assert len(ids) == CONFIG.top_k or kept.sum() >= CONFIG.top_p           # stopped by k or by the mass


def test_ties_keep_index_order() -> None:
    ids, _ = nucleus_candidates(np.full(40, 1 / 40), top_p=0.8, top_k=25)
    assert ids.tolist() == list(range(25))


def test_draws_follow_the_kept_probabilities() -> None:
    scores = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    rng = np.random.default_rng(0)
    n = 20000
    counts = np.bincount([ras_sample(scores, [], CONFIG, rng) for _ in range(n)], minlength=4)
    assert counts[3] == 0                                  # outside the nucleus (0.4 + 0.3 + 0.2 crosses 0.8)
    expected = np.array([0.4, 0.3, 0.2]) / 0.9 * n
    assert np.all(np.abs(counts[:3] - expected) < 5 * np.sqrt(expected))


def test_repetition_in_window_falls_back_to_the_full_distribution() -> None:
    probs = np.array([0.97, 0.01, 0.01, 0.01])
    scores = np.log(probs)
    rng = np.random.default_rng(1)
    history_hit = [1, 2, 3, 0, 1, 2, 3, 1, 2, 3]            # token 0 once in the last 10: 1 >= 10 * 0.1
    drawn = [ras_sample(scores, history_hit, CONFIG, rng) for _ in range(3000)]
    assert 0 not in drawn                                   # banned, then redrawn from the rest
    counts = np.bincount(drawn, minlength=4)[1:]
    assert np.all(np.abs(counts - 1000) < 5 * np.sqrt(1000))  # uniform over the remaining three
    history_old = [0] + [1, 2, 3] * 3 + [1]                 # token 0 only before the window
    assert all(ras_sample(scores, history_old, CONFIG, rng) == 0 for _ in range(200))


def test_fallback_can_leave_the_nucleus() -> None:
    """The redraw uses the full softmax: tokens outside top-k become possible."""
    scores = np.log(np.array([0.9] + [0.1 / 99] * 99))
    config = SamplingConfig(top_p=0.5, top_k=1, win_size=10, tau_r=0.1)
    drawn = {ras_sample(scores, [0], config, np.random.default_rng(s)) for s in range(200)}
    assert 0 not in drawn and len(drawn) > 50


def test_eos_rule_applies_before_sampling_and_greedy() -> None:
    eos = 3
    scores = np.log(np.array([0.001, 0.002, 0.002, 0.995]))
    rng = np.random.default_rng(2)
    assert all(choose_token(scores, 4, 5, eos, [], False, CONFIG, rng) != eos for _ in range(300))
    assert choose_token(scores, 4, 5, eos, [], True, CONFIG, rng) == 1      # argmax after the mask, first wins
    assert choose_token(scores, 5, 5, eos, [], True, CONFIG, rng) == eos
    assert scores[eos] == np.log(0.995)                                      # the caller's row is not modified


def test_seeded_generators_are_reproducible_and_independent() -> None:
    rng = np.random.default_rng(123)
    rows = [rng.normal(0, 2, 100) for _ in range(50)]

    def run(gen: np.random.Generator) -> list[int]:
        history: list[int] = []
        for row in rows:
            history.append(choose_token(row, len(history), 0, 99, history, False, CONFIG, gen))
        return history

    alone_a, alone_b = run(np.random.default_rng(7)), run(np.random.default_rng(8))
    assert run(np.random.default_rng(7)) == alone_a and alone_a != alone_b
    gen_a, gen_b = np.random.default_rng(7), np.random.default_rng(8)   # interleaved: no shared state
    hist_a: list[int] = []
    hist_b: list[int] = []
    for row in rows:
        hist_a.append(choose_token(row, len(hist_a), 0, 99, hist_a, False, CONFIG, gen_a))
        hist_b.append(choose_token(row, len(hist_b), 0, 99, hist_b, False, CONFIG, gen_b))
    assert hist_a == alone_a and hist_b == alone_b


def test_draw_handles_unnormalised_weights() -> None:
    rng = np.random.default_rng(3)
    assert {draw(np.array([0.0, 2.0, 0.0]), rng) for _ in range(100)} == {1}


@pytest.mark.parametrize("case", ["sft0_s0", "zero_shot0_s0", "cross_lingual0_s0", "instruct20_s0"])
def test_official_ras_runs_are_explained_by_these_rules(golden_dir, case: str) -> None:
    """llm.npz holds one official RAS run per heavy case and the log-probs it saw at every step (teacher forced).
    Every official choice must be possible under our rules: a nucleus candidate not repeated in the window, or
    a fallback draw, which needs some nucleus candidate in the window. The stop token ends the run."""
    with np.load(golden_dir / "cosyvoice2-tiny" / "vectors" / "llm.npz") as z:
        tokens, rows = z[f"{case}__ras_tokens"].tolist(), z[f"{case}__teacher_forced_ras_logp"]
        min_len, stop = int(z[f"{case}__min_max_len"][0]), int(z[f"{case}__ras_stop_token"][0])
    assert stop == 6561
    for step, token in enumerate(tokens + [stop]):
        scores = rows[step].copy()
        if step < min_len:
            scores[6561] = -np.inf
        ids, _ = nucleus_candidates(softmax(scores), CONFIG.top_p, CONFIG.top_k)
        window = tokens[max(0, step - CONFIG.win_size):step]
        direct = token in ids and token not in window
        assert direct or any(int(i) in window for i in ids), (case, step, token)
