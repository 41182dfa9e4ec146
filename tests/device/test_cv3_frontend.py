"""Fun-CosyVoice3 device frontend (device/cosyvoice3/frontend.py) against the official goldens
(cosyvoice3-tiny/vectors: tokenizer_v3.json, meta.json, e2e_*.npz, silent_filter.npz, frontend.npz).

Tolerances: token ids, lengths exact; resampled wavs abs 1e-5 (vectors/README.md section 7). The spectra are
computed exactly (float64) here and the official ones in float32, so, as in the CosyVoice2 features test, the bound
is the official float32 error: whisper log-mel 1e-4, Kaldi fbank 2e-3 abs (log-energies), flow mel 1e-4 - except
the mel bins above the Nyquist frequency of a 22.05 kHz clip (11.025 kHz: empty after resampling, log-energies at
the 1e-5 floor where the official float32 STFT noise dominates): 1e-3 there. CAM++ embedding abs 1e-4.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import soundfile as sf

from cosyedge.device.cosyvoice2 import features as F
from cosyedge.device.cosyvoice3 import frontend as V3
from cosyedge.device.errors import InputError
from cosyedge.quantize.cosyvoice3.tokenizer import write_tokenizer_json
from goldentools import Measured

CASES = [f"{mode}_{i}" for mode in ("zero_shot", "cross_lingual", "instruct2") for i in (1, 2, 3)]
MEASURED = Measured()
_err = MEASURED.err


@pytest.fixture(scope="module")
def frontend(cv3_tiny_dir: Path, tmp_path_factory) -> V3.TextFrontend3:
    path = write_tokenizer_json(cv3_tiny_dir / "CosyVoice-BlankEN",
                                tmp_path_factory.mktemp("cv3tok") / "tokenizer.json")
    return V3.TextFrontend3(path)


@pytest.fixture(scope="module")
def table(cv3_vectors: Path) -> dict:
    return json.loads((cv3_vectors / "tokenizer_v3.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def sessions(cv3_tiny_dir: Path) -> tuple[ort.InferenceSession, ort.InferenceSession]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return tuple(ort.InferenceSession(str(cv3_tiny_dir / name), options, providers=["CPUExecutionProvider"])
                 for name in ("campplus.onnx", "speech_tokenizer_v3.onnx"))


# ------------------------------------------------------------------------------------------------------ tokenizer

def test_added_token_table(frontend: V3.TextFrontend3, table: dict) -> None:
    assert frontend._tokenizer.get_vocab_size() == table["len_tokenizer"] == 151924
    for token_id, content in table["added_tokens_decoder"].items():
        assert frontend._tokenizer.token_to_id(content) == int(token_id), content
    assert frontend.endofprompt_id == table["endofprompt_id"] == 151646


def test_encodings_and_instructions(frontend: V3.TextFrontend3, table: dict) -> None:
    for text, ids in table["encodings"].items():
        assert frontend.encode(text) == ids, text
    for instruction in table["instruct_list"]:      # every official instruction ends with <|endofprompt|>
        assert frontend.encode(instruction)[-1] == frontend.endofprompt_id
    assert frontend.encode("[j][ǐ]") == [151797, 151913]           # inline pinyin hot-fix tokens stay whole


@pytest.mark.parametrize("case", CASES)
def test_mode_token_ids(frontend: V3.TextFrontend3, cv3_vectors: Path, case: str) -> None:
    """Raw request -> segments -> ids per mode, exactly the official frontend's (e2e seg0 arrays)."""
    meta = json.loads((cv3_vectors / "meta.json").read_text(encoding="utf-8"))["e2e"][case]
    e = np.load(cv3_vectors / f"e2e_{case}.npz")
    mode, request = meta["case"]["mode"], meta["case"]
    prompt = request.get("prompt_text") or request.get("instruct_text") or ""
    segments = frontend.normalize(request["tts_text"], split=True)
    assert segments == meta["segments"]
    text_ids = V3.text_segments(frontend, request["tts_text"])
    prompt_ids = V3.prompt_text_ids(frontend, mode, prompt)
    np.testing.assert_array_equal(text_ids[0], e["seg0_text_token"].reshape(-1))
    np.testing.assert_array_equal(prompt_ids, e["seg0_prompt_text_token"].reshape(-1))
    features = F.PromptFeatures(tokens=e["seg0_flow_prompt_speech_token"].reshape(-1),
                                mel=e["seg0_prompt_speech_feat"][0], embedding=e["seg0_flow_embedding"][0])
    inputs = V3.segment_inputs(frontend, mode, text_ids[0], prompt_ids, features)
    np.testing.assert_array_equal(inputs.llm_prompt_speech, e["seg0_llm_prompt_speech_token"].reshape(-1))
    np.testing.assert_array_equal(inputs.flow_prompt_speech, e["seg0_flow_prompt_speech_token"].reshape(-1))
    assert list(inputs.min_max_len()) == e["seg0_min_len_max_len"].tolist()


