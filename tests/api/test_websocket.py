"""WebSocket /v1/audio/stream against the real `cosyedge serve` process (gunicorn), with websocket-client.

Text sent in pieces comes back as audio plus one `segment` per sentence and `done`; `cancel` stops the audio;
bad messages get an `error` event and a normal close; a pcm WebSocket stream equals the HTTP API's audio.
"""
from __future__ import annotations

import json
import re
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import requests
import websocket

from cosyedge.api.app import MAX_HEADERS
from cosyedge.api.bench.ws_client import measure_ws
from cosyedge.api.bench.harness import ServiceProcess
from cosyedge.api.journal import CRASHED, DEAD_LETTER, INFLIGHT, read_jsonl
from cosyedge.api.server import MAX_HEADER_LINE, peer_closed
from cosyedge.device.request import WEBSOCKET
from requesttools import DEFAULTS, HOSTILE, case_id, wire

T = 120  # seconds: a bound for every call, never an expectation
KEY = "k3y-" + "0123456789abcdef0123456789ab"
AUTH = {"Authorization": f"Bearer {KEY}"}
PIECES = ["Hello the", "re, my friend. This is a sec", "ond sentence! And here is a", " tail without an end"]
SENTENCES = ["Hello there, my friend.", "This is a second sentence!", "And here is a tail without an end"]


@dataclass
class Reply:
    audio: bytes = b""
    events: list[dict[str, Any]] = field(default_factory=list)
    close_code: int | None = None
    frames_before_first_event: int = 0
    heard: list[int] = field(default_factory=list)  # audio bytes received before each event

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]


def _env(home, tmp_path, **extra: str) -> dict[str, str]:
    return {"COSYEDGE_HOME": str(home), "COSYEDGE_PROVIDERS": "cpu", "COSYEDGE_THREADS": "1", **extra}


def _ws_url(service: ServiceProcess) -> str:
    return service.url.replace("http://", "ws://") + "/v1/audio/stream"


def _talk(service: ServiceProcess, messages: list[Any], headers: dict[str, str] | None = None,
          cancel_after_audio: bool = False) -> Reply:
    """Send `messages` (dicts as JSON text, str and bytes as they are), read everything until the close frame."""
    ws = websocket.create_connection(_ws_url(service), timeout=T, header=AUTH if headers is None else headers)
    reply = Reply()
    try:
        for message in messages:
            if isinstance(message, bytes):
                ws.send_binary(message)
            else:
                ws.send(message if isinstance(message, str) else json.dumps(message))
        while True:
            opcode, data = ws.recv_data()
            if opcode == websocket.ABNF.OPCODE_BINARY:
                if cancel_after_audio and not reply.audio:
                    ws.send(json.dumps({"type": "cancel"}))
                reply.audio += data
            elif opcode == websocket.ABNF.OPCODE_TEXT:
                reply.events.append(json.loads(data))
                reply.heard.append(len(reply.audio))
            elif opcode == websocket.ABNF.OPCODE_CLOSE:
                reply.close_code = int.from_bytes(data[:2], "big") if len(data) >= 2 else None
                return reply
    finally:
        ws.close()


def _check_round_trip(reply: Reply, rate: int, sentences: list[str]) -> None:
    assert reply.close_code == 1000 and not reply.of("error"), reply.events
    segments, done = reply.of("segment"), reply.of("done")
    assert [s["text"] for s in segments] == sentences  # one per sentence, the tail spoken at `end`
    assert [s["index"] for s in segments] == list(range(len(sentences)))
    assert len(done) == 1 and reply.events[-1] == done[0]
    starts = [s["start_s"] for s in segments]
    assert starts[0] == 0.0 and all(s["end_s"] > s["start_s"] for s in segments)
    assert all(a["end_s"] == b["start_s"] for a, b in zip(segments, segments[1:]))  # one clock, no gaps
    audio_s = len(reply.audio) / 2 / rate
    assert abs(segments[-1]["end_s"] - done[0]["audio_s"]) <= 1 / rate
    assert abs(done[0]["audio_s"] - audio_s) <= 1 / rate


