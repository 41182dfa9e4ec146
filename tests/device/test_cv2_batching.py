"""Cross-request batched LLM decoding (device/cosyvoice2/scheduler.py) on the tiny CosyVoice2 bundle.

Acceptance: a request's speech tokens and audio do not depend on the requests it was batched with (same seed =>
same tokens and same audio). Tolerances: tokens exact; audio exact (np.array_equal): with equal tokens the flow
and HiFT calls of a request are the ones it makes alone, and its noise comes from its own Generator.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cosyedge.device.engine import Engine
from cosyedge.device.options import SynthesisOptions
from cosyedge.device.sessions import SessionConfig
from schedulertools import assert_concurrent_streams_match_alone, record_flow_batches, rows_per_step_delta

ZH_VOICE, EN_VOICE, SFT_VOICE = "tiny_spk_zh", "tiny_spk_en", "tiny_sft_spk"


@pytest.fixture(scope="module")
def engine(cv2_tiny_bundle: Path) -> Engine:
    return Engine.load(cv2_tiny_bundle, precision="fp32",
                       sessions=SessionConfig(providers=("cpu",), intra_op_threads=1), warmup=False)


def _lm_inputs(engine: Engine, text: str, request: SynthesisOptions) -> tuple[list[np.ndarray], list[int]]:
    pipeline = engine.pipeline
    inputs = pipeline._mode_inputs(request)
    segments = engine.segments(text)
    return ([pipeline._lm.lm_input(u.ids, inputs.prompt_text, inputs.prompt_speech) for u in segments],
            [len(u.ids) for u in segments])


# two segments (the text of golden case zero_shot2)
LONG_ZH = ("人工智能正在改变我们的生活方式。从智能手机上的语音助手，到自动驾驶汽车，再到医疗诊断系统，这些技术已经深入到社会的各个角"
           "落。然而，随着技术的快速发展，人们也开始担心隐私保护、就业替代以及算法偏见等问题。专家们认为，我们需要在推动创新的同")
JOBS = [("你好，世界！", {"voice": SFT_VOICE, "sampling": "greedy", "deterministic": True}),
        (LONG_ZH, {"voice": ZH_VOICE, "seed": 5}),
        ("Good morning, my friend.", {"voice": ZH_VOICE, "mode": "cross_lingual", "seed": 6}),
        ("Hello there, this is a batched request.", {"voice": EN_VOICE, "sampling": "greedy", "seed": 7})]


def test_tokens_and_audio_do_not_depend_on_the_batch(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four requests (different texts, voices, modes, seeds; greedy and seeded RAS; one of two segments) give in one
    `synthesize_many` call exactly the tokens and audio each gives alone; the decode steps were shared and segments
    of different requests (their own voice prompts) went through one padded flow batch."""
    pipeline, lm = engine.pipeline, engine.pipeline._lm
    requests = [engine.options(**options) for _, options in JOBS]
    jobs = [(engine.segments(text), req) for (text, _), req in zip(JOBS, requests)]
    # tokens: the scheduler's rows against the single-prompt / single-group reference decoders
    alone_tokens = []
    for (text, _), req in zip(JOBS, requests):
        lm_inputs, n_text = _lm_inputs(engine, text, req)
        rng = np.random.default_rng(req.seed)
        greedy = req.sampling == "greedy"
        alone_tokens.append([list(lm.tokens(lm_inputs[0], n_text[0], greedy, rng))] if len(lm_inputs) == 1
                            else lm.batch_tokens(lm_inputs, n_text, greedy, rng))
    assert len(alone_tokens[1]) == 2 and all(rows and all(rows) for rows in alone_tokens)
    before = pipeline._decoder.stats()
    groups = [pipeline._decoder.submit(*_lm_inputs(engine, text, req), req.sampling == "greedy",
                                       np.random.default_rng(req.seed)) for (text, _), req in zip(JOBS, requests)]
    assert [g.results() for g in groups] == alone_tokens
    shared = rows_per_step_delta(before, pipeline._decoder.stats())
    assert max(shared) >= 4  # the four requests (five rows) decoded in common steps
    # audio: each job alone, then all four in one call
    alone = [engine.synthesize_many([job])[0] for job in jobs]
    flow_rows = record_flow_batches(monkeypatch, pipeline)
    before = pipeline._decoder.stats()
    together = engine.synthesize_many(jobs)
    assert any(len(set(voices_in_call)) > 1 for voices_in_call in flow_rows)
    assert max(rows_per_step_delta(before, pipeline._decoder.stats())) > 1
    for a, b in zip(alone, together):
        assert a.size and np.array_equal(a, b)
    assert np.array_equal(together[2], engine.synthesize_waveform(JOBS[2][0], **JOBS[2][1]))


