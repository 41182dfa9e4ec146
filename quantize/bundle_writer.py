"""Writing bundles: files go into a temporary sibling directory that is renamed into place at the end,
so an interrupted `cosyedge quantize` never leaves something that looks like a bundle."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import onnx

from device.bundle import MANIFEST, Asset, Component, Manifest, TensorSpec, sha256_file

TOOL_VERSION = "cosyedge-quantize 0.1.0"


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
        self.work = self.out.with_name(f"{self.out.name}.tmp-{os.getpid()}")
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)

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

    def commit(self) -> Path:
        if self.out.exists():
            shutil.rmtree(self.out)
        self.work.rename(self.out)
        return self.out

    def abort(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
