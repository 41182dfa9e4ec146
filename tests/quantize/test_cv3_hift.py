"""Fun-CosyVoice3 vocoder (CausalHiFTGenerator) against the official goldens (cosyvoice3-tiny/vectors: hift.npz,
noise.npz, e2e_*.npz, streaming.npz).

Tolerances (vectors/README.md section 7): fixed noise exact; f0 (float64) abs 1e-6 Hz; source abs 5e-4;
waveform / tts_speech / streaming chunks abs 2e-4; sample counts and trimming exact.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyedge.quantize.cosyvoice3.hift import CausalHiFTGenerator, HiFT3Config, build_hift
from cosyedge.quantize.cosyvoice3.hift_source import NoiseSizes, fixed_sine_noise
from cosyedge.quantize.cosyvoice3.release import Release3, open_release
from goldentools import Measured

CASES = [f"{mode}_{i}" for mode in ("zero_shot", "cross_lingual", "instruct2") for i in (1, 2, 3)]
F0_ATOL = 1e-6
SOURCE_ATOL = 5e-4
WAVE_ATOL = 2e-4
MEASURED = Measured()
_err = MEASURED.err


@pytest.fixture(scope="module")
def hift(cv3_release: Release3) -> CausalHiFTGenerator:
    return build_hift(cv3_release)


def test_config_from_yaml(cv3_tiny_dir: Path) -> None:
    cfg = HiFT3Config.from_release_hparams(open_release(cv3_tiny_dir).hparams)
    assert (cfg.base_channels, cfg.f0_cond_channels, cfg.conv_pre_look_right, cfg.samples_per_frame) == (32, 32, 4, 480)


def test_fixed_noise_tiny(hift: CausalHiFTGenerator, cv3_vectors: Path) -> None:
    n = np.load(cv3_vectors / "noise.npz")
    assert hift.noise_sizes.draws_before() == 1_763_041
    ini, waves = hift.fixed_noise(n["hift_sine_waves"].shape[0])
    np.testing.assert_array_equal(ini.numpy(), n["hift_rand_ini"][0])
    np.testing.assert_array_equal(waves[:n["hift_sine_waves"].shape[0]].numpy(), n["hift_sine_waves"])


def test_fixed_noise_real_model_sizes() -> None:
    """The recipe placed for Fun-CosyVoice3-0.5B's sizes reproduces the values the official build printed."""
    real = NoiseSizes(mel_bins=80, flow_vocab=6561, flow_input_size=80, spk_embed_dim=192, f0_in_channels=80,
                      f0_cond_channels=512)
    assert real.draws_before() == 5_052_961
    ini, waves = fixed_sine_noise(real, 9, 1)
    np.testing.assert_allclose(ini, [0.0, 0.170989, 0.165332, 0.14378, 0.762947, 0.65893, 0.027519, 0.434825,
                                     0.053836], atol=1e-6)
    np.testing.assert_allclose(waves[0], [0.922826, 0.477448, 0.827052, 0.283457, 0.793482, 0.173435, 0.852375,
                                          0.922855, 0.73102], atol=1e-6)


def test_short_internals(hift: CausalHiFTGenerator, cv3_vectors: Path) -> None:
    g = np.load(cv3_vectors / "hift.npz")
    mel = torch.as_tensor(g["short_mel"])
    with torch.no_grad():
        f0 = hift.f0(mel)
        assert f0.dtype == torch.float64 and _err("f0", f0, g["short_f0_f64"]) <= F0_ATOL
        f0_up = torch.repeat_interleave(f0.float(), 480, dim=1).unsqueeze(-1)
        np.testing.assert_array_equal(f0_up.numpy(), g["short_f0_upsampled"])
        ini, waves = hift.fixed_noise(f0_up.shape[1])
        assert _err("sines_unit", hift.m_source.sines(f0_up, ini), g["short_sines_unit"]) <= SOURCE_ATOL
        source = hift.source(f0)
        assert _err("source", source, g["short_source"]) <= SOURCE_ATOL
        stft = hift.stft(source)
        assert _err("stft", stft[:, :9], g["short_stft_real"]) <= 1e-5
        assert _err("stft", stft[:, 9:], g["short_stft_imag"]) <= 1e-5
        trace: dict[str, torch.Tensor] = {}
        speech = hift.decode(mel, source, True, trace)
    for name in ("conv_pre", "ups0", "source_branch0", "ups1", "source_branch1", "ups2", "source_branch2",
                 "conv_post", "istft_out"):
        assert _err(f"decode_{name}", trace[name], g[f"short_{name}"]) <= WAVE_ATOL * 10, name   # pre-waveform
    assert _err("speech", speech, g["short_speech"]) <= WAVE_ATOL


