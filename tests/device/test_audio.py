"""One codec table for every door: a whole file and a stream of the same format are encoded alike."""
from __future__ import annotations

import json
import queue
import subprocess

import numpy as np
import pytest

from cosyedge.device.audio import CODECS, FfmpegEncoder, encode, to_audio_segment, to_pcm16

RATE = 22050


def _probe(data: bytes) -> dict:
    out = subprocess.run(["ffprobe", "-v", "error", "-show_entries", "stream=codec_name,sample_rate,bit_rate",
                          "-of", "json", "pipe:0"], input=data, capture_output=True, check=True).stdout
    return json.loads(out)["streams"][0]


def _streamed(fmt: str, wave: np.ndarray) -> bytes:
    events: queue.SimpleQueue = queue.SimpleQueue()
    encoder = FfmpegEncoder(fmt, RATE, events.put)
    try:
        for start in range(0, len(wave), RATE // 2):  # several writes, as chunks arrive
            encoder.write(to_pcm16(wave[start:start + RATE // 2]))
        encoder.finish()
        parts = []
        while (event := events.get(timeout=30))[0] != "eof":
            parts.append(event[1])
    finally:
        encoder.close()
    return b"".join(parts)


@pytest.mark.parametrize("fmt", sorted(CODECS))
def test_a_stream_encodes_its_first_chunk_before_more_audio_comes(fmt: str):
    """A stream's first half second comes out of ffmpeg while the encoder still waits for the rest (ffmpeg's default
    input probing held back ~2 s of audio: a streamed mp3's first bytes came only after the whole sentence)."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    encoder = FfmpegEncoder(fmt, RATE, events.put)
    try:
        encoder.write(to_pcm16(0.3 * np.sin(2 * np.pi * 220 * np.arange(RATE // 2) / RATE)))
        kind, data = events.get(timeout=30)  # stdin stays open: without the fix nothing comes until more audio
        assert kind == "data" and data
    finally:
        encoder.close()


@pytest.mark.parametrize("fmt", sorted(CODECS))
def test_whole_file_and_stream_share_codec_and_rate(fmt: str):
    t = np.arange(3 * RATE) / RATE
    wave = (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 3 * t)) / 2).astype(np.float32)
    whole = _probe(encode(to_audio_segment(wave, RATE), fmt))
    streamed = _probe(_streamed(fmt, wave))
    assert whole["codec_name"] == streamed["codec_name"]
    assert whole["sample_rate"] == streamed["sample_rate"]  # opus: 22050 Hz -> 24000 Hz in both
    if fmt == "opus":
        assert whole["sample_rate"] == "48000" or int(whole["sample_rate"]) in (24000, 48000)
    if fmt == "mp3":  # constant bitrate from the table (pydub's default would be 128k)
        assert whole["bit_rate"] == streamed["bit_rate"] == "96000"
