"""Fun-CosyVoice3 ONNX graphs (quantize/cosyvoice3/export.py, hift_export.py) on ONNX Runtime CPU against the torch
modules and the official goldens (cosyvoice3-tiny/vectors).

Tolerances (vectors/README.md section 7, and the brief): graph vs torch abs 1e-4; log-probs 1e-4; token ids, stop
ids, lengths exact; mel 1e-4; f0 (float64) 1e-6 Hz; HiFT source 5e-4; waveform 2e-4. Measured figures are kept in
MEASURED (printed with -s by test_report).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from cosyedge.device.cosyvoice2.llm import cache_dims, prefill_feeds
from cosyedge.quantize.cosyvoice2.flow import cosine_t_span, fixed_noise
from cosyedge.quantize.cosyvoice3 import export as E
from cosyedge.quantize.cosyvoice3 import hift_export as HX
from cosyedge.quantize.cosyvoice3.llm import greedy_choice
from cosyedge.quantize.cosyvoice3.models import Models, load_models
from goldentools import Measured

CASES = [f"{mode}_{i}" for mode in ("zero_shot", "cross_lingual", "instruct2") for i in (1, 2, 3)]
ONNX_ATOL = 1e-4
MEL_ATOL = 1e-4
F0_ATOL = 1e-6
SOURCE_ATOL = 5e-4
WAVE_ATOL = 2e-4
MEASURED = Measured()
_err = MEASURED.err


def _flag(on: bool) -> np.ndarray:
    return np.array([int(on)], np.int64)


@pytest.fixture(scope="module")
def models(cv3_tiny_dir: Path) -> Models:
    return load_models(cv3_tiny_dir)


@pytest.fixture(scope="module")
def paths(models: Models, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("cv3_onnx")
    return E.export_llm(models.llm, out) | E.export_flow(models.flow, out) | HX.export_hift(models.hift, out)


@pytest.fixture(scope="module")
def s(paths: dict[str, Path]) -> dict[str, ort.InferenceSession]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return {name: ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            for name, path in paths.items()}


def test_graphs_are_standard_opset17(paths: dict[str, Path]) -> None:
    assert set(paths) == {"llm", "flow_encoder", "flow_estimator", "hift_source", "hift_decoder"}
    for path in paths.values():
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
        assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [17]
        assert all(node.domain in ("", "ai.onnx") for node in model.graph.node)


def test_signatures_and_metadata(s: dict[str, ort.InferenceSession], models: Models) -> None:
    c = models.llm.config
    assert s["llm"].get_outputs()[0].shape == ["batch", c.speech_vocab]      # 6761 speech logits only
    meta = s["llm"].get_modelmeta().custom_metadata_map
    assert (meta["sos"], meta["task_id"], meta["stop_id_min"], meta["stop_id_max"]) == ("6561", "6563", "6561", "6760")
    assert meta["min_len_masked_id"] == "6561"
    flow_meta = s["flow_estimator"].get_modelmeta().custom_metadata_map
    assert (flow_meta["estimator_chunk"], flow_meta["pre_lookahead_len"], flow_meta["token_mel_ratio"]) == \
        ("50", "3", "2")
    assert [i.name for i in s["flow_estimator"].get_inputs()] == ["x", "mask", "mu", "t", "spks", "cond",
                                                                   "streaming"]
    hift_meta = s["hift_source"].get_modelmeta().custom_metadata_map
    assert hift_meta["noise_draws_before"] == "1763041" and hift_meta["f0_lookahead"] == "3"
    assert [(o.name, o.type) for o in s["hift_source"].get_outputs()] == [("source", "tensor(float)"),
                                                                          ("f0", "tensor(double)")]


# ------------------------------------------------------------------------------------------------------------ LLM

@pytest.mark.parametrize("case", ["zero_shot_1", "cross_lingual_1", "instruct2_1"])
@torch.no_grad()
def test_llm_graphs_match_torch_and_teacher_forcing(models: Models, s, cv3_vectors: Path, case: str) -> None:
    """Prefill + 24 decode steps over the recorded tokens: logits and caches vs torch, log-probs vs tf_logp."""
    lm, g = models.llm, np.load(cv3_vectors / "llm.npz")
    lm_input = g[f"{case}_lm_input"]
    out = s["llm"].run(None, prefill_feeds(lm_input, np.ones(lm_input.shape[:2], np.int64), cache_dims(s["llm"])))
    ref = lm.prefill(torch.from_numpy(lm_input))
    for name, got, want in zip(("logits", "key", "value"), out, ref):
        assert _err(f"llm_{name}_vs_torch", got, want.numpy()) <= ONNX_ATOL
    rows = [torch.log_softmax(torch.from_numpy(out[0][0]), -1).numpy()]
    _, key, value = out
    tables = E.embedding_tables(lm)
    for token in g["recorded_tokens"].tolist():
        p = key.shape[3]
        embed = tables["speech_embedding"][token].reshape(1, 1, -1)
        logits, key, value = s["llm"].run(None, {"inputs_embeds": embed, "past_key": key, "past_value": value,
                                                 "attention_mask": np.ones((1, p + 1), np.int64),
                                                 "position_ids": np.array([[p]], np.int64)})
        rows.append(torch.log_softmax(torch.from_numpy(logits[0]), -1).numpy())
    assert _err("llm_tf_logp_vs_golden", np.stack(rows), g[f"{case}_tf_logp"]) <= ONNX_ATOL


@pytest.mark.parametrize("case", CASES)
def test_llm_graphs_greedy_decode_exact(models: Models, s, cv3_vectors: Path, case: str) -> None:
    """The runtime's loop: numpy gathers from the exported tables + the one graph reproduce the golden tokens."""
    e = np.load(cv3_vectors / f"e2e_{case}.npz")
    c, t = models.llm.config, E.embedding_tables(models.llm)
    prompt_text, text = e["seg0_prompt_text_token"].reshape(-1), e["seg0_text_token"].reshape(-1)
    speech = e["seg0_llm_prompt_speech_token"].reshape(-1)
    lm_input = np.concatenate([t["speech_embedding"][[c.sos]], t["embed_tokens"][np.concatenate([prompt_text, text])],
                               t["speech_embedding"][[c.task_id]], t["speech_embedding"][speech]])[None]
    np.testing.assert_array_equal(lm_input, e["seg0_lm_input"])
    min_len, max_len = c.min_max_len(text.shape[0])
    logits, key, value = s["llm"].run(None, prefill_feeds(lm_input, np.ones(lm_input.shape[:2], np.int64),
                                                          cache_dims(s["llm"])))
    _err("llm_logp_first_vs_golden", torch.log_softmax(torch.from_numpy(logits[0]), -1).numpy(),
         e["seg0_logp_first4"][0])
    tokens, stop = [], -1
    for step in range(max_len):
        token = greedy_choice(logits[0], step, min_len, c)
        if c.is_stop(token):
            stop = token
            break
        tokens.append(token)
        p = key.shape[3]
        logits, key, value = s["llm"].run(None, {
            "inputs_embeds": t["speech_embedding"][token].reshape(1, 1, -1), "past_key": key, "past_value": value,
            "attention_mask": np.ones((1, p + 1), np.int64), "position_ids": np.array([[p]], np.int64)})
    assert tokens == e["seg0_llm_tokens"].tolist()
    assert stop == int(e["seg0_llm_stop_id"])