def _two_prompts(engine: Engine) -> list[tuple[np.ndarray, int]]:
    """(LLM input, text tokens) of A (a zero-shot voice, sampled with seed 21) and B (the SFT voice, greedy)."""
    a = _lm_inputs(engine, "收到好友从远方寄来的生日礼物。", engine.options(voice=ZH_VOICE, seed=21))
    b = _lm_inputs(engine, JOBS[0][0], engine.options(voice=SFT_VOICE, sampling="greedy"))
    return [(inputs[0], texts[0]) for inputs, texts in (a, b)]


def test_concurrent_streams_share_decode_steps(engine: Engine) -> None:
    """Four threads streaming at once (greedy and seeded, noise on and off) get the chunks each gets alone."""
    assert_concurrent_streams_match_alone(engine, JOBS, timeout=120)


def test_request_joins_a_running_batch_and_leaves_it(engine: Engine) -> None:
    """B is submitted while A is mid-decode: it joins A's steps (the row count changes from 1 to 2 and back) and
    both get their solo tokens."""
    pipeline, lm = engine.pipeline, engine.pipeline._lm
    (a_input, a_text), (b_input, b_text) = _two_prompts(engine)
    solo_a = list(lm.tokens(a_input, a_text, False, np.random.default_rng(21), pin=400))
    solo_b = list(lm.tokens(b_input, b_text, True, np.random.default_rng(0)))
    before = pipeline._decoder.stats()
    stream_a = pipeline._decoder.stream(a_input, a_text, False, np.random.default_rng(21), pin=400)
    got_a = [next(stream_a) for _ in range(5)]  # A is decoding now
    group_b = pipeline._decoder.submit([b_input], [b_text], True, np.random.default_rng(0))
    got_a += list(stream_a)
    assert got_a == solo_a and len(solo_a) == 400
    assert group_b.results() == [solo_b]
    after = pipeline._decoder.stats()
    assert after["joined_running"] - before["joined_running"] == 1
    assert set(rows_per_step_delta(before, after)) == {1, 2}
    assert after["active_rows"] == 0 and after["waiting_groups"] == 0


def test_an_urgent_row_decodes_alone_until_it_has_its_tokens_then_rejoins(engine: Engine) -> None:
    """B is submitted urgent for its first 12 tokens while A is mid-decode: B's next 11 steps (its prefill chose
    the first) run B alone with A set aside, then A rejoins in one merge; both get their solo tokens."""
    pipeline, lm = engine.pipeline, engine.pipeline._lm
    (a_input, a_text), (b_input, b_text) = _two_prompts(engine)
    solo_a = list(lm.tokens(a_input, a_text, False, np.random.default_rng(21), pin=400))
    solo_b = list(lm.tokens(b_input, b_text, True, np.random.default_rng(0), pin=60))
    before = pipeline._decoder.stats()
    stream_a = pipeline._decoder.stream(a_input, a_text, False, np.random.default_rng(21), pin=400)
    got_a = [next(stream_a) for _ in range(5)]  # A is decoding now
    group_b = pipeline._decoder.submit([b_input], [b_text], True, np.random.default_rng(0), pin=60, urgent_tokens=12)
    assert group_b.results() == [solo_b]
    got_a += list(stream_a)
    assert got_a == solo_a and len(solo_a) == 400
    after = pipeline._decoder.stats()
    assert after["parked_steps"] - before["parked_steps"] == 11
    # A rejoining, then B leaving: as many rebuilds as B joining and leaving without the wait (B's steps run on its
    # prefill's own cache, and A's cache waits whole)
    assert after["cache_rebuilds"] - before["cache_rebuilds"] == 2
    assert set(rows_per_step_delta(before, after)) == {1, 2}
    assert after["active_rows"] == 0 and after["waiting_groups"] == 0