def _words_after_their_audio(reply: Reply, rate: int, held: int = 0) -> list[list[dict[str, Any]]]:
    """The `word` events sentence by sentence, checking that each came only once the pcm received held its end (but
    for `held` samples a resampler may still hold), and before its sentence's `segment` event, inside that
    sentence's time, in order."""
    sentences: list[list[dict[str, Any]]] = []
    words: list[dict[str, Any]] = []
    for event, heard in zip(reply.events, reply.heard):
        if event["type"] == "word":
            assert heard // 2 + held >= round(event["end_s"] * rate), (event, heard // 2)  # its audio came first
            words.append(event)
        elif event["type"] == "segment":
            times = [event["start_s"], *(t for w in words for t in (w["start_s"], w["end_s"])), event["end_s"]]
            assert times == sorted(times), (event, words)
            sentences.append(words)
            words = []
    assert not words, words  # every word before its sentence's segment event
    return sentences


@pytest.fixture(scope="module")
def joe(cosyedge_home, default_bundle_path, tmp_path_factory) -> Iterator[ServiceProcess]:
    """The default voice behind the API key, at most 2 streams per client."""
    env = _env(cosyedge_home, None, COSYEDGE_API_KEY=KEY, COSYEDGE_MAX_STREAMS_PER_CLIENT="2")
    with ServiceProcess(env=env) as service:
        yield service


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def _start(**extra: Any) -> dict[str, Any]:
    return {"type": "start", "format": "pcm", "deterministic": True, **extra}


def test_pieces_round_trip_on_the_default_voice(joe):
    reply = _talk(joe, [_start(), *({"type": "text", "text": p} for p in PIECES), {"type": "end"}])
    _check_round_trip(reply, 22050, SENTENCES)
    assert np.abs(np.frombuffer(reply.audio, "<i2")).max() > 1000  # speech, not silence


def test_word_events_follow_their_audio_on_the_default_voice(joe, default_engine):
    """`timestamps`: each sentence's words are the engine's own word times (synthesize_words) moved to where the
    sentence starts on the session's clock, each sent after its audio and before its sentence's segment event."""
    reply = _talk(joe, [_start(timestamps=True), *({"type": "text", "text": p} for p in PIECES), {"type": "end"}])
    _check_round_trip(reply, 22050, SENTENCES)
    spoken = _words_after_their_audio(reply, 22050)
    for segment, words in zip(reply.of("segment"), spoken, strict=True):
        expected = default_engine.synthesize_words(segment["text"], deterministic=True)[1]
        assert [w["text"] for w in words] == [w.text for w in expected] == segment["text"].split()
        for got, want in zip(words, expected):
            assert abs(got["start_s"] - segment["start_s"] - want.start_s) <= 1 / 22050, (got, want)
            assert abs(got["end_s"] - segment["start_s"] - want.end_s) <= 1 / 22050, (got, want)
    plain = _talk(joe, [_start(), {"type": "text", "text": "No words asked for."}, {"type": "end"}])
    assert plain.close_code == 1000 and plain.of("segment") and not plain.of("word"), plain.events


def test_word_events_on_the_resampled_clock(joe, default_engine):
    """With `sample_rate`, the word times are the engine's rounded to the output rate's samples, and each word
    follows its audio but for the few milliseconds the resampler holds at a sentence's end."""
    text = "Counter three is free. Please take your ticket."
    reply = _talk(joe, [_start(timestamps=True, sample_rate=16000), {"type": "text", "text": text}, {"type": "end"}])
    _check_round_trip(reply, 16000, ["Counter three is free.", "Please take your ticket."])
    spoken = _words_after_their_audio(reply, 16000, held=320)  # soxr holds ~265 samples (17 ms) here
    for segment, words in zip(reply.of("segment"), spoken, strict=True):
        expected = default_engine.synthesize_words(segment["text"], deterministic=True)[1]
        assert [w["text"] for w in words] == [w.text for w in expected]
        for got, want in zip(words, expected):
            assert abs(got["end_s"] * 16000 - round(got["end_s"] * 16000)) < 0.01, got  # on a 16 kHz sample
            assert abs(got["end_s"] - segment["start_s"] - want.end_s) <= 1 / 16000, (got, want)


