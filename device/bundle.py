"""Bundle format v1: a directory with `manifest.json` and the files it lists.

A bundle is what `cosyedge quantize` writes and what the device runtime loads. Everything is
validated once, at load: a bundle that loads is complete, hashed and of a known family.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cosyedge.device.errors import BundleError

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
FAMILIES = ("vits", "cosyvoice2", "cosyvoice3")
PRECISIONS = ("fp32", "fp16", "int8", "int4")  # numeric formats of single graphs (int4: LLM weights of cpu-int4)
TARGETS = ("cpu", "cpu-int4", "gpu-fp16", "trt-int8")  # build targets: per-graph precisions chosen by quality gates


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def only_listed_files(root: Path) -> list[Path] | None:
    """The files at `root` if it holds nothing but a manifest and the files it lists (no link, nothing
    unlisted), else None: what a tool may delete there without touching anything a user put in."""
    try:
        data = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
        listed = {MANIFEST} | {entry["file"] for key in ("components", "assets") for entry in data[key]}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    found = [path for path in root.rglob("*") if not path.is_dir()]
    if any(path.is_symlink() or path.relative_to(root).as_posix() not in listed for path in found):
        return None
    return found


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int | str, ...]


@dataclass(frozen=True)
class Component:
    """One ONNX graph of one precision; a stage may have several precisions in one bundle."""
    name: str
    precision: str
    file: str
    sha256: str
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()


@dataclass(frozen=True)
class Asset:
    """A non-graph file: tokenizer, phoneme map, fixed noise, voices."""
    name: str
    file: str
    sha256: str


@dataclass(frozen=True)
class Manifest:
    family: str
    name: str
    sample_rate: int
    components: tuple[Component, ...]
    assets: tuple[Asset, ...] = ()
    voices: tuple[str, ...] = ()
    default_precision: str = "fp32"
    config: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    quality: dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    @property
    def precisions(self) -> tuple[str, ...]:
        return tuple(p for p in PRECISIONS if any(c.precision == p for c in self.components))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, ensure_ascii=False, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Manifest":
        """Parse and validate a manifest dict; every problem is a BundleError naming the field."""
        if not isinstance(data, dict):
            raise BundleError(f"{MANIFEST}: top level must be a JSON object")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise BundleError(f"{MANIFEST}: unknown schema_version {version!r} (this runtime reads "
                              f"{SCHEMA_VERSION}); re-create the bundle with this version of `cosyedge quantize`")
        family = data.get("family")
        if family not in FAMILIES:
            raise BundleError(f"{MANIFEST}: unknown family {family!r}; known: {', '.join(FAMILIES)}")
        try:
            components = tuple(
                Component(**{**c, "inputs": tuple(TensorSpec(t["name"], t["dtype"], tuple(t["shape"])) for t in c.get("inputs", ())),
                             "outputs": tuple(TensorSpec(t["name"], t["dtype"], tuple(t["shape"])) for t in c.get("outputs", ()))})
                for c in data["components"])
            assets = tuple(Asset(**a) for a in data.get("assets", ()))
            manifest = cls(family=family, name=str(data["name"]), sample_rate=int(data["sample_rate"]),
                           components=components, assets=assets, voices=tuple(data.get("voices", ())),
                           default_precision=data.get("default_precision", "fp32"), config=dict(data.get("config", {})),
                           provenance=dict(data.get("provenance", {})), quality=dict(data.get("quality", {})),
                           schema_version=version)
        except (KeyError, TypeError, ValueError) as exc:
            raise BundleError(f"{MANIFEST}: malformed entry ({type(exc).__name__}: {exc}); re-create the bundle") from None
        for comp in components:
            if comp.precision not in PRECISIONS:
                raise BundleError(f"{MANIFEST}: component {comp.name!r} has unknown precision {comp.precision!r}")
        if manifest.default_precision not in manifest.precisions:
            raise BundleError(f"{MANIFEST}: default_precision {manifest.default_precision!r} has no components")
        return manifest


@dataclass(frozen=True)
class Bundle:
    """A validated bundle directory. Paths inside it are resolved only through `path()`."""
    root: Path
    manifest: Manifest
    sha256: str = ""  # of manifest.json as loaded: the bundle's identity (the manifest holds every file's sha256)

    @classmethod
    def load(cls, root: Path | str, precision: str | None = None, verify: bool = True) -> "Bundle":
        """Read and validate the manifest; hash the assets and the graphs of `precision` (all graphs if None)."""
        root = Path(root)
        label = root.name or str(root)
        if not root.is_dir():
            raise BundleError(f"bundle {label!r} not found: pass the directory written by `cosyedge quantize`")
        manifest_path = root / MANIFEST
        if not manifest_path.is_file():
            raise BundleError(f"bundle {label!r} has no {MANIFEST}: not a bundle, or an interrupted `cosyedge quantize`; re-run it")
        raw = manifest_path.read_bytes()
        try:
            data = json.loads(raw.decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BundleError(f"{MANIFEST} of bundle {label!r} is not valid JSON ({exc}); re-create the bundle") from None
        bundle = cls(root, Manifest.from_dict(data), hashlib.sha256(raw).hexdigest())
        checked = bundle.manifest.components if precision is None else tuple(bundle.selected(precision).values())
        for entry in (*checked, *bundle.manifest.assets):
            bundle._check_file(entry.file, entry.sha256, verify)
        return bundle

    def _check_file(self, rel: str, sha256: str, verify: bool) -> None:
        path = self.path(rel)
        if not path.is_file():
            raise BundleError(f"bundle {self.root.name!r}: file {rel!r} listed in {MANIFEST} is missing; re-create or re-copy the bundle")
        if verify and sha256_file(path) != sha256:
            raise BundleError(f"bundle {self.root.name!r}: file {rel!r} does not match its sha256 in {MANIFEST} "
                              "(corrupted or modified); re-create or re-copy the bundle")

    def path(self, rel: str) -> Path:
        """The absolute path of a file named in the manifest; refuses names that leave the bundle."""
        candidate = (self.root / rel).resolve()
        if self.root.resolve() not in candidate.parents:
            raise BundleError(f"{MANIFEST}: file name {rel!r} points outside the bundle")
        return candidate

    @property
    def targets(self) -> dict[str, Any]:
        """Precision targets written by `cosyedge quantize --target` (cpu, cpu-int4, gpu-fp16, trt-int8)."""
        return dict(self.manifest.config.get("targets", {}))

    def selected(self, selection: str) -> dict[str, Component]:
        """The component every graph runs with under `selection`.

        A target name (`cpu`, `cpu-int4`, `gpu-fp16`, `trt-int8`) uses the graphs its quality gates chose; a precision
        (`int8`) uses that precision where a graph has it and fp32 elsewhere (stages quantise unevenly).
        """
        names = list(dict.fromkeys(c.name for c in self.manifest.components))
        target = self.targets.get(selection)
        if target is not None:
            try:
                chosen = {name: self.component(entry["component"], entry["precision"])
                          for name, entry in target["graphs"].items()}
            except (KeyError, TypeError):
                raise BundleError(f"{MANIFEST}: target {selection!r} is malformed; re-create the bundle") from None
            return chosen | {n: self.component(n, "fp32") for n in names if n not in chosen and self._has(n, "fp32")
                             and not n.startswith("trt_")}
        if selection not in self.manifest.precisions:
            known = [*self.manifest.precisions, *self.targets]
            raise BundleError(f"bundle {self.root.name!r} has no {selection!r} graphs; it has: {', '.join(known)}")
        return {n: self.component(n, selection if self._has(n, selection) else "fp32") for n in names
                if (self._has(n, selection) or self._has(n, "fp32")) and not n.startswith("trt_")}

    def _has(self, name: str, precision: str) -> bool:
        return any(c.name == name and c.precision == precision for c in self.manifest.components)

    def component(self, name: str, precision: str) -> Component:
        for comp in self.manifest.components:
            if comp.name == name and comp.precision == precision:
                return comp
        raise BundleError(f"bundle {self.root.name!r} has no {precision} graph {name!r}")

    def asset(self, name: str) -> Path:
        for asset in self.manifest.assets:
            if asset.name == name:
                return self.path(asset.file)
        raise BundleError(f"bundle {self.root.name!r} has no asset {name!r}")
