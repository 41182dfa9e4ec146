"""Connections closed under a session, as the door fuzz campaign (`cosyedge.api.bench.door_fuzz`) found them: the
session ends quietly, with no traceback, no ERROR line and no HTTP answer written onto a WebSocket."""
from __future__ import annotations

from types import SimpleNamespace

from flask import Flask, g
from wsproto.utilities import LocalProtocolError

from cosyedge.api.routes.websocket import Session


class _ClosingWs:
    """simple-websocket's Server as the campaign caught it: a frame queued just before its reader thread closed the
    connection itself (close 1009 for the next frame, over the bound; 1007 for a text frame that is not UTF-8) while
    `connected` was still True, so wsproto refuses every frame sent, the close included."""

    def __init__(self) -> None:
        self.queued: list[bytes | str] = [b"\x00"]  # a binary frame: the session answers bad_message
        self.sent = 0

    def receive(self, timeout: float | None = None) -> bytes | str | None:
        return self.queued.pop(0) if self.queued else None

    def send(self, data: bytes | str) -> None:
        self.sent += 1
        raise LocalProtocolError("Event TextMessage cannot be sent in state ConnectionState.LOCAL_CLOSING.")

    def close(self, reason: int | None = None, message: str | None = None) -> None:
        raise LocalProtocolError("Event CloseConnection cannot be sent in state ConnectionState.LOCAL_CLOSING.")


def test_a_websocket_that_simple_websocket_is_closing_ends_the_session_quietly():
    """Campaign input (seed 0): a binary frame, then at once a text frame over the frame bound (12 x max_text_len +
    4096 characters). The session's `bad_message` event and its close met wsproto's closing state: LocalProtocolError
    escaped the route, Flask logged a traceback and gunicorn wrote a 500 onto the closed socket (EBADF). The race
    is forced here: the session runs against a connection in exactly that state."""
    ws = _ClosingWs()
    service = SimpleNamespace(config=SimpleNamespace(request_timeout_s=5.0, max_text_len=200), journal=None)
    with Flask(__name__).test_request_context():
        g.request_id = "closing"
        Session(ws, service, "127.0.0.1").run()  # type: ignore[arg-type]  (raised LocalProtocolError)
    assert ws.sent == 1  # the error event was tried once, then the session ended as for a client gone