def test_pcm_over_websocket_equals_the_http_api(joe):
    text = "".join(PIECES) + "."
    reply = _talk(joe, [_start(), *({"type": "text", "text": p} for p in PIECES), {"type": "text", "text": "."},
                        {"type": "end"}])
    assert reply.close_code == 1000 and len(reply.of("segment")) == 3, reply.events
    http = requests.post(joe.url + "/v1/tts", json={"text": text, "format": "pcm", "deterministic": True},
                         headers=AUTH, timeout=T)
    assert http.status_code == 200
    ws_audio, http_audio = np.frombuffer(reply.audio, "<i2"), np.frombuffer(http.content, "<i2")
    assert ws_audio.size == http_audio.size
    assert np.abs(ws_audio.astype(np.int32) - http_audio).max() <= 1  # int16 rounding at most


@pytest.mark.parametrize("fmt, magic", [("wav", b"RIFF"), ("mp3", None), ("opus", b"OggS")])
def test_other_formats_stream_and_play(joe, fmt, magic):
    reply = _talk(joe, [_start(format=fmt), {"type": "text", "text": "One more sentence. And another."},
                        {"type": "end"}])
    assert reply.close_code == 1000 and len(reply.of("segment")) == 2 and reply.of("done"), reply.events
    if magic:
        assert reply.audio.startswith(magic)
    from apitools import decode
    assert decode(reply.audio).size / 22050 == pytest.approx(reply.of("done")[0]["audio_s"], abs=0.2)


def test_cancel_stops_the_audio(joe):
    sentences = [f"This is sentence number {i}, spoken only if nobody cancels." for i in range(60)]
    texts = [{"type": "text", "text": s + " "} for s in sentences]
    full = _talk(joe, [_start(), *texts, {"type": "end"}])
    assert len(full.of("segment")) == 60
    reply = _talk(joe, [_start(), *texts, {"type": "end"}], cancel_after_audio=True)
    assert reply.close_code == 1000 and reply.events[-1]["type"] == "done" and reply.events[-1]["cancelled"]
    assert len(reply.of("segment")) < 30 and len(reply.audio) < len(full.audio) / 2, len(reply.of("segment"))
    assert abs(reply.events[-1]["audio_s"] - len(reply.audio) / 2 / 22050) <= 1 / 22050


@pytest.mark.parametrize("messages, code", [
    (["not json {"], "invalid_json"),
    (["[" * 5000 + "]" * 5000], "nesting_too_deep"),  # issue 21 item 11: was internal_error (RecursionError)
    (['{"type": "start", "seed": 1' + "0" * 50 + "}"], "number_too_large"),
    ([_start(), {"type": "shout"}], "bad_message"),
    ([{"type": "text", "text": "Too early."}], "bad_message"),
    ([_start(), b"\x00\x01"], "bad_message"),
    ([_start(), {"type": "text", "text": 5}], "invalid_parameter"),
    ([_start(), {"type": "text", "text": "Hi \ud800."}], "invalid_parameter"),  # item 11: was internal_error
    ([_start(voice="nobody")], "unknown_voice"),
    ([_start(format="midi")], "unknown_format"),
    ([_start(model="gpt-5")], "unknown_model"),
    ([_start(stream=True)], "unknown_field"),  # an HTTP field: the WebSocket always streams
    ([_start(), _start()], "bad_message"),
    ([_start(), {"type": "text", "text": "x" * 2001}], "text_too_long"),
])
def test_bad_messages_get_an_error_event_then_a_normal_close(joe, messages, code):
    reply = _talk(joe, messages)
    assert reply.close_code == 1000, reply.events
    assert reply.events[-1]["type"] == "error" and reply.events[-1]["code"] == code, reply.events
    assert isinstance(reply.events[-1]["message"], str) and reply.events[-1]["message"]


@pytest.mark.parametrize("case", HOSTILE, ids=case_id)
def test_hostile_start_fields_get_the_codes_http_gives(joe, case):
    """The request declaration's table of hostile values (tests/requesttools.py), as HTTP answers them
    (test_api_errors.py::test_hostile_fields_get_the_same_code_on_every_route)."""
    fields, code = case
    reply = _talk(joe, [_start(**wire(fields, WEBSOCKET))])
    assert reply.close_code == 1000 and reply.events[-1]["type"] == "error", reply.events
    assert reply.events[-1]["code"] == code, reply.events


