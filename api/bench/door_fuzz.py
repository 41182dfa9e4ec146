"""Generated sessions against the service's streaming doors: WebSocket `GET /v1/audio/stream` and Wyoming (issue 20
item 8), the way `fuzz` covers the HTTP routes from the OpenAPI document.

hypothesis generates each session from a fixed seed, a bounded number per protocol (`@given` over a list of
messages and an ending; generation only, no shrinking: findings are collected, not raised, so the figures cover
the whole run). A session mixes valid and hostile input: WebSocket `start` with valid and invalid fields (types,
ranges, unknown fields, huge numbers, deep nesting), `text` pieces (empty, unicode, lone surrogates as JSON
escapes, up to the service's max_text_len and beyond), `end`, `cancel`, unknown types, binary frames, invalid
JSON and invalid UTF-8, a frame over the transport bound, frames before `start`, a second `start`, `text` after
`end`, ended by `end`, `cancel`, the client's close or an abrupt one; Wyoming `describe`, `synthesize` (valid
and invalid voice, text, fields), `synthesize-start` / `-chunk` / `-stop` in and out of order, unknown event types,
malformed headers (not JSON, a list, no type, a string data_length, an oversized line) and wrong data or payload
lengths, ended by waiting, half-closing or an abrupt reset.

What must hold (anything else is a finding, with the session's input to reproduce it):
- WebSocket: the session ends with `done` after its audio, or an `error` event with a code, then the server's
  close 1000 (1007 for a text frame that is not UTF-8 and 1009 for a frame over its bound: RFC 6455's answers);
  never a connection dropped without a close frame, never `internal_error`, nothing after the last event, and no
  wait over SESSION_TIMEOUT_S. A session of only valid input ends with `done`.
- Wyoming: every `error` event has a code, never `synthesis_failed` (the service's answer to an unexpected
  failure); audio comes as `audio-start`, `audio-chunk`s, `audio-stop`; in a session without malformed bytes
  (which end the connection and withdraw what is not yet spoken) a valid `synthesize` sent before any stream gets
  its audio; the server ends every connection the client leaves open with an `error` event (the malformed event's
  code, or `idle_timeout` once everything is spoken: the service started here idles out after WYOMING_IDLE_S) and
  a clean close (FIN, not a reset), within SESSION_TIMEOUT_S.
- Afterwards: /healthz and /readyz 200, Wyoming still answers `describe`, the server process alive and its log
  free of tracebacks and ERROR lines (LOG_MARKERS).

    python -m cosyedge.api.bench.door_fuzz --sessions 300 [--seed 0] [--bundle DIR] [--json fuzz-doors.json]
    python -m cosyedge.api.bench.door_fuzz --url http://127.0.0.1:PORT --wyoming-port P   (a running service: no log)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import struct
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple
from urllib.parse import urlsplit

from cosyedge.api.bench.harness import ServiceProcess, free_port, http_status, write_json
from cosyedge.api.security import is_loopback

SESSION_TIMEOUT_S = 30.0  # the longest wait for the server's next word: beyond it the session hangs
WYOMING_IDLE_S = 1.0  # wyoming_idle_timeout_s of the service started here: how a left-open connection ends
TEXT_CAP = 200  # max_text_len of the service started here: long texts stay cheap, "beyond" stays reachable
MAX_FINDINGS_KEPT = 50
FORBIDDEN_CODES = ("internal_error", "synthesis_failed")  # the service's answers to an unexpected failure
# In the service's log: a traceback, or an ERROR line (an unexpected failure; `log.error` in the doors)
LOG_MARKERS = ("Traceback", "\nERROR ", "Task exception was never retrieved")
SPEAKABLE = ("Hello there.", "Counter three is free", "Please take your ticket. ", "Thank you, my friend!",
             "Caf\u00e9 na\u00efve, d\u00e9j\u00e0 vu.")
FORMATS = ("pcm", "wav", "mp3", "opus", "flac", "aac")


class Frame(NamedTuple):
    """One WebSocket frame to send: `data` as a text frame (str; bytes: a text frame that is not UTF-8) or binary."""
    data: str | bytes
    binary: bool = False
    valid: str = ""  # "start": a valid `start`; "text": a speakable `text` piece


class Item(NamedTuple):
    """One Wyoming event to send: an `Event` (the package's framing) or raw bytes; `role` for the expectations:
    "oneshot" (a valid `synthesize`), "stream" (a `synthesize-start`), "raw" (framing the server cannot trust)."""
    data: Any
    role: str = ""


@dataclass
class DoorStats:
    """What the campaign sent and what came back, per protocol; `findings` keeps the first ones in full."""
    sessions: Counter = field(default_factory=Counter)
    sent: Counter = field(default_factory=Counter)
    outcomes: dict[str, Counter] = field(default_factory=lambda: {"websocket": Counter(), "wyoming": Counter()})
    error_codes: dict[str, Counter] = field(default_factory=lambda: {"websocket": Counter(), "wyoming": Counter()})
    replies: Counter = field(default_factory=Counter)  # Wyoming event types received
    findings: list[dict[str, Any]] = field(default_factory=list)
    finding_count: int = 0

    def session(self, protocol: str, sent: int, outcome: str, codes: list[str], problems: list[str],
                reproduce: Callable[[], Any]) -> None:
        """One session's figures; each problem is a finding, kept with the input that reproduces it."""
        self.sessions[protocol] += 1
        self.sent[protocol] += sent
        self.outcomes[protocol][outcome] += 1
        self.error_codes[protocol].update(codes)
        for problem in problems:
            self.finding_count += 1
            if len(self.findings) < MAX_FINDINGS_KEPT:
                self.findings.append({"protocol": protocol, "problem": problem[:600], "outcome": outcome,
                                      "reproduce": reproduce()})

    def report(self) -> dict[str, Any]:
        def part(protocol: str, sent_name: str) -> dict[str, Any]:
            return {"sessions": self.sessions[protocol], sent_name: self.sent[protocol],
                    "outcomes": dict(self.outcomes[protocol].most_common()),
                    "error_codes": dict(self.error_codes[protocol].most_common())}
        return {"websocket": part("websocket", "messages_sent"),
                "wyoming": {**part("wyoming", "events_sent"), "replies": dict(self.replies.most_common())},
                "finding_count": self.finding_count, "findings": self.findings}


# -- generated input ---------------------------------------------------------------------------------------------
def _strategies(max_text: int) -> dict[str, Any]:
    """The hypothesis strategies of both protocols' sessions, for a service whose max_text_len is `max_text`."""
    from hypothesis import strategies as st

    frame_bound = 12 * max_text + 4096  # the WebSocket frame bound and the Wyoming line bound (api/README.md)
    anything = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(), st.text(max_size=12),
                         st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(),
                                                                              max_size=2))
    long_text = st.integers(max_text - 3, max_text + 40).map(lambda n: ("word " * n)[:n])
    speakable = st.sampled_from(SPEAKABLE)
    texts = st.one_of(speakable, st.just(""), st.just("   "), st.text(max_size=30), long_text,
                      st.sampled_from(("\ud800", "a\udfffb", "\U0001f600" * 3, "\u0000", "\u202e\u200b")), anything)
    voices = st.one_of(st.sampled_from(("joe", "nobody", "", "JOE")), anything)
    fields = {"voice": voices, "format": st.one_of(st.sampled_from(FORMATS + ("ogg", "")), anything),
              "sample_rate": st.one_of(st.sampled_from((8000, 16000, 22050, 48000)), st.integers(-10 ** 9, 10 ** 9),
                                       anything),
              "speed": st.one_of(st.floats(0.25, 4.0), anything), "deterministic": st.one_of(st.booleans(), anything),
              "seed": st.one_of(st.integers(-2 ** 80, 2 ** 80), anything), "model": anything,
              "speaker_id": anything, "preset": anything, "bogus": anything,
              "nested": st.integers(1, 40).map(lambda n: json.loads("[" * n + "]" * n))}
    json_frame = lambda strategy: strategy.map(lambda m: Frame(json.dumps(m)))  # noqa: E731 - ASCII escapes
    raw_numbers = st.integers(41, 3000).map(lambda n: Frame('{"type": "start", "speed": ' + "9" * n + "}"))
    raw_nesting = st.integers(30, 3000).map(lambda n: Frame('{"type": "start", "x": ' + "[" * n + "]" * n + "}"))
    frame = st.one_of(
        json_frame(st.fixed_dictionaries({"type": st.just("start")}, optional=fields)),
        speakable.map(lambda t: Frame(json.dumps({"type": "text", "text": t}), valid="text")),
        json_frame(st.fixed_dictionaries({"type": st.just("text")}, optional={"text": texts})),
        json_frame(st.sampled_from(({"type": "end"}, {"type": "cancel"}, {}, {"text": "Hi."}))),
        json_frame(st.fixed_dictionaries({"type": st.one_of(st.text(max_size=10), anything)})),
        st.sampled_from(("[]", "null", "1", '"start"', '[{"type": "start"}]', "{", "not json", '{"type": "end",}',
                         "{'type': 'end'}", '{"type": NaN}', "")).map(Frame),
        raw_numbers, raw_nesting, st.text(max_size=20).map(Frame),
        st.binary(max_size=64).map(lambda b: Frame(b, binary=True)),
        st.sampled_from((b"\xff\xfe{", b'{"type": "text", "text": "\xc3"}')).map(Frame),  # text frames not UTF-8
        st.just(Frame(json.dumps({"type": "text", "text": "a" * frame_bound}))),  # a frame over the bound
    )
    ws_start = st.sampled_from(FORMATS[:4]).map(lambda f: Frame(json.dumps({"type": "start", "format": f}),
                                                                valid="start"))
    ws_session = st.tuples(st.one_of(st.none(), ws_start, ws_start), st.lists(frame, max_size=6),
                           st.sampled_from(("end", "end", "end", "cancel", "close", "abrupt")))

    wy_fields = {"text": texts, "voice": st.one_of(st.fixed_dictionaries({"name": voices}), anything,
                                                   st.just({"name": "joe", "speaker": "x"})),
                 "text_format": st.one_of(st.just("ssml"), anything), "speed": fields["speed"],
                 "sample_rate": fields["sample_rate"], "format": st.just("mp3"), "bogus": anything}
    data_of = lambda **extra: st.fixed_dictionaries({}, optional={**wy_fields, **extra})  # noqa: E731
    wy_raw = st.one_of(
        st.sampled_from((b"not json\n", b'["synthesize"]\n', b'{"data": {"text": "Hi."}}\n', b'{"type": ""}\n',
                         b'{"type": "synthesize", "data_length": "12"}\n{"text": "Hi."}',
                         b'{"type": "synthesize", "data": "text"}\n', b'{"type": "describe\xff"}\n',
                         b'{"type": "describe", "payload_length": -1}\n', b"[" * 5000 + b"\n",
                         b'{"type": "describe", "payload_length": 70000}\n', b"\n")),
        st.tuples(st.integers(0, 64), st.integers(0, 64)).map(  # a payload of another length than announced
            lambda n: b'{"type": "describe", "payload_length": %d}\n' % n[0] + b"\0" * n[1]),
        st.tuples(st.sampled_from(SPEAKABLE), st.integers(-5, 5)).map(  # data of another length than announced
            lambda t: b'{"type": "synthesize", "data_length": %d}\n' % max(0, len(_data(t[0])) + t[1]) + _data(t[0])),
        st.just(b'{"type": "describe", "x": "' + b"a" * frame_bound + b'"}\n'),  # a line over the bound
    )
    item = st.one_of(
        st.just(Item(_event("describe", {}))),
        st.tuples(speakable, st.booleans()).map(
            lambda t: Item(_event("synthesize", {"text": t[0], **({"voice": {"name": "joe"}} if t[1] else {})}),
                           "oneshot")),
        data_of().map(lambda d: Item(_event("synthesize", d))),
        data_of().map(lambda d: Item(_event("synthesize-start", d), "stream")),
        st.just(Item(_event("synthesize-start", {}), "stream")),
        st.one_of(speakable, texts).map(lambda t: Item(_event("synthesize-chunk", {"text": t}))),
        data_of().map(lambda d: Item(_event("synthesize-chunk", d))),
        st.just(Item(_event("synthesize-stop", {}))),
        st.one_of(st.sampled_from(("audio-start", "audio-chunk", "error", "info", "synthesize-stopped")),
                  st.text(min_size=1, max_size=12)).map(lambda t: Item(_event(t, {}))),
        st.binary(max_size=100).map(lambda p: Item(_event("describe", {}, p))),
        wy_raw.map(lambda b: Item(b, "raw")),
    )
    wy_session = st.tuples(st.lists(item, max_size=6),
                           st.sampled_from(("wait", "wait", "wait", "half_close", "abrupt")))
    return {"websocket": ws_session, "wyoming": wy_session}