# ----------------------------------------------------------------------------------------------------------- flow

def _encoder_token(prompt: np.ndarray, token: np.ndarray, k: int) -> np.ndarray:
    """prompt ++ tokens ++ k placeholders (finalize: zero look-ahead)."""
    return np.concatenate([prompt.reshape(-1), token.reshape(-1), np.zeros(k, np.int64)]).astype(np.int64)[None]


def _euler(estimator: ort.InferenceSession, mu, spks, cond, noise, cfg_rate: float, streaming: bool) -> np.ndarray:
    """The runtime's numpy CFG Euler loop around the estimator graph (official solve_euler, float32)."""
    t_span = cosine_t_span().numpy()
    frames = mu.shape[2]
    x = noise[:, :, :frames].copy()
    zeros = np.zeros_like(mu)
    feeds = {"mask": np.ones((2, 1, frames), np.float32), "mu": np.concatenate([mu, zeros]),
             "spks": np.concatenate([spks, np.zeros_like(spks)]), "cond": np.concatenate([cond, zeros]),
             "streaming": _flag(streaming)}
    t, dt = t_span[0], t_span[1] - t_span[0]
    for step in range(1, len(t_span)):
        (v,) = estimator.run(None, feeds | {"x": np.concatenate([x, x]), "t": np.full(2, t, np.float32)})
        x = x + dt * ((1.0 + cfg_rate) * v[:1] - cfg_rate * v[1:])
        t = t + dt
        if step < len(t_span) - 1:
            dt = t_span[step + 1] - t
    return x.astype(np.float32)