@pytest.mark.parametrize("finalize", [True, False])
def test_prompt_mel_finalize(hift: CausalHiFTGenerator, cv3_vectors: Path, finalize: bool) -> None:
    """174 frames: finalize -> 480 T samples; not -> f0 T-3 frames, speech 480 (T-8), a prefix of the final one."""
    g = np.load(cv3_vectors / "hift.npz")
    mel = torch.as_tensor(g["prompt_mel"])
    speech, source, f0 = hift.inference(mel, finalize)
    tag = f"prompt_mel_fin{int(finalize)}"
    assert _err("f0", f0, g[f"{tag}_f0_f64"]) <= F0_ATOL
    assert _err("source", source, g[f"{tag}_source"]) <= SOURCE_ATOL
    assert _err("speech", speech, g[f"{tag}_speech"]) <= WAVE_ATOL
    T = mel.shape[2]
    assert speech.shape[1] == (T if finalize else T - 8) * 480
    if not finalize:
        full, _, _ = hift.inference(mel, True)
        np.testing.assert_array_equal(speech.numpy(), full[:, :speech.shape[1]].numpy())


@pytest.mark.parametrize("case", CASES)
def test_e2e_hift(hift: CausalHiFTGenerator, cv3_vectors: Path, case: str) -> None:
    e = np.load(cv3_vectors / f"e2e_{case}.npz")
    speech, source, f0 = hift.inference(torch.as_tensor(e["seg0_mel"]), True)
    assert _err("f0", f0, e["seg0_hift_f0_f64"]) <= F0_ATOL
    assert _err("source", source, e["seg0_hift_source"]) <= SOURCE_ATOL
    assert _err("speech", speech, e["seg0_tts_speech"]) <= WAVE_ATOL


@pytest.mark.parametrize("run", ["scripted", "instruct2_3"])
def test_streaming_emission(hift: CausalHiFTGenerator, cv3_vectors: Path, run: str) -> None:
    """HiFT re-run on the whole accumulated mel each chunk (finalize False until the last), only samples after
    the previous offset emitted; the official flow mels of each chunk are the input."""
    s = np.load(cv3_vectors / "streaming.npz")
    chunks = json.loads((cv3_vectors / "meta.json").read_text())["files"]["streaming.npz"][run]["chunks"]
    parts, offset = [], 0
    for i, chunk in enumerate(chunks):
        parts.append(s[f"{run}_chunk{i}_flow_mel"][:, :, 2 * chunk["token_offset"]:])
        mel = torch.as_tensor(np.concatenate(parts, axis=2))
        assert mel.shape[2] == chunk["hift_mel_frames"]
        raw, source, f0 = hift.inference(mel, chunk["hift_finalize"])
        assert raw.shape[1] == chunk["hift_speech_raw_len"] and offset == chunk["speech_offset_before"]
        assert _err("stream_f0", f0, s[f"{run}_chunk{i}_hift_f0_f64"]) <= F0_ATOL
        assert _err("stream_speech", raw[:, offset:], s[f"{run}_chunk{i}_tts_speech"]) <= WAVE_ATOL
        offset = raw.shape[1]
    np.testing.assert_array_equal(mel.numpy(), s[f"{run}_final_hift_mel"])
    assert _err("stream_final_source", source, s[f"{run}_final_hift_source"]) <= SOURCE_ATOL


def test_report_measured() -> None:
    print({k: f"{v:.2e}" for k, v in sorted(MEASURED.items())})
