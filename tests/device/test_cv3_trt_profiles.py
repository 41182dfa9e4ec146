"""TensorRT profiles, engine plans and the GPU memory plan of `cosyvoice3` bundles, checked without a GPU (issue 24
item 2; CosyVoice2's are in test_trt_profiles.py): every shape the runtime feeds during the tiny release's golden
end-to-end and streaming runs lies within its graph's min..max on every device profile (the per-target graphs are
checked in tests/quantize/test_cv3_precision.py), the fixed sine-noise rows of `hift_source` included;
`build-engines --dry-run --json` and `memory-plan` work on a CosyVoice3 bundle for every device profile."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cosyedge.device.bundle import Bundle
from cosyedge.device.trt import cli as trt_cli
from cosyedge.device.trt.device_profiles import PROFILES, device_profile
from cosyedge.device.trt.profiles import graph_profiles
from trttools import STAGES, Shapes, assert_profiles_cover, cv3_golden_runs, record_shapes

_RECORDED: dict[str, Shapes] = {}


def _fed(bundle: Path, vectors: Path, profile_name: str, tmp_path: Path) -> Shapes:
    if profile_name not in _RECORDED:
        _RECORDED[profile_name] = record_shapes(bundle, "fp32", profile_name, tmp_path, cv3_golden_runs(vectors))
    return _RECORDED[profile_name]


def test_the_recording_saw_every_stage_and_a_growing_stream(cv3_tiny_bundle: Path, cv3_vectors: Path,
                                                            tmp_path: Path) -> None:
    fed = _fed(cv3_tiny_bundle, cv3_vectors, "agx-orin-64gb", tmp_path)
    assert set(STAGES) <= set(fed)
    assert 0 in {shape[3] for name, shape in fed["llm"] if name == "past_key"}          # prefill: empty cache
    noise_rows = {shape[0] for name, shape in fed["hift_source"] if name == "sine_noise"}
    assert len(noise_rows) > 10   # the streamed HiFT re-runs on a growing mel: one profile must hold every length
    mel_frames = {shape[2] for name, shape in fed["hift_source"] if name == "mel"}
    assert max(noise_rows) == 480 * max(mel_frames)


@pytest.mark.parametrize("profile_name", list(PROFILES))
def test_profiles_cover_every_shape_the_runtime_feeds(cv3_tiny_bundle: Path, cv3_vectors: Path, profile_name: str,
                                                      tmp_path: Path) -> None:
    assert_profiles_cover(cv3_tiny_bundle, "fp32", profile_name, _fed(cv3_tiny_bundle, cv3_vectors, profile_name,
                                                                      tmp_path))


def test_the_noise_rows_follow_the_output_samples(cv3_tiny_bundle: Path) -> None:
    profile = graph_profiles(Bundle.load(cv3_tiny_bundle, verify=False), "fp32",
                             device_profile("orin-nano-8gb"))["hift_source"]
    noise, mel = profile.input("sine_noise"), profile.input("mel")
    assert noise is not None and mel is not None
    assert noise.max[0] == 480 * mel.max[2] and noise.min[0] == 480 * mel.min[2] and noise.max[1] == 9
    bundle = Bundle.load(cv3_tiny_bundle, verify=False)
    widest = graph_profiles(bundle, "fp32", device_profile("agx-orin-64gb"))["hift_source"].input("sine_noise")
    assert widest is not None and widest.max[0] == bundle.manifest.config["hift_noise"]["max_rows"]   # 300 s


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = trt_cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("profile_name", list(PROFILES))
def test_dry_run_and_memory_plan_on_every_device_profile(cv3_tiny_bundle: Path, capsys, profile_name: str,
                                                         tmp_path: Path) -> None:
    code, out, err = _run(capsys, "build-engines", "--bundle", str(cv3_tiny_bundle), "--device-profile", profile_name,
                          "--dry-run", "--json", "--cache-dir", str(tmp_path), "--gpu-name", "Orin",
                          "--compute-capability", "8.7", "--tensorrt-version", "10.3.0")
    assert code == 0, err
    plan = json.loads(out)
    assert set(plan["graphs"]) == set(STAGES) and plan["cpu_graphs"] == ["campplus", "llm_align", "speech_tokenizer"]
    assert "sine_noise:" in plan["graphs"]["hift_source"]["provider_options"]["trt_profile_max_shapes"]
    code, out, err = _run(capsys, "memory-plan", "--bundle", str(cv3_tiny_bundle), "--device-profile", profile_name,
                          "--json")
    assert code == 0, err
    rows = json.loads(out)[profile_name]
    assert [r["stage"] for r in rows][:3] == ["llm", "flow", "hift"] and rows[-1]["fits"]
    assert rows[1]["weights_mb"] > 0


def test_the_memory_plan_reads_the_dit_sizes_from_the_manifest(cv3_tiny_bundle: Path) -> None:
    from cosyedge.device.trt.memory import ENCODER_CHANNELS, ModelSizes
    bundle = Bundle.load(cv3_tiny_bundle, verify=False)
    sizes = ModelSizes.from_bundle(bundle, "fp32")
    flow = bundle.manifest.config["flow_sizes"]
    assert (sizes.flow_heads, sizes.flow_channels, sizes.encoder_heads) == (flow["estimator_heads"],
                                                                           flow["estimator_width"], 0)
    assert sizes.encoder_channels == flow["encoder_width"] != ENCODER_CHANNELS
