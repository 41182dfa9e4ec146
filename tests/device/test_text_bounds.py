"""Bounded work per request, whatever the text (issue 21 items 1 and 2), on the real frontends: lengths counted
after normalisation, every segment cut to its family's model-call bound (after a clause, else at a word, else
between characters; never refused when it is normal text), every TensorRT profile covering the bound, and the
instruct text bounded. The memory these bounds buy is measured on the running service in
tests/api/test_memory_bounds.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from cosyedge.device.engine import Engine
from cosyedge.device.errors import TextTooLongError
from cosyedge.device.options import INSTRUCT_MAX_CHARS
from cosyedge.device.sessions import SessionConfig
from cosyedge.device.text import COSYVOICE_MAX_TOKENS, VITS_MAX_IDS, cut_to_bound, validate
from cosyedge.device.trt.device_profiles import PROFILES
from cosyedge.device.trt.profiles import graph_profiles

DIGITS = ("9999999 " * 250)[:2000]
HOSTILE = {  # the texts: each made one model call of thousands of ids / tokens
    "digits": DIGITS,
    "commas": ("the old man walked slowly down the road, " * 50)[:2000],
    "ni": "你" * 200,
    "fdfa": "\ufdfa" * 30,
}


def test_cut_to_bound_prefers_clauses_then_words_then_characters():
    def cut(text: str, bound: int) -> list[str]:
        pieces = ["".join(p) for p in cut_to_bound(list(text), bound, len)]
        assert "".join(pieces) == text and all(len(p) <= bound for p in pieces)
        return pieces
    assert cut("a short one", 20) == ["a short one"]
    assert cut("the quick brown fox, jumps over the lazy dog", 24) == ["the quick brown fox,", " jumps over the lazy dog"]
    assert cut("the quick brown fox jumps over the lazy dog", 20) == ["the quick brown fox", " jumps over the lazy",
                                                                    " dog"]
    assert cut("x" * 45, 20) == ["x" * 20, "x" * 20, "x" * 5]
    assert cut("你" * 45, 20) == ["你" * 20, "你" * 20, "你" * 5]


def test_length_is_counted_after_nfkc():
    assert validate("\ufdfa" * 100, 2000)  # 1,800 characters once NFKC expanded: accepted
    with pytest.raises(TextTooLongError, match="1818 characters after Unicode normalisation"):
        validate("\ufdfa" * 101, 1800)


@pytest.fixture(scope="module")
def cv2_engine(cv2_tiny_bundle) -> Engine:
    return Engine.load(cv2_tiny_bundle, precision="fp32", sessions=SessionConfig(providers=("cpu",), intra_op_threads=1),
                       warmup=False)


def _vits_profiles(engine: Engine) -> list:
    return [graph_profiles(engine.bundle, engine.precision, device)["vits"] for device in PROFILES.values()]


@pytest.mark.parametrize("case", list(HOSTILE))
def test_vits_segments_are_cut_to_the_call_bound_and_every_profile_covers_them(default_engine, case):
    segments = default_engine.segments(HOSTILE[case])
    assert len(segments) > 1 and max(len(s.ids) for s in segments) <= VITS_MAX_IDS
    for profile in _vits_profiles(default_engine):
        assert all(profile.input("input").covers((1, len(s.ids))) for s in segments), profile.shapes("max")
    assert all(s.text == s.text.strip(" ") for s in segments[1:-1])  # cut at words: no space at a cut's edge


def test_vits_sentences_within_the_bound_are_spoken_as_piper_phonemises_them(default_engine):
    from piper.phoneme_ids import phonemes_to_ids
    text = "Good morning, everyone. The kettle is on; tea will be ready soon!"
    pipeline = default_engine.pipeline
    sentences = pipeline._phonemizer.phonemize(pipeline._espeak_voice, default_engine.pipeline.validate_text(text, 2000))
    assert [s.ids for s in default_engine.segments(text)] == [tuple(phonemes_to_ids(p, pipeline._id_map))
                                                              for p in sentences]


def test_a_slow_vits_request_is_cut_finer_so_its_calls_stay_bounded(default_engine):
    """Frames per id grow as speed falls (speed 0.25: four times the frames), so does a call's memory."""
    segment = max(default_engine.segments(HOSTILE["commas"]), key=lambda s: len(s.ids))
    pipeline = default_engine.pipeline
    assert len(segment.ids) > VITS_MAX_IDS // 2
    assert [(0, segment)] == pipeline._pieces(segment, 1.0) == pipeline._pieces(segment, 2.0)
    slow = [piece for _, piece in pipeline._pieces(segment, 0.25)]
    assert len(slow) >= 4 and max(len(p.ids) for p in slow) <= VITS_MAX_IDS // 4


