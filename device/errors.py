"""Typed errors of the runtime. Each message names the problem and, where there is one, the fix.

Messages never contain absolute paths or tracebacks: they are shown to HTTP clients and CLI users.
"""
from __future__ import annotations


class CosyedgeError(Exception):
    """Base class: anything the user can act on."""


class BundleError(CosyedgeError):
    """A bundle directory is missing, corrupt or of an unknown kind."""


class ReleaseError(CosyedgeError):
    """An official model release (the input of `cosyedge quantize`) is incomplete or malformed."""


class InputError(CosyedgeError, ValueError):
    """A request is invalid: empty text, bad speed, unknown voice, ..."""


class UnknownVoiceError(InputError):
    """The voice name or speaker id is not in the bundle."""


class ProviderError(CosyedgeError):
    """No usable ONNX Runtime execution provider."""