def test_empty_strings_are_defaults_and_astral_text_fits_the_frame_bound(joe):
    """`preset: ""` is the default as on HTTP (it was refused); 1,500 astral letters (under max_text_len, but 12
    JSON characters each) are spoken, not closed 1009 (issue 21 item 14); sample_rate is honoured."""
    bold = "".join(chr(0x1D41A + ord(c) - ord("a")) for c in "hellothere")  # NFKC: "hellothere"
    text = f"{bold}. " * 150  # 1,500 astral letters, 1,800 characters
    assert len(text) <= 2000 and len(json.dumps({"type": "text", "text": text})) > 2000 * 4 + 4096  # the old bound
    reply = _talk(joe, [_start(**{k: v for d in DEFAULTS for k, v in d.items()}, sample_rate=16000),
                        {"type": "text", "text": text}, {"type": "end"}], cancel_after_audio=True)
    assert reply.close_code == 1000 and not reply.of("error"), reply.events
    assert reply.events[-1]["type"] == "done" and reply.audio
    assert abs(reply.events[-1]["audio_s"] - len(reply.audio) / 2 / 16000) < 0.05  # pcm at the asked rate


def test_the_key_and_the_per_client_stream_bound(joe):
    with pytest.raises(websocket.WebSocketBadStatusException) as refused:
        websocket.create_connection(_ws_url(joe), timeout=T)
    assert refused.value.status_code == 401
    assert requests.get(joe.url + "/v1/audio/stream", headers=AUTH, timeout=T).status_code == 426
    held = [websocket.create_connection(_ws_url(joe), timeout=T, header=AUTH) for _ in range(2)]
    try:
        held[0].send(json.dumps(_start()))  # a session under way and an idle handshake hold a slot each
        with pytest.raises(websocket.WebSocketBadStatusException) as refused:
            websocket.create_connection(_ws_url(joe), timeout=T, header=AUTH)
        assert refused.value.status_code == 429  # at the handshake (issue 21 item 4)
    finally:
        for ws in held:
            ws.close()


def test_clients_that_leave_mid_stream_give_their_slots_back(joe):
    sentences = [{"type": "text", "text": f"Sentence {i} goes on for a while before it ends. "} for i in range(40)]
    for fmt in ("mp3", "pcm"):  # as many sessions as the client has slots; each leaves without a close frame
        ws = websocket.create_connection(_ws_url(joe), timeout=T, header=AUTH)
        for message in [_start(format=fmt), *sentences, {"type": "end"}]:
            ws.send(json.dumps(message))
        while ws.recv_data()[0] != websocket.ABNF.OPCODE_BINARY:
            pass
        ws.sock.close()  # gone, mid-stream
    for _ in range(300):  # bounded: the server notices at its next send
        reply = _talk(joe, [_start(), {"type": "text", "text": "Still here."}, {"type": "end"}])
        if not reply.of("error"):
            break
        assert reply.events[-1]["code"] == "too_many_streams"
        time.sleep(0.1)
    _check_round_trip(reply, 22050, ["Still here."])
    log = joe.log_tail(200_000)
    left = [int(n) for n in re.findall(r"websocket client left after (\d+) segments", log)]
    assert len(left) >= 2 and all(n < 40 for n in left), left  # they stopped; not spoken to the end
    assert "unhandled" not in log and "Traceback" not in log, log[-3000:]


def test_serve_bounds_header_lines_and_their_number(joe):
    for headers in ({"X-Big": "a" * (MAX_HEADER_LINE + 1)}, {f"X-N{i}": "1" for i in range(MAX_HEADERS + 1)}):
        assert requests.get(joe.url + "/healthz", headers=headers, timeout=T).status_code == 431
    assert requests.get(joe.url + "/healthz", headers={"X-Fine": "a" * 4000}, timeout=T).status_code == 200


def test_the_disconnect_probe_of_http_streams_under_serve():
    left, right = socket.socketpair()
    try:
        assert not peer_closed(left)  # connected, nothing sent
        right.sendall(b"more")
        assert not peer_closed(left) and left.recv(16) == b"more"  # data is not a disconnect; the peek kept it
        right.close()
        assert peer_closed(left)
    finally:
        left.close()


