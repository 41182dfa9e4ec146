"""The CosyVoice word aligner (device/cosyvoice2/alignment.py) on constructed attention matrices with known answers."""
from __future__ import annotations

import numpy as np
import pytest

from cosyedge.device.cosyvoice2.alignment import StreamWords, monotonic_path, segment_words, token_edges


def staircase(durations: list[int], text: int | None = None, sharpness: float = 0.9, seed: int = 0,
              noise: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Attention [sum(durations), T] whose rows put `sharpness` of their weight on the text token each speech token
    says (token t said for durations[t] rows), the rest spread; and that known path."""
    text = text or len(durations)
    path = np.repeat(np.arange(len(durations)), durations)
    rng = np.random.default_rng(seed)
    attention = rng.random((path.size, text)) * noise + (1 - sharpness) / text
    attention[np.arange(path.size), path] += sharpness
    return attention, path


def test_a_sharp_staircase_is_recovered_exactly() -> None:
    attention, path = staircase([3, 1, 4, 2, 5])
    assert monotonic_path(attention).tolist() == path.tolist()


def test_monotonicity_overrides_a_row_that_looks_back() -> None:
    """A speech token whose attention jumps back to an earlier text token stays on the current one (speech follows
    the text in order), and a row that looks far ahead does not drag the path past tokens not yet said."""
    attention, path = staircase([4, 4, 4, 4])
    attention[9] = 0.01
    attention[9, 0] = 1.0          # looks back to token 0 while token 2 is said
    attention[5] = 0.01
    attention[5, 3] = 1.0          # looks ahead to token 3 while token 1 is said
    found = monotonic_path(attention)
    assert np.all(np.diff(found) >= 0) and np.all(np.diff(found) <= 1)
    assert found[9] == 2 and found[5] == 1 and found.tolist() == path.tolist()


def test_a_planted_path_survives_heavy_noise() -> None:
    durations = [2, 7, 3, 9, 1, 6, 4, 8]
    attention, path = staircase(durations, sharpness=0.35, noise=0.6, seed=3)
    found = monotonic_path(attention)
    assert np.mean(found == path) > 0.9 and found[0] == 0 and found[-1] == len(durations) - 1


def test_every_text_token_gets_a_speech_token_when_there_are_enough() -> None:
    """Uniform attention (no information): the path still starts on the first token, ends on the last and visits
    every token (steps of 0 or 1), so each word gets at least 40 ms."""
    found = monotonic_path(np.ones((10, 7)))
    assert found[0] == 0 and found[-1] == 6 and set(found.tolist()) == set(range(7))
    assert set(np.diff(found).tolist()) <= {0, 1}


def test_fewer_speech_tokens_than_text_tokens_jump_and_still_reach_the_end() -> None:
    attention = np.full((3, 7), 0.01)
    attention[0, 0] = attention[1, 3] = attention[2, 6] = 1.0
    assert monotonic_path(attention).tolist() == [0, 3, 6]


def test_an_open_end_stops_where_the_speech_is_and_a_start_is_honoured() -> None:
    """A stream's partial path (final=False) ends on the token being said, not on the last; a path resumed after
    committed words starts on the given token."""
    attention, _ = staircase([3, 3, 3, 3, 3, 3])
    assert monotonic_path(attention[:8], final=False).tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    assert monotonic_path(attention[6:], start=2).tolist() == [2, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5]


SPANS = (("Hello,", 0, 2), ("big", 2, 3), ("world.", 3, 5))  # words as ranges of 5 text tokens


def test_segment_words_tile_the_segment_at_the_known_boundaries() -> None:
    attention, _ = staircase([2, 3, 4, 5, 6])           # 20 speech tokens: 0.8 s at 40 ms each
    edges = token_edges([True] * 20, 0.04)
    words = segment_words(attention, SPANS, edges, 0.81)  # the audio is a little longer than its tokens
    assert [w.text for w in words] == ["Hello,", "big", "world."]
    assert [(round(w.start_s, 6), round(w.end_s, 6)) for w in words] == [(0.0, 0.2), (0.2, 0.36), (0.36, 0.81)]


def test_tokens_the_flow_drops_last_no_time() -> None:
    """CosyVoice3 drops long silent runs before the flow: those speech tokens have no audio, so the times after
    them move earlier by their count."""
    attention, _ = staircase([2, 3, 4, 5, 6])
    kept = [True] * 20
    kept[3:5] = [False, False]                            # two tokens of "Hello," never voiced
    words = segment_words(attention, SPANS, token_edges(kept, 0.04), 0.72)
    assert [(round(w.start_s, 6), round(w.end_s, 6)) for w in words] == [(0.0, 0.12), (0.12, 0.28), (0.28, 0.72)]


def test_a_stream_commits_each_word_once_in_order_and_never_past_the_audio_sent() -> None:
    """Rows arrive chunk by chunk; a word is handed out only when the audio sent so far holds its end and the
    path has moved `settle` tokens past it; the last chunk gives the rest, ending at the segment's end; on clean
    attention the stream's words equal the whole segment's."""
    durations = [3, 5, 2, 6, 4, 7, 3]
    attention, _ = staircase(durations)
    spans = tuple((f"w{i}", i, i + 1) for i in range(len(durations)))
    edges = token_edges([True] * attention.shape[0], 0.04)
    whole = segment_words(attention, spans, edges, edges[-1])
    stream = StreamWords(spans, settle=3)
    got, sent_s = [], 0.0
    for rows in (8, 14, 22, 30):                          # tokens decoded so far at each chunk
        sent_s = edges[rows - 3]                          # the chunk voices all but the look-ahead
        words = stream.update(attention[:rows], edges, sent_s)
        assert all(w.end_s <= sent_s + 1e-9 for w in words)
        got += words
    got += stream.finish(attention, edges, float(edges[-1]))
    assert [w.text for w in got] == [w.text for w in whole]
    assert np.allclose([(w.start_s, w.end_s) for w in got], [(w.start_s, w.end_s) for w in whole])
    assert stream.finish(attention, edges, float(edges[-1])) == ()   # nothing twice


def test_a_committed_boundary_is_never_revised() -> None:
    """A word handed out early stays as sent: later rows that would have placed its end elsewhere only move the
    words after it."""
    attention, _ = staircase([4, 4, 4, 4])
    spans = tuple((f"w{i}", i, i + 1) for i in range(4))
    edges = token_edges([True] * 16, 0.04)
    stream = StreamWords(spans, settle=2)
    first = stream.update(attention[:8], edges, 0.3)
    assert [(w.text, round(w.end_s, 6)) for w in first] == [("w0", 0.16)]
    changed = attention.copy()
    changed[4:8] = 0.01
    changed[4:8, 0] = 1.0                                  # rows 4-7 now look like token 0 again
    rest = stream.finish(changed, edges, 0.64)
    assert rest[0].start_s == pytest.approx(0.16) and [w.text for w in rest] == ["w1", "w2", "w3"]
    assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(first + rest, (first + rest)[1:]))