def test_a_slow_vits_request_with_words_is_cut_into_the_same_pieces(default_engine):
    """The word paths (whole and streamed) make the calls `synthesize` makes at speed 0.5, so the audio is the
    same; the words' times never go back and stay inside it."""
    text = ("the old man walked slowly down the road with his dog, and the children ran after them "
            "singing songs about the river and the mill near the village where everyone knew each other")
    segments = default_engine.segments(text, words=True)
    assert len(segments) == 1 and len(default_engine.pipeline._pieces(segments[0], 0.5)) > 1  # cut only when slow
    plain = default_engine.synthesize_waveform(text, speed=0.5, seed=7)
    wave, words = default_engine.synthesize_words(text, speed=0.5, seed=7)
    assert np.array_equal(wave, plain)
    assert [w.text for w in words] == text.split()
    duration = wave.size / default_engine.sample_rate
    assert all(0 <= w.start_s <= w.end_s <= duration for w in words)
    assert all(a.end_s <= b.start_s for a, b in zip(words, words[1:]))
    assert words[-1].end_s > 0.8 * duration  # spread over the whole audio, not the first piece's
    chunks = list(default_engine.stream_words(segments, default_engine.options(speed=0.5, seed=7)))
    assert len(chunks) > 1 and np.array_equal(np.concatenate([chunk for chunk, _ in chunks]), plain)
    assert [w for _, chunk_words in chunks for w in chunk_words] == words
    sent = 0
    for chunk, chunk_words in chunks:  # a word comes with the chunk that completes it
        sent += chunk.size
        assert all(w.end_s <= sent / default_engine.sample_rate for w in chunk_words)


@pytest.mark.parametrize("case", list(HOSTILE) + ["digits480"])
def test_cosyvoice_segments_are_cut_to_the_call_bound(cv2_engine, case):
    text = DIGITS[:480] if case == "digits480" else HOSTILE[case]
    if case == "digits":  # ten times longer once read out: refused, not spoken for half an hour
        with pytest.raises(TextTooLongError, match="reads out as"):
            cv2_engine.segments(text)
        return
    segments = cv2_engine.segments(text)
    assert max(len(s.ids) for s in segments) <= COSYVOICE_MAX_TOKENS
    if case != "fdfa":  # 30 x U+FDFA is 31 tokens: one segment
        assert len(segments) > 1


def test_cosyvoice_markup_text_beyond_the_bound_is_refused_not_cut(cv2_engine):
    with pytest.raises(TextTooLongError, match="markup is one model call"):
        cv2_engine.segments("<|endofprompt|>" + "word " * 200)


def test_every_cosyvoice_profile_covers_the_longest_segment(cv2_engine, cv2_tiny_bundle):
    """The prefill of a segment at the bound, with the longest voice prompt, fits every device profile's LLM range."""
    from cosyedge.device.trt.profiles import CosyVoice2Bounds
    for device in PROFILES.values():
        bounds = CosyVoice2Bounds.from_config(cv2_engine.bundle.manifest.config, device)
        assert bounds.prefill >= 2 + COSYVOICE_MAX_TOKENS + 2 * bounds.prompt_speech
        llm = graph_profiles(cv2_engine.bundle, "fp32", device)["llm"]
        assert llm.input("inputs_embeds").max[1] >= 2 + COSYVOICE_MAX_TOKENS + 2 * bounds.prompt_speech


def test_instruct_text_is_bounded_after_nfkc(cv2_engine):
    assert cv2_engine.options(voice="tiny_spk_zh", instruct_text="用四川话说这句话").instruct_text
    with pytest.raises(TextTooLongError, match=f"the limit is {INSTRUCT_MAX_CHARS}"):
        cv2_engine.options(voice="tiny_spk_zh", instruct_text="speak slowly " * 231)  # 3,000 characters
    with pytest.raises(TextTooLongError, match="after NFKC"):
        cv2_engine.options(voice="tiny_spk_zh", instruct_text="\ufdfa" * 30)  # 30 characters, 540 after NFKC