def test_bench_ws_measures_first_audio_and_total(joe):
    result = measure_ws(_ws_url(joe), PIECES, api_key=KEY)
    assert 0 < result["first_audio_s"] <= result["total_s"] and result["segments"] == 3
    assert result["audio_s"] > 1.0


def test_idle_timeout_rate_limit_and_sigterm(cosyedge_home, default_bundle_path, tmp_path):
    env = _env(cosyedge_home, tmp_path, COSYEDGE_REQUEST_TIMEOUT_S="3", COSYEDGE_RATE_LIMIT_PER_S="0.001",
               COSYEDGE_RATE_LIMIT_BURST="2")
    with ServiceProcess(env=env) as service:
        idle = _talk(service, [_start()], headers={})  # then nothing: the session gives its thread back
        assert idle.close_code == 1000 and idle.events[-1]["code"] == "idle_timeout", idle.events
        ws = websocket.create_connection(_ws_url(service), timeout=T)
        with pytest.raises(websocket.WebSocketBadStatusException) as limited:
            websocket.create_connection(_ws_url(service), timeout=T)
        assert limited.value.status_code == 429  # the handshake is rate-limited like an HTTP synthesis request
        ws.send(json.dumps(_start()))
        ws.send(json.dumps({"type": "text", "text": "Before the stop. "}))
        events = []
        while not events:
            opcode, data = ws.recv_data()
            if opcode == websocket.ABNF.OPCODE_TEXT:
                events.append(json.loads(data))
        assert events[0]["type"] == "segment"
        service.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # the worker has the signal; the session is still open
        ws.send(json.dumps({"type": "text", "text": "After the stop. "}))
        while True:
            opcode, data = ws.recv_data()
            if opcode == websocket.ABNF.OPCODE_TEXT:
                events.append(json.loads(data))
            elif opcode == websocket.ABNF.OPCODE_CLOSE:
                break
        ws.close()
        assert events[-1]["type"] == "error" and events[-1]["code"] == "shutting_down", events
        assert int.from_bytes(data[:2], "big") == 1000
        assert service.proc.wait(timeout=30) == 0, service.log_tail()


def test_pieces_round_trip_on_cosyvoice2(cv2_tiny_bundle, cosyedge_home, tmp_path):
    start = _start(voice="tiny_spk_zh", sampling="greedy")
    pieces = ["收到好友从远方", "寄来的生日礼物。今天", "天气很好"]
    with ServiceProcess(bundle=str(cv2_tiny_bundle), env=_env(cosyedge_home, tmp_path)) as service:
        reply = _talk(service, [start, *({"type": "text", "text": p} for p in pieces), {"type": "end"}], headers={})
        _check_round_trip(reply, 24000, ["收到好友从远方寄来的生日礼物。", "今天天气很好"])
        cancelled = _talk(service, [start, {"type": "text", "text": "收到好友从远方寄来的生日礼物。" * 6},
                                    {"type": "end"}], headers={}, cancel_after_audio=True)
        workers = Path(f"/proc/{service.pid}/task/{service.pid}/children").read_text().split()
        assert len(workers) == 1  # gunicorn's one worker process holds the engine
        assert service.kill() == -signal.SIGKILL
        for _ in range(100):  # bounded: the worker does not outlive the service (PR_SET_PDEATHSIG)
            if not _alive(int(workers[0])):
                break
            time.sleep(0.05)
        assert not _alive(int(workers[0])), "the worker outlived a SIGKILL of the service"
    assert cancelled.close_code == 1000 and cancelled.events[-1].get("cancelled"), cancelled.events
    assert len(cancelled.of("segment")) < 6


