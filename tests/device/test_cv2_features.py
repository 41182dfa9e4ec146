"""CosyVoice2 prompt features in numpy against the official torch outputs (vectors/features.npz).

Tolerances are those of vectors/README.md / tolerances.json (the official float32 results are compared with
float64-exact numpy here, so each bound is at least the official fp32-vs-fp64 error).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import soundfile as sf

from cosyedge.device.cosyvoice2 import features as F
from cosyedge.device.errors import InputError

FLOW_MEL = F.FlowMelConfig(n_fft=1920, hop=480, win=1920, n_mels=80, fmin=0.0, fmax=8000.0, sample_rate=24000)


@pytest.fixture(scope="module")
def golden(cv2_tiny_dir: Path) -> dict[str, np.ndarray]:
    with np.load(cv2_tiny_dir / "vectors" / "features.npz") as data:
        return {key: data[key] for key in data.files}


@pytest.fixture(scope="module")
def prompt(golden_dir: Path) -> tuple[np.ndarray, int]:
    wav, sr = sf.read(golden_dir / "audio" / "zero_shot_prompt.wav", dtype="float32")
    return wav, sr


@pytest.fixture(scope="module")
def sessions(cv2_tiny_dir: Path) -> tuple[ort.InferenceSession, ort.InferenceSession]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return tuple(ort.InferenceSession(str(cv2_tiny_dir / name), options, providers=["CPUExecutionProvider"])
                 for name in ("campplus.onnx", "speech_tokenizer_v2.onnx"))


def test_resample_24k_to_16k(golden, prompt):
    wav, sr = prompt
    np.testing.assert_array_equal(wav, golden["wav_24k"][0])
    wav_16k = F.resample(wav, sr, 16000)
    assert wav_16k.shape == golden["wav_16k"][0].shape and wav_16k.dtype == np.float32
    np.testing.assert_allclose(wav_16k, golden["wav_16k"][0], rtol=0, atol=1e-6)  # observed 1.2e-7


@pytest.mark.parametrize("sr_in, sr_out", [(44100, 16000), (48000, 24000), (16000, 24000)])
def test_resample_other_rates_keep_a_sine(sr_in, sr_out):
    # No golden for these rates: a 440 Hz tone must come out as the same tone (edges excluded) at ceil length.
    n = sr_in // 2
    wav = (0.5 * np.sin(2 * np.pi * 440 * np.arange(n) / sr_in)).astype(np.float32)
    out = F.resample(wav, sr_in, sr_out)
    assert out.shape == (-(-n * sr_out // sr_in),)
    expected = 0.5 * np.sin(2 * np.pi * 440 * np.arange(out.shape[0]) / sr_out)
    np.testing.assert_allclose(out[200:-200], expected[200:-200], rtol=0, atol=1e-3)


def test_mel_filterbanks_equal_librosa(golden):
    np.testing.assert_array_equal(F.whisper_mel_filters(128), golden["whisper_mel_filters_128x201"])
    np.testing.assert_array_equal(F.slaney_mel_filters(24000, 1920, 80, 0.0, 8000.0), golden["matcha_mel_basis_80x961"])


def test_kaldi_fbank_and_mean_normalisation(golden):
    fbank = F.kaldi_fbank(golden["wav_16k"][0])
    assert fbank.shape == (346, 80)
    np.testing.assert_allclose(fbank, golden["fbank_80"], rtol=0, atol=2e-3)  # observed 6.4e-4 (= official fp32 error)
    np.testing.assert_allclose(F.mean_normalize(fbank), golden["fbank_80_cmn"], rtol=0, atol=2e-3)


def test_whisper_log_mel(golden):
    log_mel = F.whisper_log_mel(golden["wav_16k"][0], F.whisper_mel_filters())
    assert log_mel.shape == (128, 348)
    np.testing.assert_allclose(log_mel, golden["whisper_logmel_128"][0], rtol=0, atol=1e-4)  # observed 1.6e-5


def test_flow_mel(golden):
    c = FLOW_MEL
    mel = F.flow_mel(golden["wav_24k"][0], c.n_fft, c.hop, c.win, c.n_mels, c.fmin, c.fmax, c.sample_rate)
    assert mel.shape == (174, 80)
    np.testing.assert_allclose(mel, golden["prompt_mel_24k"][0], rtol=0, atol=1e-4)  # observed 2.7e-5


def test_align_prompt(golden):
    tokens, mel = F.align_prompt(golden["speech_tokens"][0], golden["prompt_mel_24k"][0])
    np.testing.assert_array_equal(tokens, golden["zero_shot_prompt_tokens"][0])
    np.testing.assert_array_equal(mel, golden["zero_shot_prompt_mel"][0])
    short_tokens, short_mel = F.align_prompt(np.arange(10), np.zeros((15, 80), np.float32))
    assert short_tokens.shape == (7,) and short_mel.shape == (14, 80)


def test_extract_prompt(golden, prompt, sessions):
    wav, sr = prompt
    features = F.extract_prompt(wav, sr, *sessions, mel_config=FLOW_MEL)
    assert features.tokens.dtype == np.int64
    np.testing.assert_array_equal(features.tokens, golden["zero_shot_prompt_tokens"][0])  # exact
    np.testing.assert_allclose(features.mel, golden["zero_shot_prompt_mel"][0], rtol=0, atol=1e-4)
    np.testing.assert_allclose(features.embedding, golden["campplus_embedding"][0], rtol=0, atol=1e-3)  # obs. 1e-6
    # stereo input is averaged over channels
    stereo = F.extract_prompt(np.stack([wav, wav], axis=1), sr, *sessions, mel_config=FLOW_MEL)
    np.testing.assert_array_equal(stereo.tokens, features.tokens)


def test_speech_tokens_from_golden_log_mel(golden, sessions):
    tokenizer = sessions[1]
    names = [i.name for i in tokenizer.get_inputs()]
    log_mel = F.whisper_log_mel(golden["wav_16k"][0], F.whisper_mel_filters())
    out = tokenizer.run(None, {names[0]: log_mel[None], names[1]: np.array([log_mel.shape[1]], np.int32)})[0]
    np.testing.assert_array_equal(out.reshape(-1).astype(np.int64), golden["speech_tokens"][0])


def test_prompt_limits(sessions):
    sr = 16000
    with pytest.raises(InputError, match="at most 30 s"):
        F.extract_prompt(np.zeros(int(30.5 * sr), np.float32), sr, *sessions, mel_config=FLOW_MEL)
    with pytest.raises(InputError):
        F.extract_prompt(np.zeros(100, np.float32), sr, *sessions, mel_config=FLOW_MEL)
    with pytest.raises(InputError):
        F.extract_prompt(np.zeros(8000, np.float32), 4000, *sessions, mel_config=FLOW_MEL)  # below 8 kHz


RUN_WITHOUT_TORCH = """
import sys
import numpy as np, soundfile as sf, onnxruntime as ort
try:
    import torch
