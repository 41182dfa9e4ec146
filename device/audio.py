"""Waveforms -> AudioSegment -> encoded bytes (wav, mp3, flac, opus, aac, pcm)."""
from __future__ import annotations

import io
import struct

import numpy as np
from pydub import AudioSegment

from cosyedge.device.errors import InputError

FORMATS = ("wav", "mp3", "flac", "opus", "aac", "pcm")
MIME = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "opus": "audio/ogg",
        "aac": "audio/aac", "pcm": "audio/L16"}
_FFMPEG_ARGS = {"mp3": ("mp3", None), "flac": ("flac", None), "opus": ("opus", "libopus"), "aac": ("adts", "aac")}


def to_pcm16(samples: np.ndarray) -> bytes:
    """float32 in [-1, 1] -> little-endian int16 bytes."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def to_audio_segment(samples: np.ndarray, sample_rate: int) -> AudioSegment:
    return AudioSegment(data=to_pcm16(samples), sample_width=2, frame_rate=sample_rate, channels=1)


def check_format(fmt: str) -> str:
    fmt = fmt.lower()
    if fmt not in FORMATS:
        raise InputError(f"unknown audio format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return fmt


def check_sample_rate(rate: int | None) -> int | None:
    if rate is not None and not 8000 <= rate <= 48000:
        raise InputError(f"sample rate {rate} Hz is out of range (8000-48000)")
    return rate


def encode(segment: AudioSegment, fmt: str, sample_rate: int | None = None) -> bytes:
    """Encode a segment; wav and pcm need no ffmpeg, the others go through pydub + ffmpeg."""
    fmt = check_format(fmt)
    if sample_rate and sample_rate != segment.frame_rate:
        segment = segment.set_frame_rate(sample_rate)
    if fmt == "pcm":
        return segment.raw_data
    if fmt == "wav":
        buffer = io.BytesIO()
        segment.export(buffer, format="wav")
        return buffer.getvalue()
    container, codec = _FFMPEG_ARGS[fmt]
    if fmt == "opus" and segment.frame_rate not in (8000, 12000, 16000, 24000, 48000):
        segment = segment.set_frame_rate(48000 if segment.frame_rate > 24000 else 24000)
    buffer = io.BytesIO()
    segment.export(buffer, format=container, codec=codec)
    return buffer.getvalue()


def streaming_wav_header(sample_rate: int) -> bytes:
    """A 16-bit mono WAV header whose sizes say 'unknown' (0xFFFFFFFF), for audio sent as it is made."""
    unknown = 0xFFFFFFFF
    return (b"RIFF" + struct.pack("<I", unknown) + b"WAVEfmt " +
            struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16) +
            b"data" + struct.pack("<I", unknown))