def test_word_events_follow_their_audio_on_cosyvoice2(cv2_tiny_bundle, cosyedge_home, tmp_path):
    """Streamed CosyVoice words (the LLM's attention, chunk by chunk): every character of the text once, in order,
    each sent after its audio and before its sentence's segment event; none without `timestamps`."""
    start = _start(voice="tiny_spk_zh", sampling="greedy")
    pieces = ["收到好友从远方寄来的生日礼物，", "今天天气很好。", "我们一起去公园吧"]
    messages = [*({"type": "text", "text": p} for p in pieces), {"type": "end"}]
    with ServiceProcess(bundle=str(cv2_tiny_bundle), env=_env(cosyedge_home, tmp_path)) as service:
        timed = _talk(service, [{**start, "timestamps": True}, *messages], headers={})
        plain = _talk(service, [start, *messages], headers={})
    assert timed.close_code == 1000 and not timed.of("error"), timed.events
    spoken = _words_after_their_audio(timed, 24000)
    assert len(spoken) == len(timed.of("segment")) >= 2
    def letters(text: str) -> str:  # the frontend ends a tail without punctuation with "。"
        return "".join(c for c in text if c.isalnum())

    for segment, words in zip(timed.of("segment"), spoken):
        assert letters("".join(w["text"] for w in words)) == letters(segment["text"])
    assert letters("".join(w["text"] for w in timed.of("word"))) == letters("".join(pieces))
    assert plain.close_code == 1000 and plain.of("segment") and not plain.of("word"), plain.events


def test_a_session_counts_among_the_requests_in_flight(cv2_tiny_bundle, cosyedge_home, tmp_path):
    """queue_size 1: while one WebSocket sentence streams, a second session's sentence is refused with a
    `queue_full` error event (then a normal close), and the place comes back once the first session ends."""
    long_sentence = "，".join(["收到好友从远方寄来的生日礼物"] * 100) + "。"  # >= 1800 speech tokens: many chunks
    start = _start(voice="tiny_spk_zh", sampling="greedy")
    env = _env(cosyedge_home, tmp_path, COSYEDGE_QUEUE_SIZE="1")
    with ServiceProcess(bundle=str(cv2_tiny_bundle), env=env) as service:
        first = websocket.create_connection(_ws_url(service), timeout=T)
        try:
            for message in (start, {"type": "text", "text": long_sentence}, {"type": "end"}):
                first.send(json.dumps(message))
            assert first.recv_data()[0] == websocket.ABNF.OPCODE_BINARY  # the long sentence is streaming
            refused = _talk(service, [start, {"type": "text", "text": "你好。"}, {"type": "end"}], headers={})
            first.send(json.dumps({"type": "cancel"}))
        finally:
            first.close()
        assert refused.close_code == 1000 and [e["code"] for e in refused.of("error")] == ["queue_full"], refused.events
        for _ in range(100):  # the cancelled session gives its place back
            again = _talk(service, [start, {"type": "text", "text": "你好。"}, {"type": "end"}], headers={})
            if not again.of("error"):
                break
            time.sleep(0.1)
        _check_round_trip(again, 24000, ["你好。"])


def _journal_state(state: Path) -> tuple[list[dict[str, Any]], set[str], list[dict[str, Any]]]:
    """The WebSocket route's accepted journal records, the keys still open, and the dead-letter records."""
    records = read_jsonl(state / INFLIGHT)
    accepted = [r for r in records if r.get("event") == "accepted" and r["route"] == "/v1/audio/stream"]
    finished = {r["key"] for r in records if r.get("event") == "finished"}
    still_open = {r.get("key", r["request_id"]) for r in accepted} - finished
    return accepted, still_open, read_jsonl(state / DEAD_LETTER)