def test_endofprompt_rule(frontend: V3.TextFrontend3) -> None:
    features = F.PromptFeatures(tokens=np.arange(4), mel=np.zeros((8, 80), np.float32),
                                embedding=np.zeros(192, np.float32))
    text = V3.text_segments(frontend, "Hello there.")[0]
    with pytest.raises(InputError, match="endofprompt"):
        V3.segment_inputs(frontend, "zero_shot", text, V3.prompt_text_ids(frontend, "zero_shot", "Just a transcript."),
                          features)
    with pytest.raises(InputError, match="endofprompt"):
        V3.segment_inputs(frontend, "cross_lingual", text, V3.prompt_text_ids(frontend, "cross_lingual"), features)
    ok = V3.segment_inputs(frontend, "cross_lingual",
                           V3.text_segments(frontend, f"{V3.SYSTEM_PROMPT}{V3.ENDOFPROMPT}Hello there.")[0],
                           V3.prompt_text_ids(frontend, "cross_lingual"), features)
    assert ok.prompt_text.size == 0 and ok.llm_prompt_speech.size == 0 and ok.flow_prompt_speech.size == 4
    with pytest.raises(InputError, match="unknown"):
        V3.prompt_text_ids(frontend, "sft")


# --------------------------------------------------------------------------------------------------- silent filter

def test_silent_filter_scripted(cv3_vectors: Path) -> None:
    g = np.load(cv3_vectors / "silent_filter.npz")
    assert V3.SILENT_TOKENS == frozenset(g["silent_tokens"].tolist())
    assert V3.filter_silent(g["llm_tokens"].tolist()) == g["flow_tokens"].tolist()


@pytest.mark.parametrize("case", CASES)
def test_silent_filter_end_to_end(cv3_vectors: Path, case: str) -> None:
    e = np.load(cv3_vectors / f"e2e_{case}.npz")
    flow = V3.filter_silent(e["seg0_llm_tokens"].tolist())
    assert flow == e["seg0_flow_tokens"].reshape(-1).tolist()
    f = V3.SilentFilter()
    assert [t for t in e["seg0_llm_tokens"].tolist() if f.keep(t)] == flow     # the streaming form agrees


# ----------------------------------------------------------------------------------------------- prompt features

def _clip(golden_dir: Path, vectors: Path, prefix: str) -> tuple[np.ndarray, int]:
    path = {"zs": golden_dir / "audio" / "zero_shot_prompt.wav", "zs2s": vectors / "audio" / "zero_shot_prompt_2s.wav",
            "xl3s": vectors / "audio" / "cross_lingual_prompt_3s_22050.wav"}[prefix]
    return sf.read(path, dtype="float32")


@pytest.mark.parametrize("prefix", ["zs", "zs2s", "xl3s"])
def test_prompt_feature_stages(golden_dir: Path, cv3_vectors: Path, sessions, prefix: str) -> None:
    g = np.load(cv3_vectors / "frontend.npz")
    wav, sr = _clip(golden_dir, cv3_vectors, prefix)
    wav_16k = F.resample(wav, sr, 16000)
    assert _err("wav_16k", wav_16k, g[f"{prefix}_wav_16k"][0]) <= 1e-5
    wav_24k = F.resample(wav, sr, 24000)
    if f"{prefix}_wav_24k" in g.files:                                # the 22.05 kHz clip
        assert _err("wav_24k_from_22050", wav_24k, g[f"{prefix}_wav_24k"][0]) <= 1e-5
    fbank = F.kaldi_fbank(g[f"{prefix}_wav_16k"][0])
    assert _err("kaldi_fbank", fbank, g[f"{prefix}_kaldi_fbank"]) <= 2e-3
    log_mel = F.whisper_log_mel(g[f"{prefix}_wav_16k"][0], F.whisper_mel_filters())
    assert _err("whisper_logmel", log_mel, g[f"{prefix}_whisper_logmel128"][0]) <= 1e-4
    c = V3.FLOW_MEL
    mel = F.flow_mel(wav_24k, c.n_fft, c.hop, c.win, c.n_mels, c.fmin, c.fmax, c.sample_rate)
    _mel_close(mel, g[f"{prefix}_speech_feat"][0], sr)


