"""TensorRT profiles and engine plans, checked without a GPU (issue 15).

The shapes the runtime really feeds are recorded through `SessionConfig.session_factory` during the golden
end-to-end and streaming runs of the tiny CosyVoice2 bundle (CPU provider), then every one must lie within the
min..max of its graph's profile, for every device profile. The TensorRT provider itself cannot run here.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from cosyedge.device.bundle import Bundle
from cosyedge.device.engine import Engine
from cosyedge.device.errors import ProviderError
from cosyedge.device.pipeline import SynthesisOptions
from cosyedge.device.sessions import SessionConfig
from cosyedge.device.trt import cli as trt_cli
from cosyedge.device.trt.device_profiles import PROFILES, device_profile
from cosyedge.device.trt.engines import GpuIdentity, cache_root
from trttools import STAGES, Shapes, assert_profiles_cover, record_shapes

GOLDEN = Path(__file__).resolve().parents[2].parent / "shared" / "golden" / "cosyvoice2-tiny" / "vectors"
CASES = json.loads((GOLDEN / "index.json").read_text(encoding="utf-8"))["e2e"] if (GOLDEN / "index.json").is_file() else []


_RECORDED: dict[str, Shapes] = {}


def _golden_runs(engine: Engine) -> None:
    """The golden e2e cases (render and stream) and the golden token streams."""
    for case in CASES:
        options = {"voice": case["sft_spk_id"] or "tiny_spk_zh", "mode": case["mode"], "speed": case["speed"],
                   "sampling": "greedy", "deterministic": True}
        if case["instruct_text"]:
            options["instruct_text"] = case["instruct_text"]
        engine.synthesize_waveform(case["text"], **options)
        list(engine.stream(case["text"], **options))
    with np.load(GOLDEN / "stream.npz") as golden:
        for case, voice in (("stream_zero_shot", "tiny_spk_zh"), ("stream_sft", "tiny_sft_spk")):
            tokens = golden[f"{case}__tokens"].reshape(-1).tolist()
            list(engine.pipeline.stream_tokens(tokens, SynthesisOptions(voice=voice, deterministic=True)))


def _fed_shapes(bundle_path: Path, profile_name: str, tmp_path: Path) -> Shapes:
    """graph name -> (input, shape) pairs fed during the golden runs under that device profile's limits."""
    if profile_name not in _RECORDED:
        _RECORDED[profile_name] = record_shapes(bundle_path, "fp32", profile_name, tmp_path, _golden_runs)
    return _RECORDED[profile_name]


def test_the_recording_saw_every_stage(cv2_tiny_bundle: Path, tmp_path: Path) -> None:
    assert CASES, "golden index missing"
    fed_shapes = _fed_shapes(cv2_tiny_bundle, "agx-orin-64gb", tmp_path)
    assert set(STAGES) <= set(fed_shapes)
    assert any(shape[0] > 2 for name, shape in fed_shapes["flow_estimator"] if name == "x")  # a batched render
    pasts = {shape[3] for name, shape in fed_shapes["llm"] if name == "past_key"}
    assert len(pasts) > 50  # the cache grew step after step: one profile must hold every length
    assert 0 in pasts       # ... from the prefill's empty cache on (one graph for prefill and decode)
    assert any(shape[1] > 1 for name, shape in fed_shapes["llm"] if name == "inputs_embeds")


@pytest.mark.parametrize("profile_name", list(PROFILES))
def test_profiles_cover_every_shape_the_runtime_feeds(cv2_tiny_bundle: Path, profile_name: str, tmp_path: Path) -> None:
    assert_profiles_cover(cv2_tiny_bundle, "fp32", profile_name, _fed_shapes(cv2_tiny_bundle, profile_name, tmp_path))