def test_text_pieces_are_journalled_until_spoken(cosyedge_home, tmp_path):
    """Nothing accepted is lost: each text piece is journalled when it arrives and closed once spoken; a client
    that leaves mid-stream has its unspoken pieces dead-lettered; a SIGKILL leaves them to the next start."""
    state = tmp_path / "state"
    state.mkdir()
    env = _env(cosyedge_home, tmp_path, COSYEDGE_STATE_DIR=str(state))
    pieces = [f"Sentence {i} goes on for a while before it ends. " for i in range(40)]

    def leave_mid_stream(service: ServiceProcess) -> None:
        ws = websocket.create_connection(_ws_url(service), timeout=T)
        for message in [_start(), *({"type": "text", "text": p} for p in pieces), {"type": "end"}]:
            ws.send(json.dumps(message))
        while ws.recv_data()[0] != websocket.ABNF.OPCODE_BINARY:
            pass
        ws.sock.close()  # gone, without a close frame

    with ServiceProcess(env=env) as service:
        reply = _talk(service, [_start(), *({"type": "text", "text": p} for p in PIECES), {"type": "end"}], headers={})
        _check_round_trip(reply, 22050, SENTENCES)
        accepted, still_open, dead = _journal_state(state)
        assert [r["request"]["text"] for r in accepted] == PIECES and not still_open and not dead

        leave_mid_stream(service)
        for _ in range(300):  # bounded: the server notices at its next send
            accepted, still_open, dead = _journal_state(state)
            if dead and not still_open:
                break
            time.sleep(0.1)
        assert dead and not still_open, (len(dead), still_open)
        # the unspoken tail, in order (at least once: a sentence whose audio went out but whose `segment` event
        # could not be sent any more is dead-lettered too)
        assert [d["request"]["text"] for d in dead] == pieces[len(pieces) - len(dead):]
        assert all(d["route"] == "/v1/audio/stream" and "left" in d["error"] for d in dead)

        left_before = len(dead)
        leave_mid_stream(service)  # the same again, but the service is killed while the session speaks
        assert service.kill() == -signal.SIGKILL
    _, open_at_kill, _ = _journal_state(state)  # the dead process's journal, as the next start reads it
    assert open_at_kill, "no piece was open at the kill"
    with ServiceProcess(env=env):  # recovery: the pieces open at the kill are dead-lettered
        _, _, dead = _journal_state(state)
        crashed = [d for d in dead[left_before:] if d["error"] == CRASHED]
        assert len(crashed) == len(open_at_kill) and {d["request"]["text"] for d in crashed} <= set(pieces)


# -- issue 21 items 4 and 7: idle handshakes and unspoken text are bounded ------------------------------------
START_S, PENDING, MAX_TEXT = 2.0, 400, 200


@pytest.fixture(scope="module")
def guarded(cosyedge_home, default_bundle_path, tmp_path_factory) -> Iterator[tuple[ServiceProcess, Path]]:
    """No key (every test client is addr:127.0.0.1), 4 threads, 2 streams per client, a 2 s `start` deadline, at
    most 400 characters unspoken per session (texts of at most 200); its state directory."""
    state = tmp_path_factory.mktemp("guarded_state")
    env = _env(cosyedge_home, None, COSYEDGE_STATE_DIR=str(state), COSYEDGE_HTTP_THREADS="4",
               COSYEDGE_MAX_STREAMS_PER_CLIENT="2", COSYEDGE_WEBSOCKET_START_TIMEOUT_S=str(START_S),
               COSYEDGE_MAX_TEXT_LEN=str(MAX_TEXT), COSYEDGE_WEBSOCKET_MAX_PENDING_CHARS=str(PENDING))
    with ServiceProcess(env=env) as service:
        yield service, state


def _read_until_close(ws: websocket.WebSocket) -> Reply:
    reply = Reply()
    while True:
        opcode, data = ws.recv_data()
        if opcode == websocket.ABNF.OPCODE_TEXT:
            reply.events.append(json.loads(data))
        elif opcode == websocket.ABNF.OPCODE_BINARY:
            reply.audio += data
        elif opcode == websocket.ABNF.OPCODE_CLOSE:
            reply.close_code = int.from_bytes(data[:2], "big") if len(data) >= 2 else None
            return reply


def test_a_handshake_without_start_is_closed_at_the_start_deadline(guarded):
    """Idle handshakes held a worker thread until request_timeout_s (60 s), renewable: now `start` must come
    within websocket_start_timeout_s, else a `start_timeout` error event and a normal close; /healthz answers
    meanwhile."""
    service, _ = guarded
    opened = time.monotonic()
    idle = [websocket.create_connection(_ws_url(service), timeout=START_S + 5) for _ in range(2)]
    try:
        assert requests.get(service.url + "/healthz", timeout=START_S).status_code == 200
        assert time.monotonic() - opened < START_S  # answered while both handshakes wait for `start`
        replies = [_read_until_close(ws) for ws in idle]  # the old code: nothing for 60 s, a client timeout
    finally:
        for ws in idle:
            ws.close()
    assert time.monotonic() - opened < START_S + 5
    for reply in replies:
        assert reply.close_code == 1000 and [e["code"] for e in reply.events] == ["start_timeout"], reply.events
    _check_round_trip(_talk(service, [_start(), {"type": "text", "text": "Still here."}, {"type": "end"}], headers={}),
                      22050, ["Still here."])  # the slots came back


