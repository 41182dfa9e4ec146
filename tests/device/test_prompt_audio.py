"""Prompt uploads cannot exhaust memory, and any rate from 8 kHz up is resampled, not refused (issue 10).

The defect: the exact polyphase kernel has `new x (2 width + orig)` taps for the reduced rates, so a WAV header
claiming 47999 Hz made a kernel of several GiB and one upload got the service killed under its MemoryMax.
"""
from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cosyedge.device.cosyvoice2.features import _resample_direct, resample
from cosyedge.device.engine import Engine
from cosyedge.device.errors import InputError
from cosyedge.device.sessions import SessionConfig
from cosyedge.device.voice_store import MAX_PROMPT_BYTES, read_prompt_audio

TRANSCRIPT = "希望你以后能够做的比我还好呦。"


def _wav_bytes(wav: np.ndarray, rate: int) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, wav, rate, format="WAV")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def prompt(golden_dir: Path) -> tuple[np.ndarray, int]:
    wav, rate = sf.read(golden_dir / "audio" / "zero_shot_prompt.wav", dtype="float32")
    return wav, rate


@pytest.mark.parametrize("sr_in, sr_out", [(22050, 16000), (48000, 16000), (8000, 16000), (16000, 24000),
                                           (44100, 24000), (11025, 22050)])
def test_direct_path_is_the_same_filter_as_the_polyphase_kernel(sr_in, sr_out):
    wav = np.random.default_rng(sr_in).uniform(-0.5, 0.5, sr_in // 4).astype(np.float32)
    exact = resample(wav, sr_in, sr_out)  # these pairs take the polyphase path (torchaudio-equal, golden-tested)
    from math import ceil, gcd
    g = gcd(sr_in, sr_out)
    direct = _resample_direct(wav, sr_in // g, sr_out // g, 6, 0.99, ceil(sr_out // g * wav.size / (sr_in // g)))
    assert direct.shape == exact.shape
    assert float(np.max(np.abs(direct - exact))) < 1e-5


def test_odd_rate_resamples_in_bounded_memory():
    """In a child limited to 1.5 GB of address space: the old kernel (about 6 GB) raised MemoryError."""
    code = (
        "import resource, numpy as np\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1536 << 20, 1536 << 20))\n"
        "from cosyedge.device.cosyvoice2.features import resample\n"
        "wav = np.random.default_rng(0).uniform(-0.5, 0.5, 3 * 47999).astype(np.float32)\n"
        "out = resample(wav, 47999, 16000)\n"
        "assert out.shape == (48000,) and np.isfinite(out).all(), out.shape\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_odd_rate_resampling_keeps_the_signal():
    """A 440 Hz tone at 47999 Hz comes out as the same tone at 16 kHz."""
    t = np.arange(2 * 47999) / 47999
    out = resample((0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 47999, 16000)
    expected = 0.5 * np.sin(2 * np.pi * 440 * np.arange(out.size) / 16000)
    middle = slice(200, -200)  # away from the zero-padded edges
    assert float(np.max(np.abs(out[middle] - expected[middle]))) < 1e-3


@pytest.mark.parametrize("rate", [8000, 11025, 47999])
def test_prompts_from_8_khz_up_register(cv2_tiny_bundle, tmp_path, prompt, rate):
    wav, sr = prompt
    audio = np.interp(np.arange(0, wav.size, sr / rate), np.arange(wav.size), wav).astype(np.float32)
    engine = Engine.load(cv2_tiny_bundle, precision="fp32", warmup=False, state_dir=tmp_path,
                         sessions=SessionConfig(providers=("cpu",), intra_op_threads=1))
    engine.add_voice(f"r{rate}", _wav_bytes(audio, rate), TRANSCRIPT)
    assert f"r{rate}" in engine.voices()


@pytest.mark.parametrize("rate, message", [(4000, "4000 Hz; 8000-192000 Hz"), (384000, "384000 Hz; 8000-192000 Hz")])
def test_rates_outside_8_to_192_khz_are_refused(rate, message):
    with pytest.raises(InputError, match=message):
        read_prompt_audio(_wav_bytes(np.full(2 * rate, 0.1, np.float32), rate))


def test_size_rate_and_duration_are_checked_before_decoding(monkeypatch):
    import cosyedge.device.voice_store as voice_store

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded before the header checks")

    monkeypatch.setattr(voice_store.sf, "read", no_decoding)
    with pytest.raises(InputError, match="larger than 16 MB"):
        read_prompt_audio(b"RIFF" + bytes(MAX_PROMPT_BYTES))
    with pytest.raises(InputError, match="31.0 s long; at most 30 s"):
        read_prompt_audio(_wav_bytes(np.full(31 * 8000, 0.1, np.float32), 8000))
    with pytest.raises(InputError, match="4000 Hz"):
        read_prompt_audio(_wav_bytes(np.full(8000, 0.1, np.float32), 4000))