def _data(text: str) -> bytes:
    return json.dumps({"text": text}).encode()


def _event(kind: str, data: dict[str, Any], payload: bytes | None = None) -> Any:
    """An event in the `wyoming` package's framing, or raw bytes where its UTF-8 encoding cannot carry the data
    (a lone surrogate: sent as a JSON escape, which the package does not write)."""
    from wyoming.event import Event

    try:
        json.dumps({"type": kind, "data": data}, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps({"type": kind, "data": data}).encode() + b"\n"
    return Event(type=kind, data=data, payload=payload)


# -- one WebSocket session -----------------------------------------------------------------------------------------
ENDINGS = {"end": Frame('{"type": "end"}'), "cancel": Frame('{"type": "cancel"}')}


def _handshake(url: str, timeout: float):
    """The session's connection. A handshake refused with 429 and Retry-After is the documented stream allowance
    (the slots of sessions that just ended abruptly are given back a moment later): waited for, within `timeout`;
    anything else, or a refusal past it, is the caller's finding."""
    import websocket

    end = time.monotonic() + timeout
    while True:
        try:
            return websocket.create_connection(url, timeout=timeout)
        except websocket.WebSocketBadStatusException as exc:
            retry = (exc.resp_headers or {}).get("retry-after")
            if exc.status_code != 429 or retry is None or time.monotonic() + float(retry) > end:
                raise
            time.sleep(float(retry))


def ws_session(url: str, frames: list[Frame], ending: str, max_text: int = TEXT_CAP,
               timeout: float = SESSION_TIMEOUT_S) -> tuple[int, str, list[str], list[str]]:
    """Send `frames`, then the ending; read until the server's close. (frames sent, outcome, error codes, problems)."""
    import websocket

    problems: list[str] = []
    try:
        ws = _handshake(url, timeout)
    except (websocket.WebSocketException, OSError) as exc:
        return 0, "no handshake", [], [f"the handshake failed: {type(exc).__name__}: {exc}"]
    sent = 0
    try:
        for frame in frames + ([ENDINGS[ending]] if ending in ENDINGS else []):
            try:
                ws.send(frame.data, websocket.ABNF.OPCODE_BINARY if frame.binary else websocket.ABNF.OPCODE_TEXT)
            except (websocket.WebSocketConnectionClosedException, OSError):
                break  # the server has ended the session: its answer is read below
            sent += 1
        if ending == "abrupt":
            ws.abort()  # shutdown without a close frame
            return sent, "abrupt", [], []
        if ending == "close":
            try:
                ws.send_close()
            except (websocket.WebSocketConnectionClosedException, OSError):
                pass
        events, close, after_last = _ws_read(ws, problems)
    finally:
        ws.close(timeout=1)
    codes = [str(e.get("code")) for e in events if e.get("type") == "error"]
    problems += _ws_check(frames, ending, events, close, after_last, 12 * max_text + 4096)
    last = events[-1].get("type") if events else None
    if close is None:
        outcome = "hang" if any(p.startswith("hang") for p in problems) else "dropped"
    elif ending == "close" and last not in ("done", "error"):
        outcome = "closed by the client"
    elif last == "error":
        outcome = f"error {codes[-1]}"
    elif last == "done":
        outcome = "cancelled" if events[-1].get("cancelled") else "done"
    else:
        outcome = f"close {close}"
    return sent, outcome, codes, problems


def _ws_read(ws: Any, problems: list[str]) -> tuple[list[dict[str, Any]], int | None, int]:
    """Every event until the server's close frame: (events, close code or None when none came, binary frames after
    the last event)."""
    import websocket

    events: list[dict[str, Any]] = []
    after_last = 0
    while True:
        try:
            frame = ws.recv_frame()  # raw frames: the client's own close reply may fail, the server's close counts
            opcode, data = frame.opcode, frame.data
        except websocket.WebSocketTimeoutException:
            problems.append(f"hang: nothing from the server for {ws.gettimeout():.0f} s and no close")
            return events, None, after_last
        except (websocket.WebSocketConnectionClosedException, OSError) as exc:
            problems.append(f"dropped: the connection ended without a close frame ({type(exc).__name__})")
            return events, None, after_last
        if opcode == websocket.ABNF.OPCODE_CLOSE:
            try:
                ws.send_close()
            except (websocket.WebSocketConnectionClosedException, OSError):
                pass  # the server closed the socket after its close frame
            return events, int.from_bytes(data[:2], "big") if len(data) >= 2 else 1005, after_last
        if opcode == websocket.ABNF.OPCODE_BINARY:
            after_last += bool(events and events[-1].get("type") in ("done", "error"))
            continue
        try:
            event = json.loads(data)
        except ValueError:
            event = None
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            problems.append(f"a text frame that is no event: {data[:200]!r}")
            continue
        events.append(event)


def _ws_check(frames: list[Frame], ending: str, events: list[dict[str, Any]], close: int | None,
              after_last: int, frame_bound: int) -> list[str]:
    """What is wrong with a session's answer (see the module's docstring)."""
    problems = []
    allowed = {1000}
    if any(isinstance(f.data, bytes) and not f.binary for f in frames):
        allowed.add(1007)
    if any(len(f.data) > frame_bound for f in frames):
        allowed.add(1009)
    if close is not None and close not in allowed:
        problems.append(f"close code {close}, not {sorted(allowed)}")
    for event in events:
        if event["type"] == "error":
            code = event.get("code")
            if not isinstance(code, str) or not code or code in FORBIDDEN_CODES:
                problems.append(f"error event with code {code!r}: {event.get('message')!r}")
    ends = [i for i, e in enumerate(events) if e["type"] in ("done", "error")]
    if ends and ends[0] != len(events) - 1 or after_last:
        problems.append(f"frames after the last event: {[e['type'] for e in events]}, {after_last} binary")
    if close == 1000 and ending in ENDINGS and not ends:
        problems.append(f"closed 1000 after {ending!r} with neither done nor error: {[e['type'] for e in events]}")
    valid_only = bool(frames) and frames[0].valid == "start" and all(f.valid == "text" for f in frames[1:])
    if valid_only and ending == "end" and not (events and events[-1]["type"] == "done"):
        problems.append(f"a session of valid input did not end with done: {events[-1:] or 'no event'}")
    return problems


# -- one Wyoming session -------------------------------------------------------------------------------------------
async def wyoming_session(port: int, items: list[Item], ending: str, timeout: float = SESSION_TIMEOUT_S
                          ) -> tuple[int, str, list[str], list[str], Counter]:
    """Send `items`, then end as `ending` says and read until the server closes.
    (events sent, outcome, error codes, problems, event types received)."""
    from wyoming.event import async_read_event, async_write_event

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = 0
    try:
        for item in items:
            try:
                if isinstance(item.data, bytes):
                    writer.write(item.data)
                    await writer.drain()
                else:
                    await async_write_event(item.data, writer)
            except (ConnectionError, OSError):
                break  # the server has closed after a malformed event: its answer is read below
            sent += 1
        if ending == "abrupt":  # a reset, not a FIN: the server must not care
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return sent, "abrupt", [], [], Counter()
        if ending == "half_close":
            writer.write_eof()
        events, problems, clean = [], [], False
        try:
            async with asyncio.timeout(timeout):
                while (event := await async_read_event(reader)) is not None:
                    events.append(event)
                clean = True
        except TimeoutError:
            problems.append(f"hang: the server did not close the connection within {timeout:.0f} s")
        except (ConnectionError, OSError) as exc:
            problems.append(f"the connection was reset, not closed ({type(exc).__name__})")
        except ValueError as exc:
            problems.append(f"an event the client cannot read: {exc}")
    finally:
        writer.close()
    codes = [str(e.data.get("code")) for e in events if e.type == "error"]
    problems += _wyoming_check(items, ending, events, clean)
    outcome = ("half closed" if ending == "half_close" else f"closed after error {codes[-1]}" if codes and
               events[-1].type == "error" else "closed") if clean else "not closed"
    return sent, outcome, codes, problems, Counter(e.type for e in events)


def _wyoming_check(items: list[Item], ending: str, events: list[Any], clean: bool) -> list[str]:
    problems = []
    audio_open, stops = False, 0
    for event in events:
        if event.type == "error":
            code = event.data.get("code")
            if not isinstance(code, str) or not code or code in FORBIDDEN_CODES:
                problems.append(f"error event with code {code!r}: {event.data.get('text')!r}")
        elif event.type == "audio-start":
            if audio_open:
                problems.append("audio-start inside an audio run")
            audio_open = True
        elif event.type == "audio-chunk" and not audio_open:
            problems.append("audio-chunk outside audio-start / audio-stop")
        elif event.type == "audio-stop":
            if not audio_open:
                problems.append("audio-stop without audio-start")
            audio_open, stops = False, stops + 1
    if ending == "wait" and clean:
        if not events or events[-1].type != "error":
            problems.append(f"closed without an error event: {[e.type for e in events][-5:]}")
        expected = 0  # a malformed event ends the connection, withdrawing (dead-lettering) what is not yet spoken
        for item in items if not any(i.role == "raw" for i in items) else ():
            if item.role == "stream":
                break
            expected += item.role == "oneshot"
        if stops < expected:
            problems.append(f"{expected} valid synthesize events got {stops} audio-stop")
    return problems


# -- the campaign --------------------------------------------------------------------------------------------------
def _given(strategy: Any, sessions: int, seed: int, body: Callable[[Any], None]) -> None:
    """`body` on `sessions` generated examples from `seed`: generation only, no database, no shrinking."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as fixed_seed

    @fixed_seed(seed)
    @settings(max_examples=sessions, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(strategy)
    def run(example: Any) -> None:
        body(example)

    run()


def _ws_reproduce(frames: list[Frame], ending: str) -> dict[str, Any]:
    return {"frames": [(("binary " if f.binary else "text ") + repr(f.data[:300]) + (f" (+{len(f.data) - 300} more)"
                        if len(f.data) > 300 else "")) for f in frames], "ending": ending}


def _wy_reproduce(items: list[Item], ending: str) -> dict[str, Any]:
    def wire(item: Item) -> str:
        raw = item.data if isinstance(item.data, bytes) else json.dumps(
            {"type": item.data.type, "data": item.data.data, "payload_length": len(item.data.payload or b"")})
        return repr(raw[:300]) + (f" (+{len(raw) - 300} more)" if len(raw) > 300 else "")
    return {"events": [wire(i) for i in items], "ending": ending}


def run_door_fuzz(url: str, wyoming_port: int, sessions: int = 200, seed: int = 0, max_text: int = TEXT_CAP,
                  log: Callable[[], str] | None = None, alive: Callable[[], bool] | None = None,
                  progress: bool = False) -> dict[str, Any]:
    """`sessions` generated sessions per protocol against the service at `url` and its Wyoming port; the figures.
    `log` (the server's log text) and `alive` (its process runs) are checked afterwards when given."""
    strategies = _strategies(max_text)
    stats = DoorStats()
    ws_url = url.replace("http://", "ws://", 1) + "/v1/audio/stream"
    started = time.monotonic()

    def websocket_example(example: tuple) -> None:
        start, frames, ending = example
        frames = ([start] if start else []) + frames
        sent, outcome, codes, problems = ws_session(ws_url, frames, ending, max_text)
        stats.session("websocket", sent, outcome, codes, problems, lambda: _ws_reproduce(frames, ending))

    def wyoming_example(example: tuple) -> None:
        items, ending = example
        sent, outcome, codes, problems, replies = asyncio.run(wyoming_session(wyoming_port, items, ending))
        stats.replies.update(replies)
        stats.session("wyoming", sent, outcome, codes, problems, lambda: _wy_reproduce(items, ending))

    for protocol, body in (("websocket", websocket_example), ("wyoming", wyoming_example)):
        _given(strategies[protocol], sessions, seed, body)
        if progress:
            print(f"door fuzz: {protocol}: {stats.sessions[protocol]} sessions, {stats.finding_count} findings so far, "
                  f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    log_text = log() if log is not None else None
    report = {"url": url, "wyoming_port": wyoming_port, "seed": seed, "max_text_len": max_text,
              "sessions_per_protocol": sessions, **stats.report(),
              "seconds": round(time.monotonic() - started, 1),
              "healthz_after": http_status(url, "/healthz"), "readyz_after": http_status(url, "/readyz"),
              "wyoming_after": asyncio.run(_describe(wyoming_port)),
              "server_alive": alive() if alive is not None else None,
              "log_markers": None if log_text is None else {m: log_text.count(m) for m in LOG_MARKERS if m in log_text},
              "log_excerpt": _excerpt(log_text or "")}
    return report


def _excerpt(log_text: str) -> str:
    """The log around its first marker (what a traceback says), or "" when it has none."""
    found = [i for i in (log_text.find(m) for m in LOG_MARKERS) if i >= 0]
    return log_text[max(0, min(found) - 500):min(found) + 3000] if found else ""


async def _describe(port: int) -> str:
    """The type of the answer to `describe` on a new connection ("no answer" when none)."""
    from wyoming.client import AsyncTcpClient
    from wyoming.info import Describe

    try:
        async with asyncio.timeout(SESSION_TIMEOUT_S), AsyncTcpClient("127.0.0.1", port) as client:
            await client.write_event(Describe().event())
            event = await client.read_event()
            return event.type if event is not None else "closed"
    except (OSError, TimeoutError):
        return "no answer"


def failed(report: dict[str, Any]) -> bool:
    """Whether the run found something: a finding, a service not healthy, ready, alive or answering Wyoming
    afterwards, tracebacks in its log, or a protocol that was not fuzzed at all."""
    return bool(report["finding_count"] or report["healthz_after"] != 200 or report["readyz_after"] != 200
                or report["wyoming_after"] != "info" or report["server_alive"] is False or report["log_markers"]
                or not report["websocket"]["sessions"] or not report["wyoming"]["sessions"])


def format_report(report: dict[str, Any]) -> str:
    ws, wy = report["websocket"], report["wyoming"]
    lines = [f"cosyedge door fuzz ({report['url']}, Wyoming port {report['wyoming_port']}, seed {report['seed']}, "
             f"max_text_len {report['max_text_len']}): {report['seconds']} s",
             f"  websocket: {ws['sessions']} sessions, {ws['messages_sent']} messages; outcomes {ws['outcomes']}",
             f"    error codes: {ws['error_codes']}",
             f"  wyoming: {wy['sessions']} sessions, {wy['events_sent']} events; outcomes {wy['outcomes']}",
             f"    error codes: {wy['error_codes']}", f"    replies: {wy['replies']}",
             f"  afterwards: /healthz {report['healthz_after']}, /readyz {report['readyz_after']}, Wyoming describe "
             f"-> {report['wyoming_after']}, alive {report['server_alive']}, log markers {report['log_markers']}",
             f"  findings: {report['finding_count']}"]
    for item in report["findings"][:10]:
        lines.append(f"  finding [{item['protocol']}] {item['problem']}\n    {json.dumps(item['reproduce'])[:1500]}")
    return "\n".join(lines)


def _wait_listening(port: int, service: ServiceProcess) -> None:
    """/readyz answers a moment before Wyoming listens: wait for the port (or the service's exit)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and service.proc is not None and service.proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"Wyoming never listened on port {port}:\n{service.log_tail()}")


def service_env(wyoming_port: int, max_text: int = TEXT_CAP) -> dict[str, str]:
    """The settings of a service this campaign starts: Wyoming beside HTTP, short idle time, small text bound."""
    return {"COSYEDGE_WYOMING_URI": f"tcp://127.0.0.1:{wyoming_port}", "COSYEDGE_WYOMING_IDLE_TIMEOUT_S":
            str(WYOMING_IDLE_S), "COSYEDGE_MAX_TEXT_LEN": str(max_text)}


def fuzz_service(sessions: int, seed: int, bundle: str | None = None, env: dict[str, str] | None = None,
                 progress: bool = False) -> dict[str, Any]:
    """The campaign against a fresh `cosyedge serve --wyoming` on free loopback ports (extra `env` on top)."""
    port = free_port()
    with ServiceProcess(bundle=bundle, env={**service_env(port), **(env or {})}) as service:
        _wait_listening(port, service)
        report = run_door_fuzz(service.url, port, sessions, seed, TEXT_CAP, log=lambda: service.log_path.read_text(
            errors="replace"), alive=lambda: service.proc is not None and service.proc.poll() is None,
            progress=progress)
        report["server_memory"] = service.memory()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosyedge.api.bench.door_fuzz",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=300, help="generated sessions per protocol (default 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="a running service (default: start one on free loopback ports)")
    parser.add_argument("--wyoming-port", type=int, help="with --url: its Wyoming port (on 127.0.0.1)")
    parser.add_argument("--max-text-len", type=int, default=TEXT_CAP, help="with --url: the service's max_text_len")
    parser.add_argument("--bundle", help="bundle of the service started here (default: the default voice)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    if not 1 <= args.sessions <= 100_000 or bool(args.url) != bool(args.wyoming_port):
        parser.error("--sessions must be 1-100000; --url and --wyoming-port go together")
    if args.url and not is_loopback(urlsplit(args.url).hostname or ""):
        parser.error("--url: the campaign talks to loopback only")
    if args.url:
        report = run_door_fuzz(args.url.rstrip("/"), args.wyoming_port, args.sessions, args.seed, args.max_text_len,
                               progress=True)
    else:
        report = fuzz_service(args.sessions, args.seed, args.bundle, progress=True)
    print(format_report(report))
    write_json(report, args.json)
    return 1 if failed(report) else 0


if __name__ == "__main__":
    sys.exit(main())
