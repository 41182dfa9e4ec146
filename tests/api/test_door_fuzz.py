"""Generated WebSocket and Wyoming sessions against the real service (`cosyedge serve --wyoming`, default voice),
fixed seed, bounded: every bad input an error event and a normal close, never a traceback, an internal error, a
dropped connection or a hang (`cosyedge.api.bench.door_fuzz`); `make fuzz` runs the same campaign for longer.
"""
from __future__ import annotations

import base64
import hashlib
import json
import socket
import threading

import pytest
from wyoming.event import Event

from cosyedge.api.bench.door_fuzz import (Frame, Item, _ws_check, _wyoming_check, failed, format_report, fuzz_service,
                                          ws_session)

pytestmark = pytest.mark.slow

SESSIONS = 40  # per protocol


def test_generated_sessions_on_both_doors_find_nothing(cosyedge_home):
    report = fuzz_service(SESSIONS, seed=0, env={"COSYEDGE_HOME": str(cosyedge_home), "COSYEDGE_PROVIDERS": "cpu",
                                                 "COSYEDGE_THREADS": "1"})
    print(format_report(report))
    detail = json.dumps(report["findings"][:5], indent=1) + report["log_excerpt"]
    for protocol in ("websocket", "wyoming"):
        assert report[protocol]["sessions"] == SESSIONS  # bounded, and every session was run
    assert report["websocket"]["outcomes"].get("done", 0) > 0  # some sessions were really spoken
    assert report["wyoming"]["replies"].get("audio-stop", 0) > 0
    assert len(report["websocket"]["error_codes"]) >= 3 and len(report["wyoming"]["error_codes"]) >= 3  # hostile too
    assert report["finding_count"] == 0, detail
    assert report["log_markers"] == {}, detail
    assert (report["healthz_after"], report["readyz_after"], report["wyoming_after"], report["server_alive"]) == (
        200, 200, "info", True)
    assert not failed(report)


CLEAN = {"websocket": {"sessions": 1}, "wyoming": {"sessions": 1}, "finding_count": 0, "healthz_after": 200,
         "readyz_after": 200, "wyoming_after": "info", "server_alive": True, "log_markers": {}}


@pytest.mark.parametrize("change", [
    {"finding_count": 1}, {"readyz_after": 503}, {"healthz_after": None}, {"wyoming_after": "no answer"},
    {"server_alive": False}, {"log_markers": {"Traceback": 1}}, {"wyoming": {"sessions": 0}},
], ids=lambda c: next(iter(c)))
def test_the_checker_fails_a_run_that_found_something(change):
    assert not failed(CLEAN)
    assert failed({**CLEAN, **change})


START = Frame('{"type": "start", "format": "pcm"}', valid="start")
TEXT = Frame('{"type": "text", "text": "Hello there."}', valid="text")


@pytest.mark.parametrize("events, close, problem", [
    ([{"type": "error", "code": "internal_error", "message": "internal error"}], 1000, "internal_error"),
    ([{"type": "error", "message": "no code"}], 1000, "code None"),
    ([], None, "a session of valid input did not end with done"),  # dropped: no close frame
    ([{"type": "segment"}], 1000, "neither done nor error"),
    ([{"type": "done", "audio_s": 1.0}], 1006, "close code 1006"),
    ([{"type": "error", "code": "bad_message"}, {"type": "done"}], 1000, "frames after the last event"),
])
def test_the_websocket_check_sees_a_defect(events, close, problem):
    """What the session check must call a defect: an internal error, an error without a code, a session of valid
    input dropped or ended without `done`, a close other than 1000, events after the last one."""
    problems = _ws_check([START, TEXT], "end", events, close, 0, 6496)
    assert any(problem in p for p in problems), problems
    assert _ws_check([START, TEXT], "end", [{"type": "done", "audio_s": 1.0}], 1000, 0, 6496) == []


SYNTHESIZE = Item(Event(type="synthesize", data={"text": "Hello there."}), "oneshot")
IDLE = Event(type="error", data={"code": "idle_timeout", "text": "nothing received"})
AUDIO = [Event(type="audio-start"), Event(type="audio-chunk"), Event(type="audio-stop")]


@pytest.mark.parametrize("events, problem", [
    ([Event(type="error", data={"code": "synthesis_failed", "text": "synthesis failed"})], "synthesis_failed"),
    ([Event(type="error", data={"text": "no code"}), *AUDIO, IDLE], "code None"),
    ([*AUDIO, Event(type="info")], "closed without an error event"),
    ([IDLE], "1 valid synthesize events got 0 audio-stop"),
    ([AUDIO[1], *AUDIO, IDLE], "audio-chunk outside"),
    ([AUDIO[0], *AUDIO, IDLE], "audio-start inside an audio run"),
])
def test_the_wyoming_check_sees_a_defect(events, problem):
    """What the session check must call a defect: the service's code for an unexpected failure, an error without a
    code, a connection left open by the client that the server closed without an error event, a valid synthesize
    without its audio, audio events out of order."""
    problems = _wyoming_check([SYNTHESIZE], "wait", events, True)
    assert any(problem in p for p in problems), problems
    assert _wyoming_check([SYNTHESIZE], "wait", [*AUDIO, IDLE], True) == []


def _broken_ws_server(then: str) -> str:
    """A WebSocket server on loopback that accepts one handshake, then drops the connection (no close frame) or
    says nothing and keeps it open: what the campaign must report as a defect. Returns its URL."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        request = b""
        while b"\r\n\r\n" not in request:
            request += conn.recv(4096)
        key = next(line.split(b":", 1)[1].strip() for line in request.split(b"\r\n")
                   if line.lower().startswith(b"sec-websocket-key"))
        accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
        conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
        if then == "drop":
            conn.close()
        else:
            threading.Event().wait(3)
            conn.close()
        listener.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"ws://127.0.0.1:{listener.getsockname()[1]}/v1/audio/stream"


@pytest.mark.parametrize("then, problem", [("drop", "dropped"), ("hang", "hang")])
def test_a_dropped_or_hanging_session_is_a_finding(then, problem):
    _, outcome, _, problems = ws_session(_broken_ws_server(then), [START, TEXT], "end", timeout=1)
    assert outcome == problem and any(p.startswith(problem) for p in problems), problems
