"""Writing bundles: files go into a fresh temporary sibling directory that is renamed into place at the end,
so an interrupted `cosyedge quantize` never leaves something that looks like a bundle.

`--out` is the user's path: the writer never deletes anything there that it did not write. An existing
directory is accepted only when it is empty or is a bundle this tool wrote that holds nothing but the
files its manifest lists; such an old bundle is replaced by a rename, and only its listed files are
removed afterwards. Anything else is refused before any work starts.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import onnx

from cosyedge.device.bundle import (MANIFEST, Asset, Bundle, Component, Manifest, TensorSpec, only_listed_files,
                                    sha256_file)
from cosyedge.device.errors import BundleError

TOOL_VERSION = "cosyedge-quantize 0.1.0"
TOOL_NAME = TOOL_VERSION.split()[0]


def _own_bundle_files(root: Path) -> list[Path] | None:
    """The files of a bundle this tool wrote at `root`, or None if `root` holds anything else."""
    try:
        data = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
        if not str(data["provenance"]["tool_version"]).startswith(TOOL_NAME):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return only_listed_files(root)


def check_out_dir(out: Path) -> None:
    """Refuse an output path that holds something the writer would have to delete (BundleError)."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise BundleError(f"--out {out.name!r} exists and is not a directory; choose a new or empty directory")
    if out.is_dir() and any(out.iterdir()) and _own_bundle_files(out) is None:
        raise BundleError(f"--out {out.name!r} is a non-empty directory that is not a bundle written by cosyedge; "
                          "nothing was changed: choose a new or empty directory")


def graph_specs(path: Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """Input and output signatures of an ONNX file, for the manifest."""
    graph = onnx.load(str(path), load_external_data=False).graph

    def specs(values) -> tuple[TensorSpec, ...]:
        out = []
        for value in values:
            tensor = value.type.tensor_type
            shape = tuple(d.dim_param or d.dim_value for d in tensor.shape.dim)
            out.append(TensorSpec(value.name, onnx.TensorProto.DataType.Name(tensor.elem_type).lower(), shape))
        return tuple(out)

    return specs(graph.input), specs(graph.output)


def created_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class BundleWriter:
    """Collects components and assets in `work`; `commit()` writes the manifest and moves it to `out`."""
    out: Path
    components: list[Component] = field(default_factory=list)
    assets: list[Asset] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        check_out_dir(self.out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))

    def add_component(self, name: str, precision: str, rel: str) -> Component:
        path = self.work / rel
        inputs, outputs = graph_specs(path)
        component = Component(name, precision, rel, sha256_file(path), inputs, outputs)
        self.components.append(component)
        return component

    def add_asset(self, name: str, rel: str) -> Asset:
        asset = Asset(name, rel, sha256_file(self.work / rel))
        self.assets.append(asset)
        return asset

    def write_manifest(self, **fields) -> Manifest:
        """Write (or rewrite) the manifest inside the work directory; the bundle can be loaded from `work`."""
        manifest = Manifest(components=tuple(self.components), assets=tuple(self.assets), **fields)
        (self.work / MANIFEST).write_text(manifest.to_json(), encoding="utf-8")
        return manifest

    def __enter__(self) -> "BundleWriter":
        return self

    def __exit__(self, exc_type, exc, traceback) -> bool:
        """Any failure before `commit()` (an export error, Ctrl-C) removes the work directory."""
        if exc_type is not None:
            self.abort()
        return False

    def commit(self) -> Path:
        """Validate the bundle with the runtime's own loader (hashes included), then move it to `out`; an old
        cosyedge bundle there is swapped out, then its files removed."""
        Bundle.load(self.work)  # what the runtime would refuse never reaches `out`
        check_out_dir(self.out)  # again: the directory may have changed during a long build
        self.work.chmod(0o755)  # mkdtemp made it private
        if self.out.is_dir() and not any(self.out.iterdir()):
            self.out.rmdir()
        if not self.out.exists():
            self.work.rename(self.out)
            return self.out
        old = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.old-", dir=self.out.parent))
        old.rmdir()
        self.out.rename(old)
        self.work.rename(self.out)
        for path in _own_bundle_files(old) or ():
            path.unlink()
        for folder in sorted((p for p in old.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            folder.rmdir()
        old.rmdir()  # fails loudly, rather than deleting, if anything unexpected appeared
        return self.out

    def abort(self) -> None:
        """Remove the work directory: it is this writer's own, created fresh by mkdtemp."""
        shutil.rmtree(self.work, ignore_errors=True)
