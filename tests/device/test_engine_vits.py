"""The engine on the real default voice (Piper joe, fp32, deterministic): no mocks."""
from __future__ import annotations

import numpy as np
import pytest

from cosyedge.device import BatchLimits
from cosyedge.device.errors import InputError, UnknownVoiceError

SHORT = "Hello there."
LONG = "Hello there. This sentence is quite a lot longer than the first one, and it keeps going for a while."


def _rms(samples: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(samples.astype(np.float64)))))


def test_output_non_silent_at_manifest_rate(default_engine):
    segment = default_engine.synthesize(SHORT, deterministic=True)
    assert segment.frame_rate == default_engine.bundle.manifest.sample_rate == 22050
    samples = np.array(segment.get_array_of_samples(), dtype=np.float32) / 32768
    assert segment.duration_seconds > 0.3
    assert _rms(samples) > 0.01


def test_duration_grows_with_text(default_engine):
    short = default_engine.synthesize(SHORT, deterministic=True).duration_seconds
    long = default_engine.synthesize(LONG, deterministic=True).duration_seconds
    assert long > 3 * short


def test_deterministic_mode_repeats_exactly(default_engine):
    a = default_engine.synthesize_waveform(SHORT, deterministic=True)
    b = default_engine.synthesize_waveform(SHORT, deterministic=True)
    np.testing.assert_array_equal(a, b)


def test_speed_changes_duration(default_engine):
    normal = default_engine.synthesize(LONG, deterministic=True).duration_seconds
    fast = default_engine.synthesize(LONG, speed=2.0, deterministic=True).duration_seconds
    slow = default_engine.synthesize(LONG, speed=0.5, deterministic=True).duration_seconds
    # Durations are ceil'd per phoneme, so halving them shortens the audio by a little less than half.
    assert 0.45 < fast / normal < 0.7
    assert 1.6 < slow / normal < 2.1


def test_stream_chunks_concatenate_to_full_result(default_engine):
    chunks = list(default_engine.stream(LONG, deterministic=True))
    assert len(chunks) == 2  # one chunk per sentence
    full = default_engine.synthesize_waveform(LONG, deterministic=True)
    streamed = np.concatenate(chunks)
    assert streamed.size == full.size
    # VITS renders one sentence per call (padded batches do not pay on a CPU), so the two paths are identical.
    np.testing.assert_array_equal(full, streamed)


def test_batch_results_equal_single_results_in_order(default_engine):
    texts = [LONG, SHORT, "Numbers like 42 are read out.", SHORT + " Again."]
    batch = default_engine.synthesize_batch(texts, BatchLimits(batch_max=4), deterministic=True)
    assert len(batch) == len(texts)
    for text, segment in zip(texts, batch):
        single = default_engine.synthesize(text, deterministic=True)
        assert len(segment.raw_data) == len(single.raw_data), text  # same length: trimmed to its own frames
        assert segment.raw_data == single.raw_data, text  # one sentence per model call: bit-identical


def test_emoji_and_unsupported_characters_are_skipped(default_engine):
    plain = default_engine.synthesize_waveform("Good morning.", deterministic=True)
    decorated = default_engine.synthesize_waveform("Good 😀 morning.\u0007 ✨", deterministic=True)
    np.testing.assert_array_equal(plain, decorated)


@pytest.mark.parametrize("text, message", [
    ("", "empty"), ("   \n\t", "empty"), ("😀🎉", "nothing speakable"), ("?!...", "nothing speakable"),
    ("a" * 2001, "limit is 2000"), (None, "must be a string"),
])
def test_bad_text_is_rejected(default_engine, text, message):
    with pytest.raises(InputError, match=message):
        default_engine.synthesize(text)


@pytest.mark.parametrize("speed", [0.1, 4.5, float("nan"), "fast"])
def test_bad_speed_is_rejected(default_engine, speed):
    with pytest.raises(InputError, match="speed"):
        default_engine.synthesize(SHORT, speed=speed)


def test_unknown_voice_is_rejected(default_engine):
    with pytest.raises(UnknownVoiceError, match="unknown voice 'nobody'"):
        default_engine.synthesize(SHORT, voice="nobody")


def test_numeric_speaker_id_maps_onto_voice_list(default_engine):
    assert default_engine.options(voice=7).voice == default_engine.voices()[7 % len(default_engine.voices())]
    with pytest.raises(UnknownVoiceError):
        default_engine.options(voice=-1)