def _mel_close(got: np.ndarray, want: np.ndarray, source_rate: int) -> None:
    """abs 1e-4 on bins centred below the clip's own Nyquist frequency, 1e-3 above (module docstring)."""
    c = V3.FLOW_MEL
    centres = np.argmax(F.slaney_mel_filters(c.sample_rate, c.n_fft, c.n_mels, c.fmin, c.fmax), axis=1)
    in_band = centres * c.sample_rate / c.n_fft < 0.95 * source_rate / 2
    assert _err("flow_mel_fmax12k", got[:, in_band], want[:, in_band]) <= 1e-4
    assert _err("flow_mel_band_empty_bins", got, want) <= 1e-3


@pytest.mark.parametrize("prefix", ["zs", "zs2s", "xl3s"])
def test_prompt_features_end_to_end(golden_dir: Path, cv3_vectors: Path, sessions, prefix: str) -> None:
    g = np.load(cv3_vectors / "frontend.npz")
    wav, sr = _clip(golden_dir, cv3_vectors, prefix)
    p = V3.prompt_features(wav, sr, *sessions)
    np.testing.assert_array_equal(p.tokens, g[f"{prefix}_speech_token_aligned"].reshape(-1))
    _mel_close(p.mel, g[f"{prefix}_speech_feat_aligned"][0], sr)
    assert _err("campplus_embedding", p.embedding, g[f"{prefix}_campplus_embedding"][0]) <= 1e-4


@pytest.mark.parametrize("speaker, prefix", [("zs_full", "zs"), ("zs_2s", "zs2s")])
def test_saved_speaker_entries(frontend: V3.TextFrontend3, golden_dir: Path, cv3_vectors: Path, sessions,
                               speaker: str, prefix: str) -> None:
    """The official add_zero_shot_spk entries (spk2info.pt) from our frontend: prompt text ids, tokens, mel, emb."""
    g = np.load(cv3_vectors / "frontend.npz")
    text = {"zs_full": "希望你以后能够做的比我还好呦。", "zs_2s": "希望你以后能够"}[speaker]
    ids = V3.prompt_text_ids(frontend, "zero_shot", f"{V3.SYSTEM_PROMPT}{V3.ENDOFPROMPT}{text}")
    np.testing.assert_array_equal(ids, g[f"spk2info_{speaker}__prompt_text"].reshape(-1))
    wav, sr = _clip(golden_dir, cv3_vectors, prefix)
    p = V3.prompt_features(wav, sr, *sessions)
    np.testing.assert_array_equal(p.tokens, g[f"spk2info_{speaker}__llm_prompt_speech_token"].reshape(-1))
    _mel_close(p.mel, g[f"spk2info_{speaker}__prompt_speech_feat"][0], sr)
    assert _err("spk2info_embedding", p.embedding, g[f"spk2info_{speaker}__flow_embedding"][0]) <= 1e-4


def test_48k_prompt_resampling_keeps_a_tone() -> None:
    """No golden at 48 kHz: a 440 Hz tone must come out as the same tone at 16 and 24 kHz (edges excluded)."""
    wav = (0.5 * np.sin(2 * np.pi * 440 * np.arange(24000) / 48000)).astype(np.float32)
    for rate in (16000, 24000):
        out = F.resample(wav, 48000, rate)
        assert out.shape == (24000 * rate // 48000,)
        expected = 0.5 * np.sin(2 * np.pi * 440 * np.arange(out.shape[0]) / rate)
        np.testing.assert_allclose(out[200:-200], expected[200:-200], rtol=0, atol=1e-3)


def test_report() -> None:
    for name, value in sorted(MEASURED.items()):
        print(f"{name:32s} {value:.3e}")
