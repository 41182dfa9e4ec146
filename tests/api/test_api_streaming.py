"""Streaming: audio leaves sentence by sentence; a client killed mid-response stops the work for it."""
from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import requests

from apitools import api_config, decode, run_server, streaming_client

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


def _wait_for(condition, what: str, bound: float = 30) -> None:
    end = time.monotonic() + bound
    while not condition():
        assert time.monotonic() < end, what
        time.sleep(0.01)


def test_a_client_leaving_between_chunks_is_noticed_by_the_probe(fault_engine, fault_pipeline, tmp_path):
    """The 20 ms disconnect probe: the stream's second sentence is held in the engine, so no chunk is being written
    when the client leaves; the server notices while it is still held (a failed write would come only after) and
    renders nothing more for it."""
    fault_pipeline.free = 1  # the first sentence passes, the second holds
    text = "Hold the first sentence. " + " ".join(f"Sentence {i} is here." for i in range(6))
    with run_server(api_config(tmp_path), fault_engine) as srv:
        with streaming_client(srv.port, {"text": text, "stream": True, "format": "pcm"}) as client:
            assert client.stdout.readline().strip() == "streaming", client.stderr.read()
            assert fault_pipeline.holding.wait(30), "the second sentence never started"
        _wait_for(lambda: srv.metric("cosyedge_stream_disconnects_total") == 1, "the client's leaving went unnoticed")
        assert fault_pipeline.holding.is_set() and not fault_pipeline.release.is_set()  # still held: the probe saw it
        fault_pipeline.release.set()
        _wait_for(lambda: srv.metric("cosyedge_in_flight") == 0, "the stream still holds its place")
        _wait_for(lambda: srv.service.door.in_flight() == 0, "the engine still has the job")
        assert srv.metric("cosyedge_stream_segments_skipped_total") == 6  # the held one and the five after it
        assert srv.metric("cosyedge_batches_total") == 1 + 2  # warm-up, then the two sentences: nothing more


def _child_encoders() -> list[int]:
    """PIDs of the ffmpeg processes this test process started (the in-process server's stream encoders)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" (", 1)
        except OSError:
            continue
        name, fields = rest.rsplit(") ", 1)
        if name == "ffmpeg" and int(fields.split()[1]) == os.getpid():
            found.append(int(pid))
    return found


def test_an_encoder_failure_mid_stream_withdraws_the_job(fault_engine, fault_pipeline, tmp_path):
    """A streamed mp3 whose ffmpeg dies while the second sentence is held: the body ends short, the request is
    dead-lettered, and the job is withdrawn (the engine renders nothing more for it once the sentence is let go)."""
    fault_pipeline.free = 1
    text = "Hold the first sentence. " + " ".join(f"Sentence {i} is here." for i in range(6))
    with run_server(api_config(tmp_path), fault_engine) as srv:
        with requests.post(srv.url + "/v1/tts", json={"text": text, "stream": True, "format": "mp3"}, stream=True,
                           timeout=60) as response:
            assert response.status_code == 200 and fault_pipeline.holding.wait(30), "the second sentence never started"
            _wait_for(lambda: len(_child_encoders()) == 1, "no stream encoder")
            os.kill(_child_encoders()[0], signal.SIGKILL)
            response.raw.read()  # the body ends short
        assert "encod" in (tmp_path / "api_dead_letter.jsonl").read_text()
        fault_pipeline.release.set()
        _wait_for(lambda: srv.service.door.in_flight() == 0, "the engine still has the job")
        _wait_for(lambda: srv.metric("cosyedge_in_flight") == 0, "the stream still holds its place")
        assert srv.metric("cosyedge_batches_total") == 1 + 2  # warm-up, then the two sentences: nothing more


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


@pytest.mark.parametrize("fmt, delivered", [("mp3", 11025), ("aac", 11025), ("opus", 12000), ("flac", 9000)])
def test_a_rate_the_codec_does_not_take_is_raised_and_named_truly(server, fmt, delivered):
    """mp3 and aac at 9000 Hz were encoded at ffmpeg's own choice (8000 Hz) while X-Sample-Rate said 9000: the rate
    is raised to the next one the codec takes, and the header, the whole file and the stream all say so."""
    body = {"text": "One sentence here.", "format": fmt, "deterministic": True, "sample_rate": 9000}
    for stream in (False, True):
        status, headers, audio = server.post("/v1/tts", {**body, "stream": stream})
        assert status == 200 and headers["x-sample-rate"] == str(delivered), (stream, headers)
        assert _probe_rate(audio) == delivered, stream


def _probe_rate(audio: bytes) -> int:
    """The rate the file was encoded at (an Ogg Opus decoder always says 48000: its header keeps the input rate)."""
    if audio[:4] == b"OggS":
        head = audio.index(b"OpusHead")
        return int.from_bytes(audio[head + 12:head + 16], "little")
    out = subprocess.run(["ffprobe", "-v", "error", "-show_entries", "stream=sample_rate", "-of", "json", "pipe:0"],
                         input=audio, capture_output=True, check=True).stdout
    return int(json.loads(out)["streams"][0]["sample_rate"])


def test_sample_rate_is_honoured_whole_and_streamed_alike(server):
    """`sample_rate` on HTTP (it had none): the audio is resampled, the headers say the rate, and a stream
    (resampled as it goes, across sentences) is sample for sample the whole file; the batch route too."""
    text = "One sentence here. A second sentence there."
    body = {"text": text, "format": "pcm", "deterministic": True, "sample_rate": 16000}
    status, headers, whole = server.post("/v1/tts", body)
    assert status == 200 and headers["x-sample-rate"] == "16000" and "rate=16000" in headers["content-type"]
    status, headers, streamed = server.post("/v1/tts", {**body, "stream": True})
    assert status == 200 and headers["x-sample-rate"] == "16000" and streamed == whole
    _, _, native = server.post("/v1/tts", {**body, "sample_rate": None})
    assert abs(len(whole) / 2 / 16000 - len(native) / 2 / 22050) < 0.01  # the same seconds of audio
    status, _, wav = server.post("/v1/tts", {**body, "format": "wav", "stream": True})
    assert int.from_bytes(wav[24:28], "little") == 16000 and wav[44:] == whole  # the header's rate
    status, _, raw = server.post("/v1/tts/batch", {"texts": [text], "format": "pcm", "deterministic": True,
                                                   "sample_rate": 16000})
    result = json.loads(raw)
    assert result["sample_rate"] == 16000 and base64.b64decode(result["results"][0]["audio"]) == whole