def test_idle_handshakes_beyond_the_clients_stream_allowance_are_refused(guarded):
    """The stream slot is taken at the handshake, before `start`: one client holds at most
    max_streams_per_client sessions (idle or not); the next handshake is a 429 JSON error, never upgraded."""
    service, _ = guarded
    held = [websocket.create_connection(_ws_url(service), timeout=T) for _ in range(2)]
    try:
        with pytest.raises(websocket.WebSocketBadStatusException) as refused:
            websocket.create_connection(_ws_url(service), timeout=START_S)
        assert refused.value.status_code == 429 and refused.value.resp_headers["retry-after"] == "1"
        assert json.loads(refused.value.resp_body)["error"]["code"] == "too_many_streams"
    finally:
        for ws in held:
            ws.close()
    for _ in range(100):  # bounded: the server notices the closes at its next receive
        reply = _talk(service, [_start(), {"type": "text", "text": "Back again."}, {"type": "end"}], headers={})
        if not reply.of("error"):
            break
        time.sleep(0.1)
    _check_round_trip(reply, 22050, ["Back again."])


def test_a_text_flood_beyond_the_unspoken_bound_is_refused_before_the_journal(guarded):
    """A client sending text faster than it is spoken: the piece that would take the session over
    websocket_max_pending_chars is refused (not journalled) with a `text_too_long` event and a normal close; the
    pieces accepted and not spoken are dead-lettered."""
    service, state = guarded
    accepted_before, _, dead_before = _journal_state(state)
    pieces = [f"Sentence {i:02d} goes on for a while before it ends. " for i in range(60)]  # 3,000 characters
    reply = _talk(service, [_start(), *({"type": "text", "text": p} for p in pieces), {"type": "end"}], headers={})
    assert reply.close_code == 1000 and reply.events[-1]["type"] == "error", reply.events
    assert reply.events[-1]["code"] == "text_too_long" and "not yet spoken" in reply.events[-1]["message"]
    accepted, still_open, dead = _journal_state(state)
    accepted, dead = [r["request"]["text"] for r in accepted[len(accepted_before):]], dead[len(dead_before):]
    spoken = len(reply.of("segment"))
    assert accepted == pieces[:len(accepted)] and PENDING // len(pieces[0]) <= len(accepted) < len(pieces)
    assert len(accepted) - spoken <= PENDING // len(pieces[0]) + 1  # never more than the bound held unspoken
    assert not still_open and dead and all(d["error"].startswith("text_too_long") for d in dead)
    # the unspoken ones, in order (at least once: a sentence spoken as the refusal came may be among them)
    assert [d["request"]["text"] for d in dead] == accepted[len(accepted) - len(dead):]
    assert len(dead) >= len(accepted) - spoken


def test_text_sent_as_fast_as_it_is_spoken_is_not_bounded(guarded):
    """The bound counts only text not yet spoken: a session of many times the bound, each piece sent once the one
    before it is spoken (its `segment` event), completes."""
    service, _ = guarded
    pieces = [f"Piece number {i} is a whole sentence of its own, long enough to fill a good part of the bound on "
              "the text a session may hold unspoken, and a little more. " for i in range(6)]
    assert len(pieces[0]) <= MAX_TEXT and sum(map(len, pieces)) > 2 * PENDING and 2 * len(pieces[0]) < PENDING
    ws = websocket.create_connection(_ws_url(service), timeout=T)
    reply = Reply()
    try:
        ws.send(json.dumps(_start()))
        for piece in pieces:
            ws.send(json.dumps({"type": "text", "text": piece}))
            while not reply.events:
                opcode, data = ws.recv_data()
                if opcode == websocket.ABNF.OPCODE_TEXT:
                    reply.events.append(json.loads(data))
                else:
                    reply.audio += data
            assert reply.events.pop()["type"] == "segment", reply.events
        ws.send(json.dumps({"type": "end"}))
        rest = _read_until_close(ws)
    finally:
        ws.close()
    assert rest.close_code == 1000 and [e["type"] for e in rest.events] == ["done"], rest.events
