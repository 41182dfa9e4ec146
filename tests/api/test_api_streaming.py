"""Streaming: audio leaves sentence by sentence; a client killed mid-response stops the work for it."""
from __future__ import annotations

import time

import numpy as np

from apitools import decode, streaming_client

SENTENCES = 30
LONG_TEXT = " ".join(f"This is sentence number {i}, spoken to nobody." for i in range(SENTENCES))

def test_killed_stream_client_stops_its_work(server):
    disconnects = server.metric("cosyedge_stream_disconnects_total")
    skipped = server.metric("cosyedge_stream_segments_skipped_total")
    audio_before = server.metric("cosyedge_audio_seconds_total")
    with streaming_client(server.port, {"text": LONG_TEXT, "stream": True, "format": "pcm"}) as client:
        assert client.stdout.readline().strip() == "streaming", client.stderr.read()
    for _ in range(300):  # bounded: the server notices the closed socket within milliseconds
        if server.metric("cosyedge_stream_disconnects_total") > disconnects:
            break
        time.sleep(0.02)
    assert server.metric("cosyedge_stream_disconnects_total") == disconnects + 1
    assert server.metric("cosyedge_stream_segments_skipped_total") - skipped >= SENTENCES - 5
    produced = server.metric("cosyedge_audio_seconds_total") - audio_before
    assert produced < 0.25 * SENTENCES * 3.0  # ~3 s per sentence: far less than the whole text was made


def test_streamed_wav_has_unknown_length_header_and_all_sentences(server, default_engine):
    text = "One sentence here. A second sentence there. And a third one."
    status, headers, body = server.post("/v1/tts", {"text": text, "stream": True, "format": "wav",
                                                    "deterministic": True})
    assert status == 200 and headers["transfer-encoding"] == "chunked" and headers["x-sample-rate"] == "22050"
    assert body[:4] == b"RIFF" and body[4:8] == b"\xff\xff\xff\xff" and body[40:44] == b"\xff\xff\xff\xff"
    got = np.frombuffer(body[44:], dtype="<i2")
    want = default_engine.synthesize_waveform(text, deterministic=True)
    assert len(got) == len(want)


def test_streamed_opus_plays(server):
    status, headers, body = server.post("/v1/audio/speech", {"model": "tts-1", "voice": "shimmer", "stream": True,
                                                             "input": "Opus, sent on the fly. Page by page.",
                                                             "response_format": "opus"})
    assert status == 200 and headers["content-type"] == "audio/ogg" and body[:4] == b"OggS"
    assert len(decode(body)) > 1.0 * 22050
