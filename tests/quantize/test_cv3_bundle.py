"""`cosyedge quantize --model-dir` on a Fun-CosyVoice3 release: routed by cosyvoice3.yaml to a valid `cosyvoice3`
bundle (docs/bundle_cosyvoice3.md) whose tables, voices and noise recipe match the release and the goldens."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cosyedge.device.bundle import Bundle
from cosyedge.device.cosyvoice3.vocoder import SineNoise
from cosyedge.device.errors import BundleError

GRAPHS = {"llm", "llm_align", "flow_encoder", "flow_estimator", "hift_source", "hift_decoder", "campplus",
          "speech_tokenizer"}


def _cli(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "COSYEDGE_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "cosyedge.device.cli", "quantize", *args], capture_output=True,
                          text=True, env=env, timeout=600)


def test_cli_routes_a_cosyvoice3_release(golden_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    result = _cli("--model-dir", str(golden_dir / "cosyvoice3-tiny"), "--out", str(out), home=tmp_path / "home")
    assert result.returncode == 0, result.stderr[-2000:]
    manifest = Bundle.load(out).manifest  # hashes every file
    assert manifest.family == "cosyvoice3" and manifest.sample_rate == 24000 and manifest.precisions == ("fp32",)
    assert {c.name for c in manifest.components} == GRAPHS
    assert manifest.voices == ("zs_full", "zs_2s")


def test_cli_refuses_an_unknown_target(golden_dir: Path, tmp_path: Path) -> None:
    result = _cli("--model-dir", str(golden_dir / "cosyvoice3-tiny"), "--out", str(tmp_path / "b"), "--target", "npu",
                  home=tmp_path / "home")
    assert result.returncode == 2 and "unknown --target 'npu'" in result.stderr and not (tmp_path / "b").exists()


def test_manifest_config(cv3_tiny_bundle: Path) -> None:
    cfg = Bundle.load(cv3_tiny_bundle, verify=False).manifest.config
    assert (cfg["sos"], cfg["eos"], cfg["task_id"], cfg["min_len_masked_id"]) == (6561, 6562, 6563, 6561)
    assert cfg["stop_ids"] == list(range(6561, 6761))
    assert (cfg["min_token_text_ratio"], cfg["max_token_text_ratio"]) == (2, 20)
    assert cfg["sampling"] == {"top_p": 0.8, "top_k": 25, "win_size": 10, "tau_r": 0.1}
    assert (cfg["token_mel_ratio"], cfg["pre_lookahead_len"], cfg["n_timesteps"], cfg["estimator_chunk"]) == \
        (2, 3, 10, 50)
    assert cfg["mel"]["fmax"] is None and cfg["mel"]["n_fft"] == 1920
    assert (cfg["hift_upsample"], cfg["hift_f0_lookahead"], cfg["hift_conv_pre_lookahead"]) == (480, 3, 4)
    assert cfg["hift_noise"]["draws_before"] == 1763041 and cfg["hift_noise"]["harmonics"] == 9
    assert cfg["stream"] == {"hops": [25, 50, 100], "lookahead": 3}
    assert cfg["silent_tokens"] == [1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323]
    assert cfg["instruct2_saved_speaker_quirk"] is True


def test_tables_and_noise(cv3_tiny_bundle: Path, golden_dir: Path) -> None:
    bundle = Bundle.load(cv3_tiny_bundle, verify=False)
    speech = np.load(bundle.asset("speech_embedding"))
    assert speech.shape == (6761, 24)
    np.testing.assert_array_equal(np.load(bundle.asset("llm_embedding")), speech[[6561, 6563]])
    golden = np.load(golden_dir / "cosyvoice3-tiny" / "vectors" / "noise.npz")
    np.testing.assert_array_equal(np.load(bundle.asset("cfm_noise"))[:, :, :460], golden["cfm_rand_noise"])
    recipe = bundle.manifest.config["hift_noise"]
    rows = SineNoise(recipe, 24000).rows(golden["hift_sine_waves"].shape[0])
    np.testing.assert_array_equal(rows, golden["hift_sine_waves"])           # regenerated on the device, bit-exact
    with pytest.raises(BundleError, match="check row"):
        SineNoise({**recipe, "draws_before": recipe["draws_before"] + 1}, 24000).rows(10)


def test_voices_are_spk2info(cv3_tiny_bundle: Path, golden_dir: Path) -> None:
    bundle = Bundle.load(cv3_tiny_bundle, verify=False)
    ref = np.load(golden_dir / "cosyvoice3-tiny" / "vectors" / "frontend.npz")
    for name in ("zs_full", "zs_2s"):
        voice = np.load(bundle.asset(f"voice:{name}"))
        assert str(voice["kind"]) == "zero_shot"
        np.testing.assert_array_equal(voice["prompt_text_ids"], ref[f"spk2info_{name}__prompt_text"].reshape(-1))
        np.testing.assert_array_equal(voice["flow_prompt_speech_token"],
                                      ref[f"spk2info_{name}__flow_prompt_speech_token"].reshape(-1))
        np.testing.assert_array_equal(voice["prompt_speech_feat"], ref[f"spk2info_{name}__prompt_speech_feat"][0])
        np.testing.assert_array_equal(voice["flow_embedding"], ref[f"spk2info_{name}__flow_embedding"].reshape(-1))
    assert str(np.load(bundle.asset("voice:zs_2s"))["prompt_text"]).endswith("<|endofprompt|>希望你以后能够")
