"""`--out` belongs to the user: the bundle writer never deletes what it did not write (the data-loss defect:
it used to remove the whole directory, so `--out ~/Documents` wiped the folder). The writer is the device's (it
writes the default voice's bundle on first use); `cosyedge quantize` refusing a user folder is tested in
tests/quantize/test_quantize_cli.py."""
from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from cosyedge.device.bundle import Bundle
from cosyedge.device.errors import BundleError
from cosyedge.device.bundle_writer import BundleWriter


def _write_bundle(out: Path, tag: str) -> Path:
    """A minimal real bundle (one Identity graph) written through the writer."""
    writer = BundleWriter(out)
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], tag,
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])])
    onnx.save(helper.make_model(graph), str(writer.work / "vits.fp32.onnx"))
    (writer.work / "sub").mkdir()
    (writer.work / "sub" / f"{tag}.txt").write_text(tag)
    writer.add_component("vits", "fp32", "vits.fp32.onnx")
    writer.add_asset("note", f"sub/{tag}.txt")
    writer.write_manifest(family="vits", name=tag, sample_rate=22050, voices=("a",),
                          provenance={"tool_version": "cosyedge-quantize 0.1.0"})
    return writer.commit()


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_refuses_a_folder_of_user_files_and_changes_nothing(tmp_path):
    documents = tmp_path / "Documents"
    documents.mkdir()
    (documents / "thesis.txt").write_text("years of work")
    with pytest.raises(BundleError, match="not a bundle written by cosyedge"):
        _write_bundle(documents, "new")
    assert (documents / "thesis.txt").read_text() == "years of work"
    assert sorted(p.name for p in documents.iterdir()) == ["thesis.txt"]
    assert _leftovers(tmp_path) == []


def test_refuses_a_file_in_place_of_the_directory(tmp_path):
    target = tmp_path / "bundle"
    target.write_text("mine")
    with pytest.raises(BundleError, match="not a directory"):
        _write_bundle(target, "new")
    assert target.read_text() == "mine"


def test_writes_into_a_new_or_empty_directory(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert Bundle.load(_write_bundle(empty, "one")).manifest.name == "one"
    assert Bundle.load(_write_bundle(tmp_path / "fresh" / "deep", "two")).manifest.name == "two"
    assert _leftovers(tmp_path) == []


def test_replaces_its_own_bundle_and_only_its_files(tmp_path):
    out = _write_bundle(tmp_path / "b", "old")
    _write_bundle(out, "new")
    bundle = Bundle.load(out)  # hashes every file
    assert bundle.manifest.name == "new"
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == \
        ["manifest.json", "sub", "sub/new.txt", "vits.fp32.onnx"]
    assert _leftovers(tmp_path) == []


def test_an_own_bundle_with_a_user_file_added_is_refused(tmp_path):
    out = _write_bundle(tmp_path / "b", "old")
    (out / "sub" / "notes.md").write_text("my notes")
    with pytest.raises(BundleError, match="not a bundle written by cosyedge"):
        _write_bundle(out, "new")
    assert (out / "sub" / "notes.md").read_text() == "my notes"
    assert Bundle.load(out).manifest.name == "old"


def test_a_foreign_manifest_does_not_make_a_folder_ours(tmp_path):
    out = tmp_path / "other"
    out.mkdir()
    (out / "manifest.json").write_text('{"provenance": {"tool_version": "someone-else 1.0"}, '
                                       '"components": [], "assets": []}')
    with pytest.raises(BundleError):
        _write_bundle(out, "new")
    assert (out / "manifest.json").is_file()


def test_a_failed_build_leaves_no_work_directory(tmp_path):
    with pytest.raises(RuntimeError, match="export failed"):
        with BundleWriter(tmp_path / "b") as writer:
            (writer.work / "half.onnx").write_bytes(b"partial")
            raise RuntimeError("export failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_bundle_the_runtime_would_refuse_never_reaches_out(tmp_path):
    out = _write_bundle(tmp_path / "b", "old")
    with pytest.raises(BundleError):
        with BundleWriter(out) as writer:
            writer.write_manifest(family="vits", name="broken", sample_rate=22050, voices=("a",),
                                  provenance={"tool_version": "cosyedge-quantize 0.1.0"})  # no graphs at all
            writer.commit()
    assert Bundle.load(out).manifest.name == "old"  # the old bundle is untouched
    assert _leftovers(tmp_path) == []
