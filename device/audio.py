"""Waveforms -> AudioSegment -> encoded bytes (wav, mp3, flac, opus, aac, pcm), whole or as they are made.

One codec table (`CODECS`) holds each compressed format's ffmpeg settings, used by the whole-file encoder
(`encode`, through pydub) and the streaming one (`FfmpegEncoder`, one ffmpeg process per stream, so frames
continue across sentences and chunks), and `encode_pcm_file` (file to file: a batch job's long recording never
sits in memory): the same format sounds the same from every door. A request's output
rate is reached by resampling the float waveform with soxr, whole (`resample`) or chunk by chunk (`Resampler`,
whose filter state carries across chunks): both give the same samples, so a stream equals the whole file.

ffmpeg (`ffmpeg_binary`) is the system's on PATH, else the static build the imageio-ffmpeg wheel ships, so a box
needs no Debian package. pydub is imported here only (the other modules take `AudioSegment` from this one): where
no ffmpeg is on PATH its import-time warning would be wrong.
"""
from __future__ import annotations

import io
import shutil
import struct
import subprocess
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import soxr

with warnings.catch_warnings():  # "Couldn't find ffmpeg or avconv": pydub looks on PATH only; we know better
    warnings.filterwarnings("ignore", "Couldn't find ffmpeg", RuntimeWarning)
    from pydub import AudioSegment

from cosyedge.device.errors import EncodingError, UnknownFormatError, UnsupportedSampleRateError

FORMATS = ("wav", "mp3", "flac", "opus", "aac", "pcm")
MIME = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "opus": "audio/ogg",
        "aac": "audio/aac", "pcm": "audio/L16"}
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)  # the only rates libopus takes
SAMPLE_RATES = (8000, 48000)  # the output rates a request may ask for (resampled from the voice's own)


@dataclass(frozen=True)
class Codec:
    """A compressed format's ffmpeg settings: container (`-f`), encoder, bitrate, the container options a stream
    needs that a whole file does not (a pipe cannot seek back to write headers), and the sample rates the encoder
    takes (None: any; ffmpeg would silently pick another, and the response would name the wrong rate)."""
    container: str
    encoder: str
    bitrate: str | None = None
    streaming: tuple[str, ...] = ()
    rates: tuple[int, ...] | None = None


MPEG_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)  # libmp3lame and aac, up to 48 kHz
CODECS = {
    "mp3": Codec("mp3", "libmp3lame", "96k", ("-write_xing", "0"), MPEG_RATES),
    "opus": Codec("ogg", "libopus", "48k", ("-page_duration", "100000"), OPUS_RATES),
    "aac": Codec("adts", "aac", "96k", rates=MPEG_RATES),
    "flac": Codec("flac", "flac"),
}


def ffmpeg_binary() -> str:
    """The ffmpeg the encoders run: the system's on PATH (the distribution keeps it patched), else the one in the
    imageio-ffmpeg wheel (a dependency: a static build with libmp3lame and libopus for x86_64 and aarch64)."""
    system = shutil.which("ffmpeg")
    if system:
        return system
    from imageio_ffmpeg import get_ffmpeg_exe
    try:
        return get_ffmpeg_exe()
    except RuntimeError:  # the wheel has no binary for this platform: say what to install
        raise EncodingError("no ffmpeg: install one on PATH to encode mp3, opus, aac or flac (wav and pcm need "
                            "none)") from None


def decodes(path: Path) -> bool:
    """Whether a compressed audio file decodes to some audio, as a player would read it (ffmpeg, no ffprobe)."""
    try:
        result = subprocess.run([ffmpeg_binary(), "-hide_banner", "-loglevel", "error", "-i", str(path), "-vn",
                                 "-f", "s16le", "-ac", "1", "pipe:1"], capture_output=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired, EncodingError):
        return False
    return result.returncode == 0 and len(result.stdout) > 0


