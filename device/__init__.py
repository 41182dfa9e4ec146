"""cosyedge.device: the torch-free runtime. What other layers (the API, the build host, your code) may use:

    from cosyedge.device import Engine
    engine = Engine.load()                      # the embedded default voice
    engine.synthesize("Hello.").export("hello.wav", format="wav")

Everything else in this package is an implementation detail of the engine or of one model family.
"""
from cosyedge.device.audio import (FORMATS, MIME, check_format, check_sample_rate, encode, streaming_wav_header,
                                   to_audio_segment, to_pcm16)
from cosyedge.device.door import Chunk, Door, Job, Observer, Stream, collect
from cosyedge.device.engine import Engine
from cosyedge.device.jobs import Line, read_lines, run_lines
from cosyedge.device.errors import (BundleError, CosyedgeError, EmptyTextError, FixedVoicesError, InputError,
                                    InvalidVoiceError, ProviderError, ReleaseError, TextTooLongError,
                                    UnknownVoiceError, UnsupportedOptionError, VoiceExistsError, VoiceNotFoundError)
from cosyedge.device.options import SPEED_RANGE, BatchLimits, Segment, Stat, SynthesisOptions, Word
from cosyedge.device.textstream import SentenceStream

__all__ = [
    "Engine", "BatchLimits", "SynthesisOptions", "Segment", "SPEED_RANGE", "Stat", "Word",
    "Door", "Job", "Chunk", "Stream", "Observer", "collect",
    "CosyedgeError", "BundleError", "ReleaseError", "ProviderError", "InputError", "EmptyTextError",
    "TextTooLongError", "UnknownVoiceError", "InvalidVoiceError", "VoiceExistsError", "VoiceNotFoundError",
    "FixedVoicesError", "EncodingError", "UnsupportedOptionError",
    "encode", "FORMATS", "MIME", "check_format", "check_sample_rate", "to_audio_segment", "to_pcm16",
    "streaming_wav_header", "Line", "read_lines", "run_lines", "SentenceStream",
]