@pytest.mark.parametrize("preset", ["official", "fastest"])
def test_a_stream_is_urgent_for_the_tokens_of_its_first_chunk(engine: Engine, monkeypatch: pytest.MonkeyPatch,
                                                              preset: str) -> None:
    """A stream's row is urgent for exactly the tokens its first chunk is made from (the padded first hop and the
    look-ahead; the preset without the pad: hops[0] and the look-ahead), no fewer, so the newcomer's row decodes
    alone until its first chunk can be made."""
    pipeline, seen, urgent = engine.pipeline, [0], []
    stream = pipeline._decoder.stream

    def spied(*args, **kwargs):
        urgent.append(args[8] if len(args) > 8 else kwargs["urgent_tokens"])
        for token in stream(*args, **kwargs):
            seen[0] += 1
            yield token

    monkeypatch.setattr(pipeline._decoder, "stream", spied)
    options = engine.options(voice=ZH_VOICE, seed=3, preset=preset)
    chunks = pipeline.stream(engine.segments(LONG_ZH)[0], options)
    next(chunks)
    assert urgent == [seen[0]] and seen[0] > pipeline._schedule.hops[0]
    chunks.close()


def test_abandoned_stream_leaves_the_batch(engine: Engine) -> None:
    """A consumer that stops reading withdraws its row; the scheduler keeps serving the others."""
    pipeline = engine.pipeline
    req = engine.options(voice=ZH_VOICE, seed=3)
    (x,), (n,) = _lm_inputs(engine, JOBS[0][0], req)
    before = pipeline._decoder.stats()
    stream = pipeline._decoder.stream(x, n, False, np.random.default_rng(3), pin=400)
    assert len([next(stream) for _ in range(3)]) == 3
    stream.close()
    tokens = pipeline.speech_tokens(engine.segments(JOBS[0][0])[0], engine.options(voice=SFT_VOICE, sampling="greedy"))
    info = pipeline.describe()["decode"]
    assert tokens and info["tokens"] - before["tokens"] < 400 + len(tokens)
    assert info["active_rows"] == 0 and info["waiting_groups"] == 0
    assert info["decode_steps"] > 0 and info["mean_rows"] >= 1.0


def _full_sort_nucleus(probs: np.ndarray, top_p: float, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """The nucleus rule over a full stable sort of the vocabulary (what the partial sort must reproduce)."""
    order = np.argsort(-probs, kind="stable")
    ranked = probs[order]
    before = np.cumsum(ranked) - ranked
    count = min(int(top_k), int(np.count_nonzero(before < top_p)))
    return order[:count], ranked[:count]


@pytest.mark.parametrize("seed", range(4))
def test_partial_sort_nucleus_equals_the_full_sort(seed: int) -> None:
    """Sampling runs once per row and step in the decode worker, so it sorts only the top_k head; ids and
    probabilities must be exactly those of the full stable sort, ties (coarse probabilities) included."""
    from cosyedge.device.cosyvoice2.sampling import nucleus_candidates, softmax
    rng = np.random.default_rng(seed)
    rows = [softmax(rng.normal(0, scale, 6564)) for scale in (0.5, 3.0, 8.0)]
    rows += [np.round(rows[0] * 2000) / 2000, np.full(40, 1 / 40), softmax(np.repeat(rng.normal(0, 3, 50), 20))]
    for probs in rows:
        for top_p, top_k in ((0.8, 25), (0.99, 25), (0.3, 3), (1.0, 1), (0.8, 10 ** 6)):
            ids, kept = nucleus_candidates(probs, top_p, top_k)
            ref_ids, ref_kept = _full_sort_nucleus(probs, top_p, top_k)
            assert np.array_equal(ids, ref_ids) and np.array_equal(kept, ref_kept)
