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


class UnknownFieldError(InputError):
    """A request names a field its door does not have (a typo, or another door's name for a field)."""
    code = "unknown_field"


class SpeedOutOfRangeError(InputError):
    """The speed is a number outside SPEED_RANGE."""
    code = "speed_out_of_range"


class UnknownFormatError(InputError):
    """The audio format is not one of FORMATS."""
    code = "unknown_format"


class UnsupportedSampleRateError(InputError):
    """The output sample rate is outside the range the service resamples to."""
    code = "unsupported_sample_rate"


class UnknownModelError(InputError):
    """The `model` is neither an accepted OpenAI name nor the bundle's own."""
    code = "unknown_model"


class UnknownPresetError(InputError):
    """The quality preset is not one the bundle offers."""
    code = "unknown_preset"


class InvalidVoiceError(InputError):
    """A voice to register is unusable: bad prompt audio, bad name or a missing transcript."""
    code = "invalid_voice"


class ReservedVoiceNameError(InvalidVoiceError):
    """A name no request could ever select: all digits (a speaker id) or a name an alias already answers."""
    code = "voice_name_reserved"


class VoiceExistsError(InputError):
    """A voice of that name exists already, or is being registered right now (and replacing it was not asked for)."""
    code = "voice_exists"


class VoiceNotFoundError(InputError):
    """The voice to remove was never registered."""
    code = "voice_not_found"


class UnsupportedOptionError(InputError):
    """The bundle cannot honour an option the request gives (a mode or an instruct text on Piper, a seed on a
    graph converted before seeds)."""
    code = "unsupported_option"


class FixedVoicesError(InputError):
    """The bundle's model family cannot register or remove voices (VITS), or the voice is part of the bundle."""
    code = "fixed_voices"


class EncodingError(CosyedgeError):
    """The audio encoder (ffmpeg) failed: the service's fault, never the client's."""
    code = "encoding_failed"


class SynthesisFailed(CosyedgeError):
    """The engine failed on an accepted request (the detail is logged and dead-lettered, never shown)."""
    code = "synthesis_failed"


class DeadlineError(CosyedgeError):
    """A request waited past its deadline before any work could start for it."""
    code = "deadline_exceeded"


class DoorClosed(CosyedgeError):
    """The engine's door is closing (the service stops): work not yet started will not be done."""
    code = "shutting_down"


class Cancelled(CosyedgeError):
    """The request was withdrawn while it ran (its client went away); nobody waits for its result."""
    code = "cancelled"
