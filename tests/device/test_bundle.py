"""Bundle validation: every broken bundle is refused with a message naming the file and the fix."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cosyedge.device.bundle import MANIFEST, Bundle
from cosyedge.device.engine import Engine
from cosyedge.device.errors import BundleError


@pytest.fixture()
def bundle_copy(default_bundle_path: Path, tmp_path: Path) -> Path:
    """A copy whose graphs are hard links (cheap), so tests can break it freely."""
    target = tmp_path / "copy"
    shutil.copytree(default_bundle_path, target, copy_function=shutil.copy)
    return target


def _edit_manifest(root: Path, **changes) -> None:
    data = json.loads((root / MANIFEST).read_text())
    data.update(changes)
    (root / MANIFEST).write_text(json.dumps(data))


def test_default_bundle_is_valid(default_bundle_path):
    bundle = Bundle.load(default_bundle_path)
    manifest = bundle.manifest
    assert manifest.family == "vits" and manifest.sample_rate == 22050
    assert set(manifest.precisions) == {"fp32", "int8"}
    assert manifest.provenance["source_model_sha256"] and manifest.provenance["tool_version"]
    quality = manifest.quality
    assert len(quality["int8"]["sentences"]) == 4 and set(quality["rtf_cpu"]) == {"fp32", "int8"}
    # int8 only touches the flow: same durations, small distortion (the speaker check needs torch: the build host's,
    # tests/quantize/test_quantize_cli.py).
    assert quality["int8"]["passed"] and quality["int8"]["mean_mcd_db"] < 2.0
    assert all(r["samples_fp32"] == r["samples_int8"] for r in quality["int8"]["sentences"])
    assert "resemblyzer unavailable" in quality["speaker_similarity"] and "speaker_cosine" not in quality["int8"]
    assert manifest.default_precision in quality["default_precision_reason"]
    for comp in manifest.components:
        assert [t.name for t in comp.inputs] == ["input", "input_lengths", "scales", "seed"]
        assert [t.name for t in comp.outputs] == ["output", "frames", "durations"]


def test_missing_bundle_directory(tmp_path):
    with pytest.raises(BundleError, match="'nowhere' not found"):
        Bundle.load(tmp_path / "nowhere")


def test_missing_manifest(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(BundleError, match="no manifest.json"):
        Bundle.load(tmp_path / "empty")


def test_malformed_json(bundle_copy):
    (bundle_copy / MANIFEST).write_text("{ not json")
    with pytest.raises(BundleError, match="manifest.json .* is not valid JSON"):
        Bundle.load(bundle_copy)


def test_unknown_schema_version(bundle_copy):
    _edit_manifest(bundle_copy, schema_version=99)
    with pytest.raises(BundleError, match="unknown schema_version 99"):
        Bundle.load(bundle_copy)


def test_unknown_family(bundle_copy):
    _edit_manifest(bundle_copy, family="tacotron")
    with pytest.raises(BundleError, match="unknown family 'tacotron'"):
        Bundle.load(bundle_copy)


def test_missing_graph_file(bundle_copy):
    (bundle_copy / "vits.fp32.onnx").unlink()
    with pytest.raises(BundleError, match="'vits.fp32.onnx' .* is missing"):
        Engine.load(bundle_copy, precision="fp32")


def test_hash_mismatch(bundle_copy):
    with (bundle_copy / "phoneme_id_map.json").open("a") as handle:
        handle.write(" ")
    with pytest.raises(BundleError, match="'phoneme_id_map.json' does not match its sha256"):
        Bundle.load(bundle_copy)


def test_file_name_outside_bundle_is_refused(bundle_copy):
    data = json.loads((bundle_copy / MANIFEST).read_text())
    data["assets"][0]["file"] = "../../etc/passwd"
    (bundle_copy / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(BundleError, match="outside the bundle"):
        Bundle.load(bundle_copy)


def test_unknown_precision_request(default_bundle_path):
    with pytest.raises(BundleError, match="has no 'fp16' graphs"):
        Bundle.load(default_bundle_path, precision="fp16")


def test_int8_variant_runs(default_bundle_path):
    from cosyedge.device.sessions import SessionConfig
    engine = Engine.load(default_bundle_path, precision="int8", sessions=SessionConfig(providers=("cpu",), intra_op_threads=1))
    assert engine.synthesize("Testing the small graph.", deterministic=True).duration_seconds > 0.5
