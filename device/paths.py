"""Where the box keeps what it writes (built bundles, registered voices, dead letters), and how it reads a user's
files: bounded, and every refusal names the file's last part only (a path is the user's business, not the log's)."""
from __future__ import annotations

import os
from pathlib import Path

from cosyedge.device.errors import CosyedgeError, InputError


def state_dir() -> Path:
    """`COSYEDGE_HOME`, else systemd's `STATE_DIRECTORY`, else ~/.local/share/cosyedge."""
    for var in ("COSYEDGE_HOME", "STATE_DIRECTORY"):
        if os.environ.get(var):
            path = Path(os.environ[var].split(":")[0])
            if path.exists() and not path.is_dir():
                raise InputError(f"{var} must name a directory; {path.name!r} is a file")
            return path
    return Path.home() / ".local" / "share" / "cosyedge"


def bundles_dir() -> Path:
    """Bundles the box built itself (the default voice)."""
    return state_dir() / "bundles"


def make_dir(path: Path, what: str, mode: int | None = None) -> Path:
    """`path` as a directory this process may write in, created if missing; with `mode`, a directory this call
    creates gets that mode (past the umask). A directory that exists keeps its own: it may be a user's."""
    try:
        path.mkdir(parents=True)
    except FileExistsError:
        if not path.is_dir():
            raise InputError(f"{what} {path.name!r} exists and is not a directory") from None
    except OSError as exc:
        raise InputError(f"{what} {path.name!r} cannot be created: {exc.strerror or type(exc).__name__}") from None
    else:
        if mode is not None:
            try:
                path.chmod(mode)
            except OSError as exc:
                raise InputError(f"{what} {path.name!r} cannot be set to mode {mode:o}: "
                                 f"{exc.strerror or type(exc).__name__}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InputError(f"{what} {path.name!r} is not writable")
    return path


def read_text(path: Path, what: str, limit: int, error: type[CosyedgeError] = InputError) -> str:
    """A user's UTF-8 text file (a byte-order mark is not part of it), at most `limit` bytes: a device such as
    /dev/zero or a huge file is refused after `limit` bytes instead of filling memory."""
    name = path.name or str(path)
    if path.is_dir():
        raise error(f"{what} {name!r} is a directory; give a file")
    try:
        with path.open("rb") as handle:
            data = handle.read(limit + 1)
    except FileNotFoundError:
        raise error(f"{what} {name!r} does not exist") from None
    except OSError as exc:
        raise error(f"{what} {name!r} cannot be read: {exc.strerror or type(exc).__name__}") from None
    if len(data) > limit:
        raise error(f"{what} {name!r} is larger than {limit >> 20} MiB; split it")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise error(f"{what} {name!r} is not UTF-8 text") from None