def test_cache_keys_follow_gpu_compute_capability_and_tensorrt(tmp_path: Path) -> None:
    nano = GpuIdentity("Orin (nvgpu)", "8.7", "10.3.0", "1.23.2")
    keys = {nano.cache_key(), GpuIdentity("NVIDIA GeForce RTX 4090", "8.9", "10.3.0", "1.23.2").cache_key(),
            GpuIdentity("Orin (nvgpu)", "8.7", "10.16.2", "1.23.2").cache_key(),
            GpuIdentity("Orin (nvgpu)", "8.6", "10.3.0", "1.23.2").cache_key(),
            GpuIdentity("Orin (nvgpu)", "8.7", "10.3.0", "1.24.0").cache_key()}
    assert len(keys) == 5
    assert nano.cache_key() == "orin-nvgpu-sm87-trt10.3.0-ort1.23.2"
    assert cache_root(tmp_path, nano).parent == tmp_path and "/" not in nano.cache_key()


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = trt_cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("profile_name", list(PROFILES))
def test_dry_run_json_is_valid_and_complete(cv2_tiny_bundle: Path, capsys, profile_name: str, tmp_path: Path) -> None:
    code, out, _ = _run(capsys, "build-engines", "--bundle", str(cv2_tiny_bundle), "--device-profile", profile_name,
                        "--dry-run", "--json", "--trtexec", "--cache-dir", str(tmp_path), "--gpu-name", "Orin",
                        "--compute-capability", "8.7", "--tensorrt-version", "10.3.0")
    assert code == 0
    plan = json.loads(out)
    assert plan["device_profile"]["name"] == profile_name and set(plan["graphs"]) == set(STAGES)
    assert plan["cpu_graphs"] == ["campplus", "llm_align", "speech_tokenizer"]
    bundle = Bundle.load(cv2_tiny_bundle, verify=False)
    for graph, entry in plan["graphs"].items():
        options = entry["provider_options"]
        dynamic = [s.name for s in bundle.selected("fp32")[graph].inputs if not all(isinstance(d, int) for d in s.shape)]
        for key in ("trt_profile_min_shapes", "trt_profile_opt_shapes", "trt_profile_max_shapes"):
            assert [part.split(":")[0] for part in options[key].split(",")] == dynamic, (graph, key)
        assert set(entry["profile"]) == set(dynamic)
        assert options["trt_engine_cache_enable"] and options["trt_timing_cache_enable"]
        assert options["trt_engine_cache_path"].startswith(plan["cache_root"])
        assert options["trt_max_workspace_size"] == PROFILES[profile_name].workspace_mb << 20
        assert "sm87-trt10.3.0" in plan["cache_root"]
        line = entry["trtexec"]
        assert "--stronglyTyped" in line and f"--maxShapes={options['trt_profile_max_shapes']}" in line
        assert f"--onnx={bundle.path(entry['file'])}" in line


def test_build_without_tensorrt_refuses_in_one_line(cv2_tiny_bundle: Path, capsys) -> None:
    code, out, err = _run(capsys, "build-engines", "--bundle", str(cv2_tiny_bundle))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "TensorRT is not available" in err
    assert str(cv2_tiny_bundle) not in err and " /" not in err  # no absolute paths


def test_service_mode_has_nothing_to_do_without_tensorrt(capsys, monkeypatch, cv2_tiny_bundle: Path) -> None:
    monkeypatch.setenv("COSYEDGE_BUNDLE", str(cv2_tiny_bundle))
    monkeypatch.setenv("COSYEDGE_PROVIDERS", "tensorrt,cpu")
    code, _, err = _run(capsys, "build-engines", "--service")
    assert code == 0 and "skipped" in err
    monkeypatch.setenv("COSYEDGE_PROVIDERS", "cpu")
    assert _run(capsys, "build-engines", "--service")[0] == 0


