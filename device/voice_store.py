"""Voices registered at run time: kept in the state directory, one folder per bundle, loaded at start-up.

A registered voice stores its precomputed prompt tokens, mel and embedding, so synthesis never
recomputes them and they survive restarts. Bundles are read-only; registered voices never go into them.
"""
from __future__ import annotations

import io
import os
import re
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf

from cosyedge.device.bundle import Bundle
from cosyedge.device.errors import InvalidVoiceError, VoiceExistsError, VoiceNotFoundError

VOICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
MIN_PROMPT_SECONDS, MAX_PROMPT_SECONDS = 1.0, 30.0
# Prompts below 16 kHz are upsampled (telephone-band 8 kHz is the floor); 192 kHz is the highest studio rate.
MIN_PROMPT_RATE, MAX_PROMPT_RATE = 8000, 192000
MAX_PROMPT_BYTES = 16 << 20  # 30 s of 48 kHz stereo 16-bit WAV is 11 MB
SILENCE_RMS = 1e-3
_PARTIAL = re.compile(r"\..+\.npz\.(\d+)(?:\.[A-Za-z0-9_]+)?\.partial")  # what `save` writes while it runs


def check_voice_name(name: object) -> str:
    """Letters, digits, '-', '_', '.'; not starting with '.', so a name is never a path."""
    if not isinstance(name, str) or not VOICE_NAME.fullmatch(name):
        raise InvalidVoiceError("voice names are 1-64 characters: letters, digits, '-', '_' and '.', starting with a "
                         "letter or digit")
    return name


def read_prompt_audio(data: bytes) -> tuple[np.ndarray, int]:
    """Any format libsndfile reads (wav, flac, ogg, mp3), 8-192 kHz, mono-mixed; the checks of a usable prompt.

    Size, rate and duration are checked from the header before anything is decoded, and decoding stops at
    the duration limit whatever the header claims, so one upload cannot exhaust memory.
    """
    if len(data) > MAX_PROMPT_BYTES:
        raise InvalidVoiceError(f"prompt audio is larger than {MAX_PROMPT_BYTES >> 20} MB; give 1-30 s of speech")
    unreadable = InvalidVoiceError("prompt audio is not a readable audio file (wav, flac, ogg or mp3)")
    try:
        info = sf.info(io.BytesIO(data))
    except (RuntimeError, sf.LibsndfileError, TypeError, ValueError):
        raise unreadable from None
    if not MIN_PROMPT_RATE <= info.samplerate <= MAX_PROMPT_RATE:
        raise InvalidVoiceError(f"prompt audio is sampled at {info.samplerate} Hz; {MIN_PROMPT_RATE}-{MAX_PROMPT_RATE} Hz "
                         "is supported")
    if not 1 <= info.channels <= 8:
        raise InvalidVoiceError(f"prompt audio has {info.channels} channels; at most 8 are supported")
    limit = int(MAX_PROMPT_SECONDS * info.samplerate) + 1
    if info.frames > limit:
        raise InvalidVoiceError(f"prompt audio is {info.frames / info.samplerate:.1f} s long; at most "
                         f"{MAX_PROMPT_SECONDS:.0f} s is supported")
    try:
        wav, rate = sf.read(io.BytesIO(data), frames=limit, dtype="float32", always_2d=True)
    except (RuntimeError, sf.LibsndfileError, TypeError, ValueError):
        raise unreadable from None
    wav = wav.mean(axis=1)
    seconds = wav.size / rate
    if seconds < MIN_PROMPT_SECONDS:
        raise InvalidVoiceError(f"prompt audio is {seconds:.2f} s long; give {MIN_PROMPT_SECONDS:.0f}-{MAX_PROMPT_SECONDS:.0f} s of speech")
    if seconds > MAX_PROMPT_SECONDS:
        raise InvalidVoiceError(f"prompt audio is {seconds:.1f} s long; at most {MAX_PROMPT_SECONDS:.0f} s is supported")
    if not np.all(np.isfinite(wav)) or float(np.sqrt(np.mean(wav.astype(np.float64) ** 2))) < SILENCE_RMS:
        raise InvalidVoiceError("prompt audio is silent (or invalid); record the speaker saying the transcript")
    return wav, int(rate)


def _alive(pid: int) -> bool:
    """Whether process `pid` can still write: not gone, and not a zombie (a writer killed with its parent waits to
    be reaped by PID 1, which in a container may take seconds: a restart meanwhile must still see it dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:  # gone meanwhile
        return False
    except OSError:  # no /proc to read: signal 0 reached it
        return True
    return "\nState:\tZ" not in status


class VoiceStore:
    """`<state dir>/voices/<family>-<bundle name>/<voice>.npz`."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def for_bundle(cls, bundle: Bundle, state_dir: Path) -> "VoiceStore":
        manifest = bundle.manifest
        folder = re.sub(r"[^A-Za-z0-9_.\-]", "_", f"{manifest.family}-{manifest.name}")
        return cls(state_dir / "voices" / folder)

    def files(self) -> list[tuple[str, Path]]:
        if not self.root.is_dir():
            return []
        return sorted((p.stem, p) for p in self.root.glob("*.npz") if VOICE_NAME.fullmatch(p.stem))

    def path(self, name: str) -> Path:
        return self.root / f"{check_voice_name(name)}.npz"

    def save(self, name: str, write, replace: bool = False) -> Path:
        """`write(file_object)` writes the voice; the file appears complete or not at all.

        The temporary file has a name of its own (`.<voice>.npz.<pid>.<random>.partial`, created exclusively), so
        concurrent writers never share one; without `replace` the voice file is created exclusively too (a hard
        link that fails if the name exists), so a registration never overwrites another's voice.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        target = self.path(name)
        fd, temp = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".partial", dir=self.root)
        partial = Path(temp)
        try:
            os.fchmod(fd, 0o644)  # as a plain open() under the usual umask: the service reads what the CLI wrote
            with os.fdopen(fd, "wb") as handle:
                write(handle)
                handle.flush()
                os.fsync(handle.fileno())  # the rename below must never expose a file the disk has not got
            if replace:
                partial.replace(target)
            else:
                try:
                    os.link(partial, target)
                except FileExistsError:
                    raise VoiceExistsError(f"voice {name!r} already exists; remove it first or choose another "
                                           "name") from None
        finally:
            partial.unlink(missing_ok=True)
        return target

    def remove_stale_partials(self) -> list[Path]:
        """Delete `.<voice>.npz.<pid>[.<random>].partial` files whose writer is dead (a registration killed
        mid-save)."""
        removed = []
        for partial in self.root.glob(".*.npz.*.partial") if self.root.is_dir() else ():
            match = _PARTIAL.fullmatch(partial.name)
            if match is None:
                continue
            pid = int(match.group(1))
            if pid != os.getpid() and not _alive(pid):
                partial.unlink(missing_ok=True)
                removed.append(partial)
        return removed

    def remove(self, name: str) -> None:
        path = self.path(name)
        if not path.is_file():
            raise VoiceNotFoundError(f"voice {name!r} is not a registered voice")
        path.unlink()