except ImportError:
    pass
else:
    raise SystemExit("blocker not active")
from cosyedge.device.cosyvoice2 import features as F
from cosyedge.device.cosyvoice2.frontend import TextFrontend
from cosyedge.quantize.cosyvoice2.tokenizer import write_tokenizer_json
tiny, wav_path, tok_path = sys.argv[1:4]
wav, sr = sf.read(wav_path, dtype="float32")
sessions = [ort.InferenceSession(f"{tiny}/{n}", providers=["CPUExecutionProvider"])
            for n in ("campplus.onnx", "speech_tokenizer_v2.onnx")]
cfg = F.FlowMelConfig(1920, 480, 1920, 80, 0.0, 8000.0, 24000)
features = F.extract_prompt(wav, sr, *sessions, mel_config=cfg)
frontend = TextFrontend(write_tokenizer_json(f"{tiny}/CosyVoice-BlankEN", tok_path))
segments = frontend.normalize("今天是2024年3月5日。")
print(features.tokens.shape[0], segments, frontend.encode(segments[0])[:3], "torch" in sys.modules)
"""


def test_runs_with_torch_unimportable(cv2_tiny_dir, golden_dir, tmp_path, torch_blocked_env):
    env = torch_blocked_env
    result = subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT_TORCH, str(cv2_tiny_dir),
         str(golden_dir / "audio" / "zero_shot_prompt.wav"), str(tmp_path / "tokenizer.json")],
        env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[0] == "87"
    assert result.stdout.strip().endswith("False")