@pytest.mark.parametrize("mode", ["full", "stream"])
def test_estimator_graph_single_calls(s, cv3_vectors: Path, mode: str) -> None:
    g = np.load(cv3_vectors / "flow.npz")
    for call in ("est0", "est5"):
        feeds = {"x": g[f"{mode}_{call}_x"], "mask": g[f"{mode}_est0_mask"], "mu": g[f"{mode}_est0_mu"],
                 "t": g[f"{mode}_{call}_t"], "spks": g[f"{mode}_est0_spks"], "cond": g[f"{mode}_est0_cond"],
                 "streaming": _flag(mode == "stream")}
        (out,) = s["flow_estimator"].run(None, feeds)
        assert _err(f"estimator_{mode}", out, g[f"{mode}_{call}_out"]) <= MEL_ATOL


def test_estimator_graph_streaming_chunk_runs(s, cv3_vectors: Path) -> None:
    st = np.load(cv3_vectors / "streaming.npz")
    for run in ("scripted", "instruct2_3"):
        feeds = {n: st[f"{run}_chunk0_est0_{n}"] for n in ("x", "mask", "mu", "t", "spks", "cond")}
        (out,) = s["flow_estimator"].run(None, feeds | {"streaming": _flag(True)})
        assert _err("estimator_stream_chunk", out, st[f"{run}_chunk0_est0_out"]) <= MEL_ATOL


@pytest.mark.parametrize("case", CASES)
def test_flow_graphs_reproduce_mel(models: Models, s, cv3_vectors: Path, case: str) -> None:
    e = np.load(cv3_vectors / f"e2e_{case}.npz")
    c = models.flow.config
    prompt = e["seg0_flow_prompt_speech_token"]
    token = _encoder_token(prompt, e["seg0_flow_tokens"], c.pre_lookahead_len)
    mu, spks = s["flow_encoder"].run(None, {"token": token, "embedding": e["seg0_flow_embedding"],
                                            "finalize": _flag(True), "streaming": _flag(False)})
    assert _err("flow_mu", mu, e["seg0_mu"]) <= 1e-5 and _err("flow_spks", spks, e["seg0_spks"]) <= 1e-5
    prompt_feat = e["seg0_prompt_speech_feat"]
    cond = np.zeros_like(mu)
    cond[:, :, :prompt_feat.shape[1]] = prompt_feat.transpose(0, 2, 1)
    np.testing.assert_array_equal(cond, e["seg0_cond"])
    mel = _euler(s["flow_estimator"], mu, spks, cond, fixed_noise(), c.inference_cfg_rate, False)
    assert _err("flow_mel", mel[:, :, prompt_feat.shape[1]:], e["seg0_mel"]) <= MEL_ATOL


def test_flow_graphs_streaming_chunk(models: Models, s, cv3_vectors: Path) -> None:
    """A non-final streaming chunk (finalize 0: real look-ahead tokens; chunk-causal DiT) vs the golden chunk mel."""
    st = np.load(cv3_vectors / "streaming.npz")
    c = models.flow.config
    prompt, tokens = st["scripted_flow_prompt_speech_token"], st["scripted_flow_tokens"].reshape(-1)
    want = st["scripted_chunk0_flow_mel"]                      # (1, 80, 2 * (n - 3)) over n tokens so far
    n = want.shape[2] // c.token_mel_ratio + c.pre_lookahead_len
    token = np.concatenate([prompt.reshape(-1), tokens[:n]]).astype(np.int64)[None]
    mu, spks = s["flow_encoder"].run(None, {"token": token, "embedding": st["scripted_flow_embedding"],
                                            "finalize": _flag(False), "streaming": _flag(True)})
    with torch.no_grad():
        tmu, tspks = models.flow.encode(torch.from_numpy(token), torch.from_numpy(st["scripted_flow_embedding"]),
                                        torch.tensor([0]), torch.tensor([1]))
    assert _err("flow_mu_stream_vs_torch", mu, tmu.numpy()) <= 1e-5
    prompt_feat = st["scripted_prompt_speech_feat"]
    cond = np.zeros_like(mu)
    cond[:, :, :prompt_feat.shape[1]] = prompt_feat.transpose(0, 2, 1)
    mel = _euler(s["flow_estimator"], mu, spks, cond, fixed_noise(), c.inference_cfg_rate, True)
    assert _err("flow_mel_stream_chunk", mel[:, :, prompt_feat.shape[1]:], want) <= MEL_ATOL