def to_pcm16(samples: np.ndarray) -> bytes:
    """float32 in [-1, 1] -> little-endian int16 bytes."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def to_audio_segment(samples: np.ndarray, sample_rate: int) -> AudioSegment:
    return AudioSegment(data=to_pcm16(samples), sample_width=2, frame_rate=sample_rate, channels=1)


def check_format(fmt: str) -> str:
    fmt = fmt.lower()
    if fmt not in FORMATS:
        raise UnknownFormatError(f"unknown audio format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return fmt


def check_sample_rate(rate: int | None) -> int | None:
    if rate is not None and not SAMPLE_RATES[0] <= rate <= SAMPLE_RATES[1]:
        raise UnsupportedSampleRateError(f"sample rate {rate} Hz is out of range ({SAMPLE_RATES[0]}-{SAMPLE_RATES[1]})")
    return rate


def codec_rate(fmt: str, sample_rate: int) -> int:
    """The rate a format is encoded at: the audio's own, or where the codec takes only some (mp3, aac, opus) the
    next one up, so that no frequency of the audio is lost (22050 Hz is 24000 Hz in opus, 9000 Hz 11025 in mp3)."""
    rates = CODECS[fmt].rates if fmt in CODECS else None
    if rates is None or sample_rate in rates:
        return sample_rate
    return next((r for r in rates if r > sample_rate), rates[-1])


def resample(wave: np.ndarray, rate: int, out_rate: int | None) -> np.ndarray:
    """The whole waveform at `out_rate` (None or `rate`: unchanged)."""
    if not out_rate or out_rate == rate:
        return wave
    return soxr.resample(np.asarray(wave, np.float32), rate, out_rate).astype(np.float32, copy=False)


class Resampler:
    """A stream's float chunks at `out_rate`; the filter holds back a few milliseconds, which `flush` gives at the
    end. The samples equal `resample` of the whole stream."""

    def __init__(self, rate: int, out_rate: int | None) -> None:
        self._stream = soxr.ResampleStream(rate, out_rate, 1, dtype="float32") if out_rate and out_rate != rate else None

    def __call__(self, chunk: np.ndarray) -> np.ndarray:
        return chunk if self._stream is None else self._stream.resample_chunk(np.asarray(chunk, np.float32))

    def flush(self) -> np.ndarray:
        if self._stream is None:
            return np.zeros(0, np.float32)
        return self._stream.resample_chunk(np.zeros(0, np.float32), last=True)


def encode(segment: AudioSegment, fmt: str) -> bytes:
    """Encode a segment; wav and pcm need no ffmpeg, the others go through pydub + ffmpeg (`CODECS`)."""
    fmt = check_format(fmt)
    if fmt == "pcm":
        return segment.raw_data
    buffer = io.BytesIO()
    if fmt == "wav":
        segment.export(buffer, format="wav")
        return buffer.getvalue()
    codec = CODECS[fmt]
    segment = segment.set_frame_rate(codec_rate(fmt, segment.frame_rate))
    segment.converter = ffmpeg_binary()  # this segment's, not pydub's class-wide default (ffmpeg on PATH)
    segment.export(buffer, format=codec.container, codec=codec.encoder, bitrate=codec.bitrate)
    return buffer.getvalue()


def encode_wave(wave: np.ndarray, rate: int, fmt: str, out_rate: int | None = None) -> bytes:
    """A float waveform at `rate`, encoded at `out_rate` (None: its own rate) or the codec's rate next to it
    (`codec_rate`), resampled once here."""
    target = codec_rate(fmt, out_rate or rate)
    return encode(to_audio_segment(resample(wave, rate, target), target), fmt)


def _ffmpeg_args(fmt: str, sample_rate: int, source: str, output: list[str]) -> list[str]:
    """ffmpeg reading pcm16 mono at `sample_rate` from `source` and encoding it as `fmt` (`CODECS`) to `output`.

    The input is fully described, so ffmpeg is told not to probe it: by default it holds back the first ~2 s of a
    pipe's audio to analyse it, which delays a stream's first encoded bytes by that much."""
    codec = CODECS[fmt]
    bitrate = ("-b:a", codec.bitrate) if codec.bitrate else ()
    return [ffmpeg_binary(), "-hide_banner", "-loglevel", "error", "-probesize", "32", "-analyzeduration", "0",
            "-f", "s16le", "-ar", str(sample_rate), "-ac", "1", "-i", source, "-ar", str(codec_rate(fmt, sample_rate)), "-c:a", codec.encoder, *bitrate, *output]


def encode_pcm_file(source: Path, sample_rate: int, fmt: str, target: Path) -> None:
    """A file of pcm16 mono at `sample_rate` encoded as `fmt` into `target` (made anew), file to file."""
    args = _ffmpeg_args(fmt, sample_rate, str(source), ["-f", CODECS[fmt].container, "-y", str(target)])
    done = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True)
    if done.returncode != 0:
        detail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise EncodingError(f"ffmpeg could not encode {fmt}: {detail[0][:200]}")


class Crossfade:
    """A line's sentences, given one by one, as one signal whose joins are an equal-power crossfade of `overlap`
    samples (cos / sin gains: the power of two uncorrelated signals is kept): each call returns what is final, the
    last `overlap` samples wait for the next sentence, and `flush` gives them at the end."""

    def __init__(self, overlap: int) -> None:
        self.overlap = overlap
        self.overlapped = 0  # samples the joins so far took out (where a sentence starts: what came before, less this)
        self._tail = np.zeros(0, np.float32)
        self._started = False

    def __call__(self, wave: np.ndarray) -> np.ndarray:
        wave = np.asarray(wave, np.float32)
        head = np.zeros(0, np.float32)
        if self._started and (n := min(self.overlap, len(self._tail), len(wave))):
            angle = (np.arange(n, dtype=np.float64) + 0.5) * (np.pi / 2 / n)
            mixed = self._tail[len(self._tail) - n:] * np.cos(angle) + wave[:n] * np.sin(angle)
            self.overlapped += n
            head, wave = np.concatenate([self._tail[:len(self._tail) - n], mixed.astype(np.float32)]), wave[n:]
        elif self._started:
            head = self._tail
        self._started = True
        keep = min(self.overlap, len(wave))
        self._tail = wave[len(wave) - keep:]
        return np.concatenate([head, wave[:len(wave) - keep]])

    def flush(self) -> np.ndarray:
        tail, self._tail = self._tail, np.zeros(0, np.float32)
        return tail


def streaming_wav_header(sample_rate: int) -> bytes:
    """A 16-bit mono WAV header whose sizes say 'unknown' (0xFFFFFFFF), for audio sent as it is made."""
    unknown = 0xFFFFFFFF
    return (b"RIFF" + struct.pack("<I", unknown) + b"WAVEfmt " +
            struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16) +
            b"data" + struct.pack("<I", unknown))


class FfmpegEncoder:
    """One ffmpeg process for one stream: pcm16 in on stdin, encoded bytes out through `sink(("data", bytes))` as
    ffmpeg makes them, then `sink(("eof", None))`."""

    def __init__(self, fmt: str, sample_rate: int, sink: Callable[[tuple], None]) -> None:
        args = _ffmpeg_args(fmt, sample_rate, "pipe:0", [*CODECS[fmt].streaming, "-f", CODECS[fmt].container,
                                                         "-flush_packets", "1", "pipe:1"])
        self._proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._sink = sink
        self._reader = threading.Thread(target=self._pump, name="cosyedge-ffmpeg-reader", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        while chunk := self._proc.stdout.read1(65536):
            self._sink(("data", chunk))
        self._sink(("eof", None))

    def write(self, pcm: bytes) -> None:
        try:
            self._proc.stdin.write(pcm)
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise EncodingError("ffmpeg: encoder stopped accepting audio") from None

    def finish(self) -> None:
        self._proc.stdin.close()

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._reader.join(timeout=5)
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe and not pipe.closed:
                try:
                    pipe.close()
                except OSError:
                    pass
