"""CosyVoice word times on the tiny releases of both families: the invariants the alignment promises whatever the
weights (random weights give meaningless attention, so where the words fall is only measurable on real weights)."""
from __future__ import annotations

import numpy as np
import pytest

from cosyedge.device.engine import Engine
from cosyedge.device.sessions import SessionConfig

# two segments (the frontend cuts after 60 tokens at a sentence end), a number the normaliser spells out
TEXT = ("Good morning and welcome aboard; the next train to the airport leaves from platform 4 in six minutes, "
        "so please keep your bags with you at all times, mind the gap between the train and the platform edge, "
        "and let the other passengers step off before you step on board with your family and your friends. "
        "The bar car is open until nine in the evening, and the quiet coach is at the very back of the train.")
FAMILIES = ("cv2_tiny_bundle", "cv3_tiny_bundle")


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request: pytest.FixtureRequest) -> Engine:
    bundle = request.getfixturevalue(request.param)
    return Engine.load(bundle, precision="fp32", sessions=SessionConfig(providers=("cpu",), intra_op_threads=1),
                       warmup=False)


def options(engine: Engine):
    return engine.options(voice=0, sampling="greedy", deterministic=True)


def check_segment(words, text: str, end_s: float) -> None:
    """In order, inside the segment, tiling it (each word ends where the next starts), the last at its end, and
    exactly the segment's words once each."""
    assert " ".join(w.text for w in words) == " ".join(text.split())
    assert words[0].start_s == 0.0 and words[-1].end_s == pytest.approx(end_s, abs=1e-9)
    for word, after in zip(words, words[1:]):
        assert 0.0 <= word.start_s <= word.end_s <= end_s and word.end_s == pytest.approx(after.start_s, abs=1e-12)


def test_each_segments_words_tile_it_and_the_waveform_is_the_plain_one(engine: Engine) -> None:
    segments = engine.segments(TEXT, words=True)
    assert len(segments) == 2 and all(s.ids == p.ids for s, p in zip(segments, engine.segments(TEXT)))
    timed = engine.pipeline.synthesize_words(segments, options(engine), engine.limits.batch_max)
    plain = engine.pipeline.synthesize_many([(segments, options(engine))], engine.limits.batch_max)[0]
    for segment, (wave, words), reference in zip(segments, timed, plain):
        assert np.array_equal(wave, reference)
        check_segment(words, segment.text, wave.size / engine.sample_rate)


def test_a_streams_words_come_once_in_order_never_after_the_chunk_that_ends_them(engine: Engine) -> None:
    segments = engine.segments(TEXT, words=True)
    sent, words, chunks = 0, [], 0
    for chunk, done in engine.stream_words(segments, options(engine)):
        sent += chunk.size
        chunks += 1
        for word in done:  # sent with (before) this chunk: its end is inside the audio sent so far
            assert word.end_s * engine.sample_rate <= sent + 1e-6
        words += done
    assert chunks > len(segments) + 1   # more than one chunk per segment: words arrive chunk by chunk
    streamed = np.concatenate(list(engine.stream_segments(segments, options(engine))))
    assert sent == streamed.size
    assert [w.text for w in words] == [w[0] for s in segments for w in s.words]
    assert words[0].start_s == 0.0 and words[-1].end_s == pytest.approx(sent / engine.sample_rate)
    assert all(a.end_s == pytest.approx(b.start_s, abs=1e-9) and a.start_s <= a.end_s for a, b in zip(words, words[1:]))


def test_the_pass_over_a_stream_equals_the_pass_over_the_whole_segment(engine: Engine) -> None:
    """The pass's key/value cache: a segment's attention computed chunk by chunk equals one call over all of it."""
    pipeline = engine.pipeline
    segment = engine.segments(TEXT, words=True)[0]
    request = options(engine)
    tokens = pipeline.speech_tokens(segment, request)
    inputs = pipeline._mode_inputs(request)
    whole = pipeline._segment_pass(segment, inputs, tokens).attention
    pieces = pipeline._segment_pass(segment, inputs, tokens[:1])
    for end in (30, 31, 60, len(tokens)):
        pieces.extend(tokens[:end])
    assert whole.shape == (len(tokens), len(segment.ids))
    np.testing.assert_allclose(pieces.attention, whole, atol=1e-6)


def test_the_pass_from_the_prefills_cache_equals_the_pass_over_its_own_prompt(engine: Engine) -> None:
    """The prompt's keys and values come from the LLM's prefill (`scheduler.Prefix`), not from the pass again:
    two segments of different lengths prefilled in one padded call, each pass started from its row's cache, give
    the rows of the pass that computes its prompt itself (a row or position slicing error would not)."""
    from cosyedge.device.cosyvoice2.scheduler import Prefix
    pipeline = engine.pipeline
    segments = engine.segments(TEXT, words=True)
    request = options(engine)
    inputs = pipeline._mode_inputs(request)
    lm_inputs = [pipeline._lm_input(segment, inputs) for segment in segments]
    assert len({x.shape[1] for x in lm_inputs}) == 2               # padded rows: the slice must find each one's
    prefixes = [Prefix(pipeline._aligner.depth) for _ in segments]
    group = pipeline._decoder.submit(lm_inputs, [len(s.ids) for s in segments], True, np.random.default_rng(0),
                                     prefixes=prefixes)
    for segment, tokens, prefix, lm_input in zip(segments, group.results(), prefixes, lm_inputs):
        assert prefix.key.shape[3] == lm_input.shape[1] - 1
        reused = pipeline._segment_pass(segment, inputs, tokens, prefix).attention
        own = pipeline._segment_pass(segment, inputs, tokens).attention
        assert reused.shape == own.shape == (len(tokens), len(segment.ids))
        np.testing.assert_allclose(reused, own, atol=1e-4)
