"""`cosyedge quantize --model-dir`: an official release becomes a valid cosyvoice2 bundle, and a broken
release is rejected with a message naming the file and the key."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyedge.device.bundle import Bundle
from cosyedge.device.engine import Engine
from cosyedge.device.errors import ReleaseError
from cosyedge.device.sessions import SessionConfig, create_session
from cosyedge.quantize.cosyvoice2.bundle import write_bundle
from cosyedge.quantize.cosyvoice2.random_init import _sized_yaml, PRESETS
from cosyedge.quantize.cosyvoice2.release import read_yaml

GRAPHS = {"llm", "llm_align", "flow_encoder", "flow_estimator", "hift_source", "hift_decoder", "campplus",
          "speech_tokenizer"}


@pytest.fixture(scope="module")
def tiny_release(golden_dir: Path) -> Path:
    return golden_dir / "cosyvoice2-tiny"


@pytest.fixture()
def release_copy(tiny_release: Path, tmp_path: Path) -> Path:
    target = tmp_path / "release"
    shutil.copytree(tiny_release, target, ignore=shutil.ignore_patterns("vectors", "model.safetensors"))
    return target


def test_cli_builds_a_valid_bundle(tiny_release, tmp_path):
    out = tmp_path / "bundle"
    env = {**os.environ, "COSYEDGE_HOME": str(tmp_path / "home")}
    result = subprocess.run([sys.executable, "-m", "cosyedge.device.cli", "quantize", "--model-dir", str(tiny_release),
                             "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    bundle = Bundle.load(out)  # hashes every file
    manifest = bundle.manifest
    assert manifest.family == "cosyvoice2" and manifest.sample_rate == 24000
    assert {c.name for c in manifest.components} == GRAPHS and manifest.precisions == ("fp32",)
    assert manifest.voices == ("tiny_spk_zh", "tiny_spk_en", "tiny_sft_spk")
    assert manifest.config["sampling"] == {"top_p": 0.8, "top_k": 25, "win_size": 10, "tau_r": 0.1}
    assert manifest.provenance["source_files"]["llm.pt"]
    llm = bundle.component("llm", "fp32")   # one LLM graph for prefill and decode
    assert [t.name for t in llm.inputs] == ["inputs_embeds", "past_key", "past_value", "attention_mask",
                                            "position_ids"]
    created: list[str] = []

    def factory(path: Path, config: SessionConfig):
        created.append(path.name)
        return create_session(path, config)

    sessions = SessionConfig(providers=("cpu",), intra_op_threads=1, session_factory=factory)
    engine = Engine.load(out, precision="fp32", sessions=sessions, warmup=False)
    assert [name for name in created if name.startswith("llm")] == ["llm.fp32.onnx"]   # ONE session, both call kinds
    assert engine.pipeline.describe()["precision"]["llm"] == "fp32"
    noise = np.load(bundle.asset("cfm_noise"))
    assert noise.shape == (1, 80, 15000) and abs(float(noise.sum()) - -1291.2014) < 1e-2
    zh = np.load(bundle.asset("voice:tiny_spk_zh"))
    assert str(zh["kind"]) == "zero_shot" and zh["prompt_speech_feat"].shape == (174, 80)
    assert str(zh["prompt_text"]) == "希望你以后能够做的比我还好呦。"
    assert str(np.load(bundle.asset("voice:tiny_sft_spk"))["kind"]) == "sft"


def test_bundle_graphs_reproduce_golden_spks(tiny_release, tmp_path, golden_dir):
    """The exported flow encoder inside the bundle computes the golden speaker projection."""
    import onnxruntime as ort
    bundle = Bundle.load(write_bundle(tiny_release, tmp_path / "b"))
    flow = np.load(golden_dir / "cosyvoice2-tiny/vectors/flow.npz")
    session = ort.InferenceSession(str(bundle.path(bundle.component("flow_encoder", "fp32").file)),
                                   providers=["CPUExecutionProvider"])
    tokens = np.concatenate([flow["sft0_s0__prompt_token"], flow["sft0_s0__token"], np.zeros((1, 3), np.int32)], 1)
    _, spks = session.run(None, {"token": tokens.astype(np.int64), "embedding": flow["sft0_s0__embedding"],
                                 "finalize": np.ones(1, np.int64), "streaming": np.zeros(1, np.int64)})
    np.testing.assert_allclose(spks, flow["sft0_s0__spks"], atol=1e-4)


def test_missing_file_is_named(release_copy, tmp_path):
    (release_copy / "hift.pt").unlink()
    with pytest.raises(ReleaseError, match="hift.pt: missing from the release directory"):
        write_bundle(release_copy, tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_renamed_key_is_named(release_copy, tmp_path):
    state = torch.load(release_copy / "flow.pt", weights_only=True)
    state["encoder.after_norm.bias_renamed"] = state.pop("encoder.after_norm.bias")
    torch.save(state, release_copy / "flow.pt")
    with pytest.raises(ReleaseError, match="flow.pt: missing key 'encoder.after_norm.bias'"):
        write_bundle(release_copy, tmp_path / "b")


def test_wrong_shape_is_named(release_copy, tmp_path):
    state = torch.load(release_copy / "llm.pt", weights_only=True)
    state["llm_decoder.bias"] = state["llm_decoder.bias"][:-1]
    torch.save(state, release_copy / "llm.pt")
    with pytest.raises(ReleaseError, match=r"llm.pt: key 'llm_decoder.bias' has shape \(6563,\), expected \(6564,\)"):
        write_bundle(release_copy, tmp_path / "b")


def test_cli_reports_a_broken_release_in_one_line(release_copy, tmp_path):
    (release_copy / "cosyvoice2.yaml").write_text("llm: [unclosed")
    result = subprocess.run([sys.executable, "-m", "cosyedge.device.cli", "quantize", "--model-dir", str(release_copy),
                             "--out", str(tmp_path / "b")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "cosyvoice2.yaml: not a readable yaml file" in result.stderr and "Traceback" not in result.stderr


def test_full_size_preset_yaml_has_the_real_sizes(tiny_release, tmp_path):
    """The random-init release's yaml describes CosyVoice2-0.5B (the weights themselves are benchmarked, not tested)."""
    text = _sized_yaml((tiny_release / "cosyvoice2.yaml").read_text(), PRESETS["cosyvoice2-0.5b"]["yaml"])
    (tmp_path / "cosyvoice2.yaml").write_text(text)
    hp = read_yaml(tmp_path / "cosyvoice2.yaml")
    est = hp["flow"]["decoder"]["estimator"]
    assert (hp["llm_input_size"], hp["flow"]["encoder"]["num_blocks"], est["channels"], est["num_mid_blocks"],
            hp["hift"]["base_channels"]) == (896, 6, [256], 12, 512)
    assert est["static_chunk_size"] == 50  # !ref arithmetic survives