def test_tensorrt_options_reach_session_creation_only_for_tensorrt(cv2_tiny_bundle: Path, monkeypatch,
                                                                   tmp_path: Path) -> None:
    """The session wiring: a config whose TensorRT provider is offered gets the graph's profile; cpu does not."""
    from cosyedge.device.trt.providers import TrtSessionOptions
    trt = TrtSessionOptions(device_profile("orin-nano-8gb"), tmp_path, GpuIdentity("Orin", "8.7", "10.3.0", "x"))
    path = Bundle.load(cv2_tiny_bundle, verify=False).path("llm.fp32.onnx")
    monkeypatch.setattr(ort, "get_available_providers",
                        lambda: ["TensorrtExecutionProvider", "CPUExecutionProvider"])
    resolved = SessionConfig(providers=("tensorrt", "cpu"), trt=trt).resolved_providers(path)
    name, options = resolved[0]
    assert name == "TensorrtExecutionProvider" and "past_key:2x2x2x" in options["trt_profile_max_shapes"]
    assert SessionConfig(providers=("cpu",), trt=trt).resolved_providers(path) == ["CPUExecutionProvider"]
    limited = SessionConfig(providers=("tensorrt", "cpu"), trt=trt)
    assert (limited.row_limit(16), limited.flow_row_limit(8), limited.frame_limit(15000)) == (2, 1, 1500)
    assert SessionConfig(providers=("cpu",)).row_limit(16) == 16


def test_providers_and_memory_plan_commands(capsys, cv2_tiny_bundle: Path) -> None:
    code, out, _ = _run(capsys, "providers", "--json")
    status = {s["name"]: s for s in json.loads(out)}
    assert code == 0 and status["CPUExecutionProvider"]["usable"]
    for name in ("TensorrtExecutionProvider", "CUDAExecutionProvider"):  # CPU-only onnxruntime here
        assert not status[name]["usable"] and status[name]["reason"]
    code, out, _ = _run(capsys, "memory-plan", "--json")
    plans = json.loads(out)
    assert code == 0 and set(plans) == set(PROFILES)
    assert all(rows[-1]["fits"] for rows in plans.values())
    code, out, _ = _run(capsys, "memory-plan", "--bundle", str(cv2_tiny_bundle), "--device-profile", "orin-nano-8gb")
    assert code == 0 and "| llm |" in out and "orin-nano-8gb" in out


def test_unknown_device_profile_is_one_line(capsys, cv2_tiny_bundle: Path) -> None:
    code, _, err = _run(capsys, "memory-plan", "--device-profile", "jetson-tx1")
    assert code == 2 and "unknown device profile" in err and err.count("\n") == 1
    with pytest.raises(ProviderError):
        from cosyedge.device.trt.engines import detect_gpu
        detect_gpu()


def test_register_adds_the_commands() -> None:
    parser = argparse.ArgumentParser()
    trt_cli.register(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["build-engines", "--bundle", "b", "--dry-run", "--json"]).dry_run
    assert parser.parse_args(["memory-plan"]).func is trt_cli.cmd_memory_plan


def test_units_start_timeout_covers_the_documented_build_time() -> None:
    """Both units build engines before READY (ExecStartPre) and wait long enough for the slowest documented
    device; docs/jetson.md states the same minutes per device profile."""
    from cosyedge.device.trt.device_profiles import SERVE_LOAD_SECONDS, max_build_minutes
    repo = Path(__file__).resolve().parents[2]
    docs = (repo / "docs" / "jetson.md").read_text(encoding="utf-8")
    for profile in PROFILES.values():
        assert f"| `{profile.name}` |" in docs and f"| {profile.build_minutes} min |" in docs, profile.name
    for name in ("cosyedge.service", "cosyedge@.service"):
        lines = (repo / "systemd" / name).read_text(encoding="utf-8").splitlines()
        settings = dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))
        assert settings["ExecStartPre"].endswith("cosyedge build-engines --service")
        assert int(settings["TimeoutStartSec"]) >= max_build_minutes() * 60 + SERVE_LOAD_SECONDS, name


def test_gpu_check_script_skips_absent_gpu_providers(cv2_tiny_bundle: Path) -> None:
    """tools/gpu-check.sh on this CPU-only machine: CUDA and TensorRT skipped with the reason, the CPU run and
    its bench line printed, exit 0."""
    import os
    import subprocess
    import sys
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([str(repo / "tools" / "gpu-check.sh"), "--bundle", str(cv2_tiny_bundle), "--texts", "1"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("SKIP CUDAExecutionProvider:") for line in lines)
    assert any(line.startswith("SKIP TensorrtExecutionProvider:") for line in lines)
    assert any(line.split()[:2] == ["fp32", "cpu"] and "rtf" in line and line.endswith("ok") for line in lines)
