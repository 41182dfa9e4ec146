"""Model family name (a manifest's `family`) -> its pipeline class or factory, imported only when a bundle needs it.

The core never imports a family statically (tests/test_layers.py checks it): a box serving VITS never loads
CosyVoice2's modules, and a new family is one line here plus its folder.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from cosyedge.device.bundle import Bundle
from cosyedge.device.errors import BundleError
from cosyedge.device.pipeline import Pipeline
from cosyedge.device.sessions import SessionConfig

FAMILIES = {
    "vits": "cosyedge.device.vits.pipeline:VitsPipeline",
    "cosyvoice2": "cosyedge.device.cosyvoice2.family:pipeline",
    "cosyvoice3": "cosyedge.device.cosyvoice3.family:pipeline",
}
DEFAULT_VOICE = "cosyedge.device.vits.default_voice:default_bundle"  # the embedded voice, built on first use


def _resolve(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def load_pipeline(bundle: Bundle, selection: str, sessions: SessionConfig) -> Pipeline:
    """The pipeline of `bundle`'s family with the graphs of `selection` (a precision or a target name)."""
    spec = FAMILIES.get(bundle.manifest.family)
    if spec is None:
        raise BundleError(f"bundle {bundle.root.name!r}: family {bundle.manifest.family!r} is not supported by this "
                          f"runtime; it knows {', '.join(FAMILIES)}")
    return _resolve(spec)(bundle, selection, sessions)


def default_bundle() -> Path:
    """The default voice's bundle directory, built offline on first use."""
    return _resolve(DEFAULT_VOICE)()
