"""Word times over HTTP (issue 23 item 3): `timestamps: true` answers JSON with the audio, its words and segments;
`subtitles: vtt|srt` answers the subtitle file alone (refused with stream); on both routes, cached like audio;
streamed, `timestamps` answers NDJSON lines of audio and the words each line's audio completes. The
words are the engine's own (`Engine.synthesize_words`, checked against piper-tts in tests/device)."""
from __future__ import annotations

import base64
import io
import json

import pytest
import srt
import webvtt

TEXT = "Counter three is free. Please bring 2 forms, and your ticket."
T = 120


def _json(server, path: str, body: dict) -> tuple[int, dict, dict]:
    status, headers, raw = server.post(path, body)
    return status, headers, json.loads(raw)


def test_timestamps_answer_the_audio_its_words_and_segments(server, default_engine):
    """The JSON's audio is the plain answer's, byte for byte; its words are the engine's on the delivered clock
    (16 kHz); the segments tile the audio, each holding its words."""
    body = {"text": TEXT, "format": "wav", "sample_rate": 16000, "deterministic": True}
    status, headers, plain = server.post("/v1/tts", body)
    assert status == 200
    status, headers, timed = _json(server, "/v1/tts", {**body, "timestamps": True})
    assert status == 200 and headers["content-type"] == "application/json" and headers["x-sample-rate"] == "16000"
    assert base64.b64decode(timed["audio"]) == plain
    _, words = default_engine.synthesize_words(TEXT, sample_rate=16000, deterministic=True)
    assert timed["words"] == [{"text": w.text, "start_s": w.start_s, "end_s": w.end_s} for w in words]
    segments = timed["segments"]
    assert [s["text"] for s in segments] == ["Counter three is free.", "Please bring 2 forms, and your ticket."]
    assert segments[0]["start_s"] == 0 and segments[0]["end_s"] == segments[1]["start_s"]
    assert abs(segments[-1]["end_s"] - timed["audio_seconds"]) < 1 / 16000 and timed["sample_rate"] == 16000
    for word in timed["words"]:
        assert any(s["start_s"] <= word["start_s"] <= word["end_s"] <= s["end_s"] and word["text"] in s["text"]
                   for s in segments), word


def test_the_openai_route_takes_timestamps_as_the_sdk_sends_them(server):
    """`extra_body={"timestamps": true}` on /v1/audio/speech: the JSON carries the mp3 it would have answered."""
    status, headers, timed = _json(server, "/v1/audio/speech", {"model": "tts-1", "input": TEXT, "voice": "alloy",
                                                                "timestamps": True, "deterministic": True})
    assert status == 200 and timed["format"] == "mp3"
    assert base64.b64decode(timed["audio"])[:3] in (b"ID3", b"\xff\xfb", b"\xff\xf3")
    assert [w["text"] for w in timed["words"]] == TEXT.split()


@pytest.mark.parametrize("kind", ["vtt", "srt"])
def test_subtitles_answer_a_valid_file_whose_last_cue_ends_with_the_audio(server, kind):
    body = {"text": TEXT, "deterministic": True, "format": "wav"}
    status, headers, audio = server.post("/v1/tts", body)
    seconds = float(headers["x-audio-seconds"])
    status, headers, raw = server.post("/v1/tts", {**body, "subtitles": kind})
    assert status == 200 and headers["x-cosyedge-cache"] == "miss"
    text = raw.decode()
    if kind == "vtt":
        assert headers["content-type"].startswith("text/vtt")
        cues = webvtt.WebVTT.from_buffer(io.StringIO(text), strict=True).captions
        said, end = " ".join(c.text.replace("\n", " ") for c in cues), cues[-1].end_in_seconds
        end += cues[-1].end_time.milliseconds / 1000
    else:
        assert headers["content-type"].startswith("application/x-subrip")
        cues = list(srt.parse(text))
        said, end = " ".join(c.content.replace("\n", " ") for c in cues), cues[-1].end.total_seconds()
    assert said.split() == TEXT.split() and abs(end - seconds) < 0.002


def test_timed_answers_are_cached_apart_from_the_audio(server):
    """A repeat is a cache hit with the same JSON; the plain request for the same text still gets audio."""
    body = {"text": "Cached words, twice.", "deterministic": True, "format": "wav"}
    first = server.post("/v1/tts", {**body, "timestamps": True})
    again = server.post("/v1/tts", {**body, "timestamps": True})
    assert again[1]["x-cosyedge-cache"] == "hit" and again[2] == first[2] and json.loads(again[2])["words"]
    plain = server.post("/v1/tts", body)
    assert plain[1]["content-type"] == "audio/wav" and plain[2][:4] == b"RIFF"
    vtt = server.post("/v1/tts", {**body, "subtitles": "vtt"})
    assert vtt[1]["content-type"].startswith("text/vtt") and vtt[2].startswith(b"WEBVTT")


@pytest.mark.parametrize("extra, code", [({"subtitles": "vtt", "stream": True}, "invalid_parameter"),
                                         ({"timestamps": "yes"}, "invalid_parameter"),
                                         ({"subtitles": "ass"}, "invalid_parameter")])
def test_timed_answers_refused_with_a_code(server, extra, code):
    status, _, raw = server.post("/v1/tts", {"text": "Hi.", **extra})
    assert status == 400 and json.loads(raw)["error"]["code"] == code


@pytest.mark.parametrize("fmt", ["pcm", "mp3"])
def test_streamed_timestamps_are_ndjson_lines_of_audio_and_the_words_it_completes(server, default_engine, fmt):
    """Each line: base64 audio made since the last line and the words it completes; the lines' audio joined is the
    plain stream's bytes, the words are the whole answer's in order, and (pcm: exact) a word comes in the line whose
    audio reaches its end, never before."""
    body = {"text": TEXT, "format": fmt, "stream": True, "deterministic": True, "sample_rate": 16000}
    status, headers, plain = server.post("/v1/tts", body)
    assert status == 200
    status, headers, raw = server.post("/v1/tts", {**body, "timestamps": True})
    assert status == 200 and headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in raw.decode().splitlines()]
    assert len(lines) >= 2 and b"".join(base64.b64decode(line["audio"]) for line in lines) == plain
    _, words = default_engine.synthesize_words(TEXT, sample_rate=16000, deterministic=True)
    assert [w for line in lines for w in line["words"]] == [
        {"text": w.text, "start_s": w.start_s, "end_s": w.end_s} for w in words]
    if fmt == "pcm":
        heard = 0
        for line in lines:
            heard += len(base64.b64decode(line["audio"])) // 2
            assert all(w["end_s"] <= heard / 16000 + 0.01 for w in line["words"])  # the resampler holds ~ms back
