"""Typed errors of the runtime. Each message names the problem and, where there is one, the fix.

Every class carries a stable machine-readable `code`; the API maps the code to an HTTP status and the CLI
prints the message on one line (exit 2), so nobody ever has to match message text. Messages never contain
absolute paths or tracebacks: they are shown to HTTP clients and CLI users.
"""
from __future__ import annotations


class CosyedgeError(Exception):
    """Base class: anything the user can act on."""
    code = "error"


class BundleError(CosyedgeError):
    """A bundle directory is missing, corrupt or of an unknown kind."""
    code = "bundle_invalid"


class ReleaseError(CosyedgeError):
    """An official model release (the input of `cosyedge quantize`) is incomplete or malformed."""
    code = "release_invalid"


class ProviderError(CosyedgeError):
    """No usable ONNX Runtime execution provider."""
    code = "provider_unavailable"


class InputError(CosyedgeError, ValueError):
    """A request is invalid: bad speed, bad seed, unknown option, ..."""
    code = "invalid_input"


class EmptyTextError(InputError):
    """The text is empty or has nothing speakable in it."""
    code = "empty_text"


class TextTooLongError(InputError):
    """The text is longer than the configured limit."""
    code = "text_too_long"


class UnknownVoiceError(InputError):
    """The voice name or speaker id is not in the bundle."""
    code = "unknown_voice"


class UnknownPresetError(InputError):
    """The quality preset is not one the bundle offers."""
    code = "unknown_preset"


class InvalidVoiceError(InputError):
    """A voice to register is unusable: bad prompt audio, bad name or a missing transcript."""
    code = "invalid_voice"


class VoiceExistsError(InputError):
    """A voice of that name exists already (and replacing it was not asked for)."""
    code = "voice_exists"


class VoiceNotFoundError(InputError):
    """The voice to remove was never registered."""
    code = "voice_not_found"


class FixedVoicesError(InputError):
    """The bundle's model family cannot register or remove voices (VITS), or the voice is part of the bundle."""
    code = "fixed_voices"


class Cancelled(CosyedgeError):
    """The request was withdrawn while it ran (its client went away); nobody waits for its result."""
    code = "cancelled"