def test_bench_graphs_reports_every_stage(tiny_release, tmp_path):
    from cosyedge.device.bench.graphs import run_graph_bench
    report = run_graph_bench(write_bundle(tiny_release, tmp_path / "b"), tokens=12, prompt=9, threads=1, repeats=1)
    assert set(report["graph_ms"]) == {"llm_prefill", "llm_decode_per_token", "flow_encoder", "flow_estimator_call",
                                       "hift_source", "hift_decoder"}
    assert all(v > 0 for v in report["graph_ms"].values()) and report["audio_s"] == 24 * 480 / 24000
    assert set(report["stage_s"]) == {"llm", "flow", "hift"} and report["peak_rss_mb"] > 0
    estimator = report["estimator"]  # arithmetic counted from the graph, achieved rate beside the GEMM ceiling
    assert {"MatMul", "Conv"} <= set(estimator["macs_by_op"]) and estimator["mac_per_frame"] > 0
    assert {"MatMul", "Softmax", "Conv"} <= set(estimator["ms_by_op"]) and "If" not in estimator["ms_by_op"]
    assert estimator["achieved_gops"] > 0
    assert estimator["gemm_ceiling"]["fp32_gops"] > 0 and estimator["gemm_ceiling"]["int8_dynamic_gops"] > 0


def test_legacy_weight_norm_keys_load_the_same(release_copy):
    """Releases saved by older torch use weight_g / weight_v; both styles give the same HiFT weights."""
    from cosyedge.quantize.cosyvoice2.release import Release
    new_style = Release.open(release_copy).checkpoint("hift.pt")
    state = torch.load(release_copy / "hift.pt", weights_only=True)
    legacy = {}
    for key, value in state.items():
        key = key.replace(".parametrizations.weight.original0", ".weight_g").replace(".parametrizations.weight.original1", ".weight_v")
        legacy["generator." + key] = value  # HiFiGan-trainer checkpoints also carry this prefix
    torch.save(legacy, release_copy / "hift.pt")
    old_style = Release.open(release_copy).checkpoint("hift.pt")
    assert set(old_style) == set(new_style)
    for key in new_style:
        torch.testing.assert_close(old_style[key], new_style[key], rtol=0, atol=0)