# ----------------------------------------------------------------------------------------------------------- HiFT

def _hift(models: Models, s, mel: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """finalize=True through the two graphs: (speech, source, f0)."""
    samples = mel.shape[2] * models.hift.cfg.samples_per_frame
    noise = models.hift.fixed_noise(samples)[1][:samples + 480].numpy()   # longer than needed: the graph slices
    source, f0 = s["hift_source"].run(None, {"mel": mel, "sine_noise": noise})
    (speech,) = s["hift_decoder"].run(None, {"mel": mel, "source": source})
    return speech, source, f0


def _hift_streaming(models: Models, s, mel: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """finalize=False by the documented trimming rule: (speech, source, f0)."""
    speech, source, f0 = _hift(models, s, mel)
    frames, kept_source, kept_speech = HX.streaming_lengths(models.hift, mel.shape[2])
    source = source[:, :, :kept_source]
    (speech,) = s["hift_decoder"].run(None, {"mel": mel[:, :, :frames], "source": source})
    return speech[:, :kept_speech], source, f0[:, :frames]


@pytest.mark.parametrize("case", CASES)
def test_hift_graphs_end_to_end(models: Models, s, cv3_vectors: Path, case: str) -> None:
    e = np.load(cv3_vectors / f"e2e_{case}.npz")
    speech, source, f0 = _hift(models, s, e["seg0_mel"])
    assert _err("hift_f0_f64", f0, e["seg0_hift_f0_f64"]) <= F0_ATOL
    assert _err("hift_source", source, e["seg0_hift_source"]) <= SOURCE_ATOL
    assert _err("hift_speech", speech, e["seg0_tts_speech"]) <= WAVE_ATOL
    with torch.no_grad():
        tspeech, tsource, tf0 = models.hift.inference(torch.from_numpy(e["seg0_mel"]))
    assert _err("hift_speech_vs_torch", speech, tspeech.numpy()) <= ONNX_ATOL
    assert _err("hift_source_vs_torch", source, tsource.numpy()) <= ONNX_ATOL


@pytest.mark.parametrize("finalize", [True, False])
def test_hift_graphs_finalize_trimming(models: Models, s, cv3_vectors: Path, finalize: bool) -> None:
    g = np.load(cv3_vectors / "hift.npz")
    tag = "fin1" if finalize else "fin0"
    speech, source, f0 = (_hift if finalize else _hift_streaming)(models, s, g["prompt_mel"])
    assert _err("hift_f0_f64", f0, g[f"prompt_mel_{tag}_f0_f64"]) <= F0_ATOL
    assert _err("hift_source", source, g[f"prompt_mel_{tag}_source"]) <= SOURCE_ATOL
    assert _err(f"hift_speech_{tag}", speech, g[f"prompt_mel_{tag}_speech"]) <= WAVE_ATOL


@pytest.mark.parametrize("run", ["scripted", "instruct2_3"])
def test_hift_graphs_streaming_emitted_audio(models: Models, s, cv3_vectors: Path, run: str) -> None:
    """HiFT re-run on the accumulated mel each chunk, only new samples emitted (official CosyVoice3 token2wav)."""
    st = np.load(cv3_vectors / "streaming.npz")
    final_mel = st[f"{run}_final_hift_mel"]
    chunks = sorted({int(k.split("_chunk")[1].split("_")[0]) for k in st.files if "_chunk" in k and
                     k.startswith(run + "_chunk") and k.endswith("_tts_speech")})
    emitted_so_far = 0
    for i in chunks:
        last = i == chunks[-1]
        frames = final_mel.shape[2] if last else st[f"{run}_chunk{i}_flow_mel"].shape[2]
        mel = final_mel[:, :, :frames]
        speech, _, f0 = (_hift if last else _hift_streaming)(models, s, mel)
        assert _err("hift_stream_f0", f0, st[f"{run}_chunk{i}_hift_f0_f64"]) <= F0_ATOL
        new = speech[:, emitted_so_far:]
        assert _err("hift_stream_emitted", new, st[f"{run}_chunk{i}_tts_speech"]) <= WAVE_ATOL
        emitted_so_far = speech.shape[1]


def test_report() -> None:
    for name, value in sorted(MEASURED.items()):
        print(f"{name:32s} {value:.3e}")
