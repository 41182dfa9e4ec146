"""Where the box keeps what it writes: built bundles, registered voices, dead letters."""
from __future__ import annotations

import os
from pathlib import Path


def state_dir() -> Path:
    """`COSYEDGE_HOME`, else systemd's `STATE_DIRECTORY`, else ~/.local/share/cosyedge."""
    for var in ("COSYEDGE_HOME", "STATE_DIRECTORY"):
        if os.environ.get(var):
            return Path(os.environ[var].split(":")[0])
    return Path.home() / ".local" / "share" / "cosyedge"


def bundles_dir() -> Path:
    """Bundles the box built itself (the default voice)."""
    return state_dir() / "bundles"
